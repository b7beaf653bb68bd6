"""Runs the CPU points (resumably, optionally a few at a time) and reads them back as rows
through `experiments.harness` (which reads Decoupled and data-parallel runs alike)."""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Sequence

from experiments import harness
from experiments.sweep.grid import Point

finished = harness.finished
eval_curve = harness.eval_curve


def run_all(runs: Sequence[harness.Run], outdir: str, jobs: int = 1) -> float:
  """Runs the unfinished `runs`, `jobs` at a time; the wall seconds spent."""
  todo = [r for r in runs if not finished(os.path.join(outdir, r.name))]
  started = time.monotonic()
  with concurrent.futures.ThreadPoolExecutor(max(jobs, 1)) as pool:
    for future in [pool.submit(harness.run_all, [r], outdir) for r in todo]:
      future.result()  # a failed run raises here, naming its log
  return time.monotonic() - started


def row(point: Point, run: harness.Run, workdir: str) -> dict:
  """One flat row: the point's axes, method, seed, tokens, eval_loss, accounting figures."""
  out = harness.collect(run, workdir)  # data-parallel rows carry no accounting figures
  axes = {"point": point.label, "size": point.size, "method": point.method, "M": point.M,
          "K": point.K, "H": point.H, "P": point.P}
  return {**axes, **{k: v for k, v in out.items() if k not in axes}}
