"""Runs the `chaos` experiment and regenerates its results.json, plots and README.md.

    python -m experiments.chaos.run [--preset=smoke] [--seeds=N] [--outdir=runs/experiments/chaos]

See `config.py` for the setting and the expected outcome.
"""

import json
import os
import shutil

import matplotlib.pyplot as plt  # noqa: E402  (harness selected the Agg backend)
from absl import app, flags

from diloco.distributed import chaos
from diloco.observe.accounting import read_jsonl
from experiments import harness
from experiments.chaos import config


def outages(workdir: str) -> list[tuple[int, float, float]]:
  """(learner, killed at, stepping again at) of every applied kill, on the run's clock.

  A learner is out from the kill until its next step: the downtime, the restart and the
  recompilation together (the launcher's own "down" span ends when the process starts)."""
  applied = json.load(open(os.path.join(workdir, "chaos.json"), encoding="utf-8"))
  steps = [r for r in read_jsonl(os.path.join(workdir, "activity.jsonl")) if r["kind"] == "step"]
  out = []
  for event in applied:
    if not event["applied"] or not event["event"].startswith("kill:"):
      continue
    learner = int(event["target"].removeprefix("learner"))
    later = [r["start"] for r in steps if r["learner"] == learner and r["start"] > event["at"]]
    out.append((learner, event["at"], min(later, default=event["at"])))
  return out


def figures(run: harness.Run, workdir: str) -> dict:
  """Fault counts, and round and step rates while some learner is out vs while none is."""
  acc = json.load(open(os.path.join(workdir, "accounting.json"), encoding="utf-8"))
  overrides = dict(run.overrides)
  tape = read_jsonl(os.path.join(workdir, "tape.jsonl"))
  steps = [r for r in read_jsonl(os.path.join(workdir, "activity.jsonl")) if r["kind"] == "step"]
  out_spans = [(a, b) for _, a, b in outages(workdir)]
  lo, hi = min(r["start"] for r in steps), max(r["end"] for r in steps)
  grid = [lo + (hi - lo) * i / 2000 for i in range(2001)]
  down = [any(a <= t < b for a, b in out_spans) for t in grid]
  dt = (hi - lo) / 2000
  down_s = dt * sum(down[:-1])
  up_s = (hi - lo) - down_s

  def is_down(t):
    return any(a <= t < b for a, b in out_spans)

  rounds_down = sum(1 for r in tape if lo <= r["published_at"] <= hi and is_down(r["published_at"]))
  rounds_up = sum(1 for r in tape if lo <= r["published_at"] <= hi) - rounds_down
  steps_down = sum(1 for r in steps if is_down(r["end"]))
  return {
      "kills": len(chaos.parse(overrides.get("launch.chaos", ""))),
      "kills_applied": int(acc.get("chaos/applied", 0)),
      "restarts": int(acc.get("restarts", 0)),
      "down_fraction": float(acc.get("accounting/down_fraction", 0.0)),
      "outage_s": round(down_s, 1),
      "rounds_per_s_all_up": round(rounds_up / up_s, 3) if up_s > 0 else None,
      "rounds_per_s_some_out": round(rounds_down / down_s, 3) if down_s > 0 else None,
      "steps_per_s_all_up": round((len(steps) - steps_down) / up_s, 3) if up_s > 0 else None,
      "steps_per_s_some_out": round(steps_down / down_s, 3) if down_s > 0 else None,
  }


def plot_progress(runs: list[harness.Run], outdir: str, path: str) -> None:
  """Learner steps (all learners) and merged rounds against the run clock, kills marked."""
  fig, (by_steps, by_rounds) = plt.subplots(1, 2, figsize=(12, 4))
  for i, run in enumerate(runs):
    workdir = os.path.join(outdir, run.name)
    steps = sorted(r["end"] for r in read_jsonl(os.path.join(workdir, "activity.jsonl"))
                   if r["kind"] == "step")
    rounds = sorted(r["published_at"] for r in read_jsonl(os.path.join(workdir, "tape.jsonl")))
    t0 = steps[0]
    color = f"C{i}"
    by_steps.plot([t - t0 for t in steps], range(1, len(steps) + 1), color=color, label=run.name)
    by_rounds.plot([t - t0 for t in rounds], range(1, len(rounds) + 1), color=color)
    for _, at, back in outages(workdir):
      for ax in (by_steps, by_rounds):
        ax.axvline(at - t0, color=color, ls="--", lw=0.8)
        ax.axvspan(at - t0, back - t0, color=color, alpha=0.06)
  by_steps.set_ylabel("learner steps (all learners)")
  by_rounds.set_ylabel("syncer rounds published")
  for ax in (by_steps, by_rounds):
    ax.set_xlabel("seconds since the first step (dashed: a kill; shaded: learner out)")
    ax.grid(alpha=0.3)
  by_steps.legend(fontsize=7)
  fig.suptitle("chaos: progress under real SIGKILLs")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  runs = config.runs(FLAGS.preset, seeds=range(FLAGS.seeds))
  runs = [r for r in runs if not FLAGS.only or r.method in FLAGS.only]
  wall = 0.0 if FLAGS.report_only else harness.run_all(runs, FLAGS.outdir)
  folder = FLAGS.results_dir
  os.makedirs(folder, exist_ok=True)
  done = [r for r in runs if harness.finished(os.path.join(FLAGS.outdir, r.name))]
  sections = ["## Fault schedules", "",
              "Kills drawn by `faults.py` (times in seconds after every initial learner has "
              f"stepped; compressed downtime {config.process(FLAGS.preset).downtime_s:.2f} s, "
              f"{config.EXPECTED_KILLS[FLAGS.preset]:g} kills expected before thinning):", ""]
  for seed in sorted({r.seed for r in runs}):
    sections.append(f"- seed {seed}: `{config.schedule(seed, FLAGS.preset)}`")
  first = [r for r in done if r.seed == min(r.seed for r in done)] if done else []
  if first:
    plot_progress(first, FLAGS.outdir, os.path.join(folder, "progress.png"))
    sections += ["", "## Progress and timelines (first seed)", "",
                 "Dashed lines: kills; shaded: the learner out (kill to its next step).", "",
                 "![progress](progress.png)", ""]
    for run in first:
      name = f"timeline_{run.name.split('__')[0].replace(',', '')}.png"
      shutil.copyfile(os.path.join(FLAGS.outdir, run.name, "timeline.png"),
                      os.path.join(folder, name))
      sections += [f"`{run.name}`:", "", f"![timeline {run.name}]({name})", ""]
  results = harness.report(config.NAME, runs, FLAGS.outdir, folder, columns=config.COLUMNS,
                           wall_s=wall, command="python -m experiments.chaos.run",
                           extra=figures,
                           sections=["\n".join(sections), RATES_NOTE,
                                     harness.table(_rates(done, FLAGS.outdir), RATE_COLUMNS)])
  print(harness.table(results["rows"], config.COLUMNS))


RATES_NOTE = """## Rates with a learner out

Steps (all learners together) and syncer rounds per second of the run clock, split by whether
some learner was out (killed and not stepping again yet) or none was. `outage_s`: seconds with
some learner out. On this 2-core host a restarting process's import and compilation also take
CPU from the survivors."""
RATE_COLUMNS = ("method", "seed", "outage_s", "steps_per_s_all_up", "steps_per_s_some_out",
                "rounds_per_s_all_up", "rounds_per_s_some_out")


def _rates(done, outdir):
  rows = []
  for run in done:
    rows.append({"method": run.method, "seed": run.seed,
                 **figures(run, os.path.join(outdir, run.name))})
  return rows


def define_flags():
  """The command line (defined only when run as a script, so tests can import this)."""
  harness.define_flags(config.NAME, os.path.dirname(os.path.abspath(__file__)),
                       seeds=len(config.SEEDS))
  flags.DEFINE_enum("preset", "full", list(config.STEPS), "Run length and chaos window.")
  flags.DEFINE_multi_string("only", [], "Run only this method (repeatable; default: all of "
                            "them).")


if __name__ == "__main__":
  define_flags()
  app.run(main)
