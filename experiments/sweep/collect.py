"""Reads the sweep's finished CPU points back as rows through `experiments.harness` (which
reads Decoupled and data-parallel runs alike); `harness.run_all` runs them."""

from __future__ import annotations

from experiments import harness
from experiments.sweep.grid import Point


def row(point: Point, run: harness.Run, workdir: str) -> dict:
  """One flat row: the point's axes, method, seed, tokens, eval_loss, accounting figures."""
  out = harness.collect(run, workdir)  # data-parallel rows carry no accounting figures
  axes = {"point": point.label, "size": point.size, "method": point.method, "M": point.M,
          "K": point.K, "H": point.H, "P": point.P}
  return {**axes, **{k: v for k, v in out.items() if k not in axes}}
