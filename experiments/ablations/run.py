"""Runs the `ablations` experiment and regenerates its results.json, plots and README.md.

    python -m experiments.ablations.run [--jobs=3] [--outdir=runs/experiments/ablations]

See `config.py` for the setting and the expected outcome. Runs are independent processes on
the virtual clock, so `--jobs` of them may share the machine without changing any number.
"""

import functools
import os

from absl import app, flags

from experiments import harness
from experiments.ablations import config, figures


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
  FLAGS = flags.FLAGS
  runs = config.runs(seeds=range(FLAGS.seeds))
  wall = 0.0
  if not FLAGS.report_only:
    use_compilation_cache(os.path.join(FLAGS.outdir, "jax_cache"))
    wall = harness.run_all(runs[:1], FLAGS.outdir)  # alone: it fills the cache for the rest
    wall += harness.run_all(runs[1:], FLAGS.outdir, jobs=FLAGS.jobs)
  results = write_report(runs, FLAGS.outdir, FLAGS.results_dir, wall)
  print(harness.table(harness.summarise(results["rows"]),
                      ("method", "eval_loss_mean", "eval_loss_spread", "seeds")))


def define_flags():
  """The command line (defined only when run as a script, so tests can import this)."""
  harness.define_flags(config.NAME, os.path.dirname(os.path.abspath(__file__)),
                       seeds=len(config.SEEDS), jobs=3)


if __name__ == "__main__":
  define_flags()
  app.run(main)
