"""Merged versions: the syncer's published fragments, their commit markers and the index.

Layout under a store folder (names from `names`):

  merged/index.json                 {fragment: latest committed version}, written last
  merged/f{p}_v{v}.{w}/params       Orbax: the fragment's tensors (what learners download)
  merged/f{p}_v{v}.{w}/outer        Orbax: the syncer's Nesterov momentum of the fragment
  merged/f{p}_v{v}.json             commit marker: syncer state, the round's tape record, and
                                    the name of its data folder (`w` is unique per write)

A version is trusted only once its marker exists; data and marker are fsynced on a local
disk before the index names them. The index is not (a starting syncer rewrites it from the
markers).
"""

from __future__ import annotations

import math
import os
import re
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from absl import logging

from diloco.distributed.store import entry_check
from diloco.distributed.store.blob_io import Blobs, fsync_dir
from diloco.distributed.store.entry_check import StoreError
from diloco.distributed.store.names import (
  CONFLICT,
  MERGED_DATA,
  MERGED_NAME,
  NON_FINITE,
  UNREADABLE,
  checked_array,
  checked_int,
  merged_name,
  num_pattern,
  tensor_key,
)
from diloco.sync import intake
from diloco.transport import Merged


class MergedVersions:
  """The merged versions under one store folder (`merged/`), written by one syncer."""

  def __init__(self, blobs: Blobs):
    self.blobs = blobs
    self._writer = uuid.uuid4().hex  # names this writer's commits (see `put`)

  def put(self, merged: Merged, momentum: dict[str, np.ndarray], marker: dict, *,
                 fence: Callable[[], None] | None = None) -> None:
    """Makes version `merged.version` of a fragment durable, then visible (index last).

    The data goes to a folder of its own (`f{p}_v{v}.{w}`), and the commit marker, which
    names it, is created only if the version has none: two writers can never commit the
    same version, and none deletes or overwrites another's data. `fence` (the syncer's
    `Lease.check`) runs before the data, the marker and the index are written, and raises
    if this writer may no longer write.

    StoreError WRITE_FAILED naming the version if it cannot be written (a full disk): the
    index is unchanged, and calling again retries (a version this Store already committed
    then only has its index written). CONFLICT if another writer committed the version.
    """
    if fence is not None:
      fence()
    name = merged_name(merged.fragment, merged.version)
    try:
      existing = self.marker(merged.fragment, merged.version)
    except StoreError as e:  # not a marker any writer made (a folder, a FIFO, garbage)
      self.set_aside(f"merged/{name}.json", str(e))
      existing = None
    if existing is None:
      self._write(merged, momentum, marker, fence)
    elif not (isinstance(existing, dict) and existing.get("writer") == self._writer):
      raise StoreError(CONFLICT, f"merged {name}: already committed by another writer; only "
                       f"one syncer may write to {self.blobs.root}")
    try:
      index = self.index()
    except StoreError as e:  # not a record at all: rebuilt from the commit markers
      logging.error("store: %s; rebuilding the index from the commit markers", e)
      index = self._index_from_markers()
    index[merged.fragment] = merged.version
    if fence is not None:
      fence()
    try:
      # Atomic, not synced: the markers are the durable record, a starting syncer rewrites
      # the index from them (`syncer_process.recover`), and learners only move forward.
      self.blobs.write_json("merged/index.json", {str(p): v for p, v in sorted(index.items())})
    except StoreError as e:
      raise StoreError(e.reason, f"merged {name}: committed, but not published: {e}") from e

  def _write(self, merged: Merged, momentum: dict[str, np.ndarray], marker: dict,
                    fence: Callable[[], None] | None) -> None:
    """The data of a merged version, in a folder of its own, then its commit marker."""
    name = merged_name(merged.fragment, merged.version)
    data = f"{name}.{uuid.uuid4().hex[:12]}"
    paths = sorted(merged.tensors)
    try:
      self.blobs.save_tree(f"merged/{data}/params",
                           {tensor_key(i): merged.tensors[k] for i, k in enumerate(paths)})
      self.blobs.save_tree(f"merged/{data}/outer",
                           {tensor_key(i): momentum[k] for i, k in enumerate(paths)})
      if self.blobs.local:
        fsync_dir(self.blobs.root / "merged")  # the data folder's name, before the marker's
      if fence is not None:
        fence()
      created = self.blobs.create_json(f"merged/{name}.json", dict(
          marker, fragment=merged.fragment, version=merged.version, paths=paths,
          published_at=merged.published_at, nbytes=merged.nbytes, data=data,
          writer=self._writer))
    except StoreError as e:
      self.blobs.remove_quietly(f"merged/{data}")
      raise StoreError(e.reason, f"merged {name}: not committed: {e}") from e
    except BaseException:
      self.blobs.remove_quietly(f"merged/{data}")
      raise
    if not created:
      self.blobs.remove_quietly(f"merged/{data}")
      raise StoreError(CONFLICT, f"merged {name}: already committed by another writer; only "
                       f"one syncer may write to {self.blobs.root}")

  def set_aside(self, rel: str, why: str) -> None:
    """Moves a planted or corrupt file out of the way of a commit (to `quarantine/`), so the
    version's name is free; removed if it cannot be moved."""
    logging.error("store: %s is not a usable record (%s); moved to quarantine/", rel, why)
    aside = f"{rel.replace('/', '_')}.{uuid.uuid4().hex[:8]}"
    target = self.blobs.root / "quarantine" / aside
    try:
      target.parent.mkdir(parents=True, exist_ok=True)
      (self.blobs.root / rel).rename(target)
    except OSError as e:
      logging.error("store: could not move %s aside (%r); removing it", rel, e)
      self.blobs.remove(rel)

  def index(self) -> dict[int, int]:
    """{fragment: version} of `merged/index.json`; entries that are not a canonical fragment
    number and a version counter are left out (StoreError if it is no record at all)."""
    raw = self.blobs.read_json("merged/index.json") or {}
    if not isinstance(raw, dict):
      raise StoreError(UNREADABLE, f"{self.blobs.root}/merged/index.json: not a JSON object")
    return {int(p): int(v) for p, v in raw.items()
            if re.fullmatch(num_pattern(6), p) and intake.is_count(v, 0)}

  def marker(self, fragment: int, version: int) -> dict | None:
    return self.blobs.read_json(f"merged/{merged_name(fragment, version)}.json")

  def read(self, fragment: int, version: int, *, with_momentum: bool = False,
                  shapes: dict[str, tuple] | None = None
                  ) -> tuple[Merged, dict[str, np.ndarray] | None]:
    """A committed merged fragment (and the syncer's momentum of it, on request).

    StoreError if it cannot be used: a marker of wrong types, data that are not plain files
    in real folders (checked, sizes included, before Orbax opens them), tensors that are
    not float32 of the marker's (or, given `shapes`, the plan's) paths and shapes, or values
    that are not finite (NON_FINITE: a corrupt or planted version is never applied).
    """
    name = merged_name(fragment, version)
    marker = self.marker(fragment, version)
    if marker is None:
      raise StoreError(UNREADABLE, f"merged {name}: no commit marker")
    paths, data, published_at, nbytes = merged_marker_fields(marker, name, shapes)
    m = MERGED_DATA.fullmatch(data)
    if m is None or (int(m[1]), int(m[2])) != (fragment, version):
      raise StoreError(UNREADABLE, f"merged {name}: marker names data {data!r}")
    tensors = self._part(f"merged/{data}/params", paths, shapes, nbytes, name)
    momentum = None
    if with_momentum:
      momentum = self._part(f"merged/{data}/outer", paths, shapes, nbytes, name)
    return Merged(fragment, version, tensors, published_at), momentum

  def _part(self, rel: str, paths: list[str], shapes: dict[str, tuple] | None,
                   nbytes: int, what: str) -> dict[str, np.ndarray]:
    """One Orbax tree of a merged version, checked before and after it is read."""
    if self.blobs.local and os.path.islink(self.blobs.root / rel.rsplit("/", 1)[0]):
      raise StoreError(entry_check.BAD_METADATA, f"merged {what}: its data folder is a symlink")
    data_bytes = (entry_check.expected_bytes([tuple(shapes[k]) for k in paths], None)
                  if shapes is not None else nbytes)
    entry_check.check_entry(self.blobs.root / rel, entry_check.leaf_keys(len(paths), None),
                            data_bytes, self.blobs.local, f"merged {what}")
    try:
      tree = self.blobs.load_tree(rel)
      tensors = {k: tree[tensor_key(i)] for i, k in enumerate(paths)}
    except Exception as e:  # Orbax and NumPy raise many types on damaged data
      raise StoreError(UNREADABLE, f"merged {what}: cannot read ({type(e).__name__}: "
                       f"{str(e)[:200]})") from None
    for k, x in tensors.items():
      shape = tuple(shapes[k]) if shapes is not None else getattr(x, "shape", None)
      checked_array(x, shape, np.float32, f"merged {what} {k}")
      if not intake.all_finite(x):
        raise StoreError(NON_FINITE, f"merged {what} {k}: values are not finite")
    return tensors

  def _index_from_markers(self) -> dict[int, int]:
    """{fragment: newest committed version} from the markers' names."""
    index: dict[int, int] = {}
    for marker in self.blobs.listdir("merged"):
      m = MERGED_NAME.fullmatch(marker.name[:-len(".json")]) if marker.name.endswith(
          ".json") else None
      if m is not None and self.blobs.plain_file(marker):
        index[int(m[1])] = max(int(m[2]), index.get(int(m[1]), -1))
    return index

  def versions(self, fragment: int) -> list[int]:
    """Committed versions of a fragment still in the store, ascending."""
    out = []
    fragment = checked_int(fragment, "fragment")
    for marker in self.blobs.listdir("merged"):
      if marker.name.endswith(".json"):
        m = MERGED_NAME.fullmatch(marker.name[:-len(".json")])
        if m is not None and int(m[1]) == fragment and self.blobs.plain_file(marker):
          out.append(int(m[2]))
    return sorted(out)

  def collect(self, fragment: int, keep: int) -> None:
    """Deletes all but the newest `keep` committed versions of a fragment.

    Safe while the syncer writes the next version: nothing newer than the newest committed
    version is touched (`collect_uncommitted` removes a dead syncer's leftovers).
    """
    versions = self.versions(fragment)
    if not versions:
      return
    old = set(versions[:-keep] if keep > 0 else versions)
    folders = self._data_folders()
    for v in sorted(old):
      self.blobs.remove(f"merged/{merged_name(fragment, v)}.json")  # marker first: never a marker
      for folder in folders.get((fragment, v), ()):          # without its data
        self.blobs.remove(f"merged/{folder}")

  def _data_folders(self) -> dict[tuple[int, int], list[str]]:
    """(fragment, version) -> its data folders (a committed one, and failed writes')."""
    out: dict[tuple[int, int], list[str]] = {}
    for path in self.blobs.listdir("merged"):
      m = MERGED_DATA.fullmatch(path.name)
      if m is not None:
        out.setdefault((int(m[1]), int(m[2])), []).append(path.name)
    return out

  def collect_uncommitted(self) -> int:
    """Deletes merged entries without a commit marker (a syncer died while writing them);
    call it only when no syncer is writing. Returns how many."""
    removed = 0
    listed = {p.name for p in self.blobs.listdir("merged")}
    for (fragment, version), folders in sorted(self._data_folders().items()):
      if f"{merged_name(fragment, version)}.json" not in listed:
        for folder in folders:
          self.blobs.remove(f"merged/{folder}")
          removed += 1
    return removed


def merged_marker_fields(marker: Any, name: str, shapes: dict[str, tuple] | None
                         ) -> tuple[list[str], str, float, int]:
  """(paths, data folder, published_at, nbytes) of a merged version's commit marker, typed
  (StoreError UNREADABLE otherwise); `shapes`, if given, must be exactly its paths."""
  if not isinstance(marker, dict):
    raise StoreError(UNREADABLE, f"merged {name}: commit marker is not a JSON object")
  paths, data = marker.get("paths"), marker.get("data", name)
  published_at = intake.as_float(marker.get("published_at"))
  nbytes = marker.get("nbytes", 0)
  if not (isinstance(paths, list) and all(isinstance(k, str) for k in paths)
          and len(set(paths)) == len(paths) and paths == sorted(paths)
          and isinstance(data, str) and published_at is not None
          and math.isfinite(published_at) and intake.is_count(nbytes, 0)):
    raise StoreError(UNREADABLE, f"merged {name}: commit marker fields of wrong type")
  if shapes is not None and set(paths) != set(shapes):
    raise StoreError(UNREADABLE, f"merged {name}: not the parameters of its fragment")
  return paths, data, published_at, int(nbytes)

