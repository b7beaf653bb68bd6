"""Runs the `parity` experiment and regenerates its results.json, plots and README.md.

    python -m experiments.parity.run [--outdir=runs/experiments/parity] [--only=decoupled]

See `config.py` for the setting and the expected outcome.
"""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import app, flags  # noqa: E402

from experiments import harness  # noqa: E402
from experiments.parity import config  # noqa: E402


def _is_dp(row: dict) -> bool:
  """Data-parallel at the full batch (the reference), of any length."""
  return row["method"].startswith("data-parallel") and "B=" not in row["method"]


def with_ratios(rows: list[dict]) -> list[dict]:
  """Adds each row's eval loss over data-parallel's of the same length (in steps) and seed,
  else the mean over that length's seeds."""
  by_length: dict[int, dict[int, float]] = {}
  for r in rows:
    if _is_dp(r):
      by_length.setdefault(r.get("steps", config.STEPS), {})[r["seed"]] = r["eval_loss"]
  for r in rows:
    dp = by_length.get(r.get("steps", config.STEPS), {})
    base = dp.get(r["seed"], sum(dp.values()) / len(dp) if dp else None)
    r["ratio_to_dp"] = round(r["eval_loss"] / base, 4) if base else None
  return rows


def length_section(rows: list[dict], folder: str) -> list[str]:
  """Data-parallel and the tuned Decoupled (seed 0) at each run length: a table and
  length.png (both eval losses and their ratio against steps)."""
  dp = {r["steps"]: r for r in rows if _is_dp(r) and r["seed"] == 0}
  dec = {r["steps"]: r for r in rows if r["seed"] == 0 and r["steps"] in dp
         and r["method"].removesuffix(f" {r['steps']} steps") in _tuned_methods(rows)}
  lengths = sorted(set(dp) & set(dec))
  if len(lengths) < 2:
    return []
  table = [{"steps": n, "tokens": dp[n]["tokens"], "data-parallel": dp[n]["eval_loss"],
            "decoupled": dec[n]["eval_loss"], "method": dec[n]["method"],
            "ratio_to_dp": dec[n]["ratio_to_dp"]} for n in lengths]
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
  left.plot(lengths, [dp[n]["eval_loss"] for n in lengths], "o-", label="data-parallel")
  left.plot(lengths, [dec[n]["eval_loss"] for n in lengths], "s-", label="Decoupled (tuned)")
  left.set_ylabel("final global eval loss")
  left.legend(fontsize=8)
  right.plot(lengths, [dec[n]["ratio_to_dp"] for n in lengths], "s-", color="tab:orange")
  right.axhline(1.02, color="tab:red", ls=":", lw=1, label="target 1.02")
  right.set_ylabel("Decoupled / data-parallel eval loss")
  right.legend(fontsize=8)
  for ax in (left, right):
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("steps (per learner; same tokens per step)")
  fig.tight_layout()
  fig.savefig(os.path.join(folder, "length.png"), dpi=120)
  plt.close(fig)
  return ["## Run length (seed 0)", "",
          harness.table(table, ("steps", "tokens", "data-parallel", "decoupled",
                                "ratio_to_dp", "method")), "",
          "![run length](length.png)", ""]


def _tuned_methods(rows: list[dict]) -> set[str]:
  """The Decoupled M = 4 method names of the tuned setting: the ones the longer runs use."""
  return {r["method"].removesuffix(f" {r['steps']} steps") for r in rows
          if r["steps"] != config.STEPS and r["method"].startswith("decoupled ")}


def sections(folder: str):
  """The outer-optimiser sweep as a table and a bar chart of every method (seed means)."""
  def write(rows: list[dict]) -> list[str]:
    sweep = [dict(r, setting=r["method"].removeprefix("decoupled "))
             for r in rows if r["method"].removeprefix("decoupled ") in dict(config.SWEEP)
             and r["seed"] == 0]
    # The presets' length only: the longer runs have their own plot (length.png).
    summary = harness.summarise([r for r in rows if r.get("steps", config.STEPS) == config.STEPS])
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(summary) + 1.2))
    ax.barh([s["method"] for s in summary], [s["eval_loss_mean"] for s in summary],
            xerr=[s["eval_loss_spread"] / 2 for s in summary], color="tab:blue")
    dp = [s["eval_loss_mean"] for s in summary if s["method"] == "data-parallel"]
    if dp:
      ax.axvline(dp[0], color="k", ls="--", lw=1, label="data-parallel")
      ax.axvline(dp[0] * 1.02, color="tab:red", ls=":", lw=1, label="data-parallel x 1.02")
      ax.legend(fontsize=7)
    low = min(s["eval_loss_mean"] for s in summary)
    ax.set_xlim(low * 0.95, max(s["eval_loss_mean"] for s in summary) * 1.02)
    ax.set_xlabel("final global eval loss (mean over seeds; bar = spread)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "methods.png"), dpi=120)
    plt.close(fig)
    return ["## Sweep of Decoupled settings (M = 4, seed 0), best first", "",
            harness.table(sorted(sweep, key=lambda r: r["eval_loss"]),
                          ("setting", "eval_loss", "ratio_to_dp", "mean_learners_per_round",
                           "bytes_up")), "",
            f"## Every method at {config.STEPS} steps", "", "![methods](methods.png)", "",
            *length_section(rows, folder)]
  return write


def define_flags():
  """The command line (defined only when run as a script, so tests can import this)."""
  harness.define_flags(config.NAME, os.path.dirname(os.path.abspath(__file__)))
  flags.DEFINE_enum("preset", "cpu", ["cpu", "tiny"], "cpu, or tiny for smoke runs.")
  flags.DEFINE_integer("steps", 0, "Override train.steps (smoke runs); 0 keeps them.")
  flags.DEFINE_string("only", "", "Run only the methods whose label contains this.")


def tuned(outdir: str, sweep: list[harness.Run]):
  """The SWEEP setting whose finished Decoupled run has the lowest final eval loss."""
  losses = {}
  for run in sweep:
    workdir = os.path.join(outdir, run.name)
    if run.method.startswith("decoupled ") and harness.finished(workdir):
      losses[run.method.removeprefix("decoupled ")] = harness.collect(run, workdir)["eval_loss"]
  return config.tuned_setting(losses)


def all_runs(outdir: str, preset: str, steps: int, only: str = "",
             execute: bool = True) -> tuple[list[harness.Run], float]:
  """Runs the sweep, then the baselines at the setting it picked; returns every run."""
  shrink = (lambda runs: config.shrink(runs, steps)) if steps else (lambda runs: runs)
  sweep = shrink(config.sweep(preset))
  wall = harness.run_all([r for r in sweep if only in r.method], outdir) if execute else 0.0
  setting = tuned(outdir, sweep)
  rest = shrink(config.with_tuned(setting, preset, outdir) + config.inner(setting, preset)
                + config.longer(setting, preset))
  if execute:
    wall += harness.run_all([r for r in rest if only in r.method], outdir)
  return sweep + rest, wall


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  runs, wall = all_runs(FLAGS.outdir, FLAGS.preset, FLAGS.steps, FLAGS.only,
                        execute=not FLAGS.report_only)
  os.makedirs(FLAGS.results_dir, exist_ok=True)
  results = harness.report(config.NAME, runs, FLAGS.outdir, FLAGS.results_dir,
                           columns=config.COLUMNS, wall_s=wall, derive=with_ratios,
                           sections=sections(FLAGS.results_dir), about=config.__doc__,
                           command="python -m experiments.parity.run")
  print(harness.table(results["rows"], config.COLUMNS))


if __name__ == "__main__":
  define_flags()
  app.run(main)
