"""Which accelerator a host has, and which of its devices each launched process may use.

The local launcher (`--role=launch`) must decide this without starting a JAX backend
itself: a backend started in the launcher would hold every GPU (or lock the TPU chips)
that its children need. So the platform is read from the environment and the machine
(`JAX_PLATFORMS`, `nvidia-smi -L`, `/dev/accel*` and `/dev/vfio/*` next to an installed
libtpu), and each child is told its share through the environment variables the
runtime honours before it starts: `CUDA_VISIBLE_DEVICES` for GPUs, `TPU_VISIBLE_CHIPS`
with its process bounds for TPU chips, an emulated device count for CPU. The syncer
never gets an accelerator: its math runs on the host (`JAX_PLATFORMS=cpu`).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence

from diloco.config.run_config import LAUNCH_PLATFORMS
from diloco.errors import ConfigError

_EMULATED_FLAG = "--xla_force_host_platform_device_count"
# TPU_CHIPS_PER_PROCESS_BOUNDS of a process that owns n chips of one TPU VM (chips form a
# 2-D grid on v5e/v6e hosts, a 2x2x1 block on v4/v5p hosts).
_TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}


def _nvidia_smi_gpus(run: Callable[..., subprocess.CompletedProcess]) -> list[str]:
  """GPU indices that `nvidia-smi -L` lists ("GPU 0: NVIDIA H100 ..."); [] without a driver."""
  try:
    out = run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False)
  except (OSError, subprocess.TimeoutExpired):
    return []
  if out.returncode != 0:
    return []
  return [m.group(1) for m in re.finditer(r"^GPU (\d+):", out.stdout, re.MULTILINE)]


def _cuda_plugin() -> bool:
  """Whether JAX's CUDA plugin (`pip install -e ".[cuda]"`) is installed: found, not imported."""
  for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"):
    if importlib.util.find_spec(name) is not None:
      return True
  return False


def _tpu_chips() -> list[str]:
  """Chip indices of this TPU VM: /dev/accelN (v4) or /dev/vfio/N (v5e, v5p, v6e)."""
  if importlib.util.find_spec("libtpu") is None:
    return []
  found = glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*")
  return [str(i) for i in range(len(found))]


def platforms_without_absent_tpu(environ: Mapping[str, str] = os.environ) -> str | None:
  """With libtpu installed (the `test` and `tpu` extras, for `diloco compile`) on a host with no
  TPU chip, JAX would still start the TPU plugin, which prints warnings and finds nothing: the
  platforms for this process's JAX to try instead (a GPU is still found), None when
  JAX_PLATFORMS is set or there is a chip or no libtpu. Never put in the environment: the
  launcher reads JAX_PLATFORMS as the user's choice, and sets its children's itself."""
  if (not environ.get("JAX_PLATFORMS") and importlib.util.find_spec("libtpu") is not None
      and not _tpu_chips()):
    return "cuda,cpu"
  return None


def _listed(value: str) -> list[str]:
  return [x.strip() for x in value.split(",") if x.strip()]


def detect(platform: str, environ: Mapping[str, str] = os.environ,
           run: Callable[..., subprocess.CompletedProcess] = subprocess.run
           ) -> tuple[str, list[str]]:
  """The platform to launch on and the ids of its devices on this host (none for cpu).

  `auto` follows `JAX_PLATFORMS` when it is set (its first entry), else uses the GPUs that
  `nvidia-smi` lists if JAX's CUDA plugin is installed, else the chips of a TPU VM, else the
  CPU. GPUs already restricted with `CUDA_VISIBLE_DEVICES` (TPU chips with
  `TPU_VISIBLE_CHIPS`) are the ones split.
  """
  if platform not in LAUNCH_PLATFORMS:
    raise ConfigError(f"launch.platform: must be one of {LAUNCH_PLATFORMS}, got {platform!r}")
  if platform == "auto":
    forced = _listed(environ.get("JAX_PLATFORMS", ""))
    if forced:
      platform = {"gpu": "cuda"}.get(forced[0], forced[0])
      if platform not in LAUNCH_PLATFORMS:
        raise ConfigError(f"launch.platform=auto: JAX_PLATFORMS={environ['JAX_PLATFORMS']!r} "
                          "names no platform the launcher can split (cpu, cuda, tpu)")
    elif _nvidia_smi_gpus(run) and _cuda_plugin():
      platform = "cuda"
    elif _tpu_chips():
      platform = "tpu"
    else:
      platform = "cpu"
  if platform == "cpu":
    return "cpu", []
  if platform == "cuda":
    if not _cuda_plugin():
      raise ConfigError("launch.platform=cuda: JAX's CUDA plugin is not installed; "
                        'pip install -e ".[cuda]"')
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    ids = _listed(visible) if visible is not None else _nvidia_smi_gpus(run)
    where = "CUDA_VISIBLE_DEVICES" if visible is not None else "nvidia-smi -L"
  else:
    visible = environ.get("TPU_VISIBLE_CHIPS")
    ids = _listed(visible) if visible is not None else _tpu_chips()
    where = "TPU_VISIBLE_CHIPS" if visible is not None else "/dev/accel*, /dev/vfio/*"
  if not ids:
    raise ConfigError(f"launch.platform={platform}: this host shows no {platform} devices "
                      f"({where} lists none); use launch.platform=cpu or auto")
  return platform, ids


def assign(platform: str, available: Sequence[str], sizes: Sequence[int], hosts: int,
           field: str) -> list[list[list[str]]]:
  """Device ids per learner, per host process: disjoint, contiguous groups in host order.

  `sizes[m]` is learner m's device count (all its hosts together). On cpu every process
  gets its own emulated devices, so the ids are empty. Devices left over stay idle (the
  caller logs them); too few fail here, naming `field`.
  """
  if platform == "cpu":
    return [[[] for _ in range(hosts)] for _ in sizes]
  needed = sum(sizes)
  if needed > len(available):
    raise ConfigError(f"{field}: {len(sizes)} learner(s) need {needed} {platform} devices "
                      f"({list(sizes)}) but this host has {len(available)} "
                      f"({','.join(available)}); lower {field} or launch fewer learners")
  groups, start = [], 0
  for size in sizes:
    per_host = size // hosts
    groups.append([list(available[start + h * per_host:start + (h + 1) * per_host])
                   for h in range(hosts)])
    start += size
  return groups


def child_env(base: Mapping[str, str], platform: str, *, devices: Sequence[str] = (),
              emulated: int = 1, tpu_port: int = 0) -> dict[str, str]:
  """The environment of one launched process: `base` plus the devices it may use.

  cpu (and the syncer, always): JAX_PLATFORMS=cpu and `emulated` host devices. cuda: only
  `devices` visible. tpu (untested here: no TPU VM was available): `devices` as the
  process's chips, in a one-process TPU world of its own on `tpu_port`.
  """
  env = dict(base)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_EMULATED_FLAG)]
  if platform == "cpu":
    env["XLA_FLAGS"] = " ".join(flags + [f"{_EMULATED_FLAG}={emulated}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  else:
    env.pop("XLA_FLAGS", None)
  if platform == "cuda":
    env["JAX_PLATFORMS"] = "cuda"
    env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    return env
  if platform == "tpu":
    if len(devices) not in _TPU_CHIP_BOUNDS:
      raise ConfigError(f"launch.devices_per_learner: a process on a TPU VM takes 1, 2, 4 or 8 "
                        f"chips, got {len(devices)}")
    env.update({"JAX_PLATFORMS": "tpu", "TPU_VISIBLE_CHIPS": ",".join(devices),
                "TPU_CHIPS_PER_PROCESS_BOUNDS": _TPU_CHIP_BOUNDS[len(devices)],
                "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_PORT": str(tpu_port),
                "TPU_PROCESS_ADDRESSES": f"localhost:{tpu_port}", "CLOUD_TPU_TASK_ID": "0",
                "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})
    return env
  raise ConfigError(f"launch.platform: cannot place a process on {platform!r}")


def syncer_env(base: Mapping[str, str], platform: str) -> dict[str, str]:
  """The syncer's environment: one CPU device, and no accelerator even if the host has some."""
  env = child_env(base, "cpu", emulated=1)
  if platform == "cuda":
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CUDA plugin then claims no GPU memory at all
  elif platform == "tpu":
    env.pop("TPU_VISIBLE_CHIPS", None)
  return env
