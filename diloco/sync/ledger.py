"""Which deliveries G already holds: merges happen once, and departed incarnations stay out.

A delivery is identified by (learner, incarnation, fragment, local step). A learner delivers
each fragment at increasing local steps within one incarnation, so the ledger keeps, per
(learner, incarnation, fragment), the newest local step merged: a delivery at that step or
an older one is a replay (the same entry read twice, re-written after it was deleted, or an
old message sent again) and must not enter G a second time (docs/design.md 2.4: each
delivery is merged at most once).

Per learner it also keeps a *floor*: incarnations below it left for good (`leave`) or were
superseded by a newer incarnation whose delivery G merged. Nothing of theirs is taken again.

The ledger is small (one integer per learner, incarnation and fragment, at most
`MAX_INCARNATIONS` incarnations per learner) and is part of the syncer's durable state
(`Syncer.export_state`): the multi-process runtime stores it in every merged version's commit
marker, the single-controller runtime in its checkpoints, so it survives a syncer restart.
"""

from __future__ import annotations

from typing import Any

from diloco.sync import intake

# Incarnations kept per learner; when a newer one merges, the oldest kept is superseded (its
# floor rises past it): a learner has one live incarnation, a few more are late messages.
MAX_INCARNATIONS = 8


class DeliveryLedger:
  """Newest merged local step per (learner, incarnation, fragment), and per-learner floors."""

  def __init__(self):
    self._newest: dict[tuple[int, int, int], int] = {}
    self._floor: dict[int, int] = {}

  def departed(self, learner: int, incarnation: int) -> bool:
    """Whether the incarnation left or was superseded (nothing of it is taken again)."""
    return incarnation < self._floor.get(learner, 0)

  def replayed(self, learner: int, incarnation: int, fragment: int, local_step: int) -> bool:
    """Whether G already holds this delivery or a newer one of the same incarnation."""
    newest = self._newest.get((learner, incarnation, fragment))
    return newest is not None and local_step <= newest

  def merged(self, learner: int, incarnation: int, fragment: int, local_step: int) -> None:
    """Records a merged delivery. Its incarnation supersedes the learner's older ones."""
    if self.departed(learner, incarnation):  # flushed before it left: out already
      return
    key = (learner, incarnation, fragment)
    self._newest[key] = max(local_step, self._newest.get(key, -1))
    self._raise_floor(learner, incarnation)
    kept = sorted({i for m, i, _ in self._newest if m == learner})
    if len(kept) > MAX_INCARNATIONS:
      self._raise_floor(learner, kept[-MAX_INCARNATIONS])

  def left(self, learner: int, incarnation: int) -> None:
    """The incarnation left for good: it and older ones stay out."""
    self._raise_floor(learner, incarnation + 1)

  def _raise_floor(self, learner: int, floor: int) -> None:
    if floor > self._floor.get(learner, 0):
      self._floor[learner] = floor
      self._newest = {k: v for k, v in self._newest.items()
                      if k[0] != learner or k[1] >= floor}

  def floor(self, learner: int) -> int:
    return self._floor.get(learner, 0)

  def __len__(self) -> int:
    return len(self._newest)

  # Durable form (JSON).
  def export(self, fragment: int | None = None) -> dict[str, Any]:
    """The ledger as JSON (only fragment `fragment`'s entries, if given; floors always)."""
    return {"merged": [[m, i, p, t] for (m, i, p), t in sorted(self._newest.items())
                       if fragment is None or p == fragment],
            "floor": [[m, f] for m, f in sorted(self._floor.items())]}

  def absorb(self, record: Any) -> int:
    """Adds an exported ledger (from a file: entries of a wrong type or range are skipped);
    returns how many entries were skipped."""
    skipped = 0
    if not isinstance(record, dict):
      return 1
    floors = record.get("floor", [])
    for item in floors if isinstance(floors, list) else [None]:
      if isinstance(item, list) and len(item) == 2 and all(intake.is_count(x, 0) for x in item):
        self._raise_floor(int(item[0]), int(item[1]))
      else:
        skipped += 1
    merged = record.get("merged", [])
    for item in merged if isinstance(merged, list) else [None]:
      if isinstance(item, list) and len(item) == 4 and all(intake.is_count(x, 0) for x in item):
        m, i, p, t = (int(x) for x in item)
        if not self.departed(m, i):
          self._newest[(m, i, p)] = max(t, self._newest.get((m, i, p), -1))
      else:
        skipped += 1
    return skipped
