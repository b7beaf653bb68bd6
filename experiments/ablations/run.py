"""Runs the `ablations` experiment and regenerates its results.json, plots and README.md.

    python -m experiments.ablations.run [--jobs=3] [--outdir=runs/experiments/ablations]

See `config.py` for the setting and the expected outcome. Runs are independent processes on
the virtual clock, so `--jobs` of them may share the machine without changing any number.
"""

import functools
import os
import threading

from absl import app, flags

from experiments import harness
from experiments.ablations import config, figures

_OUTDIR = flags.DEFINE_string("outdir", "runs/experiments/ablations", "Where the runs are kept.")
_FOLDER = flags.DEFINE_string("results_dir", os.path.dirname(os.path.abspath(__file__)),
                              "Where results.json, the plots and README.md are written.")
_SEEDS = flags.DEFINE_integer("seeds", len(config.SEEDS), "Seeds per method.")
_JOBS = flags.DEFINE_integer("jobs", 3, "Runs at a time.")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False,
                                 "Regenerate the report from the finished runs; run nothing.")


def run_parallel(runs: list[harness.Run], outdir: str, jobs: int) -> float:
  """`harness.run_all` over `jobs` interleaved shares of `runs` at once; the longest's wall
  seconds. A failed run stops its own share and is raised once the others are done."""
  shares = [runs[i::jobs] for i in range(max(jobs, 1))]
  walls, errors = [0.0] * len(shares), []

  def work(i):
    try:
      walls[i] = harness.run_all(shares[i], outdir)
    except RuntimeError as e:
      errors.append(e)

  threads = [threading.Thread(target=work, args=(i,)) for i in range(len(shares))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if errors:
    raise errors[0]
  return max(walls)


def write_report(runs, outdir: str, folder: str, wall_s: float) -> dict:
  os.makedirs(folder, exist_ok=True)
  return harness.report(config.NAME, runs, outdir, folder, columns=config.COLUMNS,
                        wall_s=wall_s, command="python -m experiments.ablations.run",
                        sections=functools.partial(figures.factor_sections, folder=folder))


def main(argv):
  del argv
  runs = config.runs(seeds=range(_SEEDS.value))
  wall = 0.0 if _REPORT_ONLY.value else run_parallel(runs, _OUTDIR.value, _JOBS.value)
  results = write_report(runs, _OUTDIR.value, _FOLDER.value, wall)
  print(harness.table(harness.summarise(results["rows"]),
                      ("method", "eval_loss_mean", "eval_loss_spread", "seeds")))


if __name__ == "__main__":
  app.run(main)
