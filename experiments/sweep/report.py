"""The sweep's report: results.json, sweep.png, eval_<size>.png and README.md, regenerated.

Every number comes from the runs' own files (through `collect.row`) or from the rendered
launch files; `analysis.md` in the same folder, the authored reading, is appended as is.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence

import matplotlib

from experiments import harness
from experiments.sweep import collect, config
from experiments.sweep.grid import Point

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = dict(zip(config.METHODS, ("#555555", "#1f77b4", "#2ca02c", "#d62728")))
RENDERED_COLUMNS = ("size", "method", "M", "K", "H", "P", "params", "tpu_type", "launch")


@functools.cache
def params(size: str) -> str:
  """Total (and active, for MoE) parameters of a model preset, from abstract shapes."""
  from diloco.model import presets, transformer  # pylint: disable=import-outside-toplevel
  counts = transformer.param_counts(presets.get(size))
  text = f"{counts['total'] / 1e9:.2f}B"
  return text if counts["active"] == counts["total"] else (
      f"{text} ({counts['active'] / 1e9:.2f}B active)")


def _table(rows: Sequence[dict], columns: Sequence[str]) -> str:
  """harness.table with the axes a point does not have (dp's M, K, H, P) left blank."""
  return harness.table([{k: "" if v is None else v for k, v in r.items()} for r in rows],
                       columns)


def summary_table(rows: Sequence[dict]) -> str:
  """Per size and method: points run, best eval loss and where, mean over the points."""
  groups: dict[tuple[str, str], list[dict]] = {}
  for r in rows:
    groups.setdefault((r["size"], r["method"]), []).append(r)
  out = []
  for (size, method), group in groups.items():
    best = min(group, key=lambda r: r["eval_loss"])
    out.append({"size": size, "method": method, "points": len(group),
                "best_eval_loss": best["eval_loss"], "best_point": best["point"],
                "mean_eval_loss": sum(r["eval_loss"] for r in group) / len(group)})
  return harness.table(out, ("size", "method", "points", "best_eval_loss", "best_point",
                             "mean_eval_loss"))


def plot_points(rows: Sequence[dict], path: str) -> None:
  """Final eval loss of every point run, one panel per size, bars coloured by method."""
  sizes = list(dict.fromkeys(r["size"] for r in rows))
  fig, axes = plt.subplots(1, max(len(sizes), 1), squeeze=False,
                                   figsize=(5.5 * max(len(sizes), 1), 1.2 + 0.32 * max(
                                       [sum(r["size"] == s for r in rows) for s in sizes] or [1])))
  for ax, size in zip(axes[0], sizes):
    group = [r for r in rows if r["size"] == size]
    labels = [r["point"].removeprefix(size + " ") for r in group]
    ax.barh(range(len(group)), [r["eval_loss"] for r in group],
            color=[COLORS[r["method"]] for r in group])
    for i, r in enumerate(group):
      ax.text(r["eval_loss"], i, f" {r['eval_loss']:.3f}", va="center", fontsize=7)
    ax.set_yticks(range(len(group)), labels, fontsize=7)
    ax.invert_yaxis()
    low = min(r["eval_loss"] for r in group)
    ax.set_xlim(low * 0.9, max(r["eval_loss"] for r in group) * 1.06)
    ax.set_xlabel("final global eval loss (lower is better)")
    ax.set_title(f"{size}: {group[0]['tokens']:,} tokens per run")
    ax.grid(axis="x", alpha=0.3)
  methods = list(dict.fromkeys(r["method"] for r in rows))
  fig.legend([plt.Rectangle((0, 0), 1, 1, color=COLORS[m]) for m in methods], methods,
             loc="upper center", ncol=len(methods), fontsize=7, frameon=False)
  fig.tight_layout(rect=(0, 0, 1, 0.92))
  fig.savefig(path, dpi=120)
  plt.close(fig)


def report(points: Sequence[Point], runs: Sequence[harness.Run], rendered: Sequence[dict],
           outdir: str, folder: str, *, command: str, wall_s: float) -> dict:
  """Writes results.json, the plots and README.md to `folder`; returns the results."""
  done = [(p, r) for p, r in zip(points, runs) if harness.finished(os.path.join(outdir, r.name))]
  rows = [collect.row(p, r, os.path.join(outdir, r.name)) for p, r in done]
  results = {"experiment": config.NAME, "commit": harness.commit(), "rows": rows,
             "rendered": [{**r, "params": params(r["size"])} for r in rendered]}
  with open(os.path.join(folder, "results.json"), "w", encoding="utf-8") as f:
    json.dump(results, f, indent=2)
  plots = []
  if rows:
    plot_points(rows, os.path.join(folder, "sweep.png"))
    plots.append("![final eval loss per point](sweep.png)")
  for size in dict.fromkeys(p.size for p, _ in done):
    curves = {p.label: harness.eval_curve(os.path.join(outdir, r.name))
              for p, r in done if p.size == size}
    harness.plot_curves(curves, os.path.join(folder, f"eval_{size}.png"),
                        f"{config.NAME} ({size}): global eval loss")
    plots.append(f"![eval curves, {size}](eval_{size}.png)")
  missing = [p.label for p, r in zip(points, runs) if (p, r) not in done]
  parts = [
      f"# Experiment `{config.NAME}`", "",
      f"Command: `{command}`", "",
      f"Measured {harness.today()} at commit `{results['commit'][:12]}` on {harness.machine()}; "
      f"the {len(rows)} runs took {sum(r['wall_s'] for r in rows) / 60:.1f} min of run time in "
      f"all ({wall_s / 60:.1f} min of wall time in this invocation, which reuses finished runs "
      "and may run several at once). Runs use the virtual clock, so their losses and "
      "accounting do not depend on the machine's load.", "",
      "## The grid", "", config.__doc__.strip(), "",
      "## Points run on CPU", "", _table(rows, config.COLUMNS), "",
      *([f"Not run yet: {', '.join(missing)}.", ""] if missing else []),
      "## By size and method", "", summary_table(rows) if rows else "(no runs yet)", "",
      *[line for plot in plots for line in (plot, "")],
      "## Points rendered for TPU, not run", "",
      "Launch files under [`launch/`](launch/): a JobSet manifest per DiLoCo-family point "
      "(`diloco jobset`, one slice per learner) and `commands.sh`, which reproduces "
      "them and holds the data-parallel commands. Image, bucket and data path are "
      "placeholders (the runner's --image, --bucket, --data_path).", "",
      _table([{**r, "launch": f"[{r['launch']}](launch/{r['launch']})"}
              for r in results["rendered"]], RENDERED_COLUMNS), "",
  ]
  harness.write_readme(folder, parts)
  return results
