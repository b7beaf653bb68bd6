"""What closed rounds measured, for the grace window of the next ones (docs/design.md 2.4).

The syncer sizes a round's grace window from three moving averages: how long a quorum took
to gather, how long pulling, merging and sending took, and how far ahead of their delivery
point learners' values reached their hosts. Each closed round feeds them here; they are part
of the syncer's durable state.
"""

from __future__ import annotations

from typing import Any

from diloco.sync import intake, policy


class RoundTiming:
  """The quorum, sync and lead EMAs of closed rounds."""

  def __init__(self):
    self.quorum = policy.Ema()
    self.sync = policy.Ema()
    self.lead = policy.Ema()

  def record(self, entries, decision: policy.RoundDecision,
             sync_s: float) -> tuple[float, float]:
    """Feeds a closed round's (learner, pending delivery) `entries` and its sync time to the
    EMAs; returns its pull time and its learners' longest lead."""
    if decision.quorum_wait is not None and intake.is_duration(decision.quorum_wait):
      self.quorum = self.quorum.update(decision.quorum_wait)
    # "Time to pull, merge and send": the pull is the slowest admitted payload's transit,
    # from its values being on the learner's host to the syncer holding them (never the
    # learner's compute, whatever its backend's dispatch does).
    pulls = [e.payload.transit_s for _, e in entries if intake.is_duration(e.payload.transit_s)]
    pull_s = max(pulls, default=0.0)
    if intake.is_duration(sync_s):
      self.sync = self.sync.update(pull_s + sync_s)
    leads = [e.payload.lead_s for _, e in entries if intake.is_duration(e.payload.lead_s)]
    lead_s = max(leads, default=0.0)
    self.lead = self.lead.update(lead_s)
    return pull_s, lead_s

  def export(self) -> dict[str, Any]:
    """The EMAs' values for the durable state."""
    return {"quorum_ema": self.quorum.value, "sync_ema": self.sync.value,
            "lead_ema": self.lead.value}

  def restore(self, state: dict[str, Any], decay: float) -> None:
    """Takes the EMAs back from a (typed) durable state; a missing one starts afresh."""
    self.quorum = policy.Ema(decay, state.get("quorum_ema"))
    self.sync = policy.Ema(decay, state.get("sync_ema"))
    self.lead = policy.Ema(decay, state.get("lead_ema"))
