"""Which syncer shard owns which fragment (docs/design.md 3.1, "Sharded syncer").

With `sync.shards = S` the syncer is S independent instances, each owning a fixed subset of
the P fragments: their G, momentum, versions, rounds and (in the multi-process runtime) lease,
store folder, tape and checkpoints. Every process computes the same assignment from the
fragment sizes and S alone, so routing a delivery needs no coordination.

Rule (byte-balanced, deterministic): fragments are taken largest first (ties: lower fragment
index first), each given to the shard that holds the fewest parameters so far (ties: lower
shard index). With S = 1 every fragment belongs to shard 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from diloco.errors import ConfigError


def assign(num_elements: Sequence[int], shards: int) -> tuple[int, ...]:
  """The shard of each fragment, `assign(sizes, S)[p]`, for fragments of `num_elements[p]`
  parameters each. Every shard owns at least one fragment."""
  if not (type(shards) is int and shards >= 1):  # noqa: E721  (bool is not a count)
    raise ConfigError(f"sync.shards: must be an integer >= 1, got {shards!r}")
  if shards > len(num_elements):
    raise ConfigError(f"sync.shards: {shards} shards need at least as many fragments, but the "
                      f"model has {len(num_elements)} (sync.num_fragments, capped by its "
                      "tensor count)")
  load = [0] * shards
  owner = [0] * len(num_elements)
  for p in sorted(range(len(num_elements)), key=lambda p: (-num_elements[p], p)):
    s = min(range(shards), key=lambda s: (load[s], s))
    owner[p] = s
    load[s] += num_elements[p]
  return tuple(owner)


def owned(assignment: Sequence[int], shard: int) -> tuple[int, ...]:
  """The fragments shard `shard` owns, in increasing order."""
  return tuple(p for p, s in enumerate(assignment) if s == shard)


def check_shard(shard: int, shards: int) -> None:
  """ConfigError unless `shard` names one of `shards` shards (a syncer process's own index)."""
  if not (type(shard) is int and 0 <= shard < shards):  # noqa: E721
    raise ConfigError(f"sync.shard: must be in [0, sync.shards={shards}), got {shard!r}")
