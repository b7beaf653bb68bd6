"""The syncer's durable state as read back from a file: every field typed before it is used.

`Syncer.export_state` writes a small JSON record (registry, EMAs, counters, the delivery
ledger) into each merged version's commit marker (multi-process runtime) or checkpoint
(single-controller runtime). A restarted syncer reads it back; a corrupt or planted record
must not raise out of `recover` or restore nonsense. `typed` keeps the fields that have the
right type and range and drops the rest (a dropped EMA starts again from its first sample,
a dropped registry entry re-registers at its learner's next heartbeat).
"""

from __future__ import annotations

import math
from typing import Any

from diloco.sync import intake


def _finite(x: Any) -> float | None:
  f = intake.as_float(x)
  return f if f is not None and math.isfinite(f) else None


def _status(record: Any) -> dict | None:
  """A registry record (`policy.LearnerStatus` fields), or None if any field is unusable."""
  if not isinstance(record, dict) or set(record) - {"learner_id", "incarnation",
                                                     "last_heartbeat", "step_time"}:
    return None
  step_time = record.get("step_time")
  if not (intake.is_count(record.get("learner_id"), 0)
          and intake.is_count(record.get("incarnation"), 0)
          and record["incarnation"] <= intake.MAX_INCARNATION
          and _finite(record.get("last_heartbeat")) is not None
          and (step_time is None or intake.is_duration(step_time))):
    return None
  return {"learner_id": int(record["learner_id"]), "incarnation": int(record["incarnation"]),
          "last_heartbeat": _finite(record["last_heartbeat"]),
          "step_time": None if step_time is None else float(step_time)}


def typed(state: Any) -> dict[str, Any]:
  """The usable fields of an exported syncer state (see the module docstring)."""
  state = state if isinstance(state, dict) else {}
  registry = state.get("registry")
  statuses = [s for s in map(_status, registry if isinstance(registry, list) else [])
              if s is not None]
  step_ema = state.get("step_ema")
  emas = {int(m): float(v) for m, v in (step_ema.items() if isinstance(step_ema, dict) else ())
          if isinstance(m, str) and m.isascii() and m.isdigit() and len(m) <= 9
          and intake.is_duration(v)}
  rejections = state.get("rejections")
  counts = {k: int(v) for k, v in (rejections.items() if isinstance(rejections, dict) else ())
            if isinstance(k, str) and len(k) <= 64 and intake.is_count(v, 0)}
  out = {"registry": statuses, "step_ema": emas, "rejections": counts,
         "last_quorum": state.get("last_quorum") if intake.is_count(state.get("last_quorum"), 0)
         else 0, "last_grace": _finite(state.get("last_grace")) or 0.0,
         "ledger": state.get("ledger")}
  for name in ("quorum_ema", "sync_ema", "lead_ema"):
    out[name] = state.get(name) if intake.is_duration(state.get(name)) else None
  return out
