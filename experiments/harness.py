"""Shared machinery of the experiments: run configs, collect rows, write tables and plots.

An experiment is a list of `Run`s (a config file, dotted overrides, a seed). `run_all` starts
each as its own `python -m diloco.main` process (one JAX runtime per run, as a user would) in
`OUTDIR/<run name>/` and skips runs that already finished, so an interrupted experiment resumes
where it stopped. `collect` turns each run's own `accounting.json`, `metrics.jsonl` and
`config.json` into one flat row; nothing in a table is typed by hand.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import matplotlib

from diloco.observe.accounting import read_jsonl

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Accounting figures copied into every row (without the "accounting/" prefix).
ACCOUNTING_KEYS = ("goodput", "uptime", "mean_learners_per_round", "median_grace_s",
                   "staleness_mean", "wait_fraction", "bytes_up", "bytes_down", "rounds",
                   "round_bytes_up_peak", "round_bytes_down_peak")


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run: `method` labels its row, `name` its directory.

  `args` are extra command-line flags, e.g. ("--role=launch",) for the multi-process runtime.
  `labels` are copied into the run's row as they are (e.g. the factor an ablation varies); they
  change neither the command nor the run's name."""
  method: str
  config: str
  seed: int = 0
  overrides: tuple[tuple[str, object], ...] = ()
  args: tuple[str, ...] = ()
  labels: tuple[tuple[str, object], ...] = ()

  @property
  def name(self) -> str:
    return f"{self.method}__s{self.seed}".replace(" ", "_").replace("/", "-")

  def command(self, workdir: str) -> list[str]:
    args = [sys.executable, "-m", "diloco.main", f"--config={self.config}",
            f"--workdir={workdir}", f"--config.seed={self.seed}"]
    args += [f"--config.{k}={_flag(v)}" for k, v in self.overrides]
    return args + list(self.args)


def _flag(value: object) -> str:
  return str(value).lower() if isinstance(value, bool) else str(value)


def finished(workdir: str) -> bool:
  return os.path.exists(os.path.join(workdir, "accounting.json")) or os.path.exists(
      os.path.join(workdir, "final.json"))


def run_all(runs: Sequence[Run], outdir: str, *, devices: int = 8) -> float:
  """Runs what has not finished yet; returns the wall seconds spent. Logs go to run.log."""
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
             PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  started = time.monotonic()
  for i, run in enumerate(runs):
    workdir = os.path.join(outdir, run.name)
    if finished(workdir):
      continue
    os.makedirs(workdir, exist_ok=True)
    print(f"[{i + 1}/{len(runs)}] {run.name}: {' '.join(run.command(workdir)[2:])}", flush=True)
    t0 = time.monotonic()
    with open(os.path.join(workdir, "run.log"), "w", encoding="utf-8") as log:
      code = subprocess.call(run.command(workdir), stdout=log, stderr=subprocess.STDOUT,
                             env=env, cwd=REPO)
    if code:
      raise RuntimeError(f"run {run.name} failed with exit code {code}; see {workdir}/run.log")
    print(f"    done in {time.monotonic() - t0:.0f} s", flush=True)
  return time.monotonic() - started


def eval_curve(workdir: str) -> list[dict]:
  """(step, tokens, time, eval_loss) of every global evaluation of a run, in order.

  Tokens count all learners together: the run's mean local step times learners times
  tokens per step (a data-parallel run has one learner over every device)."""
  cfg = json.load(open(os.path.join(workdir, "config.json"), encoding="utf-8"))
  learners = max(cfg["learners"]["count"], 1)
  per_step = cfg["train"]["batch_size"] * cfg["data"]["seq_len"] * learners
  points = []
  for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")):
    if "eval/loss" in r and r.get("role") in ("syncer", "train", None):
      points.append({"step": r["step"], "tokens": r["step"] * per_step,
                     "time": r.get("time", r["t"]), "eval_loss": r["eval/loss"]})
  return points


def collect(run: Run, workdir: str) -> dict:
  """One flat row of a finished run: method, seed, tokens, eval_loss, accounting figures."""
  acc = json.load(open(os.path.join(workdir, "accounting.json"), encoding="utf-8"))
  cfg = json.load(open(os.path.join(workdir, "config.json"), encoding="utf-8"))
  activity = read_jsonl(os.path.join(workdir, "activity.jsonl"))
  if activity:
    tokens = sum(r.get("tokens", 0) for r in activity if r["kind"] == "step")
  else:
    tokens = cfg["train"]["steps"] * cfg["train"]["batch_size"] * cfg["data"]["seq_len"]
  row = {"method": run.method, **dict(run.labels), "seed": run.seed, "tokens": int(tokens),
         "eval_loss": float(acc["eval/loss"]), "initial_loss": float(acc["eval/initial_loss"]),
         "wall_s": round(float(acc.get("wall_s", 0.0)), 1)}
  for key in ACCOUNTING_KEYS:
    if f"accounting/{key}" in acc:
      row[key] = float(acc[f"accounting/{key}"])
  row.update({k: v for k, v in run.overrides})
  return row


def commit() -> str:
  try:
    return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=REPO, text=True).strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def write_results(name: str, rows: list[dict], path: str) -> dict:
  results = {"experiment": name, "commit": commit(), "rows": rows}
  with open(path, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=2)
  return results


def table(rows: Sequence[dict], columns: Sequence[str]) -> str:
  """A markdown table of `columns` (floats to 4 significant digits)."""
  def cell(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
  return "\n".join(lines)


def plot_curves(curves: dict[str, list[dict]], path: str, title: str) -> None:
  """Eval loss against tokens (left) and against wall time (right), one line per run."""
  fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(11, 4))
  for label, points in sorted(curves.items()):
    if not points:
      continue
    t0 = points[0]["time"]
    by_tokens.plot([p["tokens"] for p in points], [p["eval_loss"] for p in points], "o-",
                   label=label, ms=3)
    by_time.plot([p["time"] - t0 for p in points], [p["eval_loss"] for p in points], "o-",
                 label=label, ms=3)
  by_tokens.set_xlabel("tokens (all learners)")
  by_time.set_xlabel("run clock (s)")
  for ax in (by_tokens, by_time):
    ax.set_ylabel("global eval loss")
    ax.grid(alpha=0.3)
  by_tokens.legend(fontsize=7)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def machine() -> str:
  return f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}"


def today() -> str:
  return datetime.date.today().isoformat()


def summarise(rows: Sequence[dict], key: str = "eval_loss") -> list[dict]:
  """Per method: mean of `key` over seeds, its spread (max - min) and the seeds used."""
  by_method: dict[str, list[dict]] = {}
  for r in rows:
    by_method.setdefault(r["method"], []).append(r)
  out = []
  for method, group in by_method.items():
    values = [r[key] for r in group]
    out.append({"method": method, f"{key}_mean": sum(values) / len(values),
                f"{key}_spread": max(values) - min(values), "seeds": len(values)})
  return out


def report(name: str, runs: Sequence[Run], outdir: str, folder: str, *,
           columns: Sequence[str], command: str, wall_s: float,
           sections: Callable[[list[dict]], str] | None = None) -> dict:
  """Writes `folder`/results.json, eval.png and README.md from the runs in `outdir`.

  README.md is regenerated whole: the config's docstring (command and expected outcome), the
  measured tables, the plot, when/where/how long, the markdown that `sections(rows)` generates
  (an experiment's own tables and plots, if given), then `analysis.md` of the same folder (the
  authored reading of the numbers) if it exists."""
  done = [run for run in runs if finished(os.path.join(outdir, run.name))]
  rows = [collect(run, os.path.join(outdir, run.name)) for run in done]
  results = write_results(name, rows, os.path.join(folder, "results.json"))
  curves = {run.name: eval_curve(os.path.join(outdir, run.name)) for run in done}
  plot_curves(curves, os.path.join(folder, "eval.png"), f"{name}: global eval loss")
  analysis = os.path.join(folder, "analysis.md")
  parts = [
      f"# Experiment `{name}`", "",
      f"Command: `{command}`", "",
      f"Measured {today()} at commit `{results['commit'][:12]}` on {machine()}; "
      f"the runs took {sum(r['wall_s'] for r in rows) / 60:.1f} min of wall time in all "
      f"({wall_s / 60:.1f} min in this invocation, which reuses finished runs).", "",
      "## Runs", "", table(rows, columns), "",
      *([f"Not run yet: {', '.join(r.name for r in runs if r not in done)}.", ""]
        if len(done) < len(runs) else []),
      "## Over seeds", "", table(summarise(rows), ("method", "eval_loss_mean", "eval_loss_spread",
                                                   "seeds")), "",
      "![eval loss](eval.png)", "",
  ]
  if sections is not None:
    parts += [sections(rows).strip(), ""]
  if os.path.exists(analysis):
    with open(analysis, encoding="utf-8") as f:
      parts += [f.read().strip(), ""]
  with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(parts))
  return results
