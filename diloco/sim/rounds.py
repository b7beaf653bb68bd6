"""Sampled syncer rounds: step-level simulation of a short window, driving `diloco.sync.policy`.

The goodput engine cannot afford every inner step of a 30-day, million-chip run (billions of
learner-steps), but the syncer's effect on goodput depends only on *which* learners are stepping
(their speed factors) and the policy settings, not on the time of day. So for each set of stepping
learners it meets, the engine calls `sample_window` once: a step-by-step simulation of `W` inner
steps on a virtual clock, with per-step jitter, in which

- learner i finishes steps of `step_s * factor_i * U(1 - j, 1 + j)` seconds and delivers fragment
  p after every step t with `t % H == (p * H // P) % H`, with its counters since the last receipt;
- the syncer checks every delivery with `policy.check_delivery`, opens a round at the first fresh
  eligible one, and asks `policy.decide_round` (quorum `min(K, alive)`, grace window from the EMAs
  of the slowest learner's step time, quorum time and sync time) at every delivery and deadline;
  a closed round is published `sync_s` later to every learner, which overwrites the fragment and
  zeroes its counters (docs/design.md 2.3);
- a learner that delivered fragment p after step t must have received the round that admitted it
  before starting step t + tau + 1, else it waits (block_on_late_round).

The result, per speed factor: the fraction of wall time spent stepping (not waiting), the
fraction of steps not lost to rejected deliveries, and the fraction of per-fragment step counts
that reached a merge (at most 1 - tau / H: the counts of the tau steps between a delivery and its
receipt are zeroed by the overwrite); plus round statistics. The engine caches it per set.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

from diloco.delivery import Delivery
from diloco.sync import policy

_STEP_END, _DEADLINE, _PUBLISH = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class WindowStats:
  """What one sampled window measured.

  Attributes:
    step_efficiency: speed factor -> fraction of wall time its learners spent stepping.
    coverage: speed factor -> fraction of steps whose progress was not rejected.
    merged_fraction: speed factor -> merged per-fragment step counts over P * steps.
    duration_s: simulated seconds.
    rounds: rounds closed.
    admitted: deliveries merged.
    staleness: staleness at admission -> number of admitted deliveries.
    rejected: rejection reason -> count.
    grace_s: sum of the grace windows of the closed rounds.
  """
  step_efficiency: dict[float, float]
  coverage: dict[float, float]
  merged_fraction: dict[float, float]
  duration_s: float
  rounds: int
  admitted: int
  staleness: dict[int, int]
  rejected: dict[str, int]
  grace_s: float


def sample_window(speeds: Sequence[float], *, sync: policy.SyncConfig,
                  config: policy.PolicyConfig, step_s: float, step_jitter: float,
                  sync_s: float, window_steps: int, seed: int) -> WindowStats:
  """Simulates `window_steps` nominal steps of the given stepping learners and their syncer.

  Args:
    speeds: step-time factor of each stepping learner (all alive, all of known lineage).
    sync: the `sync` group, for P (`num_fragments`) and H (`period`).
    config: the syncer policy (built from `sync`; gamma = 0 without the grace window).
    step_s: nominal step time in seconds.
    step_jitter: per-step variation j, steps take `step_s * factor * U(1 - j, 1 + j)`.
    sync_s: time from closing a round to the learners receiving it.
    window_steps: length of the window, in nominal steps.
    seed: seeds the jitter.

  Returns:
    The window's statistics.
  """
  return _Window(speeds, config, step_s, step_jitter, sync_s, sync.num_fragments, sync.period,
                 window_steps, seed).run()


class _Window:
  """State of one sampled window (private; see `sample_window`)."""

  def __init__(self, speeds, config, step_s, step_jitter, sync_s, fragments, inner_steps,
               window_steps, seed):
    self.speeds = [float(s) for s in speeds]
    self.n = len(self.speeds)
    self.cfg = config
    self.sync_s = sync_s
    self.P, self.H = fragments, inner_steps
    self.end = window_steps * step_s
    margin = 2 * (inner_steps + config.tau + 1) * step_s * max(self.speeds)
    self.cut = self.end - min(margin, self.end / 2)  # deliveries after it may still be open
    self.due = collections.defaultdict(list)  # step % H -> fragments delivered then
    for p in range(fragments):
      self.due[(p * inner_steps // fragments) % inner_steps].append(p)
    rng = np.random.default_rng(seed)
    n_draw = int(window_steps / (min(self.speeds) * (1.0 - step_jitter))) + 8
    u = rng.uniform(1.0 - step_jitter, 1.0 + step_jitter, size=(self.n, n_draw))
    self.durations = (u * step_s * np.asarray(self.speeds)[:, None]).tolist()
    self.heap = []
    self.seq = 0
    # Learners.
    self.t = [0] * self.n
    self.busy_since = [0.0] * self.n
    self.stepping_s = [0.0] * self.n
    self.waiting = [False] * self.n
    self.pending = [[] for _ in range(self.n)]  # [due_step, fragment, delivery key]
    self.base = [[0] * fragments for _ in range(self.n)]
    self.receipt_step = [[0] * fragments for _ in range(self.n)]
    self.step_ema = [policy.Ema(config.ema_decay) for _ in range(self.n)]
    self.counted = [0] * self.n  # steps completed before the cut
    self.merged = [0] * self.n  # counter steps of merged deliveries made before the cut
    self.lost = [0] * self.n  # counter steps of rejected deliveries
    # Syncer.
    self.version = [0] * fragments
    self.fresh = [[] for _ in range(fragments)]  # (Delivery, key, before_cut, arrival time)
    self.opened_at = [0.0] * fragments
    self.token = [0] * fragments
    self.resolved = {}  # delivery key -> True once received (or rejected)
    self.quorum_ema = policy.Ema(config.ema_decay)
    self.sync_ema = policy.Ema(config.ema_decay)
    self.rounds = self.admitted = 0
    self.grace_s = 0.0
    self.staleness = collections.Counter()
    self.rejected = collections.Counter()
    self.status = [policy.LearnerStatus(learner_id=i, incarnation=0, last_heartbeat=0.0)
                   for i in range(self.n)]

  def push(self, time, kind, a, b=None):
    self.seq += 1
    heapq.heappush(self.heap, (time, self.seq, kind, a, b))

  def run(self) -> WindowStats:
    for i in range(self.n):
      self.start_step(i, 0.0)
    while self.heap and self.heap[0][0] <= self.end:
      now, _, kind, a, b = heapq.heappop(self.heap)
      if kind == _STEP_END:
        self.step_end(a, now)
      elif kind == _DEADLINE:
        if b == self.token[a]:
          self.evaluate(a, now)
      else:
        self.publish(a, b, now)
    for i in range(self.n):
      if not self.waiting[i]:
        self.stepping_s[i] += self.end - self.busy_since[i]
    return self.stats()

  def start_step(self, i, now):
    self.busy_since[i] = now
    self.waiting[i] = False
    self.push(now + self.durations[i][self.t[i]], _STEP_END, i)

  def step_end(self, i, now):
    duration = now - self.busy_since[i]
    self.stepping_s[i] += duration
    self.step_ema[i] = self.step_ema[i].update(duration)
    self.t[i] += 1
    t = self.t[i]
    before_cut = now <= self.cut
    if before_cut:
      self.counted[i] = t
    for p in self.due.get(t % self.H, ()):
      steps = t - self.receipt_step[i][p]
      key = (i, t, p)
      delivery = Delivery(learner=i, incarnation=0, fragment=p, local_step=t, steps=steps,
                          tokens=steps, base_version=self.base[i][p], kind="values")
      self.pending[i].append((t + self.cfg.tau, p, key))
      self.receive(delivery, key, before_cut, now)
    self.try_continue(i, now)

  def try_continue(self, i, now):
    t = self.t[i]
    self.pending[i] = [e for e in self.pending[i] if not self.resolved.get(e[2], False)]
    if any(due <= t for due, _, _ in self.pending[i]):
      self.waiting[i] = True
    else:
      self.start_step(i, now)

  def receive(self, delivery, key, before_cut, now):
    p = delivery.fragment
    status = dataclasses.replace(self.status[delivery.learner], last_heartbeat=now)
    ok, reason = policy.check_delivery(delivery, learner=status, current_version=self.version[p],
                                       now=now, config=self.cfg)
    if not ok:
      self.rejected[reason] += 1
      self.lost[delivery.learner] += delivery.steps
      self.resolved[key] = True
      return
    if not self.fresh[p]:
      self.opened_at[p] = now
    self.fresh[p].append((delivery, key, before_cut, now))
    self.evaluate(p, now)

  def evaluate(self, p, now):
    fresh = self.fresh[p]
    if not fresh:
      return
    decision = policy.decide_round(
        [arrived for _, _, _, arrived in fresh], num_alive=self.n, opened_at=self.opened_at[p],
        now=now, config=self.cfg,
        step_time=policy.grace_step_time([e.value for e in self.step_ema],
                                         [self.step_ema[d.learner].value for d, _, _, _ in fresh],
                                         self.cfg.tau),
        quorum_time=self.quorum_ema.get(0.0), sync_time=self.sync_ema.get(self.sync_s))
    if decision.close:
      self.close(p, decision, now)
    elif decision.deadline is not None:
      self.token[p] += 1
      self.push(decision.deadline, _DEADLINE, p, self.token[p])

  def close(self, p, decision, now):
    current = self.version[p]
    self.version[p] = current + 1
    admitted = self.fresh[p]
    self.fresh[p] = []
    self.token[p] += 1
    self.quorum_ema = self.quorum_ema.update(decision.quorum_wait)
    self.sync_ema = self.sync_ema.update(self.sync_s)
    self.rounds += 1
    self.admitted += len(admitted)
    self.grace_s += decision.grace
    for delivery, _, before_cut, _ in admitted:
      self.staleness[policy.staleness(current, delivery.base_version)] += 1
      if before_cut:
        self.merged[delivery.learner] += delivery.steps
    self.push(now + self.sync_s, _PUBLISH, p, (current + 1, [k for _, k, _, _ in admitted]))

  def publish(self, p, payload, now):
    version, keys = payload
    for key in keys:
      self.resolved[key] = True
    for i in range(self.n):
      if version > self.base[i][p]:
        self.base[i][p] = version
        self.receipt_step[i][p] = self.t[i]
    for i in range(self.n):
      if self.waiting[i]:
        self.try_continue(i, now)

  def stats(self) -> WindowStats:
    by_speed = collections.defaultdict(list)
    for i, s in enumerate(self.speeds):
      by_speed[s].append(i)

    def mean(values):
      return float(np.mean(values))

    eff = {s: mean([self.stepping_s[i] / self.end for i in ids]) for s, ids in by_speed.items()}
    cov = {s: mean([1.0 - min(1.0, self.lost[i] / max(self.t[i], 1)) for i in ids])
           for s, ids in by_speed.items()}
    merged = {s: mean([self.merged[i] / max(self.P * self.counted[i], 1) for i in ids])
              for s, ids in by_speed.items()}
    return WindowStats(step_efficiency=eff, coverage=cov, merged_fraction=merged,
                       duration_s=self.end, rounds=self.rounds, admitted=self.admitted,
                       staleness=dict(self.staleness), rejected=dict(self.rejected),
                       grace_s=self.grace_s)
