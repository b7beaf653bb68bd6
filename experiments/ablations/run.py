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


def use_compilation_cache(directory: str) -> None:
  """One persistent JAX compilation cache for every run (as `tests/conftest.py` does): most
  runs compile the same model on the same meshes, and on this CPU compiling takes longer than
  training. Numbers do not change: an executable is keyed by its program, options and devices."""
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.abspath(directory))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


def main(argv):
  del argv
  runs = config.runs(seeds=range(_SEEDS.value))
  wall = 0.0
  if not _REPORT_ONLY.value:
    use_compilation_cache(os.path.join(_OUTDIR.value, "jax_cache"))
    wall = harness.run_all(runs[:1], _OUTDIR.value)  # alone: it fills the cache for the rest
    wall += run_parallel(runs[1:], _OUTDIR.value, _JOBS.value)
  results = write_report(runs, _OUTDIR.value, _FOLDER.value, wall)
  print(harness.table(harness.summarise(results["rows"]),
                      ("method", "eval_loss_mean", "eval_loss_spread", "seeds")))


if __name__ == "__main__":
  app.run(main)
