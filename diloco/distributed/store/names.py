"""The store's vocabulary: entry names, the words of its errors, and typed checks.

Every name in the store is built here from validated integers and fixed words, never from
what an entry contains, and parsed back only in its one canonical form; every part of the
store (`blob_io`, `payload_box`, `merged_versions`, `learner_registry`, `run_lifecycle`)
shares these names and reason words.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from diloco.distributed.store.entry_check import StoreError


def num_pattern(digits: int) -> str:
  """A canonical decimal of at most `digits` ASCII digits (no leading zeros, no other
  Unicode digits): one name per number, so no entry has two names."""
  return f"(0|[1-9][0-9]{{0,{digits - 1}}})"


# Names are matched whole (`fullmatch`: no trailing newline slips past a `$`).
PAYLOAD_NAME = re.compile(
    f"f{num_pattern(6)}_l{num_pattern(6)}_i{num_pattern(9)}_s{num_pattern(12)}")
MERGED_NAME = re.compile(f"f{num_pattern(6)}_v{num_pattern(12)}")
LEARNER_RECORD = re.compile(f"l{num_pattern(6)}\\.json")
# A merged version's data folder: the version's name and, since each write has its own, a
# suffix naming the write (so that no writer ever deletes or overwrites another's data).
MERGED_DATA = re.compile(f"f{num_pattern(6)}_v{num_pattern(12)}(\\.[0-9a-f]{{12}})?")

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


def checked_int(value: int, what: str) -> int:
  """`value` as an int; ValueError unless it is a non-negative integer (not a bool)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
    raise ValueError(f"store: {what} must be a non-negative integer, got {value!r}")
  return int(value)


def payload_name(fragment: int, learner: int, incarnation: int, local_step: int) -> str:
  return (f"f{checked_int(fragment, 'fragment')}_l{checked_int(learner, 'learner')}"
          f"_i{checked_int(incarnation, 'incarnation')}_s{checked_int(local_step, 'step')}")


def parse_payload_name(name: str) -> tuple[int, int, int, int] | None:
  """(fragment, learner, incarnation, local_step) of a payload entry name, or None."""
  m = PAYLOAD_NAME.fullmatch(name) if isinstance(name, str) else None
  return None if m is None else tuple(int(x) for x in m.groups())


def merged_name(fragment: int, version: int) -> str:
  return f"f{checked_int(fragment, 'fragment')}_v{checked_int(version, 'version')}"


def learner_record(learner: int) -> str:
  """The file name of learner m's record in a folder of per-learner records."""
  return f"l{checked_int(learner, 'learner')}.json"


def shard_folder(shard: int) -> str:
  """Shard s's folder under the root, with `sync.shards` > 1 (`store` module docstring)."""
  return f"shards/s{checked_int(shard, 'shard')}"


def tensor_key(i: int) -> str:
  """The key of the i-th tensor (by sorted parameter path) in an entry's Orbax tree."""
  return f"t{i:04d}"


def checked_array(item: Any, shape: tuple, dtype, what: str) -> np.ndarray:
  """`item` if it is a NumPy array of `dtype` and `shape`; StoreError with the reason else."""
  if not isinstance(item, np.ndarray):
    raise StoreError(UNREADABLE, f"{what}: not an array")
  if item.dtype != dtype:
    raise StoreError(WRONG_DTYPE, f"{what}: dtype {item.dtype}, expected {np.dtype(dtype)}")
  if item.shape != shape:
    raise StoreError(WRONG_SHAPE, f"{what}: shape {item.shape}, expected {shape}")
  return item
