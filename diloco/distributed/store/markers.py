"""Commit markers of merged versions, read back by a restarting syncer: typed before use.

A marker (`merged/f{p}_v{v}.json`) carries the round number, the syncer's durable state and
the round's tape record. `recover` trusts a marker only in the shape `typed_marker` returns:
a planted or corrupt one is refused (its version is skipped), never a reason to raise.
"""

from __future__ import annotations

from typing import Any

from diloco.sync import intake
from diloco.sync import ledger as ledger_lib

_ADMITTED_IDS = ("learner", "incarnation", "local_step")


def typed_marker(marker: Any) -> dict | None:
  """{"fragment", "round" (int or None), "state" (dict), "tape" ({"admitted": [...]}, plus
  the record's other fields)} of a usable marker, else None."""
  if not isinstance(marker, dict) or not intake.is_count(marker.get("fragment"), 0):
    return None
  round_, state, tape = marker.get("round"), marker.get("state", {}), marker.get("tape")
  if round_ is not None and not intake.is_count(round_, 0):
    return None
  if not isinstance(state, dict):
    return None
  if round_ is None:
    return {"fragment": marker["fragment"], "round": None, "state": state, "tape": None}
  if not (isinstance(tape, dict) and isinstance(tape.get("admitted"), list)
          and tape.get("round") == round_):
    return None
  admitted = tape["admitted"]
  if not all(isinstance(a, dict) and all(intake.is_count(a.get(k), 0) for k in _ADMITTED_IDS)
             for a in admitted):
    return None
  return {"fragment": marker["fragment"], "round": round_, "state": state, "tape": tape}


def joined_ledger(markers: dict[int, dict]) -> dict:
  """The delivery ledger of a restart: each fragment's entries from its own newest marker
  (the state there was exported after that fragment's round, and before any later round of
  it), the incarnations that left from all of them."""
  joined = ledger_lib.DeliveryLedger()
  for p, marker in markers.items():
    record = marker["state"].get("ledger")
    if not isinstance(record, dict):
      continue
    merged = record.get("merged")
    own = [e for e in merged if isinstance(e, list) and len(e) == 4 and e[2] == p] if (
        isinstance(merged, list)) else []
    joined.absorb({"merged": own, "floor": record.get("floor", [])})
  return joined.export()
