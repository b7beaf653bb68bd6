"""How far every run of an output directory got, finished or not, against data-parallel at the
same tokens.

The main report (`run.write_report`) reads finished runs only. A run cut short (a device
lent for less time than the row needs) still holds its evaluations in `metrics.jsonl`; this
table and plot put them beside data-parallel's curve, interpolated at the run's own tokens
(the runs evaluate G at nearby, not identical, token counts), so a partial row says what it
measured and where it stopped instead of vanishing from the report.
"""

from __future__ import annotations

import json
import os

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments import harness  # noqa: E402
from experiments.scaling import rows  # noqa: E402


def runs(outdir: str) -> list[dict]:
  """Every run directory under `outdir` with a config and at least one evaluation: its
  method, planned steps, whether it finished, and its evaluation curve."""
  out = []
  if not os.path.isdir(outdir):
    return out
  for name in sorted(os.listdir(outdir)):
    workdir = os.path.join(outdir, name)
    config_path = os.path.join(workdir, "config.json")
    if not os.path.exists(config_path) or not os.path.exists(
        os.path.join(workdir, "metrics.jsonl")):
      continue
    with open(config_path, encoding="utf-8") as f:
      labels = rows.describe(json.load(f))
    curve = harness.eval_curve(workdir)
    if curve:
      out.append(dict(labels, run=name, curve=curve, finished=harness.finished(workdir),
                      eval_loss=curve[-1]["eval_loss"]))
  return rows.with_methods(out)


def reference(found: list[dict]) -> dict | None:
  """The data-parallel run at the largest batch (the report's reference), if any."""
  dps = [r for r in found if r["method"] == "data-parallel"]
  return max(dps, key=lambda r: r["curve"][-1]["tokens"]) if dps else None


def at_tokens(curve: list[dict], tokens: float) -> float | None:
  """The curve's eval loss linearly interpolated at `tokens`; None outside its range."""
  xs = [p["tokens"] for p in curve]
  if not xs or tokens < xs[0] or tokens > xs[-1]:
    return None
  return float(np.interp(tokens, xs, [p["eval_loss"] for p in curve]))


def nearest(curve: list[dict], tokens: float) -> dict:
  """The curve's evaluation nearest to `tokens` (runs evaluate at nearby token counts)."""
  return min(curve, key=lambda p: abs(p["tokens"] - tokens))


def _row(run: dict, point: dict, dp: dict | None) -> str:
  ref = at_tokens(dp["curve"], point["tokens"]) if dp else None
  ref_text = "" if ref is None else f"{ref:.4f}"
  gap = "" if ref is None else f"{100.0 * (point['eval_loss'] / ref - 1.0):+.2f}%"
  state = "finished" if run["finished"] else "stopped"
  return (f"| {run['method']} | {state}, step {point['step']:,} of {run['steps']:,} | "
          f"{point['tokens']:,} | {point['eval_loss']:.4f} | {ref_text} | {gap} |")


HEADER = ("| method | run | tokens | eval loss | data-parallel at these tokens | gap |\n"
          "|---|---|---|---|---|---|")


def section(outdir: str, folder: str, prefix: str) -> list[str]:
  """Markdown lines (and `prefix`_progress.png in `folder`): each run's last evaluation, and
  every run at the last evaluation all of them reached; empty when every run finished."""
  found = runs(outdir)
  if not found or all(r["finished"] for r in found):
    return []
  dp = reference(found)
  reached = min(r["curve"][-1]["tokens"] for r in found)
  parts = ["## Every run so far, finished or stopped", "",
           "Some runs stopped before their last step (the device time ended); their "
           "evaluations so far are compared with data-parallel's curve at the same tokens "
           "(interpolated). Early in training the gap is larger than at D = 20N.", "",
           "Each run's last evaluation:", "", HEADER]
  parts += [_row(r, r["curve"][-1], dp) for r in found]
  if reached > 0:
    parts += ["", f"Every run at its evaluation nearest to {reached:,} tokens, the most that "
              "all of them reached:", "", HEADER]
    parts += [_row(r, nearest(r["curve"], reached), dp) for r in found]
  name = f"{prefix}_progress.png"
  plot(found, os.path.join(folder, name))
  return parts + ["", f"![eval loss against tokens, every run]({name})", ""]


def plot(found: list[dict], path: str) -> None:
  """Eval loss against tokens, finished runs solid and stopped ones dashed."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  for r in found:
    curve = r["curve"][1:]  # the step-0 evaluation is the same for all
    ax.plot([p["tokens"] for p in curve], [p["eval_loss"] for p in curve],
            "-" if r["finished"] else "--", marker=".", label=r["method"])
  ax.set_xlabel("tokens trained")
  ax.set_ylabel("eval loss")
  ax.set_yscale("log")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  ax.set_title("every run so far (dashed: stopped before its last step)", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
