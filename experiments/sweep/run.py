"""Runs the sweep's CPU points, renders its TPU points, regenerates results and README.

    python -m experiments.sweep.run [--only=size=tiny,method=decoupled] [--jobs=2]
        [--outdir=runs/experiments/sweep] [--report_only]

See `config.py` for the grid, its rules and the expected outcome.
"""

import os

from absl import app, flags

from experiments.sweep import collect, config, grid, launch, report

_ONLY = flags.DEFINE_string("only", "", "Run only these points: AXIS=VALUE,... (axes size, "
                            "method, M, K, H; OR within an axis, AND across; K=M for all).")
_OUTDIR = flags.DEFINE_string("outdir", "runs/experiments/sweep", "Where the runs are kept.")
_FOLDER = flags.DEFINE_string("results_dir", os.path.dirname(os.path.abspath(__file__)),
                              "Where results.json, the plots, README.md and launch/ go.")
_JOBS = flags.DEFINE_integer("jobs", 1, "Runs at a time (each is its own process).")
_STEPS = flags.DEFINE_integer("steps", 0, "Shorten every run to this many steps (0: the "
                              "size's own; for smoke tests).")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False,
                                 "Regenerate the report from the finished runs; run nothing.")
_IMAGE = flags.DEFINE_string("image", config.IMAGE, "Container image of the manifests.")
_BUCKET = flags.DEFINE_string("bucket", config.BUCKET, "gs:// prefix of the stores.")
_DATA_PATH = flags.DEFINE_string("data_path", config.DATA_PATH, "Pre-tokenised shards.")


def main(argv):
  del argv
  cpu = grid.expand(config.CPU_GRID, config.CPU_SIZES)
  tpu = grid.expand(config.TPU_GRID, config.TPU_SIZES)
  # --only picks what runs (a value on neither grid is an error); the report covers the grid.
  chosen = set(grid.select(cpu + tpu, grid.parse_only(_ONLY.value)))
  runs = [grid.run_of(p, steps=_STEPS.value or None) for p in cpu]
  todo = [r for p, r in zip(cpu, runs) if p in chosen]
  wall = 0.0 if _REPORT_ONLY.value else collect.run_all(todo, _OUTDIR.value, _JOBS.value)
  rendered = launch.render(tpu, os.path.join(_FOLDER.value, "launch"), image=_IMAGE.value,
                           bucket=_BUCKET.value, data_path=_DATA_PATH.value)
  results = report.report(cpu, runs, rendered, _OUTDIR.value, _FOLDER.value,
                          command="python -m experiments.sweep.run", wall_s=wall)
  print(report.summary_table(results["rows"]))
  print(f"{len(results['rows'])} of {len(cpu)} CPU points run, {len(rendered)} TPU points "
        f"rendered; see {os.path.join(_FOLDER.value, 'README.md')}")


if __name__ == "__main__":
  app.run(main)
