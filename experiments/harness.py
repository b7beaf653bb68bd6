"""Shared machinery of the experiments: run configs, collect rows, write tables and plots.

An experiment is a list of `Run`s (a config file, dotted overrides, a seed). `run_all` starts
each as its own `python -m diloco.main` process (one JAX runtime per run, as a user would) in
`OUTDIR/<run name>/`, a few at a time if asked, and skips runs that already finished, so an
interrupted experiment resumes where it stopped. Every runner (`experiments/<name>/run.py`)
takes its common flags from `define_flags`. `collect` turns each run's own `accounting.json`,
`metrics.jsonl` and `config.json` into one flat row; nothing in a table is typed by hand.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

import matplotlib
from absl import flags

from diloco.observe.accounting import read_jsonl

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Written by `run_all` next to a finished run: its wall time as the harness measured it.
HARNESS_FILE = "harness.json"
# Accounting figures copied into every row (without the "accounting/" prefix).
ACCOUNTING_KEYS = ("goodput", "uptime", "mean_learners_per_round", "median_grace_s",
                   "staleness_mean", "wait_fraction", "bytes_up", "bytes_down", "rounds",
                   "horizon_s", "round_bytes_up_peak", "round_bytes_down_peak")


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


def define_flags(name: str, folder: str, *, seeds: int | None = None,
                 steps: int | None = None, jobs: int | None = None) -> None:
  """The flags every experiment's runner takes: --outdir, --results_dir, --report_only, and
  --seeds / --steps / --jobs when it has them (their defaults given here). A runner defines
  its own further flags next to these. Called only when the runner runs as a script, so that
  tests can import several runners."""
  flags.DEFINE_string("outdir", f"runs/experiments/{name}", "Where the runs are kept.")
  flags.DEFINE_string("results_dir", folder,
                      "Where results.json, the plots and README.md are written.")
  flags.DEFINE_bool("report_only", False,
                    "Regenerate the report from the finished runs; run nothing.")
  if seeds is not None:
    flags.DEFINE_integer("seeds", seeds, "Seeds per method.")
  if steps is not None:
    flags.DEFINE_integer("steps", steps, "Inner steps per learner.")
  if jobs is not None:
    flags.DEFINE_integer("jobs", jobs, "Runs at a time (each is its own process).")


def _flag(value: object) -> str:
  return str(value).lower() if isinstance(value, bool) else str(value)


def finished(workdir: str) -> bool:
  """A Decoupled run ends with accounting.json; a data-parallel one with its final evaluation
  (at `train.steps`) in metrics.jsonl and its export."""
  if os.path.exists(os.path.join(workdir, "accounting.json")) or os.path.exists(
      os.path.join(workdir, "final.json")):
    return True
  config_path = os.path.join(workdir, "config.json")
  if not os.path.isdir(os.path.join(workdir, "export")) or not os.path.exists(config_path):
    return False
  with open(config_path, encoding="utf-8") as f:
    steps = json.load(f)["train"]["steps"]
  return any("eval/loss" in r and r.get("step") == steps
             for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")))


def run_all(runs: Sequence[Run], outdir: str, *, jobs: int = 1, devices: int = 8) -> float:
  """Runs what has not finished yet, `jobs` at a time; returns the wall seconds spent.

  Each run's log goes to its run.log. A failed run raises (naming its log) once the runs
  already started have ended; runs not yet started are then not started."""
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
             PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  todo = [(i, run) for i, run in enumerate(runs)
          if not finished(os.path.join(outdir, run.name))]
  failed = threading.Event()

  def start(i: int, run: Run) -> None:
    if failed.is_set():
      return  # a run failed: start nothing new
    try:
      _run_one(run, os.path.join(outdir, run.name), env, f"[{i + 1}/{len(runs)}]")
    except BaseException:
      failed.set()
      raise

  started = time.monotonic()
  with concurrent.futures.ThreadPoolExecutor(max(jobs, 1)) as pool:
    futures = [pool.submit(start, i, run) for i, run in todo]
  errors = [f.exception() for f in futures if f.exception() is not None]
  if errors:
    raise errors[0]
  return time.monotonic() - started


def _run_one(run: Run, workdir: str, env: dict, position: str) -> None:
  """One run as its own process; its wall time and the host's load go to HARNESS_FILE."""
  os.makedirs(workdir, exist_ok=True)
  print(f"{position} {run.name}: {' '.join(run.command(workdir)[2:])}", flush=True)
  t0 = time.monotonic()
  with open(os.path.join(workdir, "run.log"), "w", encoding="utf-8") as log:
    code = subprocess.call(run.command(workdir), stdout=log, stderr=subprocess.STDOUT,
                           env=env, cwd=REPO)
  if code:
    raise RuntimeError(f"run {run.name} failed with exit code {code}; see {workdir}/run.log")
  wall = time.monotonic() - t0
  with open(os.path.join(workdir, HARNESS_FILE), "w", encoding="utf-8") as f:
    # The launcher's accounting.json has no wall time; the host's load average at the end
    # says how much other work shared the machine with a real-time run.
    json.dump({"wall_s": wall, "loadavg": list(os.getloadavg())}, f)
  print(f"    {run.name} done in {wall:.0f} s", flush=True)


def init_tokens(cfg: dict) -> int:
  """Tokens already trained by the checkpoint a run starts from (`train.init_from` naming a
  run's `checkpoints/STEP`), so that a warm start counts them; 0 otherwise."""
  source = os.path.normpath(os.path.join(REPO, cfg["train"].get("init_from") or "."))
  head, step = os.path.split(source)
  run_dir, kind = os.path.split(head)
  config_path = os.path.join(run_dir, "config.json")
  if kind != "checkpoints" or not step.isdigit() or not os.path.exists(config_path):
    return 0
  with open(config_path, encoding="utf-8") as f:
    source_cfg = json.load(f)
  return int(step) * source_cfg["train"]["batch_size"] * source_cfg["data"]["seq_len"] * max(
      source_cfg["learners"]["count"], 1)


def eval_curve(workdir: str) -> list[dict]:
  """(step, tokens, time, wall, eval_loss) of every global evaluation of a run, in order.

  `time` is the run clock of the evaluation (virtual seconds on the virtual clock), `wall`
  real seconds since the run's first record. Tokens count all learners together: the steps
  that ended by then in `activity.jsonl` (so learners added or removed midway count), or,
  for a data-parallel run, which has none, the step times the tokens per step; plus those of
  the checkpoint it started from (`init_tokens`)."""
  cfg = json.load(open(os.path.join(workdir, "config.json"), encoding="utf-8"))
  per_step = cfg["train"]["batch_size"] * cfg["data"]["seq_len"] * max(
      cfg["learners"]["count"], 1)
  steps = sorted((r["end"], r.get("tokens", 0))
                 for r in read_jsonl(os.path.join(workdir, "activity.jsonl"))
                 if r["kind"] == "step")
  records = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  t0 = records[0]["t"] if records else 0.0
  start = init_tokens(cfg)
  points = []
  for r in records:
    if "eval/loss" in r and r.get("role") in ("syncer", "dp", "train", None):
      time = r.get("time", r["t"] - t0)
      tokens = start + (sum(n for end, n in steps if end <= time + 1e-9) if steps
                        else r["step"] * per_step)
      points.append({"step": r["step"], "tokens": tokens, "time": time,
                     "wall": r["t"] - t0, "eval_loss": r["eval/loss"]})
  return points


def collect(run: Run, workdir: str) -> dict:
  """One flat row of a finished run: method, seed, tokens, eval_loss, accounting figures.

  A data-parallel run has no accounting.json: its losses and wall time come from its
  evaluations in metrics.jsonl."""
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    cfg = json.load(f)
  accounting_path = os.path.join(workdir, "accounting.json")
  if os.path.exists(accounting_path):
    with open(accounting_path, encoding="utf-8") as f:
      acc = json.load(f)
  else:
    curve = eval_curve(workdir)
    acc = {"eval/loss": curve[-1]["eval_loss"], "eval/initial_loss": curve[0]["eval_loss"],
           "wall_s": curve[-1]["wall"]}
  activity = read_jsonl(os.path.join(workdir, "activity.jsonl"))
  if activity:
    tokens = sum(r.get("tokens", 0) for r in activity if r["kind"] == "step")
  else:
    tokens = cfg["train"]["steps"] * cfg["train"]["batch_size"] * cfg["data"]["seq_len"]
  tokens += init_tokens(cfg)
  row = {"method": run.method, **dict(run.labels), "seed": run.seed, "tokens": int(tokens),
         "eval_loss": float(acc["eval/loss"]), "initial_loss": float(acc["eval/initial_loss"]),
         "wall_s": round(float(acc.get("wall_s", _harness_record(workdir).get("wall_s", 0.0))),
                         1)}
  for key in ACCOUNTING_KEYS:
    if f"accounting/{key}" in acc:
      row[key] = float(acc[f"accounting/{key}"])
  row.update({k: v for k, v in run.overrides})
  return row


def _harness_record(workdir: str) -> dict:
  path = os.path.join(workdir, HARNESS_FILE)
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


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


def plot_curves(curves: dict[str, list[dict]], path: str, title: str, *,
                time_key: str = "wall", time_label: str = "wall clock since the run's start (s)"
                ) -> None:
  """Eval loss against tokens (left) and against `time_key` (right), one line per run."""
  fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(11, 4))
  for label, points in sorted(curves.items()):
    if not points:
      continue
    by_tokens.plot([p["tokens"] for p in points], [p["eval_loss"] for p in points], "o-",
                   label=label, ms=3)
    by_time.plot([p[time_key] for p in points], [p["eval_loss"] for p in points], "o-",
                 label=label, ms=3)
  by_tokens.set_xlabel("tokens (all learners)")
  by_time.set_xlabel(time_label)
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


def write_readme(folder: str, parts: Sequence[str]) -> None:
  """`folder`/README.md: the generated `parts`, then the folder's authored analysis.md."""
  parts = list(parts)
  analysis = os.path.join(folder, "analysis.md")
  if os.path.exists(analysis):
    with open(analysis, encoding="utf-8") as f:
      parts += [f.read().strip(), ""]
  with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(parts))


def _sections(sections, rows: list[dict]) -> list[str]:
  generated = sections(rows) if callable(sections) else sections
  return [generated] if isinstance(generated, str) else list(generated)


def report(name: str, runs: Sequence[Run], outdir: str, folder: str, *,
           columns: Sequence[str], command: str, wall_s: float,
           derive: Callable[[list[dict]], list[dict]] | None = None,
           extra: Callable[[Run, str], dict] | None = None,
           sections: Callable[[list[dict]], str | Sequence[str]] | Sequence[str] = (),
           plot: dict | None = None, about: str = "") -> dict:
  """Writes `folder`/results.json, eval.png and README.md from the runs in `outdir`.

  `extra(run, workdir)` adds an experiment's own figures to each row; `derive(rows)` adds
  columns computed across rows (e.g. a ratio to a baseline row); `sections` are more markdown
  blocks (tables, plots) placed after the eval plot, or a function of the rows returning them;
  `plot` passes `time_key`/`time_label` to `plot_curves`. README.md is regenerated whole:
  `about` (the config's docstring: setting and expected outcome), the measured tables, the
  plot, when/where/how long, the sections, then `analysis.md` of the same folder (the authored
  reading of the numbers) if it exists."""
  done = [run for run in runs if finished(os.path.join(outdir, run.name))]
  rows = [collect(run, os.path.join(outdir, run.name)) for run in done]
  if extra is not None:
    for run, row in zip(done, rows):
      row.update(extra(run, os.path.join(outdir, run.name)))
  if derive:
    rows = derive(rows)
  results = write_results(name, rows, os.path.join(folder, "results.json"))
  curves = {run.name: eval_curve(os.path.join(outdir, run.name)) for run in done}
  plot_curves(curves, os.path.join(folder, "eval.png"), f"{name}: global eval loss",
              **(plot or {}))
  parts = [
      f"# Experiment `{name}`", "",
      f"Command: `{command}`", "",
      *([about.strip(), ""] if about else []),
      f"Measured {today()} at commit `{results['commit'][:12]}` on {machine()}; "
      f"the runs took {sum(r['wall_s'] for r in rows) / 60:.1f} min of wall time in all "
      f"({wall_s / 60:.1f} min in this invocation, which reuses finished runs).", "",
      "## Runs", "", table(rows, columns), "",
      *([f"Not run yet: {', '.join(r.name for r in runs if r not in done)}.", ""]
        if len(done) < len(runs) else []),
      "## Over seeds", "", table(summarise(rows), ("method", "eval_loss_mean", "eval_loss_spread",
                                                   "seeds")), "",
      "![eval loss](eval.png)", "",
      *[block for section in _sections(sections, rows) for block in (section.strip(), "")],
  ]
  write_readme(folder, parts)
  return results
