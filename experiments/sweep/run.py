"""Runs the sweep's CPU points, renders its TPU points, regenerates results and README.

    python -m experiments.sweep.run [--only=size=tiny,method=decoupled] [--jobs=2]
        [--outdir=runs/experiments/sweep] [--report_only]

See `config.py` for the grid, its rules and the expected outcome.
"""

import os

from absl import app, flags

from experiments import harness
from experiments.sweep import config, grid, launch, report


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  cpu = grid.expand(config.CPU_GRID, config.CPU_SIZES)
  tpu = grid.expand(config.TPU_GRID, config.TPU_SIZES)
  # --only picks what runs (a value on neither grid is an error); the report covers the grid.
  chosen = set(grid.select(cpu + tpu, grid.parse_only(FLAGS.only)))
  runs = [grid.run_of(p, steps=FLAGS.steps or None) for p in cpu]
  todo = [r for p, r in zip(cpu, runs) if p in chosen]
  wall = 0.0 if FLAGS.report_only else harness.run_all(todo, FLAGS.outdir, jobs=FLAGS.jobs)
  rendered = launch.render(tpu, os.path.join(FLAGS.results_dir, "launch"), image=FLAGS.image,
                           bucket=FLAGS.bucket, data_path=FLAGS.data_path)
  results = report.report(cpu, runs, rendered, FLAGS.outdir, FLAGS.results_dir,
                          command="python -m experiments.sweep.run", wall_s=wall)
  print(report.summary_table(results["rows"]))
  print(f"{len(results['rows'])} of {len(cpu)} CPU points run, {len(rendered)} TPU points "
        f"rendered; see {os.path.join(FLAGS.results_dir, 'README.md')}")


def define_flags():
  """The command line (defined only when run as a script, so tests can import this)."""
  harness.define_flags(config.NAME, os.path.dirname(os.path.abspath(__file__)), jobs=1)
  flags.DEFINE_string("only", "", "Run only these points: AXIS=VALUE,... (axes size, method, "
                      "M, K, H; OR within an axis, AND across; K=M for all).")
  flags.DEFINE_integer("steps", 0, "Shorten every run to this many steps (0: the size's own; "
                       "for smoke tests).")
  flags.DEFINE_string("image", config.IMAGE, "Container image of the manifests.")
  flags.DEFINE_string("bucket", config.BUCKET, "gs:// prefix of the stores.")
  flags.DEFINE_string("data_path", config.DATA_PATH, "Pre-tokenised shards.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
