"""Compares finished runs side by side: a table and the eval-loss curves, from their own files.

    python -m experiments.compare runs/dp_cpu runs/decoupled_cpu [--report_dir=runs/compare]

Each argument is a run's workdir (any runtime: data-parallel, single-controller or
multi-process). The table has its final and initial global eval loss, tokens, wall time and,
for Decoupled runs, the accounting figures (goodput, learners per round, grace, staleness,
bandwidth); `--report_dir` also gets compare.md, compare.json and eval.png (eval loss against tokens
and against the run clock). Nothing is typed by hand: every figure is read from the run's
`metrics.jsonl`, `accounting.json` and `config.json`.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from experiments import harness

_OUT = flags.DEFINE_string("report_dir", "",
                            "If set, write compare.md, compare.json and eval.png here.")
_COLUMNS = ("run", "eval_loss", "initial_loss", "tokens", "wall_s", "eval_windows", "goodput",
            "mean_learners_per_round", "median_grace_s", "staleness_mean", "wait_fraction",
            "bytes_up")


def _load(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def row(workdir: str) -> dict:
  """The comparable figures of one finished run; ValueError naming the workdir otherwise."""
  for name in ("config.json", "metrics.jsonl"):
    if not os.path.exists(os.path.join(workdir, name)):
      raise ValueError(f"{workdir}: no {name}; is it the workdir of a run?")
  curve = harness.eval_curve(workdir)
  if not curve:
    raise ValueError(f"{workdir}: no global evaluation in metrics.jsonl (did the run finish?)")
  out = {"run": os.path.basename(os.path.normpath(workdir)), "eval_loss": curve[-1]["eval_loss"],
         "initial_loss": curve[0]["eval_loss"], "tokens": curve[-1]["tokens"],
         "wall_s": round(curve[-1]["wall"] - curve[0]["wall"], 1),
         "eval_windows": eval_windows(workdir)}
  accounting = _load(os.path.join(workdir, "accounting.json")) or {}
  for key in _COLUMNS:
    if f"accounting/{key}" in accounting:
      out[key] = float(accounting[f"accounting/{key}"])
  if "eval/loss" in accounting:  # the runtime's own final evaluation
    out["eval_loss"] = float(accounting["eval/loss"])
  return out


def eval_windows(workdir: str) -> int:
  """How many held-out windows the run's global evaluation scores (batch x eval batches)."""
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    train = json.load(f)["train"]
  return train["batch_size"] * train["eval_batches"]


def compare(workdirs: list[str], out: str = "") -> str:
  """The markdown table of `workdirs`; with `out`, also its files and the plot.

  Runs whose evaluations score different held-out windows (a data-parallel run's batch is
  usually M times a learner's) are flagged under the table: their losses are not comparable
  until `train.eval_batches` makes batch x eval batches equal."""
  rows = [row(w) for w in workdirs]
  columns = [c for c in _COLUMNS if any(c in r for r in rows)]
  text = harness.table(rows, columns)
  windows = sorted({r["eval_windows"] for r in rows})
  if len(windows) > 1:
    text += (f"\n\nWarning: these runs evaluate on different held-out windows ({windows}); "
             "set --config.train.eval_batches so that batch_size x eval_batches is equal.")
  if out:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "compare.md"), "w", encoding="utf-8") as f:
      f.write(text + "\n")
    with open(os.path.join(out, "compare.json"), "w", encoding="utf-8") as f:
      json.dump({"runs": workdirs, "rows": rows}, f, indent=2)
    curves = {r["run"]: harness.eval_curve(w) for r, w in zip(rows, workdirs)}
    harness.plot_curves(curves, os.path.join(out, "eval.png"), "global eval loss")
  return text


def main(argv):
  workdirs = argv[1:]
  if not workdirs:
    raise app.UsageError("give the workdirs of the runs to compare")
  try:
    print(compare(workdirs, _OUT.value))
  except ValueError as e:
    raise SystemExit(f"compare: {e}") from None


if __name__ == "__main__":
  app.run(main)
