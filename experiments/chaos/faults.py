"""A kill schedule for the multi-process launcher drawn from the simulator's failure process.

`diloco.sim` fails every healthy slice as a Poisson process at `FailureModel.slice_rate`; a
failure takes its learner out until the slice is repaired (`repair_s`) and the learner has
reconfigured (`reconfig_s`), and failures that hit a learner already down are absorbed
(thinning). Here each learner is `slices` slices and a failure is a real SIGKILL of its process.

A minute-long run would see no failure at the fitted rates (one per slice every ~4 years of
chip-time), so time is compressed by one factor `scale` (simulated seconds per real second),
chosen so that `expected` kills land on average in the window. Every duration of the model is
compressed by the same factor, so the downtime of a failure (`downtime_s`) keeps its ratio to
the gap between failures; the launcher then restarts the killed process after that downtime
(`launch.restart_backoff_s`). The real restart (re-importing JAX and recompiling, `restart_s`)
takes far longer than the compressed reconfiguration; the simulator absorbs failures of a
learner that is pausing, so the draw does too: a learner is immune for its downtime plus the
restart. (The launcher would otherwise kill a process that is still compiling.)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from diloco.distributed import chaos
from diloco.sim.params import FailureModel


@dataclasses.dataclass(frozen=True)
class Compressed:
  """The failure process of `learners` learners of `slices` slices each, in real seconds."""
  model: FailureModel
  learners: int
  slices: int
  scale: float  # simulated seconds per real second

  @property
  def rate(self) -> float:
    """Failures per real second of one healthy learner."""
    return self.slices * self.model.slice_rate * self.scale

  @property
  def downtime_s(self) -> float:
    """Real seconds a failed learner stays out: its slice's repair, then a reconfiguration."""
    return (self.model.repair_s + self.model.reconfig_s) / self.scale

  def expected_kills(self, window_s: float, restart_s: float = 0.0) -> float:
    """Closed-form mean count in `window_s`, failures while a learner is out absorbed.

    Per learner the failures form a renewal process with mean cycle 1 / rate + downtime +
    restart (non-paralysable dead time); over a window long against the cycle the count is
    window / cycle, exact without dead time (Poisson)."""
    return self.learners * window_s / (1.0 / self.rate + self.downtime_s + restart_s)


def compress(model: FailureModel, *, learners: int, window_s: float, expected: float,
             slices: int = 1) -> Compressed:
  """The time compression that puts `expected` failures (before thinning) in `window_s`."""
  if learners < 1 or slices < 1 or window_s <= 0 or expected <= 0:
    raise ValueError("learners, slices, window_s and expected must be positive")
  scale = expected / (learners * slices * model.slice_rate * window_s)
  return Compressed(model, learners, slices, scale)


def draw(process: Compressed, *, start_s: float, end_s: float, seed: int,
         restart_s: float = 0.0) -> list[chaos.Event]:
  """Kills of named learners in [start_s, end_s], sorted; the same for the same seed.

  Each learner gets its own exponential gaps (the superposition of its slices' Poisson
  processes) and is immune for `downtime_s + restart_s` after a kill."""
  rng = np.random.default_rng([seed, 1299709])
  events = []
  for m in range(process.learners):
    t = start_s
    while True:
      t += rng.exponential(1.0 / process.rate)
      if t > end_s:
        break
      events.append(chaos.Event(round(float(t), 2), "kill", m))
      t += process.downtime_s + restart_s
  return sorted(events)


def render(events: list[chaos.Event]) -> str:
  """The `launch.chaos` string of `events` (parsed back by `chaos.parse`)."""
  return ";".join(str(e) for e in events)
