"""Runs the `stale` experiment and regenerates its results.json, eval.png and README.md.

    python -m experiments.stale.run [--preset=tiny] [--outdir=runs/experiments/stale]

See `config.py` for the setting and the expected outcome.
"""

import os

from absl import app, flags

from experiments import harness
from experiments.stale import config


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  runs = config.runs(FLAGS.preset, seeds=range(FLAGS.seeds))
  # Runs measured before (in results.json) whose folders are not here are carried, not rerun.
  carried = harness.carried_rows(runs, FLAGS.outdir, FLAGS.results_dir)
  todo = [r for r in runs if (r.method, r.seed) not in carried]
  wall = 0.0 if FLAGS.report_only else harness.run_all(todo, FLAGS.outdir)
  os.makedirs(FLAGS.results_dir, exist_ok=True)
  results = harness.report(config.NAME, runs, FLAGS.outdir, FLAGS.results_dir,
                           columns=config.COLUMNS, wall_s=wall, carry=True,
                           command="python -m experiments.stale.run")
  print(harness.table(harness.summarise(results["rows"]),
                      ("method", "eval_loss_mean", "eval_loss_spread", "seeds")))


def define_flags():
  """The command line (defined only when run as a script, so tests can import this)."""
  harness.define_flags(config.NAME, os.path.dirname(os.path.abspath(__file__)),
                       seeds=len(config.SEEDS))
  flags.DEFINE_enum("preset", "cpu", ["cpu", "tiny"], "Model and run length.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
