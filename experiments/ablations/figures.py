"""Per-factor tables and bar charts of the ablations, generated from the results rows.

Each factor's table holds the shared baseline (under the name of its level of that factor) and
the factor's other levels, averaged over seeds, so every comparison is read against the same
runs. Nothing here is typed by hand: it is all computed from `results.json`'s rows.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import matplotlib

from experiments import harness
from experiments.ablations import config

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# A second panel for the factors whose point is also a byte count.
BYTES_PANEL = {"fragmentation": ("round_bytes_up_peak", "peak bytes up per round"),
               "precision": ("bytes_up", "bytes up (whole run)")}


def level_summary(rows: Sequence[dict], factor: str) -> list[dict]:
  """Per level of `factor` (baseline first, then config order): seeds and the mean, min and max
  of eval loss, and the means of the byte counts."""
  levels = [config.BASELINE_LEVEL[factor]] + [lvl for lvl, _ in config.FACTORS[factor]]
  out = []
  for level in levels:
    group = [r for r in rows if (r.get("factor"), r.get("level")) in
             ((factor, level), ("baseline", "baseline") if level == levels[0] else ())]
    if not group:
      continue
    losses = [r["eval_loss"] for r in group]
    item = {"level": level + (" (baseline)" if level == levels[0] else ""),
            "seeds": len(group), "eval_loss_mean": sum(losses) / len(losses),
            "eval_loss_min": min(losses), "eval_loss_max": max(losses)}
    for key in ("bytes_up", "round_bytes_up_peak", "mean_learners_per_round"):
      values = [r[key] for r in group if key in r]
      if values:
        item[key] = sum(values) / len(values)
    out.append(item)
  if out and out[0]["level"].endswith("(baseline)"):
    base = out[0]["eval_loss_mean"]
    for item in out:
      item["vs_baseline"] = item["eval_loss_mean"] - base
  return out


def plot_factor(summary: Sequence[dict], factor: str, path: str) -> None:
  """Bars of mean final eval loss (whiskers: min and max over seeds), plus bytes if relevant."""
  panels = 2 if factor in BYTES_PANEL else 1
  fig, axes = plt.subplots(1, panels, figsize=(1.2 + 0.9 * len(summary) * panels, 3.6),
                           squeeze=False)
  labels = [s["level"].replace(" (baseline)", "\n(baseline)") for s in summary]
  x = range(len(summary))
  means = [s["eval_loss_mean"] for s in summary]
  whiskers = [[m - s["eval_loss_min"] for m, s in zip(means, summary)],
              [s["eval_loss_max"] - m for m, s in zip(means, summary)]]
  colors = ["tab:gray"] + ["tab:blue"] * (len(summary) - 1)
  ax = axes[0][0]
  ax.bar(x, means, yerr=whiskers, color=colors, capsize=3)
  low, high = min(s["eval_loss_min"] for s in summary), max(s["eval_loss_max"] for s in summary)
  ax.set_ylim(low - 0.1 * (high - low + 1e-3) - 0.02, high + 0.1 * (high - low + 1e-3) + 0.02)
  ax.set_ylabel("final global eval loss")
  if panels == 2:
    key, title = BYTES_PANEL[factor]
    axes[0][1].bar(x, [s.get(key, 0) for s in summary], color=colors)
    axes[0][1].set_ylabel(title)
  for a in axes[0]:
    a.set_xticks(list(x), labels, fontsize=7, rotation=30 if len(summary) > 4 else 0)
    a.grid(axis="y", alpha=0.3)
  fig.suptitle(f"ablation: {factor} (mean over seeds; whiskers min..max)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def factor_sections(rows: Sequence[dict], folder: str) -> str:
  """Markdown: one table and one bar chart (written to `folder`) per factor."""
  parts = ["## Per factor", "",
           ("Each table repeats the shared baseline; `vs_baseline` is the mean eval loss minus "
            "the baseline's (negative is better)."), ""]
  for factor in config.FACTORS:
    summary = level_summary(rows, factor)
    if not summary:
      continue
    columns = ["level", "seeds", "eval_loss_mean", "eval_loss_min", "eval_loss_max",
               "vs_baseline", "bytes_up", "round_bytes_up_peak"]
    if factor == "merge":
      columns.append("mean_learners_per_round")
    image = f"bars_{factor}.png"
    plot_factor(summary, factor, os.path.join(folder, image))
    parts += [f"### {factor}", "", harness.table(summary, columns), "",
              f"![{factor}]({image})", ""]
  return "\n".join(parts)
