"""Benchmark: syncer merge throughput over host copy bandwidth, measured in the same run.

One syncer round of a fragment: token weights, RDA merge of M float32 outer gradients
(`diloco.outer.merge_fragment`), Nesterov outer step in place. Throughput is payload bytes
(M x fragment bytes) per second; the reference is `np.copyto` of one array of the same total size.
RDA must read every payload twice (norms, then the weighted sum), so the ratio is bounded by
about 0.5; the goal is >= 0.3.

  PYTHONPATH=. .venv/bin/python scripts/bench_merge.py  # prints one JSON line last
"""

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np

from diloco import outer


def _best_and_median(fn, reps: int) -> tuple[float, float]:
  """Wall times of `reps` calls after one warm-up call: (best, median) in seconds."""
  fn()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return min(times), statistics.median(times)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--learners", type=int, default=8, help="payloads per round (M)")
  parser.add_argument("--fragment_mib", type=int, default=64, help="fragment size in MiB")
  parser.add_argument("--tensors", type=int, default=4, help="equal tensors per fragment")
  parser.add_argument("--reps", type=int, default=5, help="timed repetitions (best is used)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  rng = np.random.default_rng(args.seed)
  per_tensor = args.fragment_mib * (1 << 20) // 4 // args.tensors
  names = [f"t{i}" for i in range(args.tensors)]
  deltas = [{n: rng.standard_normal(per_tensor, dtype=np.float32) for n in names}
            for _ in range(args.learners)]
  params = {n: rng.standard_normal(per_tensor, dtype=np.float32) for n in names}
  momentum = {n: np.zeros(per_tensor, np.float32) for n in names}
  tokens = rng.integers(1000, 2000, args.learners)
  steps = rng.integers(20, 30, args.learners)
  payload_bytes = sum(a.nbytes for d in deltas for a in d.values())

  def merge_round():
    w = outer.token_weights(tokens, steps)
    g = outer.merge_fragment(deltas, w, None, method="rda")
    outer.nesterov_step(params, momentum, g, lr=0.7, mu=0.9, inplace=True)

  src = np.ones(payload_bytes // 4, np.float32)
  dst = np.zeros_like(src)
  copy_s, copy_med = _best_and_median(lambda: np.copyto(dst, src), args.reps)
  merge_s, merge_med = _best_and_median(merge_round, args.reps)
  result = {
      "bench": "merge",
      "ratio": round(copy_s / merge_s, 4),
      "ratio_median": round(copy_med / merge_med, 4),
      "merge_bytes_per_s": round(payload_bytes / merge_s),
      "copy_bytes_per_s": round(payload_bytes / copy_s),
      "merge_s": round(merge_s, 5),
      "copy_s": round(copy_s, 5),
      "payload_bytes": payload_bytes,
      "learners": args.learners,
      "fragment_bytes": payload_bytes // args.learners,
      "reps": args.reps,
      "numpy": np.__version__,
      "machine": platform.machine(),
  }
  print(json.dumps(result))


if __name__ == "__main__":
  main(sys.argv[1:])
