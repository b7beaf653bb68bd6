"""The store shared by learner and syncer processes: one root, a local path or `gs://...`.

Everything goes through `etils.epath` and Orbax, so a local directory and an object store
use the same code. Layout under the root (every name is built from validated integers
and fixed words, never from what an entry contains):

  merged/index.json                 {fragment: latest committed version}, written last
  merged/f{p}_v{v}.{w}/params       Orbax: the fragment's tensors (what learners download)
  merged/f{p}_v{v}.{w}/outer        Orbax: the syncer's Nesterov momentum of the fragment
  merged/f{p}_v{v}.json             commit marker: syncer state, the round's tape record, and
                                    the name of its data folder (`w` is unique per write)
  payloads/f{p}_l{m}_i{i}_s{t}/     Orbax: a learner's delivery of fragment p at local step t
  payloads/f{p}_l{m}_i{i}_s{t}.json commit marker: the delivery's counters
  quarantine/f{p}_l{m}_i{i}_s{t}/   a delivery that could not be used (moved aside, never read)
  quarantine/f{p}_l{m}_i{i}_s{t}.reason.json   why: {"reason", "detail", "time"}
  heartbeats/l{m}.json              the latest heartbeat of learner m
  incarnations/l{m}.json            the last incarnation number handed out to learner m
  learners/l{m}/                    learner m's own checkpoints (Orbax CheckpointManager)
  registry.json, stop.json          syncer registry (for people and tools); end of run
  run.json                          the run's start time (the clock origin of all records)
  lease/g{n}.json                   the syncer lease, generation n (`lease.py`)

Sharded syncer (`sync.shards = S > 1`, docs/design.md 3.1): shard s owns the folder
`shards/s{s}/`, which holds its own `merged/` (index, entries, markers: its durable tape),
`payloads/`, `quarantine/`, `lease/` and `registry.json`, laid out as above; `heartbeats/`,
`incarnations/`, `learners/`, `ready/`, `run.json` and `stop.json` stay shared at the root
(every shard reads all heartbeats). `Store(root, shard=s)` is shard s's view: its own records
under `shards/s{s}/`, the shared ones (`shared`) at the root; `shard_stores(root, S)` are the
views a learner or the evaluator routes to (with S = 1, the root itself: the layout above,
unchanged). A learner writes each delivery into its fragment's shard (`syncer_shards.assign`)
and polls every shard's `merged/index.json`.

An Orbax entry is a directory with Orbax's `_METADATA` and one `.npy` file per tensor
(`npy_handler`). It is trusted only once its commit marker exists: on a local disk the entry
is written under a temporary name that is then renamed, and the marker is written after
that, so a reader never sees a half-written entry as complete (`is_orbax_checkpoint` would
not tell). JSON records are written to a temporary name and renamed on a local disk;
object-store writes of a single object are atomic by themselves.

Durability (local disk): what the design promises to keep (merged entries and their commit
markers, the run start, incarnation numbers, the lease) is fsynced, file and then
directory, before the next step depends on it. Payloads and heartbeats are not (see
`write_json`), nor is the index, which a starting syncer rewrites from the markers. On an
object store an object is durable once its upload returns. Nothing here depends on directory
modification times or renames on an object store.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import time
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
import fsspec.dircache
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from diloco.sync import intake
from diloco import outer
from diloco.delivery import Delivery
from diloco.distributed import entry_check, npy_handler
from diloco.distributed.entry_check import StoreError
from diloco.transport import Merged

def _num(digits: int) -> str:
  """A canonical decimal of at most `digits` ASCII digits (no leading zeros, no other
  Unicode digits): one name per number, so no entry has two names."""
  return f"(0|[1-9][0-9]{{0,{digits - 1}}})"


# Names are matched whole (`fullmatch`: no trailing newline slips past a `$`).
_PAYLOAD_NAME = re.compile(f"f{_num(6)}_l{_num(6)}_i{_num(9)}_s{_num(12)}")
_MERGED_NAME = re.compile(f"f{_num(6)}_v{_num(12)}")
_LEARNER_RECORD = re.compile(f"l{_num(6)}\\.json")
# A merged version's data folder: the version's name and, since each write has its own, a
# suffix naming the write (so that no writer ever deletes or overwrites another's data).
_MERGED_DATA = re.compile(f"f{_num(6)}_v{_num(12)}(\\.[0-9a-f]{{12}})?")
_MAX_JSON_BYTES = 1 << 22

# Rejection reasons of entries that cannot even be read as a payload.
UNREADABLE = "unreadable"
WRONG_SHAPE = "wrong_shape"
WRONG_DTYPE = "wrong_dtype"
# Not a rejection: the entry was deleted after it was listed (it is nobody's delivery now).
GONE = "gone"
# A write that failed (a full disk, a lost connection): nothing of it was committed.
WRITE_FAILED = "write_failed"
# A merged version that another writer committed first (two syncers on one store).
CONFLICT = "conflict"
# A merged version whose values are NaN or infinite (corrupt or planted): never applied.
NON_FINITE = "non_finite"


def _checked_int(value: int, what: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
    raise ValueError(f"store: {what} must be a non-negative integer, got {value!r}")
  return int(value)


def payload_name(fragment: int, learner: int, incarnation: int, local_step: int) -> str:
  return (f"f{_checked_int(fragment, 'fragment')}_l{_checked_int(learner, 'learner')}"
          f"_i{_checked_int(incarnation, 'incarnation')}_s{_checked_int(local_step, 'step')}")


def parse_payload_name(name: str) -> tuple[int, int, int, int] | None:
  """(fragment, learner, incarnation, local_step) of a payload entry name, or None."""
  m = _PAYLOAD_NAME.fullmatch(name) if isinstance(name, str) else None
  return None if m is None else tuple(int(x) for x in m.groups())


def merged_name(fragment: int, version: int) -> str:
  return f"f{_checked_int(fragment, 'fragment')}_v{_checked_int(version, 'version')}"


def _tensor_key(i: int) -> str:
  return f"t{i:04d}"


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


def _fsync_dir(path: epath.Path) -> None:
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


# Folders of a syncer shard's own, and folders every shard and learner shares (at the root).
_OWN_FOLDERS = ("merged", "payloads", "lease")
_SHARED_FOLDERS = ("heartbeats", "incarnations", "learners", "ready")


def shard_folder(shard: int) -> str:
  """Shard s's folder under the root, with `sync.shards` > 1 (module docstring)."""
  return f"shards/s{_checked_int(shard, 'shard')}"


class Store:
  """Atomic JSON records and committed Orbax entries under one root.

  `shard`: shard s's view of a sharded store (`sync.shards` > 1): its merged versions,
  payloads, quarantine, lease and registry under `shards/s{s}/`, the shared records
  (heartbeats, incarnations, learner checkpoints, run start, stop) at the root, through
  `self.shared`. None: one syncer, everything at the root (`shared` is the store itself).
  """

  def __init__(self, root: str | os.PathLike, *, shard: int | None = None,
               _folders: tuple[str, ...] = _OWN_FOLDERS + _SHARED_FOLDERS):
    self.base = epath.Path(root)  # the run's root
    self.shard = shard
    self.root = self.base if shard is None else self.base / shard_folder(shard)
    self.local = "://" not in str(root)
    if not self.local:
      _no_listings_cache(self.root)
    if shard is not None:
      self.shared = Store(root, _folders=_SHARED_FOLDERS)
      _folders = _OWN_FOLDERS
    else:
      self.shared = self
    # An object store has no directories: these calls do nothing there (prefixes exist
    # through their objects), and listings of empty prefixes are treated as empty.
    for sub in _folders:
      (self.root / sub).mkdir(parents=True, exist_ok=True)
    self._durable = _tree_handler(sync=self.local)  # object-store writes are durable on close
    self._unsynced = _tree_handler(sync=False)
    self._first_seen: dict[str, float] = {}  # uncommitted entry -> when this process saw it
    self._writer = uuid.uuid4().hex  # names this Store's merged commits (see put_merged)

  def _list(self, sub: str) -> list[epath.Path]:
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

  def _plain_file(self, path: epath.Path) -> bool:
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

  # JSON control records.
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
        _fsync_dir(path.parent)
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
      _fsync_dir(path.parent)
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

  def _save_tree(self, rel: str, tree: dict, *, durable: bool = True) -> None:
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
        _fsync_dir(tmp)
      os.replace(tmp, path)
      if durable:
        _fsync_dir(path.parent)  # the rename (the caller syncs folders above it)
    except OSError as e:
      tmp.rmtree(missing_ok=True)
      raise _write_failed(f"entry {rel}", self.root, e) from e
    except BaseException:
      tmp.rmtree(missing_ok=True)
      raise

  def _load_tree(self, rel: str) -> dict:
    return self._durable.restore(self.root / rel, args=ocp.args.PyTreeRestore())

  # Learner deliveries.
  def put_payload(self, payload: Delivery) -> int:
    """Writes and commits one delivery; returns its payload bytes. StoreError(WRITE_FAILED)
    naming the entry if it cannot be written (a full disk): nothing is committed then."""
    name = payload_name(payload.fragment, payload.learner, payload.incarnation,
                        payload.local_step)
    tree, quant = {}, None
    for i, (path, tensor) in enumerate(sorted(payload.tensors.items())):
      if isinstance(tensor, outer.QuantizedTensor):
        quant = {"bits": tensor.bits, "block": tensor.block}
        tree[_tensor_key(i)] = ({"values": tensor.values} if tensor.bits == 16 else
                                {"values": tensor.values, "scales": tensor.scales})
      else:
        tree[_tensor_key(i)] = np.asarray(tensor)
    started = time.monotonic()
    self._save_tree(f"payloads/{name}", tree, durable=False)
    transit_s = payload.transit_s + (time.monotonic() - started)  # the upload is transit too
    self._commit(f"payloads/{name}", {
        "learner": payload.learner, "incarnation": payload.incarnation,
        "fragment": payload.fragment, "local_step": payload.local_step, "steps": payload.steps,
        "tokens": payload.tokens, "base_version": payload.base_version, "kind": payload.kind,
        "paths": sorted(payload.tensors), "quantization": quant, "transit_s": transit_s,
        "lead_s": payload.lead_s, "final": payload.final,
        "nbytes": payload.nbytes}, durable=False)
    return payload.nbytes

  def _commit(self, rel: str, marker: dict, *, durable: bool) -> None:
    """Writes the commit marker of the entry at `rel`; if that fails, removes the entry, so
    that a full disk leaves neither a committed entry nor (for long) an uncommitted one."""
    try:
      self.write_json(f"{rel}.json", marker, durable=durable)
    except StoreError:
      try:
        self.remove(rel)
      except OSError:
        pass  # collected later as an uncommitted entry
      raise

  def committed_payloads(self) -> list[str]:
    """Names of committed deliveries (sorted); names of any other form are ignored."""
    names = []
    for marker in self._list("payloads"):
      if marker.name.endswith(".json"):
        stem = marker.name[:-len(".json")]
        if parse_payload_name(stem) is not None:
          names.append(stem)
    return sorted(names, key=parse_payload_name)

  def _uncommitted(self) -> list[str]:
    """Names under payloads/ that are not markers and have no marker: entries being written,
    entries whose writer died, and (local disk) temporary directories."""
    listed = {p.name for p in self._list("payloads")}
    return sorted(n for n in listed if not n.endswith(".json") and f"{n}.json" not in listed)

  def uncommitted_payloads(self) -> list[str]:
    """Entry directories without a commit marker (half-written, or a writer died)."""
    return [n for n in self._uncommitted() if parse_payload_name(n) is not None]

  def collect_uncommitted(self, max_age_s: float) -> int:
    """Deletes payload leftovers without a commit marker (a writer died mid-write, including
    temporary directories) once this process has seen them uncommitted for more than
    `max_age_s`; returns how many.

    The age is this process's own (monotonic) time since it first listed the name, not a
    modification time: an object store has none for a prefix, and a writer's clock is not
    ours. A restarted syncer starts counting again, which only delays the collection.
    """
    now = time.monotonic()
    names = self._uncommitted()
    self._first_seen = {n: self._first_seen.get(n, now) for n in names}
    removed = 0
    for name in names:
      if now - self._first_seen[name] <= max_age_s:
        continue
      if self.exists(f"payloads/{name}.json"):  # committed since the listing
        continue
      try:
        self.remove(f"payloads/{name}")
      except FileNotFoundError:
        continue
      del self._first_seen[name]
      removed += 1
    return removed

  def read_payload(self, name: str, expected: dict[int, dict[str, tuple]]) -> Delivery:
    """Reads a committed delivery; StoreError with a reason if it cannot be used.

    `expected[p]` maps fragment p's parameter paths to their shapes: the marker must
    agree with its own name and the data with the plan, before anything is returned.
    """
    ids = parse_payload_name(name)
    if ids is None:
      raise StoreError(UNREADABLE, f"payload {name!r}: not a payload name")
    fragment = ids[0]
    meta = self.read_json(f"payloads/{name}.json")
    if meta is None:
      raise StoreError(GONE, f"payload {name}: deleted since it was listed")
    fields = entry_check.marker_fields(meta, f"payload {name}")
    kind, paths, quant = fields["kind"], fields["paths"], fields["quantization"]
    transit_s, lead_s = fields["transit_s"], fields["lead_s"]
    if (fields["fragment"], fields["learner"], fields["incarnation"],
        fields["local_step"]) != ids:
      raise StoreError(UNREADABLE, f"payload {name}: marker disagrees with the entry name")
    if fragment not in expected or sorted(paths) != sorted(expected[fragment]):
      raise StoreError(UNREADABLE, f"payload {name}: not the parameters of fragment {fragment}")
    # Files, `_METADATA` and size are checked before Orbax opens anything.
    entry_check.check_entry(
        self.root / "payloads" / name, entry_check.leaf_keys(len(paths), quant),
        entry_check.expected_bytes([tuple(expected[fragment][k]) for k in paths], quant),
        self.local, f"payload {name}")
    try:
      tree = self._load_tree(f"payloads/{name}")
    except Exception as e:  # Orbax and NumPy raise many types on damaged data
      raise StoreError(UNREADABLE, f"payload {name}: cannot read ({type(e).__name__}: "
                       f"{str(e)[:200]})") from None
    if not isinstance(tree, dict) or set(tree) != {_tensor_key(i) for i in range(len(paths))}:
      raise StoreError(UNREADABLE, f"payload {name}: unexpected tensors")
    tensors = {}
    for i, path in enumerate(sorted(paths)):
      shape = tuple(expected[fragment][path])
      item = tree[_tensor_key(i)]
      if kind == "values":
        tensors[path] = _checked_array(item, shape, np.float32, f"payload {name} {path}")
      else:
        tensors[path] = _quantized(item, quant, shape, f"payload {name} {path}")
    return Delivery(learner=fields["learner"], incarnation=fields["incarnation"], fragment=fragment,
                    local_step=fields["local_step"], steps=fields["steps"], tokens=fields["tokens"],
                    base_version=fields["base_version"], kind=kind, tensors=tensors,
                    transit_s=transit_s, lead_s=lead_s, final=fields["final"])

  def payload_bytes(self, name: str) -> int:
    """Bytes a delivery claims to hold (0 if its marker is unreadable): for the ledger."""
    try:
      nbytes = (self.read_json(f"payloads/{name}.json") or {}).get("nbytes", 0)
    except (StoreError, AttributeError):
      return 0
    return nbytes if intake.is_count(nbytes, 0) else 0  # a crafted count never reaches the ledger

  def quarantine_payload(self, name: str, reason: str, detail: str) -> None:
    """Moves a delivery to `quarantine/` with a record of why, so it is never read again.

    The reason record comes first and the commit marker last: until the marker moves, the
    entry is still listed (and quarantined again by a restarted syncer).
    """
    if parse_payload_name(name) is None:
      raise ValueError(f"store: not a payload name {name!r}")
    folder = self.root / "quarantine"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / f"{name}.reason.json").exists():  # a half-moved entry keeps its first why
      self.write_json(f"quarantine/{name}.reason.json",
                      {"reason": reason, "detail": detail[:2000], "time": time.time()})
    for rel in (name, f"{name}.json"):
      source, target = self.root / "payloads" / rel, folder / rel
      if not source.exists():
        continue
      if target.is_dir():
        target.rmtree()
      if self.local:
        source.rename(target)
        continue
      # An object store has no rename: copy the entry's objects (an entry is flat), then
      # delete them; the marker goes last, so a crash in between quarantines it again.
      if source.is_dir():
        target.mkdir(parents=True, exist_ok=True)
        for item in source.iterdir():
          item.copy(target / item.name, overwrite=True)
        source.rmtree()
      else:
        source.copy(target, overwrite=True)
        source.unlink()

  def quarantined(self) -> dict[str, dict]:
    """Quarantined deliveries: name -> {"reason", "detail", "time"}."""
    out = {}
    folder = self.root / "quarantine"
    for path in folder.glob("*.reason.json") if folder.exists() else ():
      name = path.name[:-len(".reason.json")]
      if parse_payload_name(name) is not None:
        try:
          out[name] = self.read_json(f"quarantine/{path.name}")
        except StoreError as e:  # a planted or damaged record still names its entry
          out[name] = {"reason": UNREADABLE, "detail": str(e)[:500], "time": None}
    return out

  def remove_payload(self, name: str) -> None:
    self.remove(f"payloads/{name}.json")  # marker first: a reader never sees it half-deleted
    self.remove(f"payloads/{name}")

  # Merged fragments (the syncer's durable rounds).
  def put_merged(self, merged: Merged, momentum: dict[str, np.ndarray], marker: dict, *,
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
      existing = self.merged_marker(merged.fragment, merged.version)
    except StoreError as e:  # not a marker any writer made (a folder, a FIFO, garbage)
      self.set_aside(f"merged/{name}.json", str(e))
      existing = None
    if existing is None:
      self._write_merged(merged, momentum, marker, fence)
    elif not (isinstance(existing, dict) and existing.get("writer") == self._writer):
      raise StoreError(CONFLICT, f"merged {name}: already committed by another writer; only "
                       f"one syncer may write to {self.root}")
    try:
      index = self.merged_index()
    except StoreError as e:  # not a record at all: rebuilt from the commit markers
      logging.error("store: %s; rebuilding the index from the commit markers", e)
      index = self._index_from_markers()
    index[merged.fragment] = merged.version
    if fence is not None:
      fence()
    try:
      # Atomic, not synced: the markers are the durable record, a starting syncer rewrites
      # the index from them (`syncer_process.recover`), and learners only move forward.
      self.write_json("merged/index.json", {str(p): v for p, v in sorted(index.items())})
    except StoreError as e:
      raise StoreError(e.reason, f"merged {name}: committed, but not published: {e}") from e

  def _write_merged(self, merged: Merged, momentum: dict[str, np.ndarray], marker: dict,
                    fence: Callable[[], None] | None) -> None:
    """The data of a merged version, in a folder of its own, then its commit marker."""
    name = merged_name(merged.fragment, merged.version)
    data = f"{name}.{uuid.uuid4().hex[:12]}"
    paths = sorted(merged.tensors)
    try:
      self._save_tree(f"merged/{data}/params",
                      {_tensor_key(i): merged.tensors[k] for i, k in enumerate(paths)})
      self._save_tree(f"merged/{data}/outer",
                      {_tensor_key(i): momentum[k] for i, k in enumerate(paths)})
      if self.local:
        _fsync_dir(self.root / "merged")  # the data folder's name, before the marker's
      if fence is not None:
        fence()
      created = self.create_json(f"merged/{name}.json", dict(
          marker, fragment=merged.fragment, version=merged.version, paths=paths,
          published_at=merged.published_at, nbytes=merged.nbytes, data=data,
          writer=self._writer))
    except StoreError as e:
      self._remove_quietly(f"merged/{data}")
      raise StoreError(e.reason, f"merged {name}: not committed: {e}") from e
    except BaseException:
      self._remove_quietly(f"merged/{data}")
      raise
    if not created:
      self._remove_quietly(f"merged/{data}")
      raise StoreError(CONFLICT, f"merged {name}: already committed by another writer; only "
                       f"one syncer may write to {self.root}")

  def set_aside(self, rel: str, why: str) -> None:
    """Moves a planted or corrupt file out of the way of a commit (to `quarantine/`), so the
    version's name is free; removed if it cannot be moved."""
    logging.error("store: %s is not a usable record (%s); moved to quarantine/", rel, why)
    target = self.root / "quarantine" / f"{rel.replace('/', '_')}.{uuid.uuid4().hex[:8]}"
    try:
      target.parent.mkdir(parents=True, exist_ok=True)
      (self.root / rel).rename(target)
    except OSError as e:
      logging.error("store: could not move %s aside (%r); removing it", rel, e)
      self.remove(rel)

  def _remove_quietly(self, rel: str) -> None:
    """Removes what a failed write left; if that fails too, the entry stays uncommitted (no
    marker names it) and `collect_uncommitted_merged` or the payload GC removes it."""
    try:
      self.remove(rel)
    except OSError as e:
      logging.warning("store: could not remove %s after a failed write: %r", rel, e)

  def merged_index(self) -> dict[int, int]:
    """{fragment: version} of `merged/index.json`; entries that are not a canonical fragment
    number and a version counter are left out (StoreError if it is no record at all)."""
    raw = self.read_json("merged/index.json") or {}
    if not isinstance(raw, dict):
      raise StoreError(UNREADABLE, f"{self.root}/merged/index.json: not a JSON object")
    return {int(p): int(v) for p, v in raw.items()
            if re.fullmatch(_num(6), p) and intake.is_count(v, 0)}

  def merged_marker(self, fragment: int, version: int) -> dict | None:
    return self.read_json(f"merged/{merged_name(fragment, version)}.json")

  def read_merged(self, fragment: int, version: int, *, with_momentum: bool = False,
                  shapes: dict[str, tuple] | None = None
                  ) -> tuple[Merged, dict[str, np.ndarray] | None]:
    """A committed merged fragment (and the syncer's momentum of it, on request).

    StoreError if it cannot be used: a marker of wrong types, data that are not plain files
    in real folders (checked, sizes included, before Orbax opens them), tensors that are
    not float32 of the marker's (or, given `shapes`, the plan's) paths and shapes, or values
    that are not finite (NON_FINITE: a corrupt or planted version is never applied).
    """
    name = merged_name(fragment, version)
    marker = self.merged_marker(fragment, version)
    if marker is None:
      raise StoreError(UNREADABLE, f"merged {name}: no commit marker")
    paths, data, published_at, nbytes = merged_marker_fields(marker, name, shapes)
    m = _MERGED_DATA.fullmatch(data)
    if m is None or (int(m[1]), int(m[2])) != (fragment, version):
      raise StoreError(UNREADABLE, f"merged {name}: marker names data {data!r}")
    tensors = self._merged_part(f"merged/{data}/params", paths, shapes, nbytes, name)
    momentum = None
    if with_momentum:
      momentum = self._merged_part(f"merged/{data}/outer", paths, shapes, nbytes, name)
    return Merged(fragment, version, tensors, published_at), momentum

  def _merged_part(self, rel: str, paths: list[str], shapes: dict[str, tuple] | None,
                   nbytes: int, what: str) -> dict[str, np.ndarray]:
    """One Orbax tree of a merged version, checked before and after it is read."""
    if self.local and os.path.islink(self.root / rel.rsplit("/", 1)[0]):
      raise StoreError(entry_check.BAD_METADATA, f"merged {what}: its data folder is a symlink")
    data_bytes = (entry_check.expected_bytes([tuple(shapes[k]) for k in paths], None)
                  if shapes is not None else nbytes)
    entry_check.check_entry(self.root / rel, entry_check.leaf_keys(len(paths), None),
                            data_bytes, self.local, f"merged {what}")
    try:
      tree = self._load_tree(rel)
      tensors = {k: tree[_tensor_key(i)] for i, k in enumerate(paths)}
    except Exception as e:  # Orbax and NumPy raise many types on damaged data
      raise StoreError(UNREADABLE, f"merged {what}: cannot read ({type(e).__name__}: "
                       f"{str(e)[:200]})") from None
    for k, x in tensors.items():
      shape = tuple(shapes[k]) if shapes is not None else getattr(x, "shape", None)
      _checked_array(x, shape, np.float32, f"merged {what} {k}")
      if not intake.all_finite(x):
        raise StoreError(NON_FINITE, f"merged {what} {k}: values are not finite")
    return tensors

  def _index_from_markers(self) -> dict[int, int]:
    """{fragment: newest committed version} from the markers' names."""
    index: dict[int, int] = {}
    for marker in self._list("merged"):
      m = _MERGED_NAME.fullmatch(marker.name[:-len(".json")]) if marker.name.endswith(
          ".json") else None
      if m is not None and self._plain_file(marker):
        index[int(m[1])] = max(int(m[2]), index.get(int(m[1]), -1))
    return index

  def merged_versions(self, fragment: int) -> list[int]:
    """Committed versions of a fragment still in the store, ascending."""
    out = []
    fragment = _checked_int(fragment, "fragment")
    for marker in self._list("merged"):
      if marker.name.endswith(".json"):
        m = _MERGED_NAME.fullmatch(marker.name[:-len(".json")])
        if m is not None and int(m[1]) == fragment and self._plain_file(marker):
          out.append(int(m[2]))
    return sorted(out)

  def collect_merged(self, fragment: int, keep: int) -> None:
    """Deletes all but the newest `keep` committed versions of a fragment.

    Safe while the syncer writes the next version: nothing newer than the newest committed
    version is touched (`collect_uncommitted_merged` removes a dead syncer's leftovers).
    """
    versions = self.merged_versions(fragment)
    if not versions:
      return
    old = set(versions[:-keep] if keep > 0 else versions)
    folders = self._merged_data_folders()
    for v in sorted(old):
      self.remove(f"merged/{merged_name(fragment, v)}.json")  # marker first: never a marker
      for folder in folders.get((fragment, v), ()):          # without its data
        self.remove(f"merged/{folder}")

  def _merged_data_folders(self) -> dict[tuple[int, int], list[str]]:
    """(fragment, version) -> its data folders (a committed one, and failed writes')."""
    out: dict[tuple[int, int], list[str]] = {}
    for path in self._list("merged"):
      m = _MERGED_DATA.fullmatch(path.name)
      if m is not None:
        out.setdefault((int(m[1]), int(m[2])), []).append(path.name)
    return out

  def collect_uncommitted_merged(self) -> int:
    """Deletes merged entries without a commit marker (a syncer died while writing them);
    call it only when no syncer is writing. Returns how many."""
    removed = 0
    listed = {p.name for p in self._list("merged")}
    for (fragment, version), folders in sorted(self._merged_data_folders().items()):
      if f"{merged_name(fragment, version)}.json" not in listed:
        for folder in folders:
          self.remove(f"merged/{folder}")
          removed += 1
    return removed

  # Heartbeats and incarnations.
  def put_heartbeat(self, learner: int, record: dict) -> None:
    if self.shared is not self:
      return self.shared.put_heartbeat(learner, record)
    self.write_json(f"heartbeats/l{_checked_int(learner, 'learner')}.json", record)

  def heartbeats(self) -> dict[int, dict]:
    """The latest heartbeat record of every learner that has one (unreadable ones skipped)."""
    if self.shared is not self:
      return self.shared.heartbeats()
    out = {}
    for path in self._list("heartbeats"):
      m = _LEARNER_RECORD.fullmatch(path.name)
      if m is None:
        continue
      try:
        record = self.read_json(f"heartbeats/{path.name}")
      except StoreError:
        continue
      if isinstance(record, dict):
        out[int(m[1])] = record
    return out

  def next_incarnation(self, learner: int) -> int:
    """A fresh incarnation number for a starting learner process (one writer per id)."""
    if self.shared is not self:
      return self.shared.next_incarnation(learner)
    rel = f"incarnations/l{_checked_int(learner, 'learner')}.json"
    last = self.read_json(rel)
    incarnation = 0 if last is None else int(last["incarnation"]) + 1
    self.write_json(rel, {"incarnation": incarnation}, durable=True)  # never handed out twice
    return incarnation

  def run_start(self, create: bool = False) -> float | None:
    """Wall time at which the run started: the clock origin of every process's records."""
    if self.shared is not self:
      return self.shared.run_start(create)
    record = self.read_json("run.json")
    if record is None and create:
      record = {"start": time.time()}
      self.write_json("run.json", record, durable=True)
    return None if record is None else float(record["start"])

  def mark_ready(self, learner: int) -> None:
    """Learner `learner` of the first cohort is compiled and holds the initial fragments."""
    if self.shared is not self:
      return self.shared.mark_ready(learner)
    self.write_json(f"ready/l{_checked_int(learner, 'learner')}.json", {"time": time.time()})

  def ready_learners(self) -> set[int]:
    if self.shared is not self:
      return self.shared.ready_learners()
    return {int(m[1]) for path in self._list("ready")
            if (m := _LEARNER_RECORD.fullmatch(path.name)) is not None}

  def learner_dir(self, learner: int) -> epath.Path:
    return self.base / "learners" / f"l{_checked_int(learner, 'learner')}"

  # The end of the run (shared by every shard).
  def request_stop(self, record: dict) -> None:
    """The launcher's `stop.json`: every syncer shard settles and stops."""
    self.shared.write_json("stop.json", record)

  def stop_requested(self) -> bool:
    return self.shared.exists("stop.json")


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


def _checked_array(item: Any, shape: tuple, dtype, what: str) -> np.ndarray:
  if not isinstance(item, np.ndarray):
    raise StoreError(UNREADABLE, f"{what}: not an array")
  if item.dtype != dtype:
    raise StoreError(WRONG_DTYPE, f"{what}: dtype {item.dtype}, expected {np.dtype(dtype)}")
  if item.shape != shape:
    raise StoreError(WRONG_SHAPE, f"{what}: shape {item.shape}, expected {shape}")
  return item


def _quantized(item: Any, quant: dict, shape: tuple, what: str) -> outer.QuantizedTensor:
  try:
    bits, block = int(quant["bits"]), int(quant["block"])
  except (TypeError, KeyError, ValueError, OverflowError):
    raise StoreError(UNREADABLE, f"{what}: bad quantization record {quant!r}") from None
  if bits not in outer.QUANT_BITS or block < 1 or not isinstance(item, dict):
    raise StoreError(UNREADABLE, f"{what}: bad quantization record {quant!r}")
  size = int(np.prod(shape))
  blocks = -(-size // block)
  if bits == 16:
    code_dtype, codes = ml_dtypes.bfloat16, size
  else:
    code_dtype = np.int8 if bits == 8 else np.uint8
    codes = outer.packed_size(blocks * block, bits)
  values = _checked_array(item.get("values"), (codes,), code_dtype, what)
  if bits == 16:
    scales = np.zeros(0, np.float32)
  else:
    scales = _checked_array(item.get("scales"), (blocks,), np.float32, what)
  return outer.QuantizedTensor(values, scales, shape, "float32", bits, block)


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
  `owner` (`syncer_shards.assign`), a shard's index counts only for the fragments it owns (a
  planted entry in another shard's folder is ignored)."""
  index: dict[int, int] = {}
  for s, store in enumerate(stores):
    for p, v in store.merged_index().items():
      if owner is None or (p < len(owner) and owner[p] == s):
        index[p] = v
  return index
