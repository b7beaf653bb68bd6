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

from absl import flags

from diloco.cli.compare import table  # noqa: F401  (the experiments' tables)
from diloco.observe import curves
from diloco.observe.accounting import read_jsonl
from diloco.observe.curves import plot_curves  # noqa: F401  (the experiments' plots)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Written by `run_all` next to a finished run: its wall time as the harness measured it.
HARNESS_FILE = "harness.json"
# Accounting figures copied into every row (without the "accounting/" prefix).
ACCOUNTING_KEYS = ("goodput", "compute_goodput", "step_device_s", "dropped_step_device_s",
                   "rejected_step_device_s", "uptime", "mean_learners_per_round", "median_grace_s",
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


def trained_tokens(workdir: str, cfg: dict) -> float:
  """Tokens every learner of the run trained on: from its step spans (activity.jsonl), else
  from the per-step `train/tokens` records of metrics.jsonl (a run copied back without its
  activity log), else the configured steps x batch x sequence length x learners."""
  activity = read_jsonl(os.path.join(workdir, "activity.jsonl"))
  if activity:
    return sum(r.get("tokens", 0) for r in activity if r["kind"] == "step")
  logged = sum(r["train/tokens"] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
               if "train/tokens" in r)
  if logged:
    return logged
  return (cfg["train"]["steps"] * cfg["train"]["batch_size"] * cfg["data"]["seq_len"]
          * max(cfg["learners"]["count"], 1))


def finished(workdir: str) -> bool:
  """A Decoupled run ends with accounting.json; a data-parallel one with its final evaluation
  (at `train.steps`) in metrics.jsonl and its export, or the harness's record that its
  process ended well (`HARNESS_FILE`: a run copied back from another machine without its
  export)."""
  if os.path.exists(os.path.join(workdir, "accounting.json")) or os.path.exists(
      os.path.join(workdir, "final.json")):
    return True
  config_path = os.path.join(workdir, "config.json")
  ended = (os.path.isdir(os.path.join(workdir, "export"))
           or os.path.exists(os.path.join(workdir, HARNESS_FILE)))
  if not ended or not os.path.exists(config_path):
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
  """`curves.init_tokens` with `train.init_from` relative to the repository (the runs' cwd)."""
  return curves.init_tokens(cfg, REPO)


def eval_curve(workdir: str) -> list[dict]:
  """`curves.eval_curve` of a run that `run_all` started (from the repository)."""
  return curves.eval_curve(workdir, REPO)


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
  tokens = trained_tokens(workdir, cfg)
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


def carried_rows(runs: Sequence[Run], outdir: str, folder: str) -> dict[tuple[str, int], dict]:
  """The rows of `folder`'s results.json for runs with no finished folder in `outdir` (run in
  an earlier session or on another machine), by (method, seed), each marked `carried_from`
  with the commit it was measured at. Such a run is not run again; delete its row to redo it."""
  path = os.path.join(folder, "results.json")
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    old = json.load(f)
  rows = {(r["method"], r["seed"]): dict(r, carried_from=r.get("carried_from", old["commit"]))
          for r in old["rows"]}
  return {(r.method, r.seed): rows[(r.method, r.seed)] for r in runs
          if (r.method, r.seed) in rows and not finished(os.path.join(outdir, r.name))}


def write_results(name: str, rows: list[dict], path: str) -> dict:
  results = {"experiment": name, "commit": commit(), "rows": rows}
  with open(path, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=2)
  return results


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
           plot: dict | None = None, about: str = "", carry: bool = False) -> dict:
  """Writes `folder`/results.json, eval.png and README.md from the runs in `outdir`.

  `extra(run, workdir)` adds an experiment's own figures to each row; `derive(rows)` adds
  columns computed across rows (e.g. a ratio to a baseline row); `sections` are more markdown
  blocks (tables, plots) placed after the eval plot, or a function of the rows returning them;
  `plot` passes `time_key`/`time_label` to `plot_curves`. README.md is regenerated whole:
  `about` (the config's docstring: setting and expected outcome), the measured tables, the
  plot, when/where/how long, the sections, then `analysis.md` of the same folder (the authored
  reading of the numbers) if it exists. With `carry`, the rows of runs whose folders are not
  here come from the folder's earlier results.json (`carried_rows`; they have no curve)."""
  carried = carried_rows(runs, outdir, folder) if carry else {}
  done = [run for run in runs if finished(os.path.join(outdir, run.name))]
  rows = [collect(run, os.path.join(outdir, run.name)) for run in done]
  if extra is not None:
    for run, row in zip(done, rows):
      row.update(extra(run, os.path.join(outdir, run.name)))
  rows += [carried[(r.method, r.seed)] for r in runs if (r.method, r.seed) in carried]
  reported = done + [r for r in runs if (r.method, r.seed) in carried]
  commits = sorted({r["carried_from"][:12] for r in carried.values()})
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
      *([f"{len(carried)} rows are carried from the results measured at commit "
         f"{', '.join(f'`{c}`' for c in commits)} (their run folders are not on this machine, "
         "so the plot has no curve for them).", ""] if carried else []),
      "## Runs", "", table(rows, columns), "",
      *([f"Not run yet: {', '.join(r.name for r in runs if r not in reported)}.", ""]
        if len(reported) < len(runs) else []),
      "## Over seeds", "", table(summarise(rows), ("method", "eval_loss_mean", "eval_loss_spread",
                                                   "seeds")), "",
      "![eval loss](eval.png)", "",
      *[block for section in _sections(sections, rows) for block in (section.strip(), "")],
  ]
  write_readme(folder, parts)
  return results
