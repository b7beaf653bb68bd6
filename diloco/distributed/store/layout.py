"""The store's layout record (`layout.json`): written once, so no run resumes another layout.

A store holds G as fragments in shard folders; which folder owns which fragment, and which
tensors (paths, shapes, dtypes) a fragment holds, follow from `sync.shards` and the fragment
plan. A process that read a store with another layout would see "no version" in folders it
expects and restart G from its initial parameters, with the trained fragments left unread.
So the first process that knows the layout creates the record (create-only, like the store's
other records) and every process compares its own layout with it before it reads or writes
anything else, refusing a difference with a ConfigError naming the field. A store made before
the record existed is checked by its folders (versions in a shard folder the run does not
have, or at the root of a sharded run, are refused) and by its versions (each fragment's in
its owner's folder, holding the plan's tensors); then the record is written. A reader that
knows no plan (`train.init_from`) takes the layout the versions give (`inferred`).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from diloco import fragments as fragments_lib
from diloco.distributed.store.blob_io import Blobs
from diloco.distributed.store.entry_check import StoreError
from diloco.distributed.store.merged_versions import MergedVersions
from diloco.distributed.store.names import MERGED_NAME, NON_FINITE, shard_folder
from diloco.errors import ConfigError
from diloco.sync import ownership

LAYOUT_FILE = "layout.json"
_PLAN_FIELDS = "the fragment plan (sync.num_fragments, sync.scheme, model.*)"


def layout_record(shards: int, plan: fragments_lib.FragmentPlan,
                  abstract_params: Any) -> dict:
  """The layout of a run: its shard count and, per fragment, [path, shape, dtype] of each
  tensor (`abstract_params`: the model's parameter tree, arrays or shape structs)."""
  flat = fragments_lib.flatten_tree(abstract_params)
  return {"shards": int(shards), "scheme": plan.scheme,
          "fragments": [[[k, [int(d) for d in flat[k].shape], str(np.dtype(flat[k].dtype))]
                         for k in paths] for paths in plan.fragments]}


def _read(shared) -> Any:
  """The recorded layout (None if none); ConfigError if the record cannot be read."""
  try:
    return shared.blobs.read_json(LAYOUT_FILE)
  except StoreError as e:
    raise ConfigError(f"store {shared.base}/{LAYOUT_FILE}: not a layout record ({e}); the "
                      "store's layout is unknown, so it is not resumed") from None


def has_record(shared) -> bool:
  """Whether the store has a layout record (of whatever content: `recorded` checks it)."""
  return shared.blobs.exists(LAYOUT_FILE)


def recorded(shared) -> dict:
  """The store's layout record, typed ({"shards": S, "fragments": [[[path, shape, dtype],
  ...], ...]}); ConfigError if it has none or one of wrong types."""
  record = _read(shared)
  if record is None:
    raise ConfigError(f"store {shared.base}: no {LAYOUT_FILE}; its layout (sync.shards, the "
                      "fragment plan) is unknown, so its G is not read")
  if not _typed(record):
    raise ConfigError(f"store {shared.base}/{LAYOUT_FILE}: not a layout record (fields of "
                      "wrong type); its G is not read")
  return record


def _typed(record: Any) -> bool:
  """Whether `record` has the fields and types `layout_record` writes."""
  def count(x, low=0):
    return type(x) is int and x >= low  # noqa: E721  (bool is not a count)

  fragments = record.get("fragments") if isinstance(record, dict) else None
  if not (count(record.get("shards") if isinstance(record, dict) else None, 1)
          and isinstance(fragments, list) and len(fragments) >= record["shards"]):
    return False
  paths = [t[0] if isinstance(t, list) and t else None for f in fragments
           for t in (f if isinstance(f, list) and f else [None])]
  return len(set(paths)) == len(paths) and all(
      isinstance(f, list) and f and all(
          isinstance(t, list) and len(t) == 3 and isinstance(t[0], str)
          and isinstance(t[1], list) and all(count(d) for d in t[1]) and isinstance(t[2], str)
          for t in f) for f in fragments)


def _where(shared) -> str:
  return f"store {shared.base} (its {LAYOUT_FILE})"


def check_shards(shared, shards: int) -> None:
  """Refuses a store recorded (or laid out) with another `sync.shards` (the launcher's check:
  it knows the shard count, not the model's plan)."""
  recorded = _read(shared)
  if recorded is None:
    _check_folders(shared, shards)
    return
  if not isinstance(recorded, dict) or recorded.get("shards") != shards:
    got = recorded.get("shards") if isinstance(recorded, dict) else recorded
    raise ConfigError(f"sync.shards={shards}: {_where(shared)} records sync.shards={got!r}; "
                      "resume with the store's layout, or start a new store")


def claim(shared, record: dict) -> None:
  """Creates the layout record if the store has none, then checks that the store's record is
  `record` (ConfigError naming `sync.shards` or the fragment plan otherwise)."""
  check_shards(shared, record["shards"])
  if _read(shared) is None:
    _check_versions(shared, record)  # a store made before the record: its versions decide
    shared.blobs.create_json(LAYOUT_FILE, record)  # the first process's; others compare
  recorded = _read(shared)
  check_shards(shared, record["shards"])
  if not isinstance(recorded, dict) or recorded.get("fragments") != record["fragments"]:
    raise ConfigError(f"{_PLAN_FIELDS}: {_where(shared)} records another plan "
                      f"({_difference(recorded, record)}); resume with the store's config, or "
                      "start a new store")


def _difference(recorded: Any, record: dict) -> str:
  """The first difference between two plans, in words."""
  theirs = recorded.get("fragments") if isinstance(recorded, dict) else None
  ours = record["fragments"]
  if not isinstance(theirs, list):
    return "no fragments recorded"
  if len(theirs) != len(ours):
    return f"{len(theirs)} fragments, this run has {len(ours)}"
  for p, (a, b) in enumerate(zip(theirs, ours)):
    if a != b:
      for x, y in zip(a if isinstance(a, list) else [], b):
        if x != y:
          return f"fragment {p}: {x!r}, this run has {y!r}"
      return f"fragment {p}: {len(a) if isinstance(a, list) else a!r} tensors, this run has {len(b)}"
  return "of another scheme"


def _has_versions(blobs, sub: str) -> bool:
  """Whether folder `sub` of a store holds a commit marker."""
  return any(p.name.endswith(".json") and MERGED_NAME.fullmatch(p.name[:-len(".json")])
             for p in blobs.listdir(sub))


def _check_folders(shared, shards: int) -> None:
  """A store without a record: refused if it holds versions of another shard count."""
  blobs = shared.blobs
  if shards > 1 and _has_versions(blobs, "merged"):
    raise ConfigError(f"sync.shards={shards}: {_where(shared)} holds the versions of one "
                      "syncer (sync.shards=1) at its root; resume with that layout")
  folders = [p.name for p in blobs.listdir("shards")]
  for name in folders:
    m = re.fullmatch(r"s(0|[1-9][0-9]{0,5})", name)
    if m is None or (shards > 1 and int(m[1]) < shards):
      continue
    if _has_versions(blobs, f"{shard_folder(int(m[1]))}/merged"):
      raise ConfigError(f"sync.shards={shards}: {_where(shared)} holds versions in "
                        f"{shard_folder(int(m[1]))}/, which this layout does not have; resume "
                        "with the store's sync.shards")


def _check_versions(shared, record: dict) -> None:
  """A store without a record is taken for `record`'s layout only if its versions are of it:
  each fragment's versions in the folder of the shard that owns it under the plan, and one of
  them (the newest that reads) holding exactly the plan's tensors; else ConfigError naming
  the record. A store without versions has nothing to check."""
  shapes = [{k: tuple(shape) for k, shape, _ in f} for f in record["fragments"]]
  owner = ownership.assign([sum(math.prod(s) for s in f.values()) for f in shapes],
                           record["shards"])
  folders = ([("", shared.blobs)] if record["shards"] == 1 else
             [(shard_folder(s) + "/", Blobs(shared.base / shard_folder(s), shared.local))
              for s in range(record["shards"])])
  for s, (name, blobs) in enumerate(folders):
    merged = MergedVersions(blobs)
    found = {int(m[1]) for p in blobs.listdir("merged") if p.name.endswith(".json")
             and (m := MERGED_NAME.fullmatch(p.name[:-len(".json")]))}
    for p in sorted(found):
      if p >= len(shapes) or owner[p] != s:
        why = (f"{name}merged/ holds fragment {p}, which this plan "
               + ("does not have" if p >= len(shapes) else "gives another shard"))
      elif not any(_of_plan(merged, p, v, shapes[p]) for v in reversed(merged.versions(p))):
        why = f"fragment {p}: no version in {name}merged/ holds this plan's tensors"
      else:
        continue
      raise ConfigError(f"{_PLAN_FIELDS}: store {shared.base} has no {LAYOUT_FILE} and its "
                        f"versions are not of this run's layout ({why}); resume with the "
                        "store's config, or start a new store")


def _of_plan(merged: MergedVersions, p: int, version: int, shapes: dict[str, tuple]) -> bool:
  """Whether version `version` of fragment p holds the plan's paths and shapes (its values
  may be non-finite: that refuses the version, not the layout)."""
  try:
    merged.read(p, version, shapes=shapes)
  except StoreError as e:
    return e.reason == NON_FINITE
  return True


def inferred(shared, shards: int) -> dict:
  """The layout of a store made before the record, from its versions, for a reader that does
  not know the writer's plan (`train.init_from` on a store): each fragment's newest version
  that reads back whole gives its tensors, and the fragments must be 0..P-1, each in the one
  folder that owns it under `ownership.assign` of their sizes; ConfigError naming the record
  otherwise. Nothing is written (the store is another run's)."""
  found: dict[int, tuple[int, list]] = {}
  folders = ([("", shared.blobs)] if shards == 1 else
             [(shard_folder(s) + "/", Blobs(shared.base / shard_folder(s), shared.local))
              for s in range(shards)])

  def refuse(why: str) -> ConfigError:
    return ConfigError(f"store {shared.base}: no {LAYOUT_FILE}, and its versions do not give "
                       f"one layout ({why}); its G is not read")

  for s, (name, blobs) in enumerate(folders):
    merged = MergedVersions(blobs)
    for p in sorted({int(m[1]) for f in blobs.listdir("merged") if f.name.endswith(".json")
                     and (m := MERGED_NAME.fullmatch(f.name[:-len(".json")]))}):
      if p in found:
        raise refuse(f"fragment {p} has versions in two folders")
      for version in reversed(merged.versions(p)):
        try:
          tensors = merged.read(p, version)[0].tensors
        except StoreError:
          continue
        found[p] = (s, [[k, list(tensors[k].shape), "float32"] for k in sorted(tensors)])
        break
      else:
        raise refuse(f"fragment {p} in {name}merged/ has no version that reads back whole")
  if not found or sorted(found) != list(range(len(found))):
    raise refuse(f"fragments {sorted(found)[:8]}, not 0..P-1")
  record = {"shards": shards, "scheme": None,
            "fragments": [found[p][1] for p in range(len(found))]}
  if not _typed(record):
    raise refuse("fragments that share a tensor, or fewer fragments than shards")
  sizes = [sum(math.prod(t[1]) for t in f) for f in record["fragments"]]
  owner = ownership.assign(sizes, shards)
  for p, (s, _) in found.items():
    if owner[p] != s:
      raise refuse(f"fragment {p} lies in shard {s}'s folder, its owner is shard {owner[p]}")
  return record
