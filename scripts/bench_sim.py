"""Benchmark of the goodput simulator: one JSON line last.

    python scripts/bench_sim.py [--repeats=3]

Times the 1.2M-chip, 30-day, Decoupled M = 8 (K = 1, grace) configuration (best of
`--repeats`) and, in the same run, a baseline: a pure-Python `heapq` loop that pushes and pops
the same number of events with no work attached (on a heap of 256 entries, about the number of
pending repairs at this scale). Fields: `wall_s`, `events`, `events_per_s`,
`baseline_s` and `ratio` = wall_s / baseline_s (how many bare heap operations one simulated
event costs), plus the dp and elastic wall times at the same scale and the goodput.
"""

from __future__ import annotations

import heapq
import json
import random
import time
from collections.abc import Sequence

from absl import app, flags

from diloco.sim import engine, params

flags.DEFINE_integer("repeats", 3, "Timed repetitions (best is reported).")
FLAGS = flags.FLAGS


def heap_baseline(n: int, seed: int = 0) -> float:
  """Seconds for n pushes and n pops of (time, seq, kind, a, b) tuples on a heap of 256."""
  rng = random.Random(seed)
  heap = [(rng.random(), -i, 0, 0, 0) for i in range(256)]
  heapq.heapify(heap)
  t = 0.0
  start = time.perf_counter()
  for i in range(n):
    heapq.heappush(heap, (t + rng.random(), i, 0, i, 0))
    t = heapq.heappop(heap)[0]
  return time.perf_counter() - start


def _best(cfg: params.SimConfig, repeats: int) -> tuple[float, engine.SimResult]:
  best, result = float("inf"), None
  for _ in range(repeats):
    start = time.perf_counter()
    result = engine.simulate(cfg)
    best = min(best, time.perf_counter() - start)
  return best, result


def main(argv: Sequence[str]) -> None:
  del argv
  cfg = params.SimConfig(mode="decoupled", chips=1_200_000, learners=8, days=30.0, seed=0)
  wall, result = _best(cfg, FLAGS.repeats)
  baseline = min(heap_baseline(result.events) for _ in range(FLAGS.repeats))
  dp_wall, _ = _best(params.SimConfig(mode="dp", chips=1_200_000, learners=1), 1)
  el_wall, _ = _best(params.SimConfig(mode="elastic", chips=1_200_000, learners=1), 1)
  record = {"config": "decoupled chips=1200000 M=8 K=1 grace days=30",
            "wall_s": round(wall, 3), "events": result.events,
            "events_per_s": round(result.events / wall), "baseline_s": round(baseline, 3),
            "ratio": round(wall / baseline, 2), "goodput": round(result.goodput, 4),
            "dp_wall_s": round(dp_wall, 3), "elastic_wall_s": round(el_wall, 3)}
  print(json.dumps(record))


if __name__ == "__main__":
  app.run(main)
