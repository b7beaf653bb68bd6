"""The global model G of a multi-process run, assembled from its store (docs/design.md 3.1).

With a sharded syncer each shard publishes only its fragments, so whoever needs the whole of G
(the evaluator process, shard 0's export at the end of a run, `train.init_from` on a store)
reads every shard's newest committed version of each of its fragments here. No JAX: NumPy
arrays from the store.
"""

from __future__ import annotations

import time

import numpy as np

from diloco.distributed import store as store_lib
from diloco.distributed.store import Store

# A version named by the index can be collected before it is read: read a fresh index.
_READ_ATTEMPTS = 20
_RETRY_S = 0.5


def read_global(stores: Store | list[Store], *, with_rounds: bool = False, paths=None):
  """The newest published version of every fragment, over every shard's store (a list from
  `store.shard_stores`, or one store), joined into flat global parameters: (params,
  {fragment: version}), and with `with_rounds` the rounds every shard has closed, summed
  (from its registry). `paths`: the parameters G must hold (a fragment not yet published by
  its shard is waited for)."""
  stores = [stores] if isinstance(stores, Store) else list(stores)
  error: Exception | None = None
  for _ in range(_READ_ATTEMPTS):
    rounds = sum(_registry(s).get("rounds", 0) for s in stores) if with_rounds else 0
    flat: dict[str, np.ndarray] = {}
    try:
      index = {}
      for store in stores:
        own = store.merged.index()
        for p, version in sorted(own.items()):
          merged, _ = store.merged.read(p, version)
          flat.update(merged.tensors)
        index.update(own)
      if paths is not None and set(paths) - set(flat):
        raise RuntimeError(f"{len(set(paths) - set(flat))} parameters not published yet")
      return (flat, index, rounds) if with_rounds else (flat, index)
    except Exception as e:  # pylint: disable=broad-except  # collected under us: re-read
      error = e
      time.sleep(_RETRY_S)
  raise RuntimeError(f"could not read the published versions in "
                     f"{stores[0].base} ({error!r})") from error



def read_store(path: str, shards: int) -> tuple[dict[str, np.ndarray], dict[int, int]]:
  """G of the store at `path` with `shards` syncer shards, for `train.init_from` on a store
  (`artifacts.export.StoreReader`)."""
  return read_global(store_lib.shard_stores(path, shards))

def _registry(store: Store) -> dict:
  try:
    record = store.blobs.read_json("registry.json") or {}
  except Exception:  # pylint: disable=broad-except  # a torn record: read it next poll
    return {}
  return record if isinstance(record, dict) else {}


def stopped(store: Store) -> bool:
  """Whether the syncer (or shard) of `store` has stopped with its final versions published."""
  return bool(_registry(store).get("stopped"))
