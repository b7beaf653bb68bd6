"""Compares finished runs side by side: a table and the eval-loss curves, from their own files.

    diloco compare runs/dp_cpu runs/decoupled_cpu [--report_dir=runs/compare]
    python -m diloco.cli.compare ...                       (the same)

Each argument is a run's workdir (any runtime: data-parallel, single-controller or
multi-process). The table has its final and initial global eval loss, tokens, time and, for
Decoupled runs, the accounting figures (goodput, learners per round, grace, staleness,
bandwidth); `--report_dir` also writes compare.md, compare.json and eval.png (eval loss
against tokens and against time). Every figure is read from the run's `metrics.jsonl`,
`accounting.json` and `config.json`; a run scored on lm-evaluation-harness tasks (`diloco
evaluate --tasks=...`, WORKDIR/benchmarks/results.json) adds a column per task metric, e.g.
"hellaswag acc".

All runs are put on one clock: seconds since each run's first training step, so that
compilation and start-up count for none of them (a data-parallel run compiles its first step
on its wall clock, the Decoupled runtime before its clock starts). Where a run's metrics hold
no training step (a multi-process run), every run falls back to the wall clock since its first
record, and the table and the plot say so. Runs that trained on different numbers of tokens,
or evaluate on different held-out windows, are flagged under the table.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from absl import flags

from diloco import documents, settings
from diloco.cli import benchmarks
from diloco.errors import ConfigError
from diloco.observe import curves

COLUMNS = ("run", "eval_loss", "initial_loss", "tokens", "time_s", "eval_windows", "goodput",
           "mean_learners_per_round", "median_grace_s", "staleness_mean", "wait_fraction",
           "bytes_up")
# The two clocks: the key of `curves.eval_curve`'s points and what it means.
CLOCKS = {"train_s": "seconds since each run's first training step (compilation excluded)",
          "wall": "wall seconds since each run's first record (compilation included where "
                  "it happens on the clock)"}
# Final token counts further apart than this (relative) are not "the same tokens".
TOKEN_TOLERANCE = 0.01


def table(rows: Sequence[dict], columns: Sequence[str]) -> str:
  """A markdown table of `columns` (floats to 4 significant digits)."""
  def cell(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
  return "\n".join(lines)


def _accounting(path: str) -> dict[str, float]:
  """The numbers of a run's accounting.json ({} when there is none), each one typed."""
  if not os.path.exists(path):
    return {}
  doc = documents.obj(documents.read(path), path)
  return {k: documents.value(v, float, path, k, finite=False) for k, v in doc.items()
          if k.startswith("accounting/") or k == "eval/loss"}


def eval_windows(workdir: str) -> int:
  """How many held-out windows the run's global evaluation scores (batch x eval batches)."""
  path = os.path.join(workdir, "config.json")
  doc = documents.obj(documents.read(path), path)
  train = documents.fields(documents.obj(doc.get("train"), path, "train"),
                           {"batch_size": int, "eval_batches": int}, path, "train.")
  return train["batch_size"] * train["eval_batches"]


def _curve(workdir: str) -> list[dict]:
  for name in ("config.json", "metrics.jsonl"):
    if not os.path.exists(os.path.join(workdir, name)):
      raise ValueError(f"{workdir}: no {name}; is it the workdir of a run?")
  curve = curves.eval_curve(workdir)
  if not curve:
    raise ValueError(f"{workdir}: no global evaluation in metrics.jsonl (did the run finish?)")
  return curve


def clock(all_curves: Sequence[list[dict]]) -> str:
  """`train_s` when every run has it, else `wall` (one clock for all runs, see CLOCKS)."""
  return "train_s" if all(p["train_s"] is not None for c in all_curves for p in c) else "wall"


def row(workdir: str, curve: list[dict], time_key: str) -> dict:
  """The comparable figures of one finished run, its time on the clock `time_key`."""
  out = {"run": os.path.basename(os.path.normpath(workdir)), "eval_loss": curve[-1]["eval_loss"],
         "initial_loss": curve[0]["eval_loss"], "tokens": curve[-1]["tokens"],
         "time_s": round(curve[-1][time_key] - curve[0][time_key], 1),
         "eval_windows": eval_windows(workdir)}
  accounting = _accounting(os.path.join(workdir, "accounting.json"))
  for key in COLUMNS:
    if f"accounting/{key}" in accounting:
      out[key] = float(accounting[f"accounting/{key}"])
  if "eval/loss" in accounting:  # the runtime's own final evaluation
    out["eval_loss"] = float(accounting["eval/loss"])
  out.update(benchmarks.metric_columns(workdir))
  return out


def warnings(rows: Sequence[dict]) -> list[str]:
  """Why the rows' losses are not directly comparable, if they are not."""
  out = []
  windows = sorted({r["eval_windows"] for r in rows})
  if len(windows) > 1:
    out.append(f"Warning: these runs evaluate on different held-out windows ({windows}); set "
               "--config.train.eval_batches so that batch_size x eval_batches is equal.")
  tokens = [r["tokens"] for r in rows]
  if max(tokens) > (1 + TOKEN_TOLERANCE) * min(tokens):
    listed = ", ".join(f"{r['run']} {r['tokens']:,}" for r in rows)
    out.append(f"Warning: these runs trained on different numbers of tokens ({listed}); "
               "compare their losses at equal tokens (eval.png, left).")
  return out


def compare(workdirs: list[str], out: str = "") -> str:
  """The markdown table of `workdirs`, its clock and its warnings; with `out`, also its files
  and the plot."""
  all_curves = [_curve(w) for w in workdirs]
  time_key = clock(all_curves)
  rows = [row(w, c, time_key) for w, c in zip(workdirs, all_curves)]
  columns = [c for c in COLUMNS if any(c in r for r in rows)]
  columns += sorted({k for r in rows for k in r if k not in COLUMNS})  # benchmark metrics
  text = "\n\n".join([table(rows, columns), f"time_s: {CLOCKS[time_key]}.", *warnings(rows)])
  if out:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "compare.md"), "w", encoding="utf-8") as f:
      f.write(text + "\n")
    with open(os.path.join(out, "compare.json"), "w", encoding="utf-8") as f:
      json.dump({"runs": workdirs, "clock": time_key, "rows": rows}, f, indent=2)
    curves.plot_curves({r["run"]: c for r, c in zip(rows, all_curves)},
                       os.path.join(out, "eval.png"), "global eval loss", time_key=time_key,
                       time_label=CLOCKS[time_key])
  return text


# The command's flags, on their own FlagValues (not absl's global FLAGS), so that importing
# this library defines no flag and `diloco compare` can hand `main` its argv.
FLAGS = flags.FlagValues()
flags.DEFINE_string("report_dir", "", "If set, write compare.md, compare.json and eval.png "
                    "here.", flag_values=FLAGS)
_PROG = "diloco compare"


def main(argv: list[str]) -> None:
  """`diloco compare WORKDIR... [--report_dir=DIR]`; argv[0] is the program's name. Every
  mistake (a flag, a directory that is no run) is one line on stderr and exit status 1."""
  if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]):
    print(f"usage: {_PROG} WORKDIR... [--report_dir=DIR]\n\n{__doc__.strip()}\n\n"
          f"{FLAGS.get_help()}")
    return
  FLAGS.unparse_flags()  # a second call in one process starts from the defaults
  try:
    workdirs = FLAGS([_PROG, *argv[1:]])[1:]
  except flags.Error as e:
    sys.exit(f"{_PROG}: error: {e}")
  try:
    settings.check_flags(FLAGS)
    for workdir in workdirs:
      problem = settings.general_problem(workdir)
      if problem:
        raise ConfigError(f"workdir {problem}")
  except ConfigError as e:
    sys.exit(f"{_PROG}: error: {e}")
  if not workdirs:
    sys.exit(f"{_PROG}: error: give the workdirs of the runs to compare")
  report_dir = FLAGS.report_dir
  if report_dir and os.path.lexists(report_dir) and not os.path.isdir(report_dir):
    sys.exit(f"{_PROG}: error: --report_dir: {report_dir!r} exists and is not a folder")
  try:
    print(compare(workdirs, FLAGS.report_dir))
  except (ValueError, OSError) as e:
    sys.exit(f"{_PROG}: error: {e}")


if __name__ == "__main__":
  main(sys.argv)
