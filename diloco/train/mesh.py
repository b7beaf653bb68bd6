"""Learner meshes: disjoint device groups, each an Auto mesh with axes (data, fsdp, tensor)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from diloco.errors import ConfigError
from diloco.model.sharding import MESH_AXES
from diloco.settings import Range, frozen, require, setting


@frozen
class MeshConfig:
  """Learner mesh axis sizes; exactly one may be -1 (fill with the rest)."""
  # Data parallelism: replicated parameters, the batch split.
  data: int = setting(-1, Range(low=-1))
  # Fully sharded data parallelism: parameters and the batch split.
  fsdp: int = setting(1, Range(low=-1))
  # Tensor parallelism: MLP, heads and vocabulary split.
  tensor: int = setting(1, Range(low=-1))

  def check(self) -> None:
    """Each axis is a size or -1, and only one of them is -1."""
    sizes = {"mesh.data": self.data, "mesh.fsdp": self.fsdp, "mesh.tensor": self.tensor}
    for field, size in sizes.items():
      require(size == -1 or size >= 1, field, f"must be -1 (fill) or >= 1, got {size}")
    require(list(sizes.values()).count(-1) <= 1, "mesh", "at most one axis may be -1")


def device_groups(devices: Sequence[jax.Device], sizes: Sequence[int]) -> list[list[jax.Device]]:
  """Splits `devices` into disjoint groups of the given sizes.

  Devices that carry a `slice_index` (multi-slice TPU) are grouped by slice first so
  that no learner straddles two slices; otherwise groups are contiguous in id order.
  """
  if any(s < 1 for s in sizes):
    raise ConfigError(f"learner device counts must be >= 1, got {list(sizes)}")
  if sum(sizes) != len(devices):
    raise ConfigError(f"learner device counts {list(sizes)} sum to {sum(sizes)}, "
                      f"but {len(devices)} devices are visible")
  ordered = sorted(devices, key=lambda d: (getattr(d, "slice_index", 0) or 0, d.id))
  groups, start = [], 0
  for size in sizes:
    group = ordered[start:start + size]
    slices = {getattr(d, "slice_index", None) for d in group}
    if len(slices) > 1 and None not in slices:
      raise ConfigError(f"a learner of {size} devices would span slices {sorted(slices)}; "
                        "give each learner a multiple or a divisor of the slice size")
    groups.append(group)
    start += size
  return groups


def resolve_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
  """Axis sizes with the -1 axis filled; ConfigError if they do not match the devices."""
  sizes = {"data": cfg.data, "fsdp": cfg.fsdp, "tensor": cfg.tensor}
  fixed = math.prod(s for s in sizes.values() if s != -1)
  fill = [name for name, s in sizes.items() if s == -1]
  if fill:
    if num_devices % fixed:
      raise ConfigError(f"mesh.{fill[0]}=-1 cannot fill {num_devices} devices: the other "
                        f"axes multiply to {fixed}, which does not divide {num_devices}")
    sizes[fill[0]] = num_devices // fixed
  if math.prod(sizes.values()) != num_devices:
    raise ConfigError(f"mesh data x fsdp x tensor = {sizes['data']} x {sizes['fsdp']} x "
                      f"{sizes['tensor']} = {math.prod(sizes.values())} does not match the "
                      f"{num_devices} devices of this learner; set one of mesh.data/fsdp/tensor "
                      "to -1 or make the product equal")
  return sizes["data"], sizes["fsdp"], sizes["tensor"]


def slice_indices(devices: Sequence[jax.Device]) -> list[int]:
  """The slice of each device (0 for devices that belong to no multi-slice system)."""
  return [getattr(d, "slice_index", 0) or 0 for d in devices]


def learner_mesh(devices: Sequence[jax.Device], cfg: MeshConfig) -> Mesh:
  """An Auto-typed (data, fsdp, tensor) mesh over exactly `devices`.

  Over devices of S > 1 slices (a data-parallel baseline across multi-slice TPU), `cfg` shapes
  each slice's mesh and the data axis also runs across the slices, over the data-center
  network: only the gradients' reduction crosses between slices, never an FSDP gather."""
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  slices = sorted(set(slice_indices(devices)))
  if len(slices) == 1:
    shape = resolve_shape(cfg, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=list(devices))
  counts = {s: slice_indices(devices).count(s) for s in slices}
  if len(set(counts.values())) > 1:
    raise ConfigError(f"a mesh over several slices needs as many devices of each, got {counts}")
  from jax.experimental import mesh_utils  # pylint: disable=import-outside-toplevel
  per_slice = resolve_shape(cfg, len(devices) // len(slices))
  grid = mesh_utils.create_hybrid_device_mesh(per_slice, (len(slices), 1, 1), list(devices))
  return Mesh(grid, MESH_AXES, axis_types=axis_types)


def data_parallel_width(mesh: Mesh) -> int:
  """Number of batch shards: the product of the data and fsdp axes."""
  return mesh.shape["data"] * mesh.shape["fsdp"]


def describe(mesh: Mesh) -> str:
  ids = [d.id for d in itertools.islice(mesh.devices.flat, 8)]
  more = "..." if mesh.devices.size > 8 else ""
  return f"mesh {dict(mesh.shape)} on devices {ids}{more}"
