"""The event loop: exact failures and repairs, stepping accounted analytically between events.

Chips are grouped into slices of `slice_chips`. Every healthy slice fails at rate
`slice_chips / MTBI_chip` (a Poisson process over the cluster, drawn by thinning: candidate
failures at the rate of all allocated slices, ignored when they hit a slice that is already down),
and comes back `repair_s` later. Jobs ("units") own slices:

- `dp`: one unit. A failure of a slice in the job stops it for `restart_s`; failures during the
  restart are absorbed by it. The job re-forms on every healthy slice at the end of the restart;
  slices repaired while it runs stay idle until the next restart.
- `elastic`: one unit. A failure or a repair pauses it for `reconfig_s` (events during a pause
  are absorbed by it); afterwards it runs on every healthy slice.
- `decoupled`: M units, each an elastic job of chips / M. Between events, the useful rate of
  each stepping learner is `chips * step_efficiency * coverage`, taken from a sampled round window
  (`diloco.sim.rounds`, which drives `diloco.sync.policy`) for the current set of stepping learners,
  cached per set. A paused learner stays alive for the syncer until its heartbeat times out, so
  while fewer learners step than `required_quorum(K, alive)`, nobody makes progress.

This is the coarse-graining: failure, repair, reconfiguration and heartbeat events are simulated
one by one on the event heap, but inner steps and syncer rounds are not; their effect enters as
rates, measured once per set of stepping learners on a short step-level window. Transients (the
first steps after a pause, a round open when a learner pauses) are ignored; they last a few
steps, against minutes between a learner's events even at 2.4M chips.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from diloco.sim import params as params_lib
from diloco.sim import rounds
from diloco.sim.result import SimResult
from diloco.sync import policy

_REPAIR, _PAUSE_END, _HB_EXPIRE, _SCHEDULE = 0, 1, 2, 3
_CHUNK = 8192


def simulate(cfg: params_lib.SimConfig) -> SimResult:
  """Runs one configuration and returns its accounting."""
  return _Engine(cfg).run()


class _Engine:
  """Mutable state of one run (private; see `simulate`)."""

  def __init__(self, cfg: params_lib.SimConfig):
    self.cfg = cfg
    fm = cfg.failures
    self.S = fm.slice_chips
    self.rate_per_slice = 0.0 if np.isinf(fm.mtbi_years) else fm.slice_rate
    self.rng = np.random.default_rng(cfg.seed)
    self.decoupled = cfg.mode == "decoupled"
    self.dp = cfg.mode == "dp"
    self.pause_s = fm.restart_s if self.dp else fm.reconfig_s
    self.policy = cfg.policy_config()
    n_slices = max(cfg.learners, round(cfg.chips / self.S))
    self.learner_slices = n_slices // cfg.learners
    # Slices.
    self.up: list[bool] = []
    self.owner: list[int] = []
    self.in_job: list[bool] = []
    # Units.
    self.healthy: list[int] = []
    self.job_slices: list[int] = []  # dp: slices in the job; else equal to healthy
    self.paused: list[bool] = []
    self.token: list[int] = []
    self.hb_dead: list[bool] = []
    self.idle: list[bool] = []  # paused with no healthy slice: waits for a repair
    self.removed: list[bool] = []
    self.speed: list[float] = []
    self.classes = sorted(set(cfg.speeds)) if cfg.speeds else [1.0]
    self.cls: list[int] = []  # index of the learner's speed in `classes`
    self.contrib: list[int] = []  # healthy slices of a stepping learner, else 0
    self.n_step = [0] * len(self.classes)  # stepping learners per speed class
    self.h_step = [0] * len(self.classes)  # their healthy slices
    self.n_paused_alive = 0  # paused learners whose heartbeat has not timed out
    self.slices_of: list[list[int]] = []
    self.returned: list[list[int]] = []  # dp: slices repaired since the job last re-formed
    for u in range(cfg.learners):
      extra = 1 if u < n_slices % cfg.learners else 0
      self._add_unit(self.learner_slices + extra, paused=True)
      self._set_stepping(u, True)
    self.heap: list = []
    self.seq = 0
    for day, delta in cfg.schedule:
      self._push(day * params_lib.DAY_S, _SCHEDULE, delta)
    self.windows: dict[tuple, rounds.WindowStats] = {}
    self.sig_time: dict[tuple, float] = {}
    # Accounting.
    self.now = 0.0
    self.useful = self.produced = self.merged = self.allocated = self.uptime = 0.0
    self.rate = self.prod_rate = self.merged_rate = 0.0
    self.sig = None
    self.events = self.failures = 0
    self._reset_failures(0.0)

  # ---- setup helpers -------------------------------------------------------------------------
  def _add_unit(self, n, paused):
    u = len(self.healthy)
    ids = list(range(len(self.up), len(self.up) + n))
    self.up.extend([True] * n)
    self.owner.extend([u] * n)
    self.in_job.extend([True] * n)
    self.slices_of.append(ids)
    self.returned.append([])
    self.healthy.append(n)
    self.job_slices.append(n)
    self.paused.append(paused)
    self.token.append(0)
    self.hb_dead.append(False)
    self.idle.append(False)
    self.removed.append(False)
    self.speed.append(self.cfg.speed_of(u))
    self.cls.append(self.classes.index(self.speed[u]))
    self.contrib.append(0)
    if paused:
      self.n_paused_alive += 1
    return u

  def _set_stepping(self, u, stepping):
    """Moves learner u between paused (alive) and stepping, keeping the class sums."""
    c = self.cls[u]
    if stepping:
      self.paused[u] = False
      if not self.hb_dead[u]:
        self.n_paused_alive -= 1
      self.hb_dead[u] = False
      self.contrib[u] = self.healthy[u]
      self.n_step[c] += 1
      self.h_step[c] += self.contrib[u]
    else:
      self.paused[u] = True
      self.n_paused_alive += 1
      self.n_step[c] -= 1
      self.h_step[c] -= self.contrib[u]
      self.contrib[u] = 0

  def _push(self, t, kind, a, b=0):
    self.seq += 1
    heapq.heappush(self.heap, (t, self.seq, kind, a, b))

  def _reset_failures(self, t):
    """(Re)starts the candidate-failure stream at time t for the current allocation."""
    self.alloc_ids = [k for k, o in enumerate(self.owner) if o >= 0]
    self.alloc_chips = len(self.alloc_ids) * self.S
    total = self.rate_per_slice * len(self.alloc_ids)
    self.fail_rate = total
    self.fail_times = []
    self.fail_pos = 0
    self.fail_base = t
    self.next_fail = self._draw_failure()

  def _draw_failure(self):
    if self.fail_rate <= 0.0:
      return float("inf")
    if self.fail_pos >= len(self.fail_times):
      gaps = self.rng.exponential(1.0 / self.fail_rate, _CHUNK)
      self.fail_times = (self.fail_base + np.cumsum(gaps)).tolist()
      self.fail_base = self.fail_times[-1]
      self.fail_picks = (self.rng.random(_CHUNK) * len(self.alloc_ids)).astype(np.int64).tolist()
      self.fail_pos = 0
    t = self.fail_times[self.fail_pos]
    self.fail_slice = self.alloc_ids[self.fail_picks[self.fail_pos]]
    self.fail_pos += 1
    return t

  # ---- main loop -----------------------------------------------------------------------------
  def run(self) -> SimResult:
    wall0 = time.perf_counter()
    end = self.cfg.days * params_lib.DAY_S
    self._update_rates()
    heap = self.heap
    while True:
      t_heap = heap[0][0] if heap else float("inf")
      t = min(self.next_fail, t_heap)
      if t > end:
        break
      self.events += 1
      self._advance(t)
      if self.next_fail <= t_heap:
        k = self.fail_slice
        self.next_fail = self._draw_failure()
        changed = self._fail(k, t)
      else:
        _, _, kind, a, b = heapq.heappop(heap)
        if kind == _REPAIR:
          changed = self._repair(a, t)
        elif kind == _PAUSE_END:
          changed = self._pause_end(a, b, t)
        elif kind == _HB_EXPIRE:
          changed = self._hb_expire(a, b)
        else:
          changed = self._schedule(a, t)
      if changed:
        self._update_rates()
    self._advance(end)
    return self._result(end, time.perf_counter() - wall0)

  def _advance(self, t):
    dt = t - self.now
    if dt > 0.0:
      self.allocated += self.alloc_chips * dt
      if self.rate > 0.0:
        self.useful += self.rate * dt
        self.produced += self.prod_rate * dt
        self.merged += self.merged_rate * dt
        self.uptime += dt
        if self.sig is not None:
          self.sig_time[self.sig] = self.sig_time.get(self.sig, 0.0) + dt
      self.now = t

  # ---- events --------------------------------------------------------------------------------
  def _start_pause(self, u, t):
    if not self.paused[u]:
      self._set_stepping(u, False)
    self.token[u] += 1
    self._push(t + self.pause_s, _PAUSE_END, u, self.token[u])
    if self.decoupled and self.pause_s >= self.policy.heartbeat_timeout_s:
      self._push(t + self.policy.heartbeat_timeout_s, _HB_EXPIRE, u, self.token[u])

  def _fail(self, k, t):
    u = self.owner[k]
    if u < 0 or not self.up[k]:
      return False  # thinning: the candidate hit a slice that is down or released
    self.failures += 1
    self.up[k] = False
    self.healthy[u] -= 1
    self._push(t + self.cfg.failures.repair_s, _REPAIR, k)
    if self.dp:
      if not self.in_job[k]:
        return False
      self.in_job[k] = False
      self.job_slices[u] -= 1
    else:
      self.job_slices[u] = self.healthy[u]
    if self.paused[u]:
      return False
    self._start_pause(u, t)
    return True

  def _repair(self, k, t):
    u = self.owner[k]
    if u < 0:
      return False
    self.up[k] = True
    self.healthy[u] += 1
    if self.dp:
      self.returned[u].append(k)
    if self.dp or self.paused[u] and not self.idle[u]:
      return False  # dp: idle until the next restart; paused: joins at the end of the pause
    self.idle[u] = False
    self._start_pause(u, t)
    return True

  def _pause_end(self, u, token, t):
    if token != self.token[u] or self.removed[u]:
      return False
    if self.dp:
      for k in self.returned[u]:
        self.in_job[k] = self.up[k]
      self.returned[u].clear()
    self.job_slices[u] = self.healthy[u]
    if self.healthy[u] == 0:
      self.idle[u] = True  # waits for a repair, which starts a new pause
      if self.decoupled and self.pause_s < self.policy.heartbeat_timeout_s:
        self._push(t - self.pause_s + self.policy.heartbeat_timeout_s, _HB_EXPIRE, u, token)
      return False
    self._set_stepping(u, True)
    return True

  def _hb_expire(self, u, token):
    if not self.paused[u] or token != self.token[u] or self.removed[u]:
      return False
    self.hb_dead[u] = True
    self.n_paused_alive -= 1
    return True

  def _schedule(self, delta, t):
    if delta > 0:
      for _ in range(delta):
        u = self._add_unit(self.learner_slices, paused=True)
        self._start_pause(u, t)  # loads the latest global fragments before its first step
    else:
      live = [u for u in range(len(self.removed)) if not self.removed[u]]
      for u in live[::-1][:-delta]:
        if not self.paused[u]:
          self._set_stepping(u, False)
        if not self.hb_dead[u]:
          self.n_paused_alive -= 1
        self.removed[u] = True
        self.token[u] += 1
        for k in self.slices_of[u]:
          self.owner[k] = -1
    self._reset_failures(t)
    return True

  # ---- rates ---------------------------------------------------------------------------------
  def _update_rates(self):
    S = self.S
    if not self.decoupled:
      self.sig = None
      self.rate = 0.0 if self.paused[0] else S * self.job_slices[0]
      self.prod_rate = self.merged_rate = self.rate
      return
    n_step = self.n_step
    stepping = sum(n_step)
    alive = stepping + self.n_paused_alive
    if not stepping or stepping < policy.required_quorum(self.cfg.sync.quorum, alive):
      self.sig = None
      self.rate = self.prod_rate = self.merged_rate = 0.0
      return
    sig = tuple(n_step)
    window = self.windows.get(sig)
    if window is None:
      window = self._sample(sig)
    eff, cov, mer = window.step_efficiency, window.coverage, window.merged_fraction
    rate = prod = merged = 0.0
    for c, speed in enumerate(self.classes):
      if n_step[c]:
        chips_eff = S * self.h_step[c] * eff[speed]
        prod += chips_eff
        rate += chips_eff * cov[speed]
        merged += chips_eff * mer[speed]
    self.sig, self.rate, self.prod_rate, self.merged_rate = sig, rate, prod, merged

  def _sample(self, sig):
    cfg = self.cfg
    speeds = [speed for c, speed in enumerate(self.classes) for _ in range(sig[c])]
    window = rounds.sample_window(
        speeds, sync=cfg.sync, config=self.policy, step_s=cfg.step_s,
        step_jitter=cfg.step_jitter, sync_s=cfg.sync_s, window_steps=cfg.window_steps,
        seed=hash((cfg.seed, sig)) & 0x7FFFFFFF)
    self.windows[sig] = window
    return window

  # ---- result --------------------------------------------------------------------------------
  def _result(self, end, wall_s) -> SimResult:
    stale_counts: dict[int, float] = {}
    rounds_n = admitted = grace = 0.0
    for sig, dt in self.sig_time.items():
      w = self.windows[sig]
      scale = dt / w.duration_s
      rounds_n += w.rounds * scale
      admitted += w.admitted * scale
      grace += w.grace_s * scale
      for s, c in w.staleness.items():
        stale_counts[s] = stale_counts.get(s, 0.0) + c * scale
    total = sum(stale_counts.values())
    hist = {s: c / total for s, c in sorted(stale_counts.items())} if total else {}
    cfg = self.cfg
    return SimResult(
        mode=cfg.mode, chips=cfg.chips, learners=cfg.learners, quorum=cfg.sync.quorum,
        grace=cfg.grace, days=cfg.days, seed=cfg.seed,
        goodput=self.useful / self.allocated if self.allocated else 0.0,
        uptime=self.uptime / end,
        merged_token_fraction=self.merged / self.produced if self.produced else 0.0,
        staleness_mean=sum(s * f for s, f in hist.items()),
        staleness_max=max(hist) if hist else 0,
        staleness_hist=hist,
        learners_per_round=admitted / rounds_n if rounds_n else 0.0,
        grace_mean_s=grace / rounds_n if rounds_n else 0.0,
        failures=self.failures, events=self.events, windows=len(self.windows),
        wall_s=wall_s)
