"""Fits the simulator's failure costs to the paper's data-parallel baselines (docs/design.md 4).

    python -m experiments.goodput.calibrate [--days=30] [--seed=0]

Fits `restart_s`, `reconfig_s` and `repair_s` of `diloco.sim.FailureModel` (slice_chips = 256 and
MTBI = 1 year fixed) by least squares on goodput, using the closed form of `diloco.sim.analytic`,
to the ten Table 1 numbers for data-parallel and elastic data-parallel; then re-runs the ten
configurations in the event simulator with the fitted values and prints both residuals. The
fitted values are the defaults of `FailureModel`; update them there if this script changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from absl import app, flags
from scipy import optimize

from diloco.sim import analytic, engine, params

CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
# Table 1 of Douillard et al. (2026) as quoted in docs/design.md 4: goodput in percent.
PAPER = {"dp": (72, 57, 38, 27, 18), "elastic": (88, 80, 69, 58, 40)}
FITTED = ("restart_s", "reconfig_s", "repair_s")

FLAGS = flags.FLAGS
FLAGS = flags.FLAGS


def fit(base: params.FailureModel | None = None) -> params.FailureModel:
  """Least-squares fit of the three failure costs to the ten paper numbers."""
  base = base or params.FailureModel()
  target = np.array(PAPER["dp"] + PAPER["elastic"]) / 100.0

  def residuals(x):
    fm = dataclasses.replace(base, **dict(zip(FITTED, np.abs(x))))
    pred = [analytic.goodput(mode, c, fm) for mode in ("dp", "elastic") for c in CHIPS]
    return np.array(pred) - target

  x0 = [getattr(base, name) for name in FITTED]
  sol = optimize.least_squares(residuals, x0, x_scale=x0)
  return dataclasses.replace(base, **dict(zip(FITTED, np.abs(sol.x))))


def main(argv: Sequence[str]) -> None:
  del argv
  fm = fit()
  print(f"Fitted failure model (MTBI_chip = {fm.mtbi_years:g} year, "
        f"slice = {fm.slice_chips} chips):")
  print(f"  restart_s  = {fm.restart_s:8.1f}  data-parallel restart (+ lost work) per failure")
  print(f"  reconfig_s = {fm.reconfig_s:8.2f}  elastic pause per slice loss or return")
  print(f"  repair_s   = {fm.repair_s:8.0f}  slice out of service ({fm.repair_s / 3600:.2f} h)")
  print()
  print("| mode | chips | paper % | closed form % | resid | simulated % | resid |")
  print("|---|---|---|---|---|---|---|")
  sq_a, sq_s = [], []
  for mode in ("dp", "elastic"):
    for chips, paper in zip(CHIPS, PAPER[mode]):
      pred = 100 * analytic.goodput(mode, chips, fm)
      cfg = params.SimConfig(mode=mode, chips=chips, learners=1, days=FLAGS.days,
                             seed=FLAGS.seed, failures=fm)
      sim = 100 * engine.simulate(cfg).goodput
      sq_a.append((pred - paper) ** 2)
      sq_s.append((sim - paper) ** 2)
      print(f"| {mode} | {chips:,} | {paper} | {pred:.1f} | {pred - paper:+.1f} | {sim:.1f} "
            f"| {sim - paper:+.1f} |")
  print()
  print(f"RMS residual: closed form {np.sqrt(np.mean(sq_a)):.2f} points, "
        f"simulated {np.sqrt(np.mean(sq_s)):.2f} points")


def define_flags() -> None:
  """The command line (defined only when run as a script, so tests can import this)."""
  flags.DEFINE_float("days", 30.0, "Simulated days of the check runs.")
  flags.DEFINE_integer("seed", 0, "Seed of the check runs.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
