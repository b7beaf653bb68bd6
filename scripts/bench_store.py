"""Benchmark: store round trips over raw NumPy files, and delivery-to-visible merge latency.

1. Throughput. One round trip of a float32 fragment through the store, as a delivery lives:
   `Payloads.put` (Orbax entry + commit marker), then `Payloads.read` (the syncer's
   checked read). The baseline is what a user would write by hand in the same directory:
   `np.save` of each tensor to its own `.npy` file (the store also keeps one array per
   tensor), then `np.load` of them. The two alternate in one run (the order flips every
   repetition); ratio = baseline write+read time / store write+read time (best, and the
   median of the per-repetition ratios). Goal: ratio >= 0.7. Deleting the entry
   (`Payloads.remove` vs `os.remove`) is timed apart (`ratio_with_remove`): the syncer
   deletes on a background thread, off its loop. The default fragment is 64 MiB, the
   fragment size of `bench_merge.py` (a 1B-parameter model in P = 16 fragments is ~250 MB
   each); at a few MiB, Orbax's fixed cost per entry (~5-10 ms) dominates.
2. Latency. M learner threads, each with a `LearnerStoreLink` on its own `Store`, and a
   syncer thread that loops like `syncer_process.run` (poll `SyncerStoreLink`, `tick`,
   durable `_commit`, `release`) over P fragments of a small fake parameter set. In round r
   every learner delivers fragment r % P (the schedule makes them all due at the same step)
   with `base_version` = the newest version it has, then waits until the version that
   admitted its delivery is visible through its own link (in `merged/index.json` and read
   back). A sample is that time minus the time `put_payload` of the delivery returned.
   Heartbeats report no step time, so rounds close without a grace window.

  PYTHONPATH=. .venv/bin/python scripts/bench_store.py  # prints one JSON line last
  PYTHONPATH=. .venv/bin/python scripts/bench_store.py --fragment_mib=2 --rounds=10
"""

import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time

import numpy as np
from absl import app, flags, logging

from diloco import fragments
from diloco.delivery import Delivery
from diloco.distributed import learner_link, syncer_link, syncer_process
from diloco.distributed.store import Store
from diloco.distributed.store.merged_versions import MergedVersions
from diloco.distributed.store.names import payload_name
from diloco.distributed.store.payload_box import Payloads
from diloco.outer.merge import OuterConfig
from diloco.sync.policy import SyncConfig
from diloco.sync.syncer import Syncer
from diloco.transport import Heartbeat

flags.DEFINE_integer("fragment_mib", 64, "Throughput fragment, MiB.")
flags.DEFINE_integer("tensors", 4, "Equal tensors per fragment.")
flags.DEFINE_integer("reps", 9, "Timed round trips of each kind.")
flags.DEFINE_integer("learners", 4, "Learner threads (M).")
flags.DEFINE_integer("fragments", 4, "Fragments of the fake model (P).")
flags.DEFINE_float("latency_fragment_mib", 1.0, "Fragment size of the latency run, MiB.")
flags.DEFINE_integer("rounds", 40, "Timed delivery rounds.")
flags.DEFINE_integer("warmup", 2, "Untimed rounds first.")
flags.DEFINE_integer("quorum", 1, "sync.quorum (K).")
flags.DEFINE_float("poll_s", 0.05, "store.poll_s.")
flags.DEFINE_float("wait_s", 30.0, "Longest wait for one delivery to become visible.")
flags.DEFINE_float("timeout_s", 600.0, "Bound of the latency run.")
flags.DEFINE_string("dir", None, "Parent of the temporary directory.")
flags.DEFINE_integer("seed", 0, "Seeds the payloads.")
FLAGS = flags.FLAGS


class _TimedPayloads(Payloads):
  """`Payloads` that note when each delivery became committed."""

  def __init__(self, blobs, committed: dict):
    super().__init__(blobs)
    self._committed = committed

  def put(self, payload: Delivery) -> int:
    nbytes = super().put(payload)
    self._committed[payload_name(payload.fragment, payload.learner, payload.incarnation,
                                 payload.local_step)] = time.time()
    return nbytes


class _TimedMerged(MergedVersions):
  """`MergedVersions` that note when each merged version became committed."""

  def __init__(self, blobs, published: dict):
    super().__init__(blobs)
    self._published = published

  def put(self, merged, momentum, marker, *, fence=None) -> None:
    super().put(merged, momentum, marker, fence=fence)
    self._published[(merged.fragment, merged.version)] = time.time()


def _timed_store(root: str, committed: dict, published: dict) -> Store:
  """A `Store` that notes when each delivery and each merged version became committed."""
  store = Store(root)
  store.payloads = _TimedPayloads(store.blobs, committed)
  store.merged = _TimedMerged(store.blobs, published)
  return store


# Throughput.
def _store_trip(store: Store, payload: Delivery, expected: dict) -> tuple[dict, list[float]]:
  t0 = time.perf_counter()
  store.payloads.put(payload)
  t1 = time.perf_counter()
  name = payload_name(payload.fragment, payload.learner, payload.incarnation, payload.local_step)
  got = store.payloads.read(name, expected).tensors
  t2 = time.perf_counter()
  store.payloads.remove(name)
  return got, [t1 - t0, t2 - t1, time.perf_counter() - t2]


def _numpy_trip(directory: str, tensors: dict) -> tuple[dict, list[float]]:
  t0 = time.perf_counter()
  files = {}
  for i, (path, tensor) in enumerate(sorted(tensors.items())):
    files[path] = os.path.join(directory, f"t{i:04d}.npy")
    np.save(files[path], tensor)
  t1 = time.perf_counter()
  got = {path: np.load(f) for path, f in files.items()}
  t2 = time.perf_counter()
  for f in files.values():
    os.remove(f)
  return got, [t1 - t0, t2 - t1, time.perf_counter() - t2]


def _throughput(top: str, args) -> dict:
  """Alternated round trips; a warm-up of each first, and a check that both read back."""
  rng = np.random.default_rng(args.seed)
  per_tensor = args.fragment_mib * (1 << 20) // 4 // args.tensors
  tensors = {f"layers/{i}/w": rng.standard_normal(per_tensor, dtype=np.float32)
             for i in range(args.tensors)}
  expected = {0: {k: v.shape for k, v in tensors.items()}}
  store = Store(os.path.join(top, "store"))
  plain = os.path.join(top, "numpy")
  os.makedirs(plain)
  times = {"store": [], "numpy": []}
  parts = {"store": [], "numpy": []}
  for rep in range(args.reps + 1):
    payload = Delivery(learner=0, incarnation=0, fragment=0, local_step=rep + 1, steps=1, tokens=1,
                       base_version=0, kind="values", tensors=tensors, transit_s=0.0)
    for kind in ("store", "numpy") if rep % 2 else ("numpy", "store"):
      t0 = time.perf_counter()
      got, split = (_store_trip(store, payload, expected) if kind == "store" else
                    _numpy_trip(plain, tensors))
      elapsed = time.perf_counter() - t0
      if rep == 0:  # warm-up, untimed
        if any(not np.array_equal(got[k], tensors[k]) for k in tensors):
          raise AssertionError(f"{kind} round trip read back other values")
        continue
      times[kind].append(elapsed)
      parts[kind].append(split)
  nbytes = sum(v.nbytes for v in tensors.values())
  trip = {k: [w + r for w, r, _ in v] for k, v in parts.items()}  # write + read
  best = {k: min(v) for k, v in trip.items()}
  split = {k: dict(zip(("write", "read", "remove"),
                       (round(statistics.median(s), 5) for s in zip(*v))))
           for k, v in parts.items()}
  return {
      "ratio": round(best["numpy"] / best["store"], 4),
      "ratio_median": round(statistics.median(n / s for n, s in zip(trip["numpy"],
                                                                    trip["store"])), 4),
      "ratio_with_remove": round(min(times["numpy"]) / min(times["store"]), 4),
      "store_bytes_per_s": round(nbytes / best["store"]),
      "numpy_bytes_per_s": round(nbytes / best["numpy"]),
      "store_s": round(best["store"], 5),
      "numpy_s": round(best["numpy"], 5),
      "store_median_split_s": split["store"],
      "numpy_median_split_s": split["numpy"],
      "fragment_bytes": nbytes,
  }


# Latency.
def _syncer_loop(store: Store, syncer: Syncer, link, records: list, poll_s: float,
                 keep: int, stop: threading.Event) -> None:
  """`syncer_process.run`'s loop without evaluation: poll, tick, durable commit, release."""
  with open(os.devnull, "w", encoding="utf-8") as tape:
    last_registry = 0.0
    while not stop.is_set():
      now = time.time()
      _, deadline = syncer_process.sync_once(store, syncer, link, records, tape, keep, now)
      if now - last_registry >= 1.0:
        last_registry = now
        store.blobs.write_json("registry.json", dict(syncer.state_summary(), time=now,
                                                     versions=syncer.versions,
                                                     alive=syncer.alive(now)))
      if store.blobs.exists("stop.json"):
        break
      stop.wait(poll_s if deadline is None else min(poll_s, max(deadline - time.time(), 0.0)))


def _learner_loop(m: int, store: Store, args, num_fragments: int, admitted: dict,
                  ready: threading.Event, barrier: threading.Barrier, out: list) -> None:
  """Registers, then per round: deliver, wait until the version that admitted it is visible."""
  incarnation = store.learners.next_incarnation(m)
  link = learner_link.LearnerStoreLink(store, m, incarnation, poll_s=args.poll_s)
  rng = np.random.default_rng(args.seed + 1 + m)
  try:
    link.heartbeat(Heartbeat(m, incarnation, 0, 0.0, time.time()))
    link.wait_initial(num_fragments, timeout=args.wait_s)
    if not ready.wait(args.wait_s):
      raise TimeoutError(f"learner {m}: the syncer did not register every learner")
    for r in range(args.warmup + args.rounds):
      barrier.wait()
      p, step = r % num_fragments, r + 1
      base = link.latest(p)
      tensors = {k: v + rng.standard_normal(v.shape, dtype=np.float32) * 1e-3
                 for k, v in base.tensors.items()}
      link.heartbeat(Heartbeat(m, incarnation, step, 0.0, time.time()))
      # transit_s is a duration (the syncer refuses a clock reading).
      link.deliver(Delivery(learner=m, incarnation=incarnation, fragment=p, local_step=step,
                            steps=1, tokens=1000, base_version=base.version, kind="values",
                            tensors=tensors, transit_s=0.0))
      deadline = time.monotonic() + args.wait_s
      need, seen = base.version + 1, None
      while time.monotonic() < deadline:
        got = link.wait_for(p, need, timeout=min(0.5, max(deadline - time.monotonic(), 0.0)))
        version = admitted.get((m, step))
        if version is not None and got.version >= version:
          seen = time.time()
          break
        need = max(need, got.version + 1) if version is None else version
      if r >= args.warmup:
        out.append((m, p, step, incarnation, seen))
  finally:
    link.close()


def _latency(root: str, args) -> dict:
  """Delivery-committed to merged-visible seconds, over `rounds` rounds of M learners."""
  num_fragments, learners = args.fragments, args.learners
  per_tensor = int(args.latency_fragment_mib * (1 << 20)) // 4 // args.tensors
  rng = np.random.default_rng(args.seed)
  params = {f"layers/{i}/w": rng.standard_normal(per_tensor, dtype=np.float32)
            for i in range(num_fragments * args.tensors)}
  plan = fragments.plan_fragments({k: v.shape for k, v in params.items()}, num_fragments)
  committed, published, admitted = {}, {}, {}
  store = _timed_store(root, committed, published)
  sync = SyncConfig(num_fragments=num_fragments, quorum=args.quorum)
  records: list[dict] = []

  def on_round(record: dict) -> None:
    records.append(record)
    for a in record["admitted"]:
      admitted[(a["learner"], a["local_step"])] = record["version"]

  syncer = Syncer(params, plan, sync, OuterConfig(), on_round=on_round)
  for merged in syncer.initial(time.time()):
    store.merged.put(merged, syncer.momentum, {"round": None, "state": syncer.export_state()})
  expected = {p: {k: params[k].shape for k in paths} for p, paths in enumerate(plan.fragments)}
  link = syncer_link.SyncerStoreLink(store, expected)
  link.poll(time.time())  # the syncer's first poll, before any learner (it ignores payloads)
  stop, ready = threading.Event(), threading.Event()
  barrier = threading.Barrier(learners, timeout=args.wait_s + 5)
  samples: list[tuple] = []
  errors: list[BaseException] = []

  def guarded(fn, *fn_args):
    try:
      fn(*fn_args)
    except BaseException as e:  # reported after the threads are stopped
      errors.append(e)
      barrier.abort()

  threads = [threading.Thread(target=guarded, name="syncer", daemon=True, args=(
      _syncer_loop, store, syncer, link, records, args.poll_s, sync.max_staleness + 2, stop))]
  threads += [threading.Thread(target=guarded, name=f"learner{m}", daemon=True, args=(
      _learner_loop, m, _timed_store(root, committed, published), args,
      num_fragments, admitted, ready, barrier, samples)) for m in range(learners)]
  end = time.monotonic() + args.timeout_s
  for t in threads:
    t.start()
  deadline = time.monotonic() + args.wait_s
  while len(syncer.registry) < learners and not errors and time.monotonic() < deadline:
    time.sleep(0.01)
  if len(syncer.registry) == learners:  # else the learners time out waiting
    ready.set()
  for t in threads[1:]:
    t.join(max(end - time.monotonic(), 0.0))
  store.blobs.write_json("stop.json", {"time": time.time()})
  stop.set()
  threads[0].join(30)
  link.close()
  if errors:
    raise RuntimeError(f"latency run failed: {errors[0]!r}") from errors[0]
  if any(t.is_alive() for t in threads):
    raise TimeoutError(f"latency run did not finish within {args.timeout_s} s")
  lat, to_index, timeouts = [], [], 0
  for m, p, step, incarnation, seen in samples:
    if seen is None:
      timeouts += 1
      continue
    delivered = committed[payload_name(p, m, incarnation, step)]
    lat.append(seen - delivered)
    to_index.append(published[(p, admitted[(m, step)])] - delivered)
  if not lat:
    raise RuntimeError(f"latency run: no delivery became visible within {args.wait_s} s")
  return {
      "latency_median_s": round(statistics.median(lat), 4),
      "latency_p90_s": round(float(np.percentile(lat, 90)), 4),
      "latency_max_s": round(max(lat), 4),
      "latency_to_index_median_s": round(statistics.median(to_index), 4),
      "latency_samples": len(lat),
      "latency_timeouts": timeouts,
      "latency_rounds_merged": syncer.rounds,
      "latency_rejected": dict(syncer.rejections),
      "latency_fragment_bytes": per_tensor * 4 * args.tensors,
  }


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  args = FLAGS
  logging.set_verbosity(logging.ERROR)  # Orbax warns on every non-OCDBT save

  top = tempfile.mkdtemp(prefix="bench_store_", dir=args.dir)
  try:
    throughput = _throughput(top, args)
    latency = _latency(os.path.join(top, "latency"), args)
  finally:
    shutil.rmtree(top, ignore_errors=True)
  result = {
      "bench": "store",
      **throughput,
      **latency,
      "baseline": "np.save/np.load/os.remove, one .npy per tensor",
      "learners": args.learners,
      "fragments": args.fragments,
      "quorum": args.quorum,
      "poll_s": args.poll_s,
      "tensors": args.tensors,
      "reps": args.reps,
      "rounds": args.rounds,
      "orbax": importlib.metadata.version("orbax-checkpoint"),
      "numpy": np.__version__,
      "machine": platform.machine(),
  }
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
