"""The payload mailbox: learners' deliveries, committed, read back, quarantined, collected.

Layout under a store folder (names from `names`):

  payloads/f{p}_l{m}_i{i}_s{t}/     Orbax: a learner's delivery of fragment p at local step t
  payloads/f{p}_l{m}_i{i}_s{t}.json commit marker: the delivery's counters
  quarantine/f{p}_l{m}_i{i}_s{t}/   a delivery that could not be used (moved aside, never read)
  quarantine/f{p}_l{m}_i{i}_s{t}.reason.json   why: {"reason", "detail", "time"}

A delivery is trusted only once its commit marker exists; payloads are not synced to disk
(they are consumed within seconds, and a lost one is only a lost delivery).
"""

from __future__ import annotations

import time
from typing import Any

import ml_dtypes
import numpy as np

from diloco import outer
from diloco.delivery import Delivery
from diloco.distributed.store import entry_check
from diloco.distributed.store.blob_io import Blobs
from diloco.distributed.store.entry_check import StoreError
from diloco.distributed.store.names import (
  GONE,
  UNREADABLE,
  checked_array,
  parse_payload_name,
  payload_name,
  tensor_key,
)
from diloco.sync import intake


class Payloads:
  """The deliveries under one store folder (`payloads/` and `quarantine/`)."""

  def __init__(self, blobs: Blobs):
    self.blobs = blobs
    self._first_seen: dict[str, float] = {}  # uncommitted entry -> when this process saw it

  def put(self, payload: Delivery) -> int:
    """Writes and commits one delivery; returns its payload bytes. StoreError(WRITE_FAILED)
    naming the entry if it cannot be written (a full disk): nothing is committed then."""
    name = payload_name(payload.fragment, payload.learner, payload.incarnation,
                        payload.local_step)
    tree, quant = {}, None
    for i, (path, tensor) in enumerate(sorted(payload.tensors.items())):
      if isinstance(tensor, outer.QuantizedTensor):
        quant = {"bits": tensor.bits, "block": tensor.block}
        tree[tensor_key(i)] = ({"values": tensor.values} if tensor.bits == 16 else
                               {"values": tensor.values, "scales": tensor.scales})
      else:
        tree[tensor_key(i)] = np.asarray(tensor)
    started = time.monotonic()
    self.blobs.save_tree(f"payloads/{name}", tree, durable=False)
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
      self.blobs.write_json(f"{rel}.json", marker, durable=durable)
    except StoreError:
      try:
        self.blobs.remove(rel)
      except OSError:
        pass  # collected later as an uncommitted entry
      raise

  def committed(self) -> list[str]:
    """Names of committed deliveries (sorted); names of any other form are ignored."""
    names = []
    for marker in self.blobs.listdir("payloads"):
      if marker.name.endswith(".json"):
        stem = marker.name[:-len(".json")]
        if parse_payload_name(stem) is not None:
          names.append(stem)
    return sorted(names, key=parse_payload_name)

  def _uncommitted(self) -> list[str]:
    """Names under payloads/ that are not markers and have no marker: entries being written,
    entries whose writer died, and (local disk) temporary directories."""
    listed = {p.name for p in self.blobs.listdir("payloads")}
    return sorted(n for n in listed if not n.endswith(".json") and f"{n}.json" not in listed)

  def uncommitted(self) -> list[str]:
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
      if self.blobs.exists(f"payloads/{name}.json"):  # committed since the listing
        continue
      try:
        self.blobs.remove(f"payloads/{name}")
      except FileNotFoundError:
        continue
      del self._first_seen[name]
      removed += 1
    return removed

  def read(self, name: str, expected: dict[int, dict[str, tuple]]) -> Delivery:
    """Reads a committed delivery; StoreError with a reason if it cannot be used.

    `expected[p]` maps fragment p's parameter paths to their shapes: the marker must
    agree with its own name and the data with the plan, before anything is returned.
    """
    ids = parse_payload_name(name)
    if ids is None:
      raise StoreError(UNREADABLE, f"payload {name!r}: not a payload name")
    fragment = ids[0]
    meta = self.blobs.read_json(f"payloads/{name}.json")
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
        self.blobs.root / "payloads" / name, entry_check.leaf_keys(len(paths), quant),
        entry_check.expected_bytes([tuple(expected[fragment][k]) for k in paths], quant),
        self.blobs.local, f"payload {name}")
    try:
      tree = self.blobs.load_tree(f"payloads/{name}")
    except Exception as e:  # Orbax and NumPy raise many types on damaged data
      raise StoreError(UNREADABLE, f"payload {name}: cannot read ({type(e).__name__}: "
                       f"{str(e)[:200]})") from None
    if not isinstance(tree, dict) or set(tree) != {tensor_key(i) for i in range(len(paths))}:
      raise StoreError(UNREADABLE, f"payload {name}: unexpected tensors")
    tensors = {}
    for i, path in enumerate(sorted(paths)):
      shape = tuple(expected[fragment][path])
      item = tree[tensor_key(i)]
      if kind == "values":
        tensors[path] = checked_array(item, shape, np.float32, f"payload {name} {path}")
      else:
        tensors[path] = _quantized(item, quant, shape, f"payload {name} {path}")
    return Delivery(learner=fields["learner"], incarnation=fields["incarnation"], fragment=fragment,
                    local_step=fields["local_step"], steps=fields["steps"], tokens=fields["tokens"],
                    base_version=fields["base_version"], kind=kind, tensors=tensors,
                    transit_s=transit_s, lead_s=lead_s, final=fields["final"])

  def nbytes(self, name: str) -> int:
    """Bytes a delivery claims to hold (0 if its marker is unreadable): for the ledger."""
    try:
      nbytes = (self.blobs.read_json(f"payloads/{name}.json") or {}).get("nbytes", 0)
    except (StoreError, AttributeError):
      return 0
    return nbytes if intake.is_count(nbytes, 0) else 0  # a crafted count never reaches the ledger

  def quarantine(self, name: str, reason: str, detail: str) -> None:
    """Moves a delivery to `quarantine/` with a record of why, so it is never read again.

    The reason record comes first and the commit marker last: until the marker moves, the
    entry is still listed (and quarantined again by a restarted syncer).
    """
    if parse_payload_name(name) is None:
      raise ValueError(f"store: not a payload name {name!r}")
    folder = self.blobs.root / "quarantine"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / f"{name}.reason.json").exists():  # a half-moved entry keeps its first why
      self.blobs.write_json(f"quarantine/{name}.reason.json",
                            {"reason": reason, "detail": detail[:2000], "time": time.time()})
    for rel in (name, f"{name}.json"):
      source, target = self.blobs.root / "payloads" / rel, folder / rel
      if not source.exists():
        continue
      if target.is_dir():
        target.rmtree()
      if self.blobs.local:
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
    folder = self.blobs.root / "quarantine"
    for path in folder.glob("*.reason.json") if folder.exists() else ():
      name = path.name[:-len(".reason.json")]
      if parse_payload_name(name) is not None:
        try:
          out[name] = self.blobs.read_json(f"quarantine/{path.name}")
        except StoreError as e:  # a planted or damaged record still names its entry
          out[name] = {"reason": UNREADABLE, "detail": str(e)[:500], "time": None}
    return out

  def remove(self, name: str) -> None:
    self.blobs.remove(f"payloads/{name}.json")  # marker first: a reader never sees it half-deleted
    self.blobs.remove(f"payloads/{name}")


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
  values = checked_array(item.get("values"), (codes,), code_dtype, what)
  if bits == 16:
    scales = np.zeros(0, np.float32)
  else:
    scales = checked_array(item.get("scales"), (blocks,), np.float32, what)
  return outer.QuantizedTensor(values, scales, shape, "float32", bits, block)
