"""The store shared by learner and syncer processes: one root, a local path or `gs://...`.

Everything goes through `etils.epath` and Orbax, so a local directory and an object store
use the same code. Layout under the root (every name is built from validated integers
and fixed words, never from what an entry contains):

  merged/index.json                 {fragment: latest committed version}, written last
  merged/f{p}_v{v}/params           Orbax: the fragment's tensors (what learners download)
  merged/f{p}_v{v}/outer            Orbax: the syncer's Nesterov momentum of the fragment
  merged/f{p}_v{v}.json             commit marker: syncer state and the round's tape record
  payloads/f{p}_l{m}_i{i}_s{t}/     Orbax: a learner's delivery of fragment p at local step t
  payloads/f{p}_l{m}_i{i}_s{t}.json commit marker: the delivery's counters
  quarantine/f{p}_l{m}_i{i}_s{t}/   a delivery that could not be used (moved aside, never read)
  quarantine/f{p}_l{m}_i{i}_s{t}.reason.json   why: {"reason", "detail", "time"}
  heartbeats/l{m}.json              the latest heartbeat of learner m
  incarnations/l{m}.json            the last incarnation number handed out to learner m
  learners/l{m}/                    learner m's own checkpoints (Orbax CheckpointManager)
  registry.json, stop.json          syncer registry (for people and tools); end of run
  run.json                          the run's start time (the clock origin of all records)

An Orbax entry is a directory with Orbax's `_METADATA` and one `.npy` file per tensor
(`npy_handler`). It is trusted only once its commit marker exists: on a local disk the entry
is written under a temporary name that is then renamed, and the marker is written after
that, so a reader never sees a half-written entry as complete (`is_orbax_checkpoint` would
not tell). JSON records are written to a temporary name and renamed on a local disk;
object-store writes of a single object are atomic by themselves.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from typing import Any

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from diloco import intake, outer
from diloco.distributed import entry_check, npy_handler
from diloco.distributed.entry_check import StoreError
from diloco.transport import Merged, Payload

_PAYLOAD_NAME = re.compile(r"^f(\d{1,6})_l(\d{1,6})_i(\d{1,9})_s(\d{1,12})$")
_MERGED_NAME = re.compile(r"^f(\d{1,6})_v(\d{1,12})$")
_MAX_JSON_BYTES = 1 << 22

# Rejection reasons of entries that cannot even be read as a payload.
UNREADABLE = "unreadable"
WRONG_SHAPE = "wrong_shape"
WRONG_DTYPE = "wrong_dtype"
# Not a rejection: the entry was deleted after it was listed (it is nobody's delivery now).
GONE = "gone"


def _checked_int(value: int, what: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
    raise ValueError(f"store: {what} must be a non-negative integer, got {value!r}")
  return int(value)


def payload_name(fragment: int, learner: int, incarnation: int, local_step: int) -> str:
  return (f"f{_checked_int(fragment, 'fragment')}_l{_checked_int(learner, 'learner')}"
          f"_i{_checked_int(incarnation, 'incarnation')}_s{_checked_int(local_step, 'step')}")


def parse_payload_name(name: str) -> tuple[int, int, int, int] | None:
  """(fragment, learner, incarnation, local_step) of a payload entry name, or None."""
  m = _PAYLOAD_NAME.match(name)
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


class Store:
  """Atomic JSON records and committed Orbax entries under one root."""

  def __init__(self, root: str | os.PathLike):
    self.root = epath.Path(root)
    self.local = "://" not in str(root)
    for sub in ("merged", "payloads", "heartbeats", "incarnations", "learners", "ready"):
      (self.root / sub).mkdir(parents=True, exist_ok=True)
    self._durable = _tree_handler(sync=self.local)  # object-store writes are durable on close
    self._unsynced = _tree_handler(sync=False)

  # JSON control records.
  def write_json(self, rel: str, record: Any) -> None:
    path = self.root / rel
    text = json.dumps(record)
    if not self.local:
      path.write_text(text)  # one object write is atomic in an object store
      return
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    tmp.write_text(text)
    os.replace(tmp, path)

  def read_json(self, rel: str) -> Any:
    """The record, or None if it does not exist; StoreError if it is not valid JSON."""
    path = self.root / rel
    try:
      raw = path.read_bytes()
    except FileNotFoundError:
      return None
    if len(raw) > _MAX_JSON_BYTES:
      raise StoreError(UNREADABLE, f"{path}: {len(raw)} bytes is too large for a record")
    try:
      return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise StoreError(UNREADABLE, f"{path}: not JSON ({e})") from None

  def exists(self, rel: str) -> bool:
    return (self.root / rel).exists()

  def remove(self, rel: str) -> None:
    path = self.root / rel
    if path.is_dir():
      path.rmtree()
    elif path.exists():
      path.unlink()

  def _save_tree(self, rel: str, tree: dict, *, durable: bool = True) -> None:
    """Writes an Orbax entry at `rel`; on a local disk under a temporary name, then renamed.
    `durable=False` (payloads) leaves the data to the page cache instead of syncing it.

    In an object store there is no atomic rename of a prefix; the commit marker, written by
    the caller after this returns, is what makes the entry trusted there (and here).
    """
    path = self.root / rel
    if path.exists():  # left over by a writer that died before its commit marker
      path.rmtree()
    tree = _host_tree(tree)
    handler = self._durable if durable else self._unsynced
    if not self.local:
      path.mkdir(parents=True)
      handler.save(path, args=ocp.args.PyTreeSave(tree))
      return
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    tmp.mkdir(parents=True)
    try:
      handler.save(tmp, args=ocp.args.PyTreeSave(tree))
      os.replace(tmp, path)
    except BaseException:
      tmp.rmtree(missing_ok=True)
      raise

  def _load_tree(self, rel: str) -> dict:
    return self._durable.restore(self.root / rel, args=ocp.args.PyTreeRestore())

  # Learner deliveries.
  def put_payload(self, payload: Payload) -> int:
    """Writes and commits one delivery; returns its payload bytes."""
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
    self.write_json(f"payloads/{name}.json", {
        "learner": payload.learner, "incarnation": payload.incarnation,
        "fragment": payload.fragment, "local_step": payload.local_step, "steps": payload.steps,
        "tokens": payload.tokens, "base_version": payload.base_version, "kind": payload.kind,
        "paths": sorted(payload.tensors), "quantization": quant, "transit_s": transit_s,
        "lead_s": payload.lead_s,
        "nbytes": payload.nbytes})
    return payload.nbytes

  def committed_payloads(self) -> list[str]:
    """Names of committed deliveries (sorted); names of any other form are ignored."""
    names = []
    for marker in (self.root / "payloads").glob("*.json"):
      stem = marker.name[:-len(".json")]
      if parse_payload_name(stem) is not None:
        names.append(stem)
    return sorted(names, key=parse_payload_name)

  def uncommitted_payloads(self) -> list[str]:
    """Entry directories without a commit marker (half-written, or a writer died)."""
    out = []
    for entry in (self.root / "payloads").iterdir():
      if entry.is_dir() and parse_payload_name(entry.name) is not None and not (
          self.root / "payloads" / f"{entry.name}.json").exists():
        out.append(entry.name)
    return sorted(out)

  def collect_uncommitted(self, max_age_s: float) -> int:
    """Deletes payload leftovers without a commit marker older than `max_age_s` (a writer
    died mid-write, including Orbax's temporary directories); returns how many."""
    removed, now = 0, time.time()
    for entry in (self.root / "payloads").iterdir():
      if not entry.is_dir() or (self.root / "payloads" / f"{entry.name}.json").exists():
        continue
      try:
        age = now - entry.stat().mtime
      except FileNotFoundError:
        continue
      if age > max_age_s:
        entry.rmtree()
        removed += 1
    return removed

  def read_payload(self, name: str, expected: dict[int, dict[str, tuple]]) -> Payload:
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
    return Payload(fields["learner"], fields["incarnation"], fragment, fields["local_step"],
                   fields["steps"], fields["tokens"], fields["base_version"], kind, tensors,
                   transit_s, lead_s)

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
      source.rename(target)

  def quarantined(self) -> dict[str, dict]:
    """Quarantined deliveries: name -> {"reason", "detail", "time"}."""
    out = {}
    folder = self.root / "quarantine"
    for path in folder.glob("*.reason.json") if folder.exists() else ():
      name = path.name[:-len(".reason.json")]
      if parse_payload_name(name) is not None:
        out[name] = self.read_json(f"quarantine/{path.name}")
    return out

  def remove_payload(self, name: str) -> None:
    self.remove(f"payloads/{name}.json")  # marker first: a reader never sees it half-deleted
    self.remove(f"payloads/{name}")

  # Merged fragments (the syncer's durable rounds).
  def put_merged(self, merged: Merged, momentum: dict[str, np.ndarray], marker: dict) -> None:
    """Makes version `merged.version` of a fragment durable, then visible (index last)."""
    name = merged_name(merged.fragment, merged.version)
    paths = sorted(merged.tensors)
    self._save_tree(f"merged/{name}/params",
                    {_tensor_key(i): merged.tensors[k] for i, k in enumerate(paths)})
    self._save_tree(f"merged/{name}/outer",
                    {_tensor_key(i): momentum[k] for i, k in enumerate(paths)})
    self.write_json(f"merged/{name}.json", dict(
        marker, fragment=merged.fragment, version=merged.version, paths=paths,
        published_at=merged.published_at, nbytes=merged.nbytes))
    index = self.merged_index()
    index[merged.fragment] = merged.version
    self.write_json("merged/index.json", {str(p): v for p, v in sorted(index.items())})

  def merged_index(self) -> dict[int, int]:
    raw = self.read_json("merged/index.json") or {}
    return {int(p): int(v) for p, v in raw.items()}

  def merged_marker(self, fragment: int, version: int) -> dict | None:
    return self.read_json(f"merged/{merged_name(fragment, version)}.json")

  def read_merged(self, fragment: int, version: int, *, with_momentum: bool = False
                  ) -> tuple[Merged, dict[str, np.ndarray] | None]:
    """A committed merged fragment (and the syncer's momentum of it, on request)."""
    name = merged_name(fragment, version)
    marker = self.merged_marker(fragment, version)
    if marker is None:
      raise StoreError(UNREADABLE, f"merged {name}: no commit marker")
    paths = marker["paths"]
    params = self._load_tree(f"merged/{name}/params")
    tensors = {k: np.asarray(params[_tensor_key(i)]) for i, k in enumerate(paths)}
    momentum = None
    if with_momentum:
      saved = self._load_tree(f"merged/{name}/outer")
      momentum = {k: np.asarray(saved[_tensor_key(i)]) for i, k in enumerate(paths)}
    return Merged(fragment, version, tensors, float(marker["published_at"])), momentum

  def merged_versions(self, fragment: int) -> list[int]:
    """Committed versions of a fragment still in the store, ascending."""
    out = []
    for marker in (self.root / "merged").glob(f"f{_checked_int(fragment, 'fragment')}_v*.json"):
      m = _MERGED_NAME.match(marker.name[:-len(".json")])
      if m is not None:
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
    for v in versions[:-keep] if keep > 0 else versions:
      name = merged_name(fragment, v)
      self.remove(f"merged/{name}.json")  # marker first: never a marker without its data
      self.remove(f"merged/{name}")

  def collect_uncommitted_merged(self) -> int:
    """Deletes merged entries without a commit marker (a syncer died while writing them);
    call it only when no syncer is writing. Returns how many."""
    removed = 0
    for entry in (self.root / "merged").iterdir():
      if (entry.is_dir() and _MERGED_NAME.match(entry.name)
          and not (self.root / "merged" / f"{entry.name}.json").exists()):
        entry.rmtree()
        removed += 1
    return removed

  # Heartbeats and incarnations.
  def put_heartbeat(self, learner: int, record: dict) -> None:
    self.write_json(f"heartbeats/l{_checked_int(learner, 'learner')}.json", record)

  def heartbeats(self) -> dict[int, dict]:
    """The latest heartbeat record of every learner that has one (unreadable ones skipped)."""
    out = {}
    for path in (self.root / "heartbeats").glob("l*.json"):
      m = re.match(r"^l(\d{1,6})\.json$", path.name)
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
    rel = f"incarnations/l{_checked_int(learner, 'learner')}.json"
    last = self.read_json(rel)
    incarnation = 0 if last is None else int(last["incarnation"]) + 1
    self.write_json(rel, {"incarnation": incarnation})
    return incarnation

  def run_start(self, create: bool = False) -> float | None:
    """Wall time at which the run started: the clock origin of every process's records."""
    record = self.read_json("run.json")
    if record is None and create:
      record = {"start": time.time()}
      self.write_json("run.json", record)
    return None if record is None else float(record["start"])

  def mark_ready(self, learner: int) -> None:
    """Learner `learner` of the first cohort is compiled and holds the initial fragments."""
    self.write_json(f"ready/l{_checked_int(learner, 'learner')}.json", {"time": time.time()})

  def ready_learners(self) -> set[int]:
    folder = self.root / "ready"
    if not folder.exists():
      return set()
    return {int(m[1]) for path in folder.glob("l*.json")
            if (m := re.match(r"^l(\d{1,6})\.json$", path.name)) is not None}

  def learner_dir(self, learner: int) -> epath.Path:
    return self.root / "learners" / f"l{_checked_int(learner, 'learner')}"


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
