"""Checks of a payload entry in the store before anything in it is trusted or read.

A learner's delivery is a directory of files plus a JSON commit marker, written by another
process. Before Orbax opens the entry the syncer checks, from the listing and two small JSON
files alone, that:
- every field of the commit marker has the right type and range (a counter written as `1e400`,
  `4.5` or `true` is refused, not rounded);
- the entry holds exactly the files the store writes (`_METADATA` and one `.npy` per tensor, no
  links, no subdirectories) and Orbax's `_METADATA` names exactly those tensors, so that a
  crafted name such as `../../x` can never make Orbax read outside the entry;
- the files add up to no more than the fragment's expected bytes plus a margin, so an
  oversized entry is refused without reading its data.
Each failure is a `StoreError` with one reason word per kind.
"""

from __future__ import annotations

import json
import math
import os
import stat
from typing import Any

from etils import epath

from diloco import outer
from diloco.sync import intake

UNREADABLE = "unreadable"
BAD_COUNTERS = "bad_counters"
BAD_TIME = "bad_time"
BAD_METADATA = "bad_metadata"
OVERSIZE = "oversize"

METADATA_FILE = "_METADATA"
_MAX_METADATA_BYTES = 1 << 20
# Per-file slack over the raw tensor bytes: a `.npy` header is 64-256 bytes; `_METADATA` holds
# about 250 bytes per leaf.
_SLACK_PER_FILE = 4096
_COUNTERS = ("learner", "incarnation", "fragment", "local_step", "steps", "tokens")
_NPY_LEAF = "diloco.npy"


class StoreError(RuntimeError):
  """A store entry that exists but cannot be used; `reason` is a fixed word for metrics."""

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason


def marker_fields(meta: Any, what: str) -> dict[str, Any]:
  """The commit marker's fields, checked for type and range (StoreError otherwise)."""
  if not isinstance(meta, dict):
    raise StoreError(UNREADABLE, f"{what}: commit marker is not a JSON object")
  missing = [k for k in (*_COUNTERS, "base_version", "kind", "paths", "quantization",
                         "transit_s") if k not in meta]
  if missing:
    raise StoreError(UNREADABLE, f"{what}: commit marker lacks {missing}")
  bad = [k for k in _COUNTERS if not intake.is_count(meta[k], 0)]
  if bad or not intake.is_count(meta["base_version"], -1):
    raise StoreError(BAD_COUNTERS, f"{what}: counters {bad or ['base_version']} are not "
                     f"integers in range ({ {k: meta[k] for k in bad} })")
  times = {"transit_s": meta["transit_s"], "lead_s": meta.get("lead_s", 0.0)}
  if not all(intake.is_number(t) for t in times.values()):  # unusable values: the syncer's
    raise StoreError(BAD_TIME, f"{what}: times {times} are not numbers of seconds")
  kind, paths, quant = meta["kind"], meta["paths"], meta["quantization"]
  if (kind not in ("values", "delta") or not isinstance(paths, list)
      or not all(isinstance(p, str) for p in paths)):
    raise StoreError(UNREADABLE, f"{what}: bad kind or paths in the commit marker")
  if (kind == "delta") != (quant is not None):
    raise StoreError(UNREADABLE, f"{what}: kind {kind!r} with quantization {quant!r}")
  if quant is not None and not (
      isinstance(quant, dict) and intake.is_count(quant.get("bits"), 1)
      and quant["bits"] in outer.QUANT_BITS and intake.is_count(quant.get("block"), 1)):
    raise StoreError(UNREADABLE, f"{what}: bad quantization record {quant!r}")
  final = meta.get("final", False)
  if not isinstance(final, bool):
    raise StoreError(UNREADABLE, f"{what}: 'final' is {final!r}, not true or false")
  return dict({k: meta[k] for k in (*_COUNTERS, "base_version")}, kind=kind, paths=paths,
              quantization=quant, final=final, **times)


def leaf_keys(num_tensors: int, quant: dict | None) -> set[tuple[str, ...]]:
  """The Orbax tree keys of an entry: `t0000`... or `(t0000, values)`, `(t0000, scales)`."""
  names = [f"t{i:04d}" for i in range(num_tensors)]
  if quant is None:
    return {(n,) for n in names}
  parts = ("values",) if quant["bits"] == 16 else ("values", "scales")
  return {(n, part) for n in names for part in parts}


def expected_bytes(shapes: list[tuple], quant: dict | None) -> int:
  """Raw data bytes of an entry holding tensors of `shapes` (float32, or quantised)."""
  total = 0
  for shape in shapes:
    size = math.prod(shape)
    if quant is None:
      total += 4 * size
    elif quant["bits"] == 16:
      total += 2 * size
    else:
      blocks = -(-size // quant["block"])
      total += outer.packed_size(blocks * quant["block"], quant["bits"]) + 4 * blocks
  return total


def check_entry(entry: epath.Path, keys: set[tuple[str, ...]], data_bytes: int,
                local: bool, what: str) -> None:
  """Checks an entry's files and `_METADATA` against `keys`, and its size against
  `data_bytes`, before any data file is opened (StoreError otherwise)."""
  files = {".".join(k) + ".npy" for k in keys} | {METADATA_FILE}
  if local and not _real_dir(entry):
    raise StoreError(BAD_METADATA if os.path.lexists(entry) else UNREADABLE,
                     f"{what}: the entry is not a directory (a symlink, a file or missing)")
  try:
    listed = list(entry.iterdir())
  except (FileNotFoundError, NotADirectoryError):
    raise StoreError(UNREADABLE, f"{what}: no entry directory") from None
  found = {p.name for p in listed}
  if found != files:
    extra, missing = sorted(found - files)[:5], sorted(files - found)[:5]
    raise StoreError(BAD_METADATA, f"{what}: unexpected files {extra}, missing {missing}")
  limit = int(data_bytes * 1.05) + _SLACK_PER_FILE * len(files)
  total = 0
  for path in listed:
    if local:  # by lstat: a symlink, FIFO, device or folder is never opened
      st = os.lstat(path)
      if not stat.S_ISREG(st.st_mode):
        raise StoreError(BAD_METADATA, f"{what}: {path.name} is not a plain file")
      size = st.st_size
    else:
      if path.is_dir():
        raise StoreError(BAD_METADATA, f"{what}: {path.name} is not a plain file")
      size = path.stat().length
    total += size
    if total > limit:
      raise StoreError(OVERSIZE, f"{what}: more than {limit} bytes for {data_bytes} bytes of "
                       "tensors; not read")
  _check_metadata(entry / METADATA_FILE, keys, what)


def _real_dir(path: epath.Path) -> bool:
  """A directory itself, not a symlink to one (local disk)."""
  try:
    return stat.S_ISDIR(os.lstat(path).st_mode)
  except OSError:
    return False


def _check_metadata(path: epath.Path, keys: set[tuple[str, ...]], what: str) -> None:
  raw = path.read_bytes()
  if len(raw) > _MAX_METADATA_BYTES:
    raise StoreError(OVERSIZE, f"{what}: {METADATA_FILE} of {len(raw)} bytes")
  try:
    meta = json.loads(raw)
    tree = meta["tree_metadata"]
    named = {tuple(k["key"] for k in leaf["key_metadata"]): leaf["value_metadata"]["value_type"]
             for leaf in tree.values()}
    plain = meta.get("use_ocdbt") is False and meta.get("use_zarr3") is False
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise StoreError(BAD_METADATA, f"{what}: {METADATA_FILE} is malformed ({e!r})") from None
  # Only the names the store writes, so no leaf can resolve to a path outside the entry.
  if len(named) != len(tree) or set(named) != keys:
    shown = sorted(map(str, set(named) - keys))[:5]
    raise StoreError(BAD_METADATA, f"{what}: {METADATA_FILE} names other tensors {shown}")
  if not plain or set(named.values()) != {_NPY_LEAF}:
    raise StoreError(BAD_METADATA, f"{what}: {METADATA_FILE} asks for another storage format")

