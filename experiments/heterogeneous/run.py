"""Runs the `heterogeneous` experiment and regenerates its results.json, plots and README.md.

    python -m experiments.heterogeneous.run [--seeds=3] [--steps=128] [--jobs=2]

See `config.py` for the setting and the expected outcome.
"""

import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import app, flags  # noqa: E402

from experiments import harness  # noqa: E402
from experiments.heterogeneous import config  # noqa: E402


def sections(folder: str):
  """Goodput against eval loss, one point per run, coloured by policy."""
  def write(rows: list[dict]) -> list[str]:
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for method in methods:
      policy = next(i for i, (p, _, _) in enumerate(config.POLICIES)
                    if method.startswith(f"{p}, "))
      marker = ("v" if "rebase" in method else "^" if "keep_local" in method
                else "os"[config.OUTERS[1][0] in method])
      group = [r for r in rows if r["method"] == method]
      hollow = method.endswith(config.INNERS[1][0])  # the higher inner rate: open markers
      ax.scatter([r["goodput"] for r in group], [r["eval_loss"] for r in group],
                 edgecolors=f"C{policy}", facecolors="none" if hollow else f"C{policy}",
                 marker=marker, label=method)
    ax.set_xlabel("goodput (useful / allocated device time)")
    ax.set_ylabel("final global eval loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "goodput_vs_loss.png"), dpi=120)
    plt.close(fig)
    for r in rows:  # step time that never reached G, by what became of it
      steps = r.get("step_device_s") or 0.0
      r["dropped_fraction"] = r.get("dropped_step_device_s", 0.0) / steps if steps else math.nan
      r["rejected_fraction"] = r.get("rejected_step_device_s", 0.0) / steps if steps else math.nan
    means = harness.summarise(rows, "goodput")
    paper = {m["method"]: m for m in harness.summarise(rows, "compute_goodput")}
    dropped = {m["method"]: m for m in harness.summarise(rows, "dropped_fraction")}
    rejected = {m["method"]: m for m in harness.summarise(rows, "rejected_fraction")}
    for m in means:
      m["compute_goodput_mean"] = paper[m["method"]]["compute_goodput_mean"]
      m["dropped_fraction_mean"] = dropped[m["method"]]["dropped_fraction_mean"]
      m["rejected_fraction_mean"] = rejected[m["method"]]["rejected_fraction_mean"]
    return ["## Goodput over seeds (ours: work that reached G; the paper's: time computing)", "",
            "`dropped`: the share of step time whose progress no delivery carried (overwritten "
            "on receipt); `rejected`: carried only by rejected (e.g. stale) deliveries.", "",
            harness.table(means, ("method", "goodput_mean", "goodput_spread",
                                  "compute_goodput_mean", "dropped_fraction_mean",
                                  "rejected_fraction_mean", "seeds")),
            "", "![goodput against eval loss](goodput_vs_loss.png)", ""]
  return write


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  runs = config.runs(range(FLAGS.seeds), FLAGS.steps)
  wall = 0.0 if FLAGS.report_only else harness.run_all(runs, FLAGS.outdir, jobs=FLAGS.jobs)
  os.makedirs(FLAGS.results_dir, exist_ok=True)
  results = harness.report(config.NAME, runs, FLAGS.outdir, FLAGS.results_dir,
                           columns=config.COLUMNS, wall_s=wall,
                           sections=sections(FLAGS.results_dir), about=config.__doc__,
                           plot=dict(time_key="time", time_label="virtual seconds"),
                           command="python -m experiments.heterogeneous.run")
  print(harness.table(harness.summarise(results["rows"]),
                      ("method", "eval_loss_mean", "eval_loss_spread", "seeds")))


def define_flags():
  """The command line (defined only when run as a script, so tests can import this)."""
  harness.define_flags(config.NAME, os.path.dirname(os.path.abspath(__file__)),
                       seeds=len(config.SEEDS), steps=config.STEPS, jobs=1)


if __name__ == "__main__":
  define_flags()
  app.run(main)
