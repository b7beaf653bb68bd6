"""Runs the `scavenging` experiment and regenerates its results.json, plots and README.md.

    python -m experiments.scavenging.run [--seeds=3] [--steps=128]

See `config.py` for the setting and the expected outcome.
"""

import os

from absl import app, flags

from experiments import harness
from experiments.scavenging import config


def time_to_loss(curve: list[dict], target: float) -> float | None:
  """Run-clock time at which the eval curve first reaches `target` (linear interpolation
  between evaluations); None if it never does."""
  for before, after in zip(curve, curve[1:]):
    if after["eval_loss"] <= target:
      if before["eval_loss"] <= target:
        return before["time"]
      frac = (before["eval_loss"] - target) / (before["eval_loss"] - after["eval_loss"])
      return before["time"] + frac * (after["time"] - before["time"])
  return None


def with_time_to_target(outdir: str, runs):
  """Adds each row's time to the fixed-M=2 run's final loss (same seed) and the speedup."""
  names = {(r.method, r.seed): r.name for r in runs}

  def derive(rows: list[dict]) -> list[dict]:
    for r in rows:
      base = next((b for b in rows if b["method"] == "fixed M=2" and b["seed"] == r["seed"]),
                  None)
      curve = harness.eval_curve(os.path.join(outdir, names[r["method"], r["seed"]]))
      reached = time_to_loss(curve, base["eval_loss"]) if base else None
      r["time_to_target_s"] = round(reached, 1) if reached is not None else None
      base_curve = harness.eval_curve(os.path.join(
          outdir, names["fixed M=2", r["seed"]])) if base else []
      r["speedup"] = (round(base_curve[-1]["time"] / reached, 3)
                      if reached and base_curve else None)
    return rows
  return derive


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  runs = config.runs(range(FLAGS.seeds), FLAGS.steps)
  wall = 0.0 if FLAGS.report_only else harness.run_all(runs, FLAGS.outdir)
  os.makedirs(FLAGS.results_dir, exist_ok=True)
  results = harness.report(config.NAME, runs, FLAGS.outdir, FLAGS.results_dir,
                           columns=config.COLUMNS, wall_s=wall,
                           derive=with_time_to_target(FLAGS.outdir, runs),
                           about=config.__doc__,
                           plot=dict(time_key="time", time_label="virtual seconds"),
                           command="python -m experiments.scavenging.run")
  print(harness.table(results["rows"], config.COLUMNS))


def define_flags():
  """The command line (defined only when run as a script, so tests can import this)."""
  harness.define_flags(config.NAME, os.path.dirname(os.path.abspath(__file__)),
                       seeds=len(config.SEEDS), steps=config.STEPS)


if __name__ == "__main__":
  define_flags()
  app.run(main)
