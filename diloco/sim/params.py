"""Settings of the goodput simulator: the failure model (fitted) and one run's configuration."""

from __future__ import annotations

import dataclasses

from diloco.errors import ConfigError
from diloco.settings import check_fields, frozen, require
from diloco.sync import policy
from diloco.sync.policy import SyncConfig

YEAR_S = 365.0 * 86400.0
DAY_S = 86400.0
MODES = ("dp", "elastic", "decoupled")


def _require(ok: bool, owner: str, field: str, value: object, allowed: str) -> None:
  if not ok:
    raise ConfigError(f"{owner}.{field} = {value!r}; allowed: {allowed}")


@frozen
class FailureModel:
  """Failure costs. Defaults: fitted once by `experiments/goodput/calibrate.py` (docs/design.md 4).

  Attributes:
    mtbi_years: mean time between interruptions of one chip, in years.
    slice_chips: chips per slice, the failure domain: one failed chip takes its whole slice
      out until it is repaired. Not fitted: only `slice_chips * repair_s` enters the mean, so it
      is fixed at a TPU-pod-slice-like 256 and `repair_s` is fitted.
    restart_s: stop time of plain data-parallel after a failure: detect, reschedule on the
      healthy slices, restore the checkpoint, recompile, plus on average the work lost since
      the last checkpoint (the two are not separately identifiable from the data).
    reconfig_s: pause of an elastic job (and of one Decoupled learner) to drop a failed slice or
      to take back a repaired one (re-shard, recompile, rebuild collectives).
    repair_s: time a failed slice stays out before it is usable again.
  """
  mtbi_years: float = 1.0
  slice_chips: int = 256
  restart_s: float = 72.7
  reconfig_s: float = 9.37
  repair_s: float = 7374.0

  def __post_init__(self):
    own = "FailureModel"
    _require(self.mtbi_years > 0, own, "mtbi_years", self.mtbi_years, "a number > 0 (inf: none)")
    _require(self.slice_chips >= 1, own, "slice_chips", self.slice_chips, "an integer >= 1")
    _require(self.restart_s >= 0, own, "restart_s", self.restart_s, "a number >= 0")
    _require(self.reconfig_s >= 0, own, "reconfig_s", self.reconfig_s, "a number >= 0")
    _require(self.repair_s >= 0, own, "repair_s", self.repair_s, "a number >= 0")

  @property
  def slice_rate(self) -> float:
    """Failures per second of one healthy slice."""
    return self.slice_chips / (self.mtbi_years * YEAR_S)


@frozen
class SimConfig:
  """One simulated run.

  Attributes:
    mode: "dp" (plain data-parallel), "elastic" (elastic data-parallel) or "decoupled".
    chips: chips allocated at the start (rounded to whole slices).
    learners: M, Decoupled learners, each an elastic job of chips / M (1 for dp and elastic).
    days: simulated wall time.
    seed: seeds failures, step jitter and sampled rounds.
    sync: the run's `sync` group, checked by its own rules: the policy the syncer runs
      (quorum K, gamma, tau, heartbeat timeout, staleness bound) and the schedule, P =
      `num_fragments` fragments, fragment p due every H = `period` steps at offset p * H // P.
      The simulator models the "overwrite" receipt with `block_on_late_round`; it does not
      read the group's other fields (scheme, moments, send queue, shards).
    grace: use the adaptive grace window (`sync.gamma`) or not (gamma = 0): the simulator's
      switch to compare a policy with and without it (the group has no such switch).
    speeds: per-learner step-time factors (cycled if shorter than the number of learners).
    step_jitter: per-step variation; a step takes `step_s * factor * U(1 - j, 1 + j)`.
    step_s: nominal inner-step time in seconds.
    sync_s: time for the syncer to pull, merge and publish one fragment.
    window_steps: inner steps per sampled round window (see `diloco.sim.rounds`).
    schedule: `(day, delta)` pairs: add (delta > 0) or remove (< 0) learners of chips / M each.
    failures: the failure model.
  """
  mode: str = "decoupled"
  chips: int = 1_200_000
  learners: int = 8
  days: float = 30.0
  seed: int = 0
  sync: SyncConfig = SyncConfig()
  grace: bool = True
  speeds: tuple[float, ...] = ()
  step_jitter: float = 0.0
  step_s: float = 1.0
  sync_s: float = 0.3
  window_steps: int = 192
  schedule: tuple[tuple[float, int], ...] = ()
  failures: FailureModel = dataclasses.field(default_factory=FailureModel)

  def __post_init__(self):
    own = "SimConfig"
    _require(self.mode in MODES, own, "mode", self.mode, " | ".join(MODES))
    _require(self.chips >= 1, own, "chips", self.chips, "an integer >= 1")
    _require(self.learners >= 1, own, "learners", self.learners, "an integer >= 1")
    _require(self.mode == "decoupled" or self.learners == 1, own, "learners", self.learners,
             "1 unless mode is decoupled")
    _require(self.days > 0, own, "days", self.days, "a number > 0")
    check_fields("sync", self.sync)
    self.sync.check()
    require(self.sync.block_on_late_round, "sync.block_on_late_round",
            "the simulator models learners that wait for a late round, got False")
    _require(all(s > 0 for s in self.speeds), own, "speeds", self.speeds, "factors > 0")
    _require(0 <= self.step_jitter < 1, own, "step_jitter", self.step_jitter, "[0, 1)")
    _require(self.step_s > 0, own, "step_s", self.step_s, "a number > 0")
    _require(self.sync_s >= 0, own, "sync_s", self.sync_s, "a number >= 0")
    _require(self.window_steps >= 4 * self.sync.period, own, "window_steps", self.window_steps,
             f">= 4 * sync.period = {4 * self.sync.period}")
    _require(self.mode == "decoupled" or not self.schedule, own, "schedule", self.schedule,
             "empty unless mode is decoupled")
    _require(all(day >= 0 and delta != 0 for day, delta in self.schedule), own, "schedule",
             self.schedule, "(day >= 0, delta != 0) pairs")

  def policy_config(self) -> policy.PolicyConfig:
    """The syncer policy this run drives (gamma = 0 when the grace window is off)."""
    return policy.PolicyConfig.from_config(self.sync, gamma=self.sync.gamma if self.grace else 0.0)

  def speed_of(self, learner: int) -> float:
    """The step-time factor of a learner (1 when no speeds are given)."""
    return self.speeds[learner % len(self.speeds)] if self.speeds else 1.0
