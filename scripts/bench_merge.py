"""Benchmark: syncer merge throughput over host copy bandwidth, measured in the same run.

One syncer round of a fragment as the syncer should run it: token weights, then
`diloco.outer.merge_and_step`, which merges M float32 outer gradients by RDA and takes the Nesterov
outer step in place on the fragment and its momentum, reusing one workspace buffer across rounds and
sharing the work among `diloco.outer.kernels.MERGE_THREADS` threads (2 where there are 2 cores;
`--threads` overrides it). Throughput is payload bytes (M x fragment bytes) per second; the
reference is `np.copyto` (one thread) of one array of the same total size. `ratio` is best copy time
over best round time; copies and rounds are timed alternately so that both see the same load on a
shared host, and `ratio_median` is the median of the per-repetition ratios. `ratio_unfused` times
the unfused pair (`merge_fragment`, then `nesterov_step(inplace=True)`, same threads) the same way,
for comparison, and `ratio_syncer` the whole round inside `Syncer.tick` (M value payloads, K = M:
outer gradients, the tape's per-delivery norms, the fused merge, the published copy). RDA must read
every payload twice (norms, then the weighted sum); the goal is >= 0.3.

  PYTHONPATH=. .venv/bin/python scripts/bench_merge.py  # prints one JSON line last
"""

import json
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
from absl import app, flags

from diloco import fragments, outer
from diloco.delivery import Delivery
from diloco.outer import kernels
from diloco.outer.merge import OuterConfig
from diloco.sync.policy import SyncConfig
from diloco.sync.syncer import Syncer
from diloco.transport import Heartbeat

flags.DEFINE_integer("learners", 8, "Payloads per round (M).")
flags.DEFINE_integer("fragment_mib", 64, "Fragment size in MiB.")
flags.DEFINE_integer("tensors", 4, "Equal tensors per fragment.")
flags.DEFINE_integer("reps", 5, "Timed repetitions (best is used).")
flags.DEFINE_integer("seed", 0, "Seeds the payloads.")
flags.DEFINE_integer("threads", kernels.MERGE_THREADS,
                     "Threads per merge (diloco.outer.kernels.MERGE_THREADS).")
FLAGS = flags.FLAGS


def _interleaved_times(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
  """Wall times in seconds of `reps` rounds calling every fn once, after one warm-up round."""
  for fn in fns.values():
    fn()
  times = {name: [] for name in fns}
  for _ in range(reps):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
  return times


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  args = FLAGS
  kernels.MERGE_THREADS = args.threads

  rng = np.random.default_rng(args.seed)
  per_tensor = args.fragment_mib * (1 << 20) // 4 // args.tensors
  names = [f"t{i}" for i in range(args.tensors)]
  deltas = [{n: rng.standard_normal(per_tensor, dtype=np.float32) for n in names}
            for _ in range(args.learners)]
  params = {n: rng.standard_normal(per_tensor, dtype=np.float32) for n in names}
  momentum = {n: np.zeros(per_tensor, np.float32) for n in names}
  workspace = np.empty(per_tensor, np.float32)  # the syncer keeps one across rounds
  tokens = rng.integers(1000, 2000, args.learners)
  steps = rng.integers(20, 30, args.learners)
  payload_bytes = sum(a.nbytes for d in deltas for a in d.values())

  def merge_round():
    w = outer.token_weights(tokens, steps)
    outer.merge_and_step(params, momentum, deltas, w, None, lr=0.7, mu=0.9,
                         workspace=workspace)

  def unfused_round():
    w = outer.token_weights(tokens, steps)
    g = outer.merge_fragment(deltas, w, None, method="rda")
    outer.nesterov_step(params, momentum, g, lr=0.7, mu=0.9, inplace=True)

  # The whole syncer round as `Syncer.tick` runs it on M value payloads (K = M): outer
  # gradients, per-delivery norms for the tape, the fused merge, the published copy.
  shapes = {f"layers/{i}/w": (per_tensor,) for i in range(args.tensors)}
  plan = fragments.plan_fragments(shapes, num_fragments=1)
  syncer = Syncer({f"layers/{i}/w": params[n] for i, n in enumerate(names)}, plan,
                  SyncConfig(num_fragments=1, quorum=args.learners, gamma=0.0,
                             heartbeat_timeout_s=1e9), OuterConfig(), sync_delay_s=0.0)
  syncer.tick(0.0, [Heartbeat(m, 0, 1, 0.1, 0.0) for m in range(args.learners)], [])
  thetas = [{f"layers/{i}/w": params[n] - d[n] for i, n in enumerate(names)} for d in deltas]

  def syncer_round():
    base = syncer.versions[0]
    merged, _ = syncer.tick(1.0, [], [
        Delivery(learner=m, incarnation=0, fragment=0, local_step=8 * (base + 1), steps=8,
                 tokens=int(tokens[m]), base_version=base, kind="values", tensors=thetas[m],
                 transit_s=0.0)
        for m in range(args.learners)])
    assert len(merged) == 1, "the syncer round did not close"

  src = np.ones(payload_bytes // 4, np.float32)
  dst = np.zeros_like(src)
  times = _interleaved_times(
      {"copy": lambda: np.copyto(dst, src), "merge": merge_round, "unfused": unfused_round,
       "syncer": syncer_round}, args.reps)
  copy_s, merge_s, unfused_s, syncer_s = (min(times[k]) for k in ("copy", "merge", "unfused",
                                                                    "syncer"))
  result = {
      "bench": "merge",
      "ratio": round(copy_s / merge_s, 4),
      "ratio_median": round(statistics.median(
          c / m for c, m in zip(times["copy"], times["merge"])), 4),
      "ratio_unfused": round(copy_s / unfused_s, 4),
      "ratio_syncer": round(copy_s / syncer_s, 4),
      "merge_bytes_per_s": round(payload_bytes / merge_s),
      "copy_bytes_per_s": round(payload_bytes / copy_s),
      "merge_s": round(merge_s, 5),
      "copy_s": round(copy_s, 5),
      "unfused_s": round(unfused_s, 5),
      "syncer_s": round(syncer_s, 5),
      "payload_bytes": payload_bytes,
      "learners": args.learners,
      "fragment_bytes": payload_bytes // args.learners,
      "reps": args.reps,
      "threads": args.threads,
      "numpy": np.__version__,
      "machine": platform.machine(),
  }
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
