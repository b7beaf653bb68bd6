"""The scaling experiment's plots: the gap to data-parallel against M, and eval loss against
tokens of each picked method, one file per (model, steps) group; the gap against N over the
model sizes."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments import harness  # noqa: E402
from experiments.scaling import config  # noqa: E402
from experiments.scaling.report import KIND_NAMES, gap, picked_stats, size_points  # noqa: E402


def gap_plot(group: list[dict], path: str, title: str) -> bool:
  """Gap (percent) against M: ours per kind (bar: seed spread), the study's 35M row and the
  targets. False (nothing written) without a data-parallel reference."""
  ps = picked_stats(group)
  dp = ps.get(("data-parallel", 0))
  if dp is None:
    return False
  fig, ax = plt.subplots(figsize=(5.5, 3.8))
  for kind, marker in (("diloco", "o"), ("decoupled", "s")):
    ms = sorted(m for k, m in ps if k == kind)
    if ms:
      ax.errorbar(ms, [gap(ps[(kind, m)]["mean"], dp["mean"]) for m in ms],
                  yerr=[50.0 * ps[(kind, m)]["spread"] / dp["mean"] for m in ms],
                  fmt=marker + "-", capsize=3, label=f"{KIND_NAMES[kind]} (ours)")
  study = config.STUDY_35M
  ms = sorted(m for m in study if m != "data-parallel")
  ax.plot(ms, [gap(study[m], study["data-parallel"]) for m in ms], "k^--", lw=1,
          label="DiLoCo, study 35M")
  ax.plot(sorted(config.TARGET_GAP), [config.TARGET_GAP[m] for m in sorted(config.TARGET_GAP)],
          "rv", ms=8, label="target (Decoupled)")
  ax.axhline(0, color="grey", lw=0.8)
  ax.set_xscale("log", base=2)
  ax.set_xticks(ms, [str(m) for m in ms])
  ax.set_xlabel("M (learners)")
  ax.set_ylabel("eval-loss gap to data-parallel (%)")
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


# The study's smallest model, where its rows start (its Table 4 names it 35M).
STUDY_SMALLEST_N = 35e6


def size_plot(rows: list[dict], path: str) -> bool:
  """Gap (percent, seed means) against N per M: our sizes at 20N joined per method, the study's
  35M row, and its fitted laws' values at tiny's N (their coefficients are not here, so no law
  is drawn as a line). False (nothing written) with fewer than two of our sizes."""
  sizes = size_points(rows)
  if len(sizes) < 2:
    return False
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  study = config.STUDY_35M
  for i, m in enumerate(config.SIZE_LEARNERS):
    color = f"C{i}"
    for kind, marker, style in (("diloco", "o", "-"), ("decoupled", "s", ":")):
      points = [(n, gap(ps[(kind, m)]["mean"], ps[("data-parallel", 0)]["mean"]))
                for n, _, ps in sizes if (kind, m) in ps]
      if points:
        ax.plot(*zip(*points), marker + style, color=color, ms=5,
                label=f"{KIND_NAMES[kind]} M = {m}")
    if m in study:
      ax.plot([STUDY_SMALLEST_N], [gap(study[m], study["data-parallel"])], "^", color=color,
              ms=8, mec="k")
    if m in config.STUDY_LAW_AT_TINY:
      ax.plot([config.params("tiny")], [config.STUDY_LAW_AT_TINY[m]], "x", color=color, ms=9,
              mew=2)
  ax.plot([], [], "k^", label="study, 35M (Table 4)")
  ax.plot([], [], "kx", label="study's laws at tiny's N (Table 7)")
  ax.axhline(0, color="grey", lw=0.8)
  ax.set_xscale("log")
  ax.set_xlabel("N (parameters)")
  ax.set_ylabel("eval-loss gap to data-parallel (%)")
  ax.set_title(f"gap against N at 20N tokens, batch {config.DP_BATCH}, H = {config.PERIOD}",
               fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=6, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def curves_plot(group: list[dict], path: str, title: str) -> tuple[bool, list[str]]:
  """Eval loss against tokens (and run time) of data-parallel, data-parallel at one
  learner's batch and each picked setting, from each row's `eval_curve`: seed 0, or the lowest
  seed that has a curve (named in the legend). Returns whether a plot was written and the
  methods left out (every row carried without its curve)."""
  picked = {s["method"] for (kind, _), s in picked_stats(group).items()
            if kind != "data-parallel"}
  methods = {r["method"] for r in group if r["kind"] == "data-parallel" or r["method"] in picked}
  curves, missing = {}, []
  for method in sorted(methods):
    drawn = sorted((r for r in group if r["method"] == method and r.get("eval_curve")),
                   key=lambda r: r["seed"])
    if not drawn:
      missing.append(method)
      continue
    seed = drawn[0]["seed"]
    curves[method + (f" (seed {seed})" if seed else "")] = drawn[0]["eval_curve"]
  if not curves:
    return False, missing
  harness.plot_curves(curves, path, title, time_key="time",
                      time_label="run clock (virtual s for DiLoCo kinds, s for data-parallel)")
  return True, missing


def section_plots(group: list[dict], folder: str, prefix: str, title: str) -> list[str]:
  """Writes both plots of a group into `folder`; returns their markdown image lines."""
  lines = []
  gap_file, curve_file = f"{prefix}_gap.png", f"{prefix}_eval.png"
  if gap_plot(group, os.path.join(folder, gap_file), title):
    lines += [f"![gap against M]({gap_file})", ""]
  drawn, missing = curves_plot(group, os.path.join(folder, curve_file), title)
  if drawn:
    lines += [f"![eval loss against tokens]({curve_file})", ""]
  if missing:
    lines += ["Curves not drawn (every row of the method was carried from a results.json "
              "written before rows kept their evaluations; the runs are not on this machine): "
              + ", ".join(missing) + ".", ""]
  return lines
