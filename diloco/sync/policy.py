"""The syncer's decision policy: eligibility, quorum, grace window and round closing.

Everything here is a pure function of its inputs (docs/design.md 2.4 and 3.1). Times are plain
floats in seconds on whatever clock the caller injects: the real syncer passes its wall clock,
the goodput simulator (`diloco.sim`) its virtual clock, so both run the very same decisions.
Nothing here reads the time, sleeps, logs or mutates its arguments.

A round of fragment `p`:

1. A delivery is *eligible* (`check_delivery`) when its learner is alive (heartbeat within the
   timeout), the incarnation matches the registry, its base version is a version of `p` this
   syncer published (versions `0..current_version`, so lineage is kept as a single integer per
   fragment), `steps >= 1`, and its staleness `current_version - base_version` is within the
   configured bound.
2. The round opens at its first fresh eligible delivery. It needs
   `required_quorum(k, num_alive) = min(k, num_alive)` (at least 1; k = 0: all alive) of them.
3. Once quorum is reached it keeps admitting for `grace_window(...)`
   `= clip(gamma * (tau * step_time - lead_time - quorum_time - sync_time), 0, step_time)`
   seconds. `lead_time` is how much of its tau steps a learner has already spent when the
   values of its delivery reach its host: a learner that dispatches steps asynchronously
   (reading metrics one step late) only has them once the step completes, about one step
   after its delivery point. It is 0 on the virtual clock, which makes this docs/design.md 2.4's
   formula; without it the window would spend slack the learners do not have and they would
   wait at t + tau.
4. `decide_round` closes the round at the end of the grace window, or at once when every alive
   learner has delivered.

Typical use by a syncer::

  ok, reason = check_delivery(d, learner=registry.get(d.learner),
                              current_version=versions[p], now=now, config=cfg)
  ...
  decision = decide_round(arrival_times, num_alive=n, opened_at=t0, now=now, config=cfg,
                          step_time=slowest, quorum_time=q_ema.get(0.), sync_time=s_ema.get(0.))
  if decision.close: merge(...)
  else: wake_up_at(decision.deadline)   # None: wait for the next delivery or heartbeat change
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from diloco import fragments, settings
from diloco.delivery import Delivery
from diloco.settings import (
  AT_LEAST_ONE,
  NON_NEGATIVE,
  OneOf,
  Range,
  frozen,
  require,
  setting,
)

# Reasons returned by `check_delivery` for rejected deliveries (stable strings, used as counter
# names by the syncer and the simulator).
OK = "ok"
REJECT_UNKNOWN_LEARNER = "unknown_learner"
REJECT_DEAD = "learner_dead"
REJECT_INCARNATION = "wrong_incarnation"
REJECT_UNKNOWN_LINEAGE = "unknown_lineage"
REJECT_NO_STEPS = "no_steps"
REJECT_STALE = "stale"


# The bounds of the `sync` settings that the policy reads: one table, declared as the rules of
# those `SyncConfig` fields and checked again by `PolicyConfig`, so the config and the policy
# accept the same values (tests/config_policy_test.py).
SYNC_BOUNDS = {
    "quorum": settings.Range(low=0, integer=True, text=">= 1, or 0 for all learners"),
    "tau": settings.Range(low=0, integer=True),
    # The window is capped at one step time anyway; a gain beyond 10 is a typo.
    "gamma": settings.Range(low=0, high=10),
    "heartbeat_timeout_s": settings.Range(low=0, low_open=True, infinite_ok=True),  # inf: never
    "max_staleness": settings.Range(low=0, integer=True),
}
EMA_DECAY_BOUND = settings.FRACTION


@frozen
class SyncConfig:
  """Fragments, schedule, quorum and delivery bounds of the outer loop (docs/design.md 2.2-2.4)."""
  # P: the parameters are split into this many fragments, each synchronised on its own.
  num_fragments: int = setting(24, AT_LEAST_ONE)
  # H: each fragment is due every `period` local steps, at offset p * H // P.
  period: int = setting(24, AT_LEAST_ONE)
  # How tensors are packed into fragments: balanced | layer | tensor (diloco/fragments.py).
  scheme: str = setting("balanced", OneOf(fragments.SCHEMES))
  # Bounded overlap: a learner applies the merge of a delivery tau steps after making it.
  tau: int = setting(2, SYNC_BOUNDS["tau"])
  # K: a round merges once this many fresh deliveries of its fragment arrived (capped by the
  # learners alive); 0 means all learners (K = M, synchronous), however many there are.
  quorum: int = setting(1, SYNC_BOUNDS["quorum"])
  # Grace-window gain: after quorum a round keeps admitting deliveries for up to
  # gamma * (the slack that tau leaves); 0 closes it at quorum.
  gamma: float = setting(0.8, SYNC_BOUNDS["gamma"], "0 disables grace")
  # A learner silent for longer is dead: rounds stop waiting for it.
  heartbeat_timeout_s: float = setting(30.0, SYNC_BOUNDS["heartbeat_timeout_s"])
  # Deliveries whose base is more than this many versions behind are rejected.
  max_staleness: int = setting(8, SYNC_BOUNDS["max_staleness"])
  # A learner whose round is not merged tau steps after its delivery waits for it (False:
  # it trains on and applies the merge when it comes).
  block_on_late_round: bool = True
  # Deliveries a learner may have on their way (copied off its devices, not yet uploaded)
  # before its next delivery waits for the oldest: bounds the host and device memory a slow
  # link can pin. The wait is recorded as "wait" activity (not useful time). Also the size of
  # a learner process's upload outbox (`distributed.learner_link`).
  send_queue: int = setting(8, AT_LEAST_ONE)
  # Bytes of fragment copies a learner may hold on their way (on its devices, then its host);
  # the next delivery waits while its own would pass this, unless none is on its way (one
  # delivery always goes, however large). With `send_queue`, the first bound hit applies.
  send_queue_bytes: int = setting(1 << 30, Range(low=1, high=2**53, text=">= 1 (bytes)"))
  # S: the syncer is split into this many shards, each owning a byte-balanced subset of the
  # fragments with its own G, momentum, rounds, lease, store folder and tape
  # (docs/design.md 3.1, `diloco/sync/ownership.py`). 1 = one syncer. The single-controller
  # runtime runs the S shards in its process (`diloco/sync/group.py`).
  shards: int = setting(1, AT_LEAST_ONE)
  # Which shard a syncer process is (`--role=syncer --config.sync.shard=s`); learners and the
  # single-controller runtime ignore it.
  shard: int = setting(0, NON_NEGATIVE)

  def check(self) -> None:
    """The rules that relate the sync fields (a field's own rule is declared beside it)."""
    # A learner applies the result of a delivery tau steps later; with H <= tau its next
    # delivery of the same fragment would come first and it could never apply a merged version.
    require(self.period > self.tau, "sync.period",
            f"must be greater than sync.tau={self.tau} (docs/design.md 2.3), got {self.period}")
    # Each shard owns at least one fragment (the plan may hold fewer than P: `fragments.py`).
    require(self.shards <= self.num_fragments, "sync.shards",
            f"must be at most sync.num_fragments={self.num_fragments}, got {self.shards}")
    require(self.shard < self.shards, "sync.shard",
            f"must be below sync.shards={self.shards}, got {self.shard}")


_SYNC_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SyncConfig)}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PolicyConfig:
  """The settings of the syncer policy (docs/design.md 2.3-2.4): the `sync` fields it reads,
  with `SyncConfig`'s defaults and `SYNC_BOUNDS`' rules (tests/config_policy_test.py holds the
  two lists equal), built from the group by `from_config(sync)`; plus its own `ema_decay`."""
  quorum: int = _SYNC_DEFAULTS["quorum"]  # K; 0: every alive learner
  tau: int = _SYNC_DEFAULTS["tau"]
  gamma: float = _SYNC_DEFAULTS["gamma"]  # grace-window gain; 0 closes a round at quorum
  heartbeat_timeout_s: float = _SYNC_DEFAULTS["heartbeat_timeout_s"]
  max_staleness: int = _SYNC_DEFAULTS["max_staleness"]
  # The weight of the old value in the EMAs of step, quorum and sync times.
  ema_decay: float = 0.9

  def __post_init__(self):
    for field, bound in SYNC_BOUNDS.items():
      _require(bound.admits(getattr(self, field)), field, getattr(self, field), bound.describe())
    _require(EMA_DECAY_BOUND.admits(self.ema_decay), "ema_decay", self.ema_decay,
             EMA_DECAY_BOUND.describe())

  @classmethod
  def from_config(cls, sync: SyncConfig, **changes) -> PolicyConfig:
    """The policy of a `sync` group, with `changes` (e.g. `gamma=0.0`) applied."""
    values = {field: getattr(sync, field) for field in SYNC_BOUNDS}
    return cls(**{**values, **changes})


def _require(ok: bool, field: str, value: object, allowed: str) -> None:
  if not ok:
    raise ValueError(f"PolicyConfig.{field} = {value!r}; allowed: {allowed}")


@dataclasses.dataclass(frozen=True, slots=True)
class Ema:
  """An exponential moving average; immutable, `update` returns a new one.

  The first sample initialises the average; afterwards
  `value = decay * value + (1 - decay) * sample`.
  """
  decay: float = 0.9
  value: float | None = None

  def update(self, sample: float) -> Ema:
    """Returns the average after one more sample."""
    if self.value is None:
      return Ema(self.decay, float(sample))
    return Ema(self.decay, self.decay * self.value + (1.0 - self.decay) * float(sample))

  def get(self, default: float = 0.0) -> float:
    """The current average, or `default` before the first sample."""
    return default if self.value is None else self.value


@frozen
class LearnerStatus:
  """What the syncer's registry knows about one learner."""
  learner_id: int
  incarnation: int
  last_heartbeat: float
  step_time: float | None = None  # EMA of the learner's inner-step time, seconds.


@frozen
class RoundDecision:
  """What to do with the open round of one fragment.

  Attributes:
    close: merge the admitted deliveries now.
    deadline: when not closing, the time at which to decide again (end of the grace window), or
      None when the round waits for quorum (decide again on the next delivery or liveness change).
    quorum: the required quorum `min(K, alive)`.
    quorum_reached_at: arrival time of the delivery that completed the quorum, else None.
    quorum_wait: `quorum_reached_at - opened_at`, the sample for the quorum-time EMA, else None.
    grace: the grace window in seconds (0 before quorum).
    reason: "all_delivered", "quorum_reached" (no grace), "grace_expired", "in_grace" or
      "waiting_for_quorum"; for a final-sync round (`decide_final_round`)
      "final_all_delivered", "final_timeout" or "final_waiting".
  """
  close: bool
  deadline: float | None
  quorum: int
  quorum_reached_at: float | None
  quorum_wait: float | None
  grace: float
  reason: str


def is_alive(last_heartbeat: float, now: float, timeout_s: float) -> bool:
  """Whether a heartbeat at `last_heartbeat` is recent enough at time `now`."""
  return now - last_heartbeat <= timeout_s


def alive_learners(learners: Iterable[LearnerStatus], now: float,
                   timeout_s: float) -> list[LearnerStatus]:
  """The learners whose heartbeat is within the timeout at time `now`."""
  return [s for s in learners if is_alive(s.last_heartbeat, now, timeout_s)]


def staleness(current_version: int, base_version: int) -> int:
  """How many versions of the fragment were published after the delivery's base version."""
  return current_version - base_version


def is_known_lineage(base_version: int, current_version: int) -> bool:
  """Whether `base_version` is one this syncer published: versions are `0..current_version`."""
  return 0 <= base_version <= current_version


def check_delivery(delivery: Delivery, *, learner: LearnerStatus | None, current_version: int,
                   now: float, config: PolicyConfig) -> tuple[bool, str]:
  """Decides whether a delivery may join a round of its fragment.

  Args:
    delivery: the delivery (its counters are read, never its tensors).
    learner: the registry entry of its learner, or None if the syncer does not know it.
    current_version: the latest published version of the delivery's fragment.
    now: the current time.
    config: the policy settings (heartbeat timeout, staleness bound).

  Returns:
    `(True, "ok")`, or `(False, reason)` with one of the `REJECT_*` strings.
  """
  if learner is None or learner.learner_id != delivery.learner:
    return False, REJECT_UNKNOWN_LEARNER
  if not is_alive(learner.last_heartbeat, now, config.heartbeat_timeout_s):
    return False, REJECT_DEAD
  if delivery.incarnation != learner.incarnation:
    return False, REJECT_INCARNATION
  if not is_known_lineage(delivery.base_version, current_version):
    return False, REJECT_UNKNOWN_LINEAGE
  if delivery.steps < 1:
    return False, REJECT_NO_STEPS
  if staleness(current_version, delivery.base_version) > config.max_staleness:
    return False, REJECT_STALE
  return True, OK


def required_quorum(k: int, num_alive: int) -> int:
  """The quorum a round needs: `min(k, num_alive)` (all of them for k = 0), and at least 1."""
  return max(1, num_alive if k == 0 else min(k, num_alive))


def grace_window(*, gamma: float, tau: int, step_time: float, quorum_time: float,
                 sync_time: float, lead_time: float = 0.0) -> float:
  """`clip(gamma * (tau * step_time - lead_time - quorum_time - sync_time), 0, step_time)`.

  Args:
    gamma: gain; 0 disables the window.
    tau: bounded overlap in inner steps.
    step_time: EMA step time of the slowest eligible learner.
    quorum_time: EMA of the time from a round's opening to its quorum.
    sync_time: EMA of the time to pull, merge and publish a fragment.
    lead_time: EMA of the time from a delivery point to its values being on the learner's
      host (module docstring).
  """
  if gamma <= 0.0 or step_time <= 0.0:
    return 0.0
  raw = gamma * (tau * step_time - lead_time - quorum_time - sync_time)
  return min(max(raw, 0.0), step_time)


def slowest_step_time(step_times: Iterable[float | None], default: float = 0.0) -> float:
  """The largest known step time (the slowest eligible learner), or `default` if none is known."""
  known = [t for t in step_times if t is not None and math.isfinite(t)]
  return max(known) if known else default


def grace_step_time(alive_step_times: Iterable[float | None],
                    quorum_step_times: Iterable[float | None], tau: int) -> float:
  """The step time a round's grace window is sized by: the slowest alive learner's
  (docs/design.md 2.4), but at most `max(tau, 1)` steps of the slowest learner counted in the
  round.

  The learners in the round wait for its merge after tau of their own steps, so a window
  longer than that spends slack they do not have; and one learner's claimed step time (a
  crafted heartbeat says a week) cannot stretch every round's window: it is capped by what
  the round's own deliverers measured. 0 when none of them has a step time yet.
  """
  cap = max(tau, 1) * slowest_step_time(quorum_step_times)
  return min(slowest_step_time(alive_step_times), cap)


def decide_round(arrival_times: Sequence[float], *, num_alive: int, opened_at: float, now: float,
                 config: PolicyConfig, step_time: float, quorum_time: float,
                 sync_time: float, lead_time: float = 0.0) -> RoundDecision:
  """Decides whether the open round of a fragment closes now or when to decide again.

  Args:
    arrival_times: arrival times of the round's fresh eligible deliveries (one per learner).
    num_alive: the number of alive learners.
    opened_at: when the round opened (its first fresh eligible delivery); only used to report
      `quorum_wait` for the caller's quorum-time EMA.
    now: the current time.
    config: the policy settings (quorum K, tau, gamma).
    step_time: EMA step time of the slowest eligible learner.
    quorum_time: EMA of the time to reach quorum.
    sync_time: EMA of the time to pull, merge and publish.
    lead_time: EMA of the learners' lead (see `grace_window`).

  Returns:
    The decision; see `RoundDecision`.
  """
  n = len(arrival_times)
  quorum = required_quorum(config.quorum, num_alive)
  if n < quorum:
    return RoundDecision(close=False, deadline=None, quorum=quorum, quorum_reached_at=None,
                         quorum_wait=None, grace=0.0, reason="waiting_for_quorum")
  reached = sorted(arrival_times)[quorum - 1]
  wait = reached - opened_at
  grace = grace_window(gamma=config.gamma, tau=config.tau, step_time=step_time,
                       quorum_time=quorum_time, sync_time=sync_time, lead_time=lead_time)
  if n >= num_alive:
    return RoundDecision(close=True, deadline=None, quorum=quorum, quorum_reached_at=reached,
                         quorum_wait=wait, grace=grace, reason="all_delivered")
  deadline = reached + grace
  if now >= deadline:
    reason = "grace_expired" if grace > 0.0 else "quorum_reached"
    return RoundDecision(close=True, deadline=None, quorum=quorum, quorum_reached_at=reached,
                         quorum_wait=wait, grace=grace, reason=reason)
  return RoundDecision(close=False, deadline=deadline, quorum=quorum, quorum_reached_at=reached,
                       quorum_wait=wait, grace=grace, reason="in_grace")


def decide_final_round(arrival_times: Sequence[float], *, num_alive: int, final_since: float,
                       opened_at: float, now: float, timeout_s: float) -> RoundDecision:
  """The round of a fragment that holds a final-sync delivery (docs/design.md 2.3, "Final sync").

  It waits for a fresh delivery from every alive learner (the learners still training deliver
  this fragment within H steps), so that the last G merges every learner's last steps
  together; it never waits longer than `timeout_s` after the first final delivery arrived.

  Args:
    arrival_times: arrival times of the round's deliveries from alive learners.
    num_alive: the number of alive learners (those that finished and left are not alive).
    final_since: arrival time of the round's first final delivery.
    opened_at: when the round opened (for `quorum_wait`).
    now: the current time.
    timeout_s: the longest wait (the heartbeat timeout).
  """
  reached = max(arrival_times, default=final_since)
  deadline = final_since + timeout_s
  if len(arrival_times) >= num_alive or now >= deadline:
    reason = "final_all_delivered" if len(arrival_times) >= num_alive else "final_timeout"
    return RoundDecision(close=True, deadline=None, quorum=num_alive,
                         quorum_reached_at=min(reached, now), quorum_wait=None, grace=0.0,
                         reason=reason)
  return RoundDecision(close=False, deadline=deadline, quorum=num_alive, quorum_reached_at=None,
                       quorum_wait=None, grace=0.0, reason="final_waiting")
