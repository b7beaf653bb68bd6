"""Heterogeneous learners (docs/design.md 5): half 18% slower, 10% per-step variation.

    python -m experiments.goodput.heterogeneous [--outdir=runs/goodput] [--chips=1200000]

Compares the syncer policies K = M, K = 1 without grace and K = 1 with the grace window on M = 8
learners, with failures (MTBI 1 year, fitted failure model) and without (`--mtbi_years=inf`
row). Prints a markdown table and writes `heterogeneous_goodput.png` under `--outdir`.
Goodput counts device-seconds spent stepping; learners per round and the merged-token fraction
show how much of that work each merge actually combines (the paper's quality argument).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import matplotlib
from absl import app, flags

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from diloco.sim import (
  engine,
  params,
)

FLAGS = flags.FLAGS
FLAGS = flags.FLAGS


def policies(m: int) -> list[tuple[str, int, bool]]:
  return [(f"K=M={m}", m, False), ("K=1, no grace", 1, False), ("K=1, grace", 1, True)]


def run(mtbi_years: float) -> list[tuple[str, engine.SimResult]]:
  m = FLAGS.learners
  speeds = tuple([1.0] * (m - m // 2) + [FLAGS.slowdown] * (m // 2))
  base = params.SimConfig(mode="decoupled", chips=FLAGS.chips, learners=m, days=FLAGS.days,
                          seed=FLAGS.seed, speeds=speeds, step_jitter=FLAGS.step_jitter,
                          failures=params.FailureModel(mtbi_years=mtbi_years))
  results = []
  for name, k, grace in policies(m):
    cfg = dataclasses.replace(base, sync=dataclasses.replace(base.sync, quorum=k), grace=grace)
    results.append((name, engine.simulate(cfg)))
  return results


def main(argv: Sequence[str]) -> None:
  del argv
  print(f"M={FLAGS.learners}, half x{FLAGS.slowdown} slower, jitter {FLAGS.step_jitter}, "
        f"{FLAGS.chips:,} chips, {FLAGS.days:g} days\n")
  print("| failures | policy | goodput % | merged-token % | learners/round | staleness mean |")
  print("|---|---|---|---|---|---|")
  results = {}
  for label, mtbi in (("MTBI 1 y", 1.0), ("none", float("inf"))):
    results[label] = run(mtbi)
    for name, r in results[label]:
      print(f"| {label} | {name} | {100 * r.goodput:.1f} | {100 * r.merged_token_fraction:.1f} "
            f"| {r.learners_per_round:.2f} | {r.staleness_mean:.2f} |")
  fig, axes = plt.subplots(1, 3, figsize=(11, 3.8))
  metrics = (("goodput %", lambda r: 100 * r.goodput),
             ("merged-token %", lambda r: 100 * r.merged_token_fraction),
             ("learners per round", lambda r: r.learners_per_round))
  width = 0.38
  for ax, (title, fn) in zip(axes, metrics):
    for j, (label, rows) in enumerate(results.items()):
      xs = [i + (j - 0.5) * width for i in range(len(rows))]
      ax.bar(xs, [fn(r) for _, r in rows], width, label=f"failures: {label}")
    ax.set_xticks(range(len(rows)), [name for name, _ in rows], fontsize=8)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.suptitle(f"M={FLAGS.learners}: half {FLAGS.slowdown}x slower, "
               f"{FLAGS.step_jitter:.0%} per-step jitter")
  fig.tight_layout()
  os.makedirs(FLAGS.outdir, exist_ok=True)
  path = os.path.join(FLAGS.outdir, "heterogeneous_goodput.png")
  fig.savefig(path, dpi=120)
  print(f"\nwrote {path}")


def define_flags() -> None:
  """The command line (defined only when run as a script, so tests can import this)."""
  flags.DEFINE_string("outdir", "runs/goodput", "Where to write the plot.")
  flags.DEFINE_integer("chips", 1_200_000, "Chips.")
  flags.DEFINE_integer("learners", 8, "M learners (half of them slow).")
  flags.DEFINE_float("slowdown", 1.18, "Step-time factor of the slow half.")
  flags.DEFINE_float("step_jitter", 0.1, "Per-step variation.")
  flags.DEFINE_float("days", 30.0, "Simulated days.")
  flags.DEFINE_integer("seed", 0, "Random seed.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
