"""Which platforms a process of this project asks JAX for (diloco/deploy/accelerators.py)."""

import os
import subprocess
import sys

from diloco.deploy import accelerators


def test_a_host_without_tpu_chips_does_not_start_libtpu():
  """libtpu comes with the test extra (for `diloco compile`): without chips, JAX is told the
  other platforms, and nothing of libtpu's start-up warnings reaches the user."""
  assert accelerators.platforms_without_absent_tpu({}) == "cuda,cpu"
  assert accelerators.platforms_without_absent_tpu({"JAX_PLATFORMS": "cpu"}) is None
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  code = ("import jax\nfrom diloco.deploy import accelerators\n"
          "jax.config.update('jax_platforms', accelerators.platforms_without_absent_tpu())\n"
          "print(jax.devices()[0].platform)")
  done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=120, check=True)
  assert done.stdout.strip() == "cpu" and "TPU" not in done.stderr, done.stderr
