"""What the syncer refused, for its counters, its tape and the store's quarantine.

Every delivery or heartbeat the syncer turns down is counted by reason and summarised in its
fragment's next round record (the tape, `accounting.where_steps_went` reads it): counts and
bytes by reason, and the first `EXAMPLES` rejections in full, so that a flood of bad
deliveries in one round cannot make the record (which the multi-process syncer writes into
the merged version's commit marker) outgrow the store's record limit; malformed
deliveries and those whose handling raised are also kept until the runtime takes them to
quarantine them, so that no syncer reads them again.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from absl import logging

from diloco.delivery import Delivery
from diloco.sync import intake

# Rejections listed in full per round record; the rest are only counted (by reason).
EXAMPLES = 8


def _nbytes(payload: Delivery) -> int:
  try:
    return payload.nbytes
  except Exception:  # noqa: BLE001  (a malformed delivery's tensors)
    return 0


class RejectionLog:
  """Rejections counted by reason, listed per fragment until its next round, and faults."""

  def __init__(self, owned: Sequence[int]):
    """`owned`: the fragments whose rounds this syncer (shard) closes."""
    self.counts: collections.Counter = collections.Counter()
    self._listed: dict[int, list[dict]] = collections.defaultdict(list)
    self._counted: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    self._bytes: dict[int, int] = collections.defaultdict(int)
    self._owned = frozenset(owned)
    self._first = min(owned)
    # Malformed deliveries and those whose ingestion or merge raised: (fragment, learner,
    # incarnation, local_step, reason, detail), for the runtime to quarantine (`take_faults`;
    # bounded, since the single-controller runtime never takes them).
    self._faults: collections.deque = collections.deque(maxlen=4096)

  def reject(self, fragment: int, learner: int, incarnation: int, reason: str, nbytes: int,
             now: float, *, local_step: int | None = None, steps: int | None = None) -> None:
    """Counts a rejected delivery; it is listed in the next tape record of its fragment.

    Ids that are not counters (a crafted delivery's) are recorded as -1; the delivery's
    `local_step` and `steps`, when they are counters, let the accounting say whose work it
    carried (`accounting.where_steps_went`).
    """
    fragment, learner, incarnation = (x if intake.is_count(x, 0) else -1
                                      for x in (fragment, learner, incarnation))
    self.counts[reason] += 1
    # Listed with the fragment's next round; one this shard does not merge (or no fragment)
    # with its first own fragment's, so that it reaches the tape.
    p = fragment if fragment in self._owned else self._first
    record = {"learner": int(learner), "incarnation": int(incarnation), "reason": reason,
              "payload_bytes": int(nbytes), "arrived_at": now}
    if intake.is_count(local_step, 0) and intake.is_count(steps, 1):
      record.update(local_step=int(local_step), steps=int(steps))
    self._counted[p][reason] += 1
    self._bytes[p] += int(nbytes)
    if len(self._listed[p]) < EXAMPLES:
      self._listed[p].append(record)
    logging.info("syncer: rejected fragment %d from learner %d: %s", fragment, learner, reason)

  def delivery(self, payload: Delivery, reason: str, now: float) -> None:
    """Rejects one delivery (`reject` with its own fields)."""
    self.reject(payload.fragment, payload.learner, payload.incarnation, reason, _nbytes(payload),
                now, local_step=payload.local_step, steps=payload.steps)

  def quarantine(self, payload: Delivery, reason: str, detail: str) -> None:
    """Lists a delivery (already rejected) for the runtime to quarantine."""
    self._faults.append((payload.fragment, payload.learner, payload.incarnation,
                         payload.local_step, reason, detail))

  def fault(self, payload: Delivery, reason: str, error: Exception, now: float) -> None:
    """A delivery whose handling raised: rejected, and listed for quarantine."""
    logging.exception("syncer: %s on a delivery of learner %r", reason, payload.learner)
    self.delivery(payload, reason, now)
    self.quarantine(payload, reason, f"{type(error).__name__}: {error}"[:500])

  def take_faults(self) -> list[tuple]:
    """Deliveries that failed the intake checks or whose ingestion or merge raised, since the
    last call, as (fragment, learner, incarnation, local_step, reason, detail)."""
    faults = list(self._faults)
    self._faults.clear()
    return faults

  def listed(self, p: int) -> dict:
    """The tape fields of fragment `p`'s rejections since its last round (taken: listed
    once): `rejected` (the first `EXAMPLES` in full), `rejected_by_reason` (all, counted) and
    `rejected_bytes` (all, their payload bytes)."""
    counted = self._counted.pop(p, collections.Counter())
    return {"rejected": self._listed.pop(p, []),
            "rejected_by_reason": dict(sorted(counted.items())),
            "rejected_bytes": self._bytes.pop(p, 0)}
