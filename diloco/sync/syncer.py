"""The syncer: collects fragment deliveries, runs rounds under the policy, merges, steps G.

Host-only NumPy (never a learner's device). Every decision goes through the pure
functions of `diloco.sync.policy` with times passed in, so the same code runs on the wall
clock (threads) and on a virtual clock (deterministic runs, the goodput simulator).
`tick(now)` ingests messages, closes every round that is due and returns the merged
fragments to publish plus the next time it wants to be called. G and the outer step it takes
live in `outer_state`, what it refuses in `rejections`, its round timings in `round_timing`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from diloco import fragments as fragments_lib
from diloco import outer
from diloco.delivery import Delivery
from diloco.outer.merge import OuterConfig
from diloco.sync import durable_state, intake, outer_state, policy, rejections, round_timing
from diloco.sync import ledger as ledger_lib
from diloco.sync.policy import SyncConfig
from diloco.transport import Heartbeat, Merged

_is_duration = intake.is_duration
_all_finite = intake.all_finite


@dataclasses.dataclass
class _Pending:
  payload: Delivery
  arrived_at: float


def _admitted_record(learner: int, entry: _Pending, old_version: int, weight: float,
                     delta_norm: float) -> dict:
  """The tape's record of one merged delivery (docs/design.md 3.2 reads it)."""
  d = entry.payload
  return {"learner": learner, "incarnation": d.incarnation, "local_step": d.local_step,
          "steps": d.steps, "tokens": d.tokens, "base_version": d.base_version,
          "staleness": old_version - d.base_version, "weight": weight, "final": d.final,
          "delta_norm": delta_norm, "payload_bytes": d.nbytes, "arrived_at": entry.arrived_at}


# A learner silent for this many heartbeat timeouts leaves the registry (it is long dead).
_PRUNE_AFTER = 10


class _RoundRejected(Exception):
  """No delivery of a round can be merged."""


class Syncer:
  """Global parameters G, Nesterov momentum, versions, registry and open rounds."""

  def __init__(self, global_params: dict[str, np.ndarray], plan: fragments_lib.FragmentPlan,
               sync: SyncConfig, outer_cfg: OuterConfig, *, sync_delay_s: float | None = None,
               on_round: Callable[[dict], None] | None = None,
               limits: intake.Limits | None = None, owned: Sequence[int] | None = None):
    """`global_params` maps paths to arrays; `sync_delay_s` fixes the (virtual) sync time;
    `limits` what an honest delivery can hold (`intake.check_earned`); `owned` the fragments
    this syncer shard holds and merges (`sync/ownership.py`; None: all of them)."""
    self.plan = plan
    self.owned = (tuple(range(plan.num_fragments)) if owned is None
                  else tuple(sorted(set(owned))))
    self.limits = limits or intake.Limits()
    # Delivery identities G holds, and incarnations that left (exactly once, durably).
    self.ledger = ledger_lib.DeliveryLedger()
    self.policy = policy.PolicyConfig.from_config(sync)
    # G, its momentum and versions, and the outer step (`outer_state.py`).
    self.state = outer_state.OuterState(global_params, plan, self.owned, outer_cfg,
                                        self.policy.max_staleness)
    self.outer_cfg = outer_cfg
    self.registry: dict[int, policy.LearnerStatus] = {}
    self._step_ema: dict[int, policy.Ema] = {}
    self.timing = round_timing.RoundTiming()  # what the grace window predicts from
    self._pending: dict[int, dict[int, _Pending]] = collections.defaultdict(dict)
    self._opened_at: dict[int, float] = {}
    self._departed: dict[int, int] = {}  # learner -> incarnation that left with deliveries
    self.rejected = rejections.RejectionLog(self.owned)  # counted, taped, quarantined
    self.ignored: collections.Counter = collections.Counter()  # unusable measurements
    self._sync_delay = sync_delay_s
    self._on_round = on_round
    self.rounds = 0
    self.closed_here = self.admitted_here = 0  # since this process started (status lines)
    self.last_quorum = 0
    self.last_grace = 0.0
    # Whether this instance counts (and tapes) the heartbeats it rejects or ignores: of S
    # shards that all see every heartbeat in one process, one does (`sync/group.py`).
    self.counts_heartbeats = True

  @property
  def params(self) -> dict[str, np.ndarray]:
    """G: the owned fragments' global parameters by path (updated in place by merges)."""
    return self.state.params

  @property
  def momentum(self) -> dict[str, np.ndarray]:
    return self.state.momentum

  @property
  def versions(self) -> list[int]:
    return self.state.versions

  @property
  def rejections(self) -> collections.Counter:
    """Rejected deliveries and heartbeats by reason."""
    return self.rejected.counts

  def take_faults(self) -> list[tuple]:
    """`RejectionLog.take_faults`: deliveries to quarantine since the last call."""
    return self.rejected.take_faults()

  def fragment_values(self, p: int) -> dict[str, np.ndarray]:
    return self.state.fragment_values(p)

  def initial(self, now: float) -> list[Merged]:
    """The current version of every owned fragment (0, or a restored one), to publish before
    any learner starts."""
    return [Merged(p, self.versions[p], self.fragment_values(p), now) for p in self.owned]

  # Ingestion.
  def _heartbeat(self, beat: Heartbeat, now: float = math.inf) -> None:
    stamp = intake.heartbeat_time(beat, now)
    if stamp is None or not intake.check_heartbeat(beat, self.limits):
      self._bad_heartbeat(beat, now)
      return
    if self.ledger.departed(beat.learner, beat.incarnation):
      if self.counts_heartbeats:
        self.ignored[intake.REJECT_DEPARTED] += 1  # it left, or a newer incarnation merged
      return
    known = self.registry.get(beat.learner)
    if known is not None and beat.incarnation > known.incarnation + intake.MAX_INCARNATION_JUMP:
      self._bad_heartbeat(beat, now)
      return
    if (known is not None and beat.incarnation < known.incarnation
        and policy.is_alive(known.last_heartbeat, stamp, self.policy.heartbeat_timeout_s)):
      return  # a late message of a superseded incarnation
    # An older incarnation is taken back once the newer one fell silent: a crafted jump
    # costs the live learner at most one heartbeat timeout, never the rest of the run.
    # A new incarnation starts a new average; so does a learner whose average a restart did not
    # bring back (none was stored while its incarnation had not reported a step time yet).
    if (known is None or beat.incarnation != known.incarnation
        or beat.learner not in self._step_ema):
      self._step_ema[beat.learner] = policy.Ema(self.policy.ema_decay)
    if _is_duration(beat.step_time) and beat.step_time > 0:
      self._step_ema[beat.learner] = self._step_ema[beat.learner].update(beat.step_time)
    elif not _is_duration(beat.step_time) and self.counts_heartbeats:
      self.ignored[intake.IGNORED_TIME] += 1
    self.registry[beat.learner] = policy.LearnerStatus(
        learner_id=beat.learner, incarnation=beat.incarnation, last_heartbeat=stamp,
        step_time=self._step_ema[beat.learner].value)

  def _bad_heartbeat(self, beat: Heartbeat, now: float) -> None:
    if self.counts_heartbeats:
      self.reject(0, beat.learner, beat.incarnation, intake.REJECT_BAD_HEARTBEAT, 0, now)

  def reject(self, fragment: int, learner: int, incarnation: int, reason: str, nbytes: int,
             now: float, *, local_step: int | None = None, steps: int | None = None) -> None:
    """Counts a rejected delivery and lists it on the tape (`RejectionLog.reject`)."""
    self.rejected.reject(fragment, learner, incarnation, reason, nbytes, now,
                         local_step=local_step, steps=steps)

  def forget(self, learner: int, incarnation: int) -> None:
    """A learner incarnation left for good (retired or finished): rounds stop counting it.

    Deliveries it made before leaving stay in their rounds and are merged when those close
    (a clean exit flushes its last progress); they no longer count toward the quorum.
    """
    if not (intake.is_count(learner, 0) and intake.is_count(incarnation, 0)):
      return
    known = self.registry.get(learner)
    if known is not None and known.incarnation <= incarnation:
      del self.registry[learner]
      self._departed[learner] = known.incarnation
    # It and its older incarnations stay out (a crafted far-ahead number is bounded).
    ahead_of = known.incarnation if known is not None else self.ledger.floor(learner)
    self.ledger.left(learner, min(incarnation, ahead_of + intake.MAX_INCARNATION_JUMP))

  def pending_keys(self) -> set[tuple[int, int, int, int]]:
    """(fragment, learner, incarnation, local_step) of deliveries waiting for a round."""
    return {(p, m, e.payload.incarnation, e.payload.local_step)
            for p, entries in self._pending.items() for m, e in entries.items()}

  def _payload(self, payload: Delivery, now: float) -> None:
    try:
      self._admit(payload, now)
    except Exception as e:  # noqa: BLE001  (one delivery never stops the syncer)
      self.rejected.fault(payload, intake.REJECT_INGEST_ERROR, e, now)

  def _admit(self, payload: Delivery, now: float) -> None:
    p = payload.fragment
    if intake.is_count(p, 0) and p < self.plan.num_fragments and p not in self.state.norms:
      problem = intake.REJECT_WRONG_SHARD
    else:
      problem = (intake.check_payload(payload, self.plan.fragments, self.state.shapes)
                 or intake.check_earned(payload, self.limits))
    if problem:
      self.rejected.delivery(payload, problem, now)
      self.rejected.quarantine(payload, problem, "failed the syncer's intake checks")
      return
    if self.ledger.departed(payload.learner, payload.incarnation):
      self.rejected.delivery(payload, intake.REJECT_DEPARTED, now)  # it left, or a newer one merged
      return
    # Before the liveness checks: a replay is a property of the delivery's identity, refused as
    # `replayed` whatever its learner's state is now (dead, restarted, stale base).
    if self._replayed(payload, now):
      return
    if not (_is_duration(payload.transit_s) and _is_duration(payload.lead_s)):
      self.ignored[intake.IGNORED_TIME] += 1  # left out of the EMAs where they are used
    if not self.state.knows_base(p, payload.base_version):
      self.rejected.delivery(payload, policy.REJECT_STALE, now)
      return
    ok, reason = policy.check_delivery(payload, learner=self.registry.get(payload.learner),
                                       current_version=self.versions[p], now=now,
                                       config=self.policy)
    if not ok:
      self.rejected.delivery(payload, reason, now)
      return
    if not self._pending[p]:
      self._opened_at[p] = now
    self._pending[p][payload.learner] = _Pending(payload, now)  # a newer one replaces the older

  def _replayed(self, payload: Delivery, now: float) -> bool:
    """Rejects (True) a delivery that G (or the open round) already holds from the same
    incarnation, or a newer one of it (`diloco.sync.ledger`)."""
    m, i, p, t = payload.learner, payload.incarnation, payload.fragment, payload.local_step
    waiting = self._pending.get(p, {}).get(m)
    if self.ledger.replayed(m, i, p, t) or (
        waiting is not None and waiting.payload.incarnation == i
        and waiting.payload.local_step >= t):
      self.rejected.delivery(payload, intake.REJECT_REPLAYED, now)
      return True
    return False

  # Rounds.
  def settled(self) -> bool:
    """Whether no delivery waits in an open round (the end of a run waits for this, so that
    the final G holds every final-sync delivery)."""
    return not any(self._pending.values())

  def alive(self, now: float) -> list[int]:
    return [s.learner_id for s in policy.alive_learners(
        self.registry.values(), now, self.policy.heartbeat_timeout_s)]

  def tick(self, now: float, beats=(), payloads=(), left=()) -> tuple[list[Merged], float | None]:
    """Ingests messages, closes due rounds; returns (merged to publish, next deadline).

    `left` lists (learner, incarnation) that left for good; their earlier deliveries (in
    `payloads` or pending) are still merged.
    """
    for beat in beats:
      self._heartbeat(beat, now)
    for payload in payloads:
      self._payload(payload, now)
    for learner, incarnation in left:
      self.forget(learner, incarnation)
    alive = set(self.alive(now))
    published, deadlines = [], []
    for p in sorted(self._pending):
      # Deliveries of learners that died meanwhile leave the round; those of learners that
      # left cleanly stay, but only alive learners count toward the quorum.
      entries = {m: e for m, e in self._pending[p].items() if (
          m in alive and self.registry[m].incarnation == e.payload.incarnation)
          or self._departed.get(m) == e.payload.incarnation}
      self._pending[p] = entries
      if not entries:
        continue
      counted = [e.arrived_at for m, e in entries.items()
                 if m in alive and self.registry[m].incarnation == e.payload.incarnation]
      step_time = policy.grace_step_time(
          (self.registry[m].step_time for m in alive),
          (self.registry[m].step_time for m in entries if m in alive), self.policy.tau)
      finals = [e.arrived_at for e in entries.values() if e.payload.final]
      decision = policy.decide_final_round(
          counted, num_alive=len(alive), final_since=min(finals), opened_at=self._opened_at[p],
          now=now, timeout_s=self.policy.heartbeat_timeout_s) if finals else policy.decide_round(
          counted if alive else [e.arrived_at for e in entries.values()], num_alive=len(alive),
          opened_at=self._opened_at[p], now=now, config=self.policy, step_time=step_time,
          quorum_time=self.timing.quorum.get(), sync_time=self.timing.sync.get(),
          lead_time=self.timing.lead.get())
      if decision.close:
        merged = self._close(p, decision, now, sorted(alive))
        if merged is not None:
          published.append(merged)
      elif decision.deadline is not None:
        deadlines.append(decision.deadline)
    for p in [p for p, e in self._pending.items() if not e]:
      del self._pending[p]
    waiting = {m for entries in self._pending.values() for m in entries}
    self._departed = {m: i for m, i in self._departed.items() if m in waiting}
    self._prune(now, waiting)
    return published, (min(deadlines) if deadlines else None)

  def _prune(self, now: float, waiting: set[int]) -> None:
    """Forgets learners silent for `_PRUNE_AFTER` heartbeat timeouts (none of whose
    deliveries wait), so the registry and the state records stay small."""
    horizon = now - _PRUNE_AFTER * self.policy.heartbeat_timeout_s
    for m in [m for m, s in self.registry.items()
              if s.last_heartbeat < horizon and m not in waiting]:
      del self.registry[m]
      self._step_ema.pop(m, None)

  def _close(self, p: int, decision: policy.RoundDecision, now: float,
             alive: list[int]) -> Merged | None:
    """Merges the round's deliveries into G_p; None if none could be merged (the round is
    rejected whole: G_p, its momentum and its version stay as they were)."""
    started = time.perf_counter()
    entries, deltas, delta_norms = self.state.bounded(
        p, sorted(self._pending.pop(p).items()),
        on_error=lambda d, err: self.rejected.fault(d, intake.REJECT_MERGE_ERROR, err, now),
        on_overflow=lambda d: self.rejected.delivery(d, intake.REJECT_OVERFLOW, now))
    try:
      if not entries:
        raise _RoundRejected()
      weights = outer.token_weights([e.payload.tokens for _, e in entries],
                                    [e.payload.steps for _, e in entries], self.outer_cfg.weights)
      step_sq = self.state.merge(p, deltas, weights)
    except _RoundRejected:
      self._opened_at.pop(p, None)
      return None
    except Exception as err:  # noqa: BLE001  (the syncer survives the round)
      for _, e in entries:
        self.rejected.fault(e.payload, intake.REJECT_MERGE_ERROR, err, now)
      self._opened_at.pop(p, None)
      return None
    old_version = self.versions[p]
    version = self.state.commit(p)  # raises if G left its bound (a bug, not bad input)
    for _, e in entries:
      self.ledger.merged(e.payload.learner, e.payload.incarnation, p, e.payload.local_step)
    update_norm = float(np.sqrt(sum(step_sq.values())))
    measured = time.perf_counter() - started
    sync_s = measured if self._sync_delay is None else self._sync_delay
    pull_s, lead_s = self.timing.record(entries, decision, sync_s)
    merged = Merged(p, version, self.fragment_values(p), now + sync_s)
    record = {
        "round": self.rounds, "fragment": p, "version": version,
        "opened_at": self._opened_at.pop(p), "closed_at": now, "published_at": now + sync_s,
        "quorum": decision.quorum, "num_alive": len(alive), "grace_s": decision.grace,
        # How much of the window the round spent after its quorum, and whom that admitted.
        "grace_used_s": max(now - decision.quorum_reached_at, 0.0),
        "admitted_in_grace": sum(e.arrived_at > decision.quorum_reached_at for _, e in entries),
        "pull_s": pull_s, "lead_s": lead_s, "reason": decision.reason,
        "admitted": [_admitted_record(m, e, old_version, float(w), d)
                     for (m, e), w, d in zip(entries, weights, delta_norms)],
        **self.rejected.listed(p),  # the first few in full, all counted by reason
        "update_norm": update_norm, "sync_s": sync_s, "merge_wall_s": measured,
        "published_bytes": merged.nbytes, "receivers": alive,
    }
    self.rounds += 1
    self.closed_here += 1
    self.admitted_here += len(entries)
    self.last_quorum = len(entries)
    self.last_grace = decision.grace
    if self._on_round is not None:
      self._on_round(record)
    return merged

  # Durable state (multi-process runtime): everything but the tensors, as JSON.
  def export_state(self) -> dict[str, Any]:
    return {
        "versions": list(self.versions), "rounds": self.rounds,
        "registry": [dataclasses.asdict(s) for s in self.registry.values()],
        "step_ema": {str(m): e.value for m, e in self._step_ema.items()},
        **self.timing.export(),
        "rejections": dict(self.rejections), "last_quorum": self.last_quorum,
        "last_grace": self.last_grace, "ledger": self.ledger.export(),
    }

  def restore_state(self, state: dict[str, Any], fragments: dict[int, tuple[int, dict, dict]],
                    history: dict[int, dict[int, dict[str, np.ndarray]]], rounds: int) -> None:
    """Resumes from durable rounds: `fragments[p] = (version, params, momentum)`.

    `rounds` is one past the last committed round (not the count in `state`, which may
    include rounds closed in the same tick that never became durable).
    """
    self.state.restore(fragments, history)
    self.rounds = rounds
    decay = self.policy.ema_decay
    state = durable_state.typed(state)  # read from a file: every field typed first
    self.registry = {r["learner_id"]: policy.LearnerStatus(**r) for r in state["registry"]}
    self._step_ema = {m: policy.Ema(decay, v) for m, v in state["step_ema"].items()}
    self.ledger = ledger_lib.DeliveryLedger()
    self.ledger.absorb(state["ledger"])
    self.timing.restore(state, decay)
    self.rejected.counts = collections.Counter(state.get("rejections", {}))
    self.last_quorum = int(state.get("last_quorum", 0))
    self.last_grace = float(state.get("last_grace", 0.0))

  def global_params(self) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in self.params.items()}

  def state_summary(self) -> dict[str, Any]:
    return {"rounds": self.rounds, "last_quorum": self.last_quorum,
            "learners_per_round": self.admitted_here / max(self.closed_here, 1),
            "last_grace_s": self.last_grace, "rejected": dict(self.rejections),
            "ignored": dict(self.ignored)}
