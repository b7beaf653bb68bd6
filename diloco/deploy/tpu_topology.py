"""Cloud TPU slices by name, as devices on any host: `libtpu` from PyPI describes a slice's
chips (`jax.experimental.topologies`) without one, so programs compile for it ahead of time.

`v5e-256` is a v5e slice of 256 chips (16 x 16), `v5p-128` a v5p slice of 128 TensorCores (64
chips, 4 x 4 x 4), as Cloud TPU names them; `v5e:4x4` and `v5p:2x2x1` name a chip grid directly.
The chip figures are the published ones (HBM, bf16 peak, HBM and ICI bandwidth); the DCN rate
between slices is an assumption (`DCN_BYTES_PER_S_PER_CHIP`), since it depends on the hosts'
network, and every estimate that uses it says so.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

from diloco.errors import ConfigError

GIB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
  name: str
  device_kind: str  # what JAX calls it
  hbm_bytes: int
  peak_bf16_flops: float  # dense, per chip
  hbm_bytes_per_s: float
  ici_bytes_per_s: float  # per chip, all of its links, one direction
  dims: int  # 2: a torus of rows x columns; 3: x x y x z
  cores_per_chip_in_name: int  # v5p-N counts TensorCores (2 per chip), v5e-N chips


CHIPS = {
    "v5e": Chip(name="v5e", device_kind="TPU v5 lite", hbm_bytes=16 * GIB,
                peak_bf16_flops=197e12, hbm_bytes_per_s=819e9, ici_bytes_per_s=1600e9 / 8,
                dims=2, cores_per_chip_in_name=1),
    "v5p": Chip(name="v5p", device_kind="TPU v5", hbm_bytes=95 * GIB, peak_bf16_flops=459e12,
                hbm_bytes_per_s=2765e9, ici_bytes_per_s=4800e9 / 8, dims=3,
                cores_per_chip_in_name=2),
}
# Assumed: a 100 Gbit/s network interface per host of four chips, shared by them.
DCN_BYTES_PER_S_PER_CHIP = 100e9 / 8 / 4
# The chip grids of the slice sizes Cloud TPU offers (chips per slice -> grid).
_GRIDS = {
    "v5e": {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
            256: (16, 16)},
    "v5p": {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
            128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16),
            2048: (8, 16, 16), 4096: (16, 16, 16)},
}
MAX_SLICES = 64
_NAMED = re.compile(r"(v5e|v5p)-(\d+)")
_GRID = re.compile(r"(v5e|v5p):(\d+(?:x\d+)+)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Slice:
  name: str  # as the user wrote it
  chip: Chip
  grid: tuple[int, ...]

  @property
  def chips(self) -> int:
    return math.prod(self.grid)

  @property
  def topology_name(self) -> str:
    return f"{self.chip.name}:{'x'.join(map(str, self.grid))}"


def names() -> list[str]:
  return [f"{chip}-{n * CHIPS[chip].cores_per_chip_in_name}"
          for chip, grids in _GRIDS.items() for n in grids]


def parse(name: str) -> Slice:
  """The slice `name` names; ConfigError with the known names otherwise."""
  text = str(name).lower()
  named, grid = _NAMED.fullmatch(text), _GRID.fullmatch(text)
  if named:
    chip = CHIPS[named.group(1)]
    count, per = int(named.group(2)), chip.cores_per_chip_in_name
    if count % per == 0 and count // per in _GRIDS[chip.name]:
      return Slice(name=text, chip=chip, grid=_GRIDS[chip.name][count // per])
  elif grid:
    chip = CHIPS[grid.group(1)]
    dims = tuple(int(d) for d in grid.group(2).split("x"))
    if len(dims) == chip.dims and all(d >= 1 for d in dims) and math.prod(dims) <= 4096:
      return Slice(name=text, chip=chip, grid=dims)
  raise ConfigError(f"--topology={name!r}: unknown TPU slice; known: {', '.join(names())}, "
                    "or a chip grid such as v5e:4x4 or v5p:2x2x1")


def devices(topology: Slice, slices: int = 1) -> list:
  """The devices of `slices` slices of `topology` (each carrying its `slice_index`), from
  libtpu's description of the slice; ConfigError when libtpu is not installed."""
  if not 1 <= slices <= MAX_SLICES:
    raise ConfigError(f"--slices={slices}: must be 1 to {MAX_SLICES}")
  from jax.experimental import topologies
  if importlib.util.find_spec("libtpu") is None:  # jax[tpu]'s compiler, found by JAX itself
    raise ConfigError("compiling for a TPU needs libtpu: pip install -e \".[tpu]\" (it runs "
                      "on any host)")
  # libtpu lets one process at a time on a host hold it (a lock file) unless told otherwise;
  # compiling uses no chip, so a compile may run beside a run or another compile.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  # Hosts of up to 2 x 2 chips (a v5e-256 or v5p-128 host has four).
  host = (min(topology.grid[0], 2), min(topology.grid[1], 2), 1)
  described = topologies.get_topology_desc(
      platform="tpu", topology_name=topology.topology_name, chip_config_name="default",
      chips_per_host_bounds=host, num_slices=slices)
  found = list(described.devices)
  if len(found) != topology.chips * slices:
    raise ConfigError(f"libtpu described {len(found)} devices for {slices} x "
                      f"{topology.topology_name}, expected {topology.chips * slices}")
  return found
