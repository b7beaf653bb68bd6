"""Runs the CPU points (resumably, optionally a few at a time) and reads them back as rows.

`experiments.harness` reads Decoupled runs: they write accounting.json and evaluate as the
syncer. A data-parallel run writes neither (its records say role "dp" and it ends with an
export), so this module also recognises a finished data-parallel run, its eval curve and its
row, which carries no accounting figures.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from collections.abc import Sequence

from diloco.observe.accounting import read_jsonl
from experiments import harness
from experiments.sweep.grid import Point


def finished(workdir: str) -> bool:
  return harness.finished(workdir) or os.path.isdir(os.path.join(workdir, "export"))


def run_all(runs: Sequence[harness.Run], outdir: str, jobs: int = 1) -> float:
  """Runs the unfinished `runs`, `jobs` at a time; the wall seconds spent."""
  todo = [r for r in runs if not finished(os.path.join(outdir, r.name))]
  started = time.monotonic()
  with concurrent.futures.ThreadPoolExecutor(max(jobs, 1)) as pool:
    for future in [pool.submit(harness.run_all, [r], outdir) for r in todo]:
      future.result()  # a failed run raises here, naming its log
  return time.monotonic() - started


def eval_curve(workdir: str) -> list[dict]:
  curve = harness.eval_curve(workdir)
  if curve:
    return curve
  cfg = json.load(open(os.path.join(workdir, "config.json"), encoding="utf-8"))
  per_step = cfg["train"]["batch_size"] * cfg["data"]["seq_len"]
  return [{"step": r["step"], "tokens": r["step"] * per_step, "time": r.get("time", r["t"]),
           "eval_loss": r["eval/loss"]}
          for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
          if "eval/loss" in r and r.get("role") == "dp"]


def row(point: Point, run: harness.Run, workdir: str) -> dict:
  """One flat row: the point's axes, method, seed, tokens, eval_loss, accounting figures."""
  if os.path.exists(os.path.join(workdir, "accounting.json")):
    out = harness.collect(run, workdir)
  else:  # data-parallel
    curve = eval_curve(workdir)
    cfg = json.load(open(os.path.join(workdir, "config.json"), encoding="utf-8"))
    out = {"seed": run.seed,
           "tokens": cfg["train"]["steps"] * cfg["train"]["batch_size"] * cfg["data"]["seq_len"],
           "eval_loss": float(curve[-1]["eval_loss"]),
           "initial_loss": float(curve[0]["eval_loss"]),
           "wall_s": round(curve[-1]["time"] - curve[0]["time"], 1)}
    out.update(dict(run.overrides))
  axes = {"point": point.label, "size": point.size, "method": point.method, "M": point.M,
          "K": point.K, "H": point.H, "P": point.P}
  return {**axes, **{k: v for k, v in out.items() if k not in axes}}
