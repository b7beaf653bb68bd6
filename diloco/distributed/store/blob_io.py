"""Blob I/O under one store folder, a local path or `gs://...`: atomic writes, safe reads.

Everything goes through `etils.epath` (fsspec for object stores) and Orbax, so a local
directory and an object store use the same code. JSON records are written to a temporary
name and renamed on a local disk; object-store writes of a single object are atomic by
themselves. An Orbax entry is a directory with Orbax's `_METADATA` and one `.npy` file per
tensor (`npy_handler`), written on a local disk under a temporary name that is then renamed;
the caller's commit marker, written after it, is what makes it trusted.

Durability (local disk): `durable` writes are fsynced, file and then directory, before they
return. On an object store an object is durable once its upload returns. Nothing here
depends on directory modification times or renames on an object store.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import uuid
from typing import Any

import fsspec
import fsspec.dircache
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from diloco.distributed.store import npy_handler
from diloco.distributed.store.entry_check import StoreError
from diloco.distributed.store.names import UNREADABLE, WRITE_FAILED

_MAX_JSON_BYTES = 1 << 22


def _tree_handler(sync: bool) -> ocp.PyTreeCheckpointHandler:
  """Orbax's PyTree handler with one `.npy` file per tensor (`npy_handler`), called directly:
  the store does its own tmp-then-rename and commit marker, so the Checkpointer's temporary
  directory, metadata and barriers would only add fixed cost to every entry (see
  `scripts/bench_store.py`). `sync` flushes each file to a local disk before returning.
  """
  registry = ocp.type_handlers.create_type_handler_registry(
      (np.ndarray, npy_handler.NpyHandler(sync=sync)))
  return ocp.PyTreeCheckpointHandler(use_ocdbt=False, type_handler_registry=registry)


def _host_tree(tree: dict) -> dict:
  """Nested dicts of host arrays (the handler is registered for NumPy arrays only)."""
  return {k: _host_tree(v) if isinstance(v, dict) else np.asarray(v) for k, v in tree.items()}


def _write_failed(what: str, root: epath.Path, e: OSError) -> StoreError:
  """The error of a write that left nothing committed (ENOSPC says so in words)."""
  cause = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else repr(e)
  return StoreError(WRITE_FAILED, f"{what}: could not be written to {root} ({cause}); "
                    "nothing of it was committed")


def fsync_dir(path: epath.Path) -> None:
  """Makes the names in a local directory (created, renamed files) survive a power loss."""
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _fsync_file(path: epath.Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _no_listings_cache(root: epath.Path) -> None:
  """Turns off the listings cache of the fsspec filesystem `root` is reached through.

  gcsfs keeps every listing it made (for ever, by default) and answers listings, `exists`
  and `info` of the names below it from that copy, so objects another process wrote or
  deleted afterwards stay invisible: a syncer would never see a new delivery, nor a lease
  holder the generation that took its lease. The store lists to learn what others wrote,
  so it must ask the server each time. (TensorFlow's gfile, which etils prefers when
  TensorFlow is installed, keeps no listings.)
  """
  from etils.epath import backend  # pylint: disable=import-outside-toplevel
  if getattr(root, "_backend", None) is not backend.fsspec_backend:
    return
  fs = backend.fsspec_backend.fs(os.fspath(root))
  if getattr(fs.dircache, "use_listings_cache", False):
    fs.dircache = fsspec.dircache.DirCache(use_listings_cache=False)


class Blobs:
  """Atomic JSON records and Orbax trees under one folder `root` (relative names `rel`)."""

  def __init__(self, root: epath.Path, local: bool):
    self.root, self.local = root, local
    if not local:
      _no_listings_cache(root)
    self._durable = _tree_handler(sync=local)  # object-store writes are durable on close
    self._unsynced = _tree_handler(sync=False)

  def listdir(self, sub: str) -> list[epath.Path]:
    """The entries under a folder (a prefix without objects is empty, not an error; so is a
    folder that is a symlink, which could lead anywhere)."""
    folder = self.root / sub
    if self.local and os.path.islink(folder):
      logging.error("store: %s is a symlink; its entries are not read", folder)
      return []
    try:
      return list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
      return []

  def plain_file(self, path: epath.Path) -> bool:
    """Whether `path` is a regular file (on a local disk: not a symlink, FIFO or device)."""
    if not self.local:
      return True  # an object store holds objects only
    try:
      return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
      return False

  def read_bytes(self, path: epath.Path, limit: int, what: str) -> bytes | None:
    """The bytes of a regular file of at most `limit` bytes, or None if it does not exist.

    StoreError(UNREADABLE) for anything else, decided before a byte is read: on a local disk
    a symlink, FIFO, device or directory (never opened: a FIFO would block), or a size over
    the limit by `stat`; then it is opened without following links or blocking, and checked
    again on the open descriptor (a swap between the two is caught).
    """
    if not self.local:
      try:
        raw = path.read_bytes()
      except FileNotFoundError:
        return None
      except (IsADirectoryError, NotADirectoryError) as e:
        raise StoreError(UNREADABLE, f"{what}: not a file ({e!r})") from None
    else:
      try:
        st = os.lstat(path)
      except (FileNotFoundError, NotADirectoryError):
        return None
      if not stat.S_ISREG(st.st_mode):
        raise StoreError(UNREADABLE, f"{what}: not a regular file (mode {st.st_mode:o})")
      if st.st_size > limit:
        raise StoreError(UNREADABLE, f"{what}: {st.st_size} bytes is too large (limit {limit})")
      try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
      except FileNotFoundError:
        return None
      except OSError as e:
        raise StoreError(UNREADABLE, f"{what}: cannot open ({e!r})") from None
      with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
          raise StoreError(UNREADABLE, f"{what}: not a regular file")
        raw = f.read(limit + 1)
    if len(raw) > limit:
      raise StoreError(UNREADABLE, f"{what}: {len(raw)} bytes is too large (limit {limit})")
    return raw

  def write_json(self, rel: str, record: Any, *, durable: bool = False) -> None:
    """Replaces a record atomically. `durable` (the run start, incarnations, the lease) also
    syncs it to a local disk, file and directory, before returning; heartbeats and payload
    markers are rewritten or consumed within seconds and skip it.
    StoreError(WRITE_FAILED) if it cannot be written; the old record is then unchanged."""
    path = self.root / rel
    text = json.dumps(record)
    if not self.local:
      try:
        path.write_text(text)  # one object write is atomic in an object store
      except OSError as e:
        raise _write_failed(f"record {rel}", self.root, e) from e
      return
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
      with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if durable:
          f.flush()
          os.fsync(f.fileno())
      os.replace(tmp, path)
      if durable:
        fsync_dir(path.parent)
    except OSError as e:
      tmp.unlink(missing_ok=True)
      raise _write_failed(f"record {rel}", self.root, e) from e

  def create_json(self, rel: str, record: Any) -> bool:
    """Writes a record only if none exists, atomically and durably; False if one does.

    The lease's compare-and-swap: on a local disk a hard link (fails if the name exists),
    on an object store fsspec's create-only write (`mode="create"`; GCS checks the
    precondition `ifGenerationMatch=0` on the server).
    """
    path = self.root / rel
    data = json.dumps(record).encode()
    if not self.local:
      fs, key = fsspec.core.url_to_fs(str(path))
      try:
        fs.pipe_file(key, data, mode="create")
      except FileExistsError:
        return False
      except OSError as e:
        raise _write_failed(f"record {rel}", self.root, e) from e
      return True
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
      with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
      try:
        os.link(tmp, path)
      except FileExistsError:
        return False
      fsync_dir(path.parent)
      return True
    except OSError as e:
      raise _write_failed(f"record {rel}", self.root, e) from e
    finally:
      tmp.unlink(missing_ok=True)

  def read_json(self, rel: str) -> Any:
    """The record, or None if it does not exist; StoreError if it is not valid JSON."""
    path = self.root / rel
    raw = self.read_bytes(path, _MAX_JSON_BYTES, str(path))
    if raw is None:
      return None
    try:
      return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
      raise StoreError(UNREADABLE, f"{path}: not JSON ({e})") from None

  def exists(self, rel: str) -> bool:
    return (self.root / rel).exists()

  def remove(self, rel: str) -> None:
    path = self.root / rel
    if self.local and os.path.islink(path):  # the link goes, never what it points to
      path.unlink()
    elif path.is_dir():
      path.rmtree()
    elif path.exists():
      path.unlink()

  def save_tree(self, rel: str, tree: dict, *, durable: bool = True) -> None:
    """Writes an Orbax entry at `rel`; on a local disk under a temporary name, then renamed.
    `durable=False` (payloads) leaves the data to the page cache instead of syncing it;
    `durable=True` syncs every file, the entry's folder, and the folder its rename changed
    (the caller syncs any folder above that it created), so the entry survives a power loss.

    In an object store there is no atomic rename of a prefix; the commit marker, written by
    the caller after this returns, is what makes the entry trusted there (and here).
    StoreError(WRITE_FAILED) if it cannot be written; what was written is removed.
    """
    path = self.root / rel
    if path.exists():  # left over by a writer that died before its commit marker
      path.rmtree()
    tree = _host_tree(tree)
    handler = self._durable if durable else self._unsynced
    if not self.local:
      path.mkdir(parents=True)
      try:
        handler.save(path, args=ocp.args.PyTreeSave(tree))
      except OSError as e:
        path.rmtree(missing_ok=True)  # best effort; no marker refers to it either way
        raise _write_failed(f"entry {rel}", self.root, e) from e
      return
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
      tmp.mkdir(parents=True)
      handler.save(tmp, args=ocp.args.PyTreeSave(tree))
      if durable:
        for f in tmp.iterdir():  # the tensor files are synced by the handler; Orbax's are not
          if f.suffix != ".npy" and f.is_file():
            _fsync_file(f)
        fsync_dir(tmp)
      os.replace(tmp, path)
      if durable:
        fsync_dir(path.parent)  # the rename (the caller syncs folders above it)
    except OSError as e:
      tmp.rmtree(missing_ok=True)
      raise _write_failed(f"entry {rel}", self.root, e) from e
    except BaseException:
      tmp.rmtree(missing_ok=True)
      raise

  def load_tree(self, rel: str) -> dict:
    return self._durable.restore(self.root / rel, args=ocp.args.PyTreeRestore())

  def remove_quietly(self, rel: str) -> None:
    """Removes what a failed write left; if that fails too, the entry stays uncommitted (no
    marker names it) and `MergedVersions.collect_uncommitted` or the payload GC removes it."""
    try:
      self.remove(rel)
    except OSError as e:
      logging.warning("store: could not remove %s after a failed write: %r", rel, e)
