"""Closed-form mean goodput of the failure model (used by calibration and as a cross-check).

Steady-state renewal arguments for the semantics in `diloco.sim.engine`, with r the failure
rate of one healthy slice and n slices:

- elastic: a slice is out for `repair_s` after each failure, so a fraction
  `c = repair_s / (1 / r + repair_s)` of the chips is down. Failures and repairs each arrive at
  about `r * n * (1 - c)`; each pauses the job for `reconfig_s`, and events during a pause are
  absorbed, so it runs `1 / (1 + 2 r n (1 - c) reconfig_s)` of the time.
- dp: a failure of a slice in the job stops it for `restart_s` (absorbing further failures), so it
  runs `1 / (1 + lambda restart_s)` of the time with `lambda = r n (1 - c)`; a repaired slice waits
  idle for the next re-formation, on average `w = u (1 / lambda + R) + (1 - u) R / 2` with `u` the
  running fraction, so `c = (repair_s + w) / (1 / r + repair_s + w)` (solved by iteration).
- decoupled (K = 1, equal speeds, no syncer waits): M elastic jobs of n / M slices.
"""

from __future__ import annotations

from diloco.sim import params as params_lib


def _slices(chips: int, fm: params_lib.FailureModel) -> float:
  return max(1.0, round(chips / fm.slice_chips))


def elastic_goodput(chips: int, fm: params_lib.FailureModel, learners: int = 1) -> float:
  """Mean goodput of `learners` independent elastic jobs sharing `chips` equally."""
  r = fm.slice_rate
  n = _slices(chips, fm) / learners
  down = fm.repair_s / (1.0 / r + fm.repair_s)
  return (1.0 - down) / (1.0 + 2.0 * r * n * (1.0 - down) * fm.reconfig_s)


def dp_goodput(chips: int, fm: params_lib.FailureModel) -> float:
  """Mean goodput of plain data-parallel with restarts."""
  r, R = fm.slice_rate, fm.restart_s
  n = _slices(chips, fm)
  out = fm.repair_s / (1.0 / r + fm.repair_s)
  for _ in range(50):
    lam = r * n * (1.0 - out)
    running = 1.0 / (1.0 + lam * R)
    wait = running * (1.0 / lam + R) + (1.0 - running) * R / 2.0
    out = (fm.repair_s + wait) / (1.0 / r + fm.repair_s + wait)
  lam = r * n * (1.0 - out)
  return (1.0 - out) / (1.0 + lam * R)


def goodput(mode: str, chips: int, fm: params_lib.FailureModel, learners: int = 1) -> float:
  """Mean goodput of `mode` ("dp", "elastic" or "decoupled") under the failure model."""
  if mode == "dp":
    return dp_goodput(chips, fm)
  return elastic_goodput(chips, fm, learners if mode == "decoupled" else 1)
