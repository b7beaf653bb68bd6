"""Test setup: 8 emulated CPU devices, set before JAX starts its backend."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole suite, its workers and the processes its tests
# start: most tests compile the same tiny model on the same meshes, and compiling is most of
# their time on CPU (a 6-step runtime test: 21 s cold, 6 s warm). Results do not change: an
# executable is cached under a key of its program, options, devices and JAX version.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"diloco-tests-jax-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


import dataclasses  # noqa: E402

import gcs_emulator as gcs_emulator_lib  # noqa: E402
import pytest  # noqa: E402
from absl import flags  # noqa: E402

flags.FLAGS.mark_as_parsed()


@pytest.fixture
def tiny_config():
  """The tiny data-parallel config as frozen dataclasses (fast: 2 layers, seq 64)."""
  from configs import dp
  from diloco.config import run_config
  return run_config.from_config_dict(dp.get_config("tiny"))


@pytest.fixture
def replace():
  """`replace(cfg, group, **fields)`: a copy of a frozen Config with one group changed."""
  def _replace(cfg, group, **fields):
    return dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group), **fields)})
  return _replace


# The Cloud Storage emulator's fixtures (tests/gcs_emulator.py), for every test module that names
# them.
@pytest.fixture(scope="module")
def gcs_emulator(tmp_path_factory):
  """One emulator per test module (started in ~1 s), stopped at the module's end."""
  emulator = gcs_emulator_lib.Emulator(str(tmp_path_factory.mktemp("gcs") / "emulator.log"))
  try:
    yield emulator
  finally:
    emulator.stop()
    assert emulator.proc.returncode is not None  # no process left behind


@pytest.fixture
def gcs_root(gcs_emulator, monkeypatch):
  """A fresh `gs://` store root on the emulator, with gcsfs wired in this process."""
  gcs_emulator_lib.use_gcsfs(monkeypatch, gcs_emulator)
  return gcs_emulator.root()
