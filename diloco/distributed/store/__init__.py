"""The store shared by learner and syncer processes: one root, a local path or `gs://...`.

`Store` owns one part per job, each in its own module with its part of the layout:
`blobs` (`blob_io`: atomic records and Orbax trees), `payloads` (`payload_box`: learners'
deliveries and the quarantine), `merged` (`merged_versions`: the syncer's published
versions, markers and index), `learners` (`learner_registry`: heartbeats, incarnations,
learner checkpoint folders) and `run` (`run_lifecycle`: run start, readiness, stop). Every
name is built from validated integers and fixed words (`names`), never from what an
entry contains. Under the root:

  merged/ payloads/ quarantine/     the syncer's own records (`merged_versions`, `payload_box`)
  heartbeats/ incarnations/ learners/   per-learner records (`learner_registry`)
  ready/ run.json stop.json         the run's lifecycle (`run_lifecycle`)
  registry.json                     syncer registry (for people and tools)
  lease/g{n}.json                   the syncer lease, generation n (`lease.py`)

Sharded syncer (`sync.shards = S > 1`, docs/design.md 3.1): shard s owns the folder
`shards/s{s}/`, which holds its own `merged/` (index, entries, markers: its durable tape),
`payloads/`, `quarantine/`, `lease/` and `registry.json`, laid out as above; `heartbeats/`,
`incarnations/`, `learners/`, `ready/`, `run.json` and `stop.json` stay shared at the root
(every shard reads all heartbeats). `Store(root, shard=s)` is shard s's view: its own records
under `shards/s{s}/`, the shared ones (`shared`, `learners`, `run`) at the root;
`shard_stores(root, S)` are the views a learner or the evaluator routes to (with S = 1, the
root itself: the layout above, unchanged). A learner writes each delivery into its
fragment's shard (`ownership.assign`) and polls every shard's `merged/index.json`.

Durability (local disk): what the design promises to keep (merged entries and their commit
markers, the run start, incarnation numbers, the lease) is fsynced, file and then
directory, before the next step depends on it. Payloads and heartbeats are not, nor is the
index, which a starting syncer rewrites from the markers.
"""

from __future__ import annotations

import os

from etils import epath

from diloco.distributed.store.blob_io import Blobs
from diloco.distributed.store.learner_registry import LearnerRegistry
from diloco.distributed.store.merged_versions import MergedVersions
from diloco.distributed.store.names import shard_folder
from diloco.distributed.store.payload_box import Payloads
from diloco.distributed.store.run_lifecycle import RunLifecycle
from diloco.errors import ConfigError

# Folders of a syncer shard's own, and folders every shard and learner shares (at the root).
_OWN_FOLDERS = ("merged", "payloads", "lease")
_SHARED_FOLDERS = ("heartbeats", "incarnations", "learners", "ready")


class Store:
  """The parts of the store under one root: `blobs`, `payloads`, `merged`, `learners`, `run`.

  `shard`: shard s's view of a sharded store (`sync.shards` > 1): its merged versions,
  payloads, quarantine, lease and registry under `shards/s{s}/`, the shared records
  (heartbeats, incarnations, learner checkpoints, run start, stop) at the root, through
  `self.shared` (whose `learners` and `run` this view uses). None: one syncer, everything at
  the root (`shared` is the store itself).
  """

  def __init__(self, root: str | os.PathLike, *, shard: int | None = None,
               _folders: tuple[str, ...] = _OWN_FOLDERS + _SHARED_FOLDERS):
    self.base = epath.Path(root)  # the run's root
    self.shard = shard
    self.root = self.base if shard is None else self.base / shard_folder(shard)
    self.local = "://" not in str(root)
    if shard is not None and self.local:
      _refuse_symlinks(self.base, shard)
    self.blobs = Blobs(self.root, self.local)
    if shard is not None:
      self.shared = Store(root, _folders=_SHARED_FOLDERS)
      _folders = _OWN_FOLDERS
    else:
      self.shared = self
    # An object store has no directories: these calls do nothing there (prefixes exist
    # through their objects), and listings of empty prefixes are treated as empty.
    for sub in _folders:
      (self.root / sub).mkdir(parents=True, exist_ok=True)
    self.payloads = Payloads(self.blobs)
    self.merged = MergedVersions(self.blobs)
    # Shared by every shard: the root's, through `shared`.
    self.learners = (LearnerRegistry(self.blobs) if self.shared is self
                     else self.shared.learners)
    self.run = RunLifecycle(self.blobs) if self.shared is self else self.shared.run


def _refuse_symlinks(base: epath.Path, shard: int) -> None:
  """A shard's folder (or `shards/`) that is a symlink would put its lease, versions and
  payloads outside the store (and collect them there): refused, like a symlinked `merged/`."""
  folder = shard_folder(shard)
  for rel in ("shards", folder):
    if os.path.islink(base / rel):
      raise ConfigError(f"store.root={str(base)!r}: {rel} is a symlink; a shard's folder must "
                        "be a folder of the store, not a link to elsewhere")


def shared_store(root: str | os.PathLike, shards: int) -> Store:
  """The run's root as the launcher sees it: with several shards, only the shared records
  (no syncer folders are made at the root)."""
  return Store(root) if shards == 1 else Store(root, _folders=_SHARED_FOLDERS)


def shard_stores(root: str | os.PathLike, shards: int) -> list[Store]:
  """The store of each syncer shard, indexed by shard: `[Store(root)]` with one syncer
  (today's layout), else `Store(root, shard=s)` for s < `shards`."""
  if shards == 1:
    return [Store(root)]
  return [Store(root, shard=s) for s in range(shards)]


def global_index(stores: list[Store], owner: tuple[int, ...] | None = None
                 ) -> dict[int, int]:
  """{fragment: latest committed version} over every shard's `merged/index.json`; with
  `owner` (`ownership.assign`), a shard's index counts only for the fragments it owns (a
  planted entry in another shard's folder is ignored)."""
  index: dict[int, int] = {}
  for s, store in enumerate(stores):
    for p, v in store.merged.index().items():
      if owner is None or (p < len(owner) and owner[p] == s):
        index[p] = v
  return index
