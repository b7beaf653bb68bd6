"""The one table that maps logical axis names to the learner mesh axes.

Model code names axes logically ("embed", "mlp", ...); only this module knows the
mesh axes ("data", "fsdp", "tensor"). Rules are ordered: an axis already used by an
earlier dimension of the same array is skipped, so activations shaped
("batch", "length", "embed") shard batch over data x fsdp and leave embed whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", None),
    ("head_dim", None),
    ("expert", None),
    ("length", None),
    ("layers", None),
)


def logical_spec(names: Sequence[str | None]) -> P:
  """PartitionSpec of logical `names` under DEFAULT_RULES."""
  return nn.logical_to_mesh_axes(tuple(names), DEFAULT_RULES)


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
  """Sharding constraint on an activation; a no-op outside a mesh context (e.g. eval_shape)."""
  if jax.sharding.get_abstract_mesh().empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_spec(names))


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Sharding of a [batch, length] token array: batch over data x fsdp."""
  return NamedSharding(mesh, logical_spec(("batch", "length")))
