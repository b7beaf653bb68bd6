"""Runs the `stale` experiment and regenerates its results.json, eval.png and README.md.

    python -m experiments.stale.run [--preset=tiny] [--outdir=runs/experiments/stale]

See `config.py` for the setting and the expected outcome.
"""

import os

from absl import app, flags

from experiments import harness
from experiments.stale import config

_PRESET = flags.DEFINE_enum("preset", "cpu", ["cpu", "tiny"], "Model and run length.")
_OUTDIR = flags.DEFINE_string("outdir", "runs/experiments/stale", "Where the runs are kept.")
_FOLDER = flags.DEFINE_string("results_dir", os.path.dirname(os.path.abspath(__file__)),
                              "Where results.json, eval.png and README.md are written.")
_SEEDS = flags.DEFINE_integer("seeds", len(config.SEEDS), "Seeds per method.")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False,
                                 "Regenerate the report from the finished runs; run nothing.")


def main(argv):
  del argv
  runs = config.runs(_PRESET.value, seeds=range(_SEEDS.value))
  wall = 0.0 if _REPORT_ONLY.value else harness.run_all(runs, _OUTDIR.value)
  os.makedirs(_FOLDER.value, exist_ok=True)
  results = harness.report(config.NAME, runs, _OUTDIR.value, _FOLDER.value,
                           columns=config.COLUMNS, wall_s=wall,
                           command="python -m experiments.stale.run")
  print(harness.table(harness.summarise(results["rows"]),
                      ("method", "eval_loss_mean", "eval_loss_spread", "seeds")))


if __name__ == "__main__":
  app.run(main)
