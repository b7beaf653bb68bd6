"""The global model G of a multi-process run, assembled from its store (docs/design.md 3.1).

With a sharded syncer each shard publishes only its fragments, so whoever needs the whole of G
(the evaluator process, shard 0's export at the end of a run, `train.init_from` on a store)
reads every shard's newest committed version of each of its fragments here. No JAX: NumPy
arrays from the store.
"""

from __future__ import annotations

import math
import time

import numpy as np
from absl import logging

from diloco.distributed import store as store_lib
from diloco.distributed.store import Store
from diloco.distributed.store import layout as store_layout
from diloco.distributed.store.entry_check import StoreError
from diloco.errors import ConfigError
from diloco.sync import ownership

# A fragment with no usable version yet (not yet published, or collected under the read) is
# read again this many times before the reader gives up.
_READ_ATTEMPTS = 20
_RETRY_S = 0.5


def plan_of(layout: dict) -> tuple[list[dict[str, tuple]], tuple[int, ...]]:
  """(per fragment {path: shape}, owner shard per fragment) of a layout record
  (`store_layout.layout_record`)."""
  shapes = [{k: tuple(shape) for k, shape, _ in fragment} for fragment in layout["fragments"]]
  sizes = [sum(math.prod(s) for s in f.values()) for f in shapes]
  return shapes, ownership.assign(sizes, layout["shards"])


def newest_usable(store: Store, p: int, shapes: dict[str, tuple]):
  """Fragment p's newest committed version in `store` that reads back whole: its commit
  markers are the durable record (the index is not consulted: it may be torn, missing or name
  a phantom), each version checked against the plan's paths and shapes, float32 and finite
  (`MergedVersions.read`). None if no version is usable."""
  for version in reversed(store.merged.versions(p)):
    try:
      merged, _ = store.merged.read(p, version, shapes=shapes)
      return merged
    except StoreError as e:
      logging.warning("read_global: merged f%d_v%d in %s is not used: %s", p, version,
                      store.root, e)
  return None


def join_floor(stores: list[Store], owner: tuple[int, ...], shapes: list[dict[str, tuple]],
               held: dict[int, int]) -> dict[int, int]:
  """{fragment: the version a joining learner must start from at least}: the newest version
  by the commit markers of the fragment's owner that reads back whole (`MergedVersions.read`
  with the plan's shapes), or `held[p]` (what the learner already fetched) when no newer one
  is usable. The index is not consulted: a version it names that is missing (phantom),
  torn or non-finite would keep the join waiting for it until the join timed out."""
  floor: dict[int, int] = {}
  for p, fragment in enumerate(shapes):
    have = held.get(p, -1)
    floor[p] = have
    store = stores[owner[p]]
    for version in reversed(store.merged.versions(p)):
      if version <= have:
        break
      try:
        store.merged.read(p, version, shapes=fragment)
      except StoreError as e:
        logging.warning("join: merged f%d_v%d in %s is not used: %s", p, version, store.root, e)
        continue
      floor[p] = version
      break
  return floor


def published(stores: list[Store], layout: dict) -> bool:
  """Whether every fragment has a committed version (a marker) in its owner's folder."""
  shapes, owner = plan_of(layout)
  return all(stores[owner[p]].merged.versions(p) for p in range(len(shapes)))


def read_global(stores: Store | list[Store], *, with_rounds: bool = False, paths=None,
                layout: dict | None = None):
  """G of a multi-process store: each fragment's newest usable version, read only from the
  folder of the shard that owns it under the store's plan (`newest_usable`), joined into flat
  global parameters: (params, {fragment: version}), and with `with_rounds` the rounds every
  shard has closed, summed (from its registry).

  `stores`: from `store.shard_stores` (or one store). `layout`: the run's layout record (default
  the store's own, `store_layout`; a store without one is refused). `paths`: parameters G
  must hold, checked against the plan. A fragment with no usable version yet is waited for
  (`_READ_ATTEMPTS`); then RuntimeError naming it. Never a G of another plan or owner.
  """
  stores = [stores] if isinstance(stores, Store) else list(stores)
  if layout is None:
    layout = store_layout.recorded(stores[0].shared)
  if layout["shards"] != len(stores):
    raise ConfigError(f"sync.shards={len(stores)}: store {stores[0].base} records "
                      f"sync.shards={layout['shards']}")
  shapes, owner = plan_of(layout)
  if paths is not None and set(paths) != {k for f in shapes for k in f}:
    raise ConfigError(f"the fragment plan: store {stores[0].base} holds other parameters "
                      "than this model's")
  missing: list[int] = []
  for _ in range(_READ_ATTEMPTS):
    rounds = sum(_registry(s).get("rounds", 0) for s in stores) if with_rounds else 0
    flat: dict[str, np.ndarray] = {}
    index: dict[int, int] = {}
    missing = []
    for p, fragment in enumerate(shapes):
      merged = newest_usable(stores[owner[p]], p, fragment)
      if merged is None:
        missing.append(p)
        continue
      flat.update(merged.tensors)
      index[p] = merged.version
    if not missing:
      return (flat, index, rounds) if with_rounds else (flat, index)
    time.sleep(_RETRY_S)
  raise RuntimeError(f"store {stores[0].base}: fragments {missing[:8]} have no usable "
                     "committed version in the folders of the shards that own them")


def read_store(path: str, shards: int) -> tuple[dict[str, np.ndarray], dict[int, int]]:
  """G of the store at `path` with `shards` syncer shards, for `train.init_from` on a store
  (`artifacts.export.StoreReader`); the store's recorded layout decides the shard count. A
  store made before the record is read under the layout its versions give, if they give one
  (`store_layout.inferred`; `shards` from its folders)."""
  shared = store_lib.Store(path, _folders=())
  if store_layout.has_record(shared):
    layout = store_layout.recorded(shared)
  else:
    layout = store_layout.inferred(shared, shards)
  return read_global(store_lib.shard_stores(path, layout["shards"]), layout=layout)


def _registry(store: Store) -> dict:
  try:
    record = store.blobs.read_json("registry.json") or {}
  except Exception:  # pylint: disable=broad-except  # a torn record: read it next poll
    return {}
  return record if isinstance(record, dict) else {}


def stopped(store: Store) -> bool:
  """Whether the syncer (or shard) of `store` has stopped with its final versions published."""
  return bool(_registry(store).get("stopped"))
