"""The goodput grid of docs/design.md 4: chips x {dp, elastic, Decoupled M = 2, 4, 8, 16}.

    python -m experiments.goodput.table [--outdir=runs/goodput] [--days=30] [--seed=0]

Prints a markdown table (simulated goodput, with the paper's value in brackets where one is
known) and writes `goodput_table.md` and `goodput_table.png` under `--outdir`. The Decoupled
rows (K = 1, grace window on, equal speeds) use the failure model fitted to the dp and elastic
rows by `experiments/goodput/calibrate.py`, with no further fitting. The paper values known to
us: the ten dp / elastic numbers and 88% for M = 8 at 1.2M chips (docs/design.md 1); no others.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import matplotlib
from absl import app, flags

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from diloco.sim import (
  engine,
  params,
)

CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
ROWS = (("dp", 1), ("elastic", 1), ("decoupled", 2), ("decoupled", 4), ("decoupled", 8),
        ("decoupled", 16))
PAPER = {("dp", 1): (72, 57, 38, 27, 18), ("elastic", 1): (88, 80, 69, 58, 40),
         ("decoupled", 8): (None, None, None, 88, None)}

FLAGS = flags.FLAGS
FLAGS = flags.FLAGS


def row_name(mode: str, learners: int) -> str:
  return {"dp": "data-parallel", "elastic": "elastic data-parallel"}.get(
      mode, f"Decoupled M={learners}")


def run_grid(days: float, seed: int) -> dict[tuple[str, int], list[float]]:
  """Simulated goodput (fraction) per row and chip count."""
  grid = {}
  for mode, learners in ROWS:
    grid[(mode, learners)] = [
        engine.simulate(params.SimConfig(mode=mode, chips=chips, learners=learners, days=days,
                                         seed=seed)).goodput for chips in CHIPS]
  return grid


def markdown(grid: dict[tuple[str, int], list[float]]) -> str:
  lines = ["| goodput % | " + " | ".join(f"{c / 1e6:g}M" if c >= 1e6 else f"{c // 1000}k"
                                         for c in CHIPS) + " |",
           "|---" * (len(CHIPS) + 1) + "|"]
  for row, values in grid.items():
    paper = PAPER.get(row, (None,) * len(CHIPS))
    cells = [f"{100 * v:.1f}" + (f" ({p})" if p is not None else "")
             for v, p in zip(values, paper)]
    lines.append(f"| {row_name(*row)} | " + " | ".join(cells) + " |")
  lines.append("")
  lines.append("Simulated, 30 days, MTBI_chip = 1 year; (paper value) where known.")
  return "\n".join(lines)


def plot(grid: dict[tuple[str, int], list[float]], path: str) -> None:
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for row, values in grid.items():
    line, = ax.plot(CHIPS, [100 * v for v in values], marker="o", label=row_name(*row))
    paper = PAPER.get(row)
    if paper:
      xs = [c for c, p in zip(CHIPS, paper) if p is not None]
      ax.plot(xs, [p for p in paper if p is not None], linestyle="none", marker="x",
              markersize=9, color=line.get_color())
  ax.set_xscale("log")
  ax.set_xticks(CHIPS, [f"{c / 1e6:g}M" for c in CHIPS])
  ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
  ax.set_xlabel("chips (MTBI per chip = 1 year)")
  ax.set_ylabel("goodput %")
  ax.set_ylim(0, 100)
  ax.grid(alpha=0.3)
  ax.set_title("Simulated goodput (lines) vs paper (x)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: Sequence[str]) -> None:
  del argv
  start = time.perf_counter()
  grid = run_grid(FLAGS.days, FLAGS.seed)
  table = markdown(grid)
  print(table)
  os.makedirs(FLAGS.outdir, exist_ok=True)
  with open(os.path.join(FLAGS.outdir, "goodput_table.md"), "w") as f:
    f.write(table + "\n")
  png = os.path.join(FLAGS.outdir, "goodput_table.png")
  plot(grid, png)
  print(f"\nwrote {png} ({time.perf_counter() - start:.1f} s)")


def define_flags() -> None:
  """The command line (defined only when run as a script, so tests can import this)."""
  flags.DEFINE_string("outdir", "runs/goodput", "Where to write the table and the plot.")
  flags.DEFINE_float("days", 30.0, "Simulated days per configuration.")
  flags.DEFINE_integer("seed", 0, "Random seed.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
