"""Learner overhead: tokens/s of one learner inside the runtime over the bare train loop.

Where a learner's time goes besides its steps is reported apart: the first period's compiles,
waits for late rounds (`sync.block_on_late_round`) and waits for sends (the bounded queue of
deliveries, `sync.send_queue_bytes`).

  python scripts/bench_learner_overhead.py --model=small              # 1 CPU device
  XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
    python scripts/bench_learner_overhead.py --model=tiny            # a 2-device group
  python scripts/bench_learner_overhead.py --model=small --devices=1 --batch_size=64 \\
    --seq_len=1024 --dtype=bfloat16                                  # one GPU / TPU chip
  python scripts/bench_learner_overhead.py --model=dp:m35 --virtual_clock  # any preset

Nothing here is CPU-specific: the learner group is the first `--devices` of `jax.devices()`
(GPUs or TPU chips when present), the syncer merges on the host in NumPy.

`--model` is a preset of `configs/decoupled.py` or `configs/dp.py` (`tiny`, `m35`, `dp:small`,
`decoupled:cpu`; a bare name is looked up in decoupled.py first; `small` is decoupled.py's
`cpu`, as before). The runtime side is `ThreadedDriver` on the wall clock (`VirtualDriver`
with `--virtual_clock`) with one learner (K = 1, P = H = 24 so a fragment is delivered every
step, the syncer merging and publishing every round, tau = 2). Its throughput is (timed steps
x tokens per step) over the wall time from the end of the last warm-up step to the end of the
last step (the recorder's step spans on the wall clock; on the virtual clock, whose spans are
virtual, the wall time at which each step was handed back), so waits and `sync_point` between
steps count as overhead. The bare side runs the same jitted `make_train_step` (the runtime slot's, so
nothing recompiles) on the same mesh, data and batch: fetch, `device_put`, step, read the
previous step's metrics. Warm-up steps (compiles, and one full period so that every
fragment's copy is compiled) are excluded from both. The two are alternated
(bare, runtime, bare, runtime, ...) and the medians are compared. Prints one JSON line last.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np
from absl import app, flags, logging

from diloco.config import run_config
from diloco.model.sharding import batch_sharding
from diloco.runtime.core import Runtime
from diloco.runtime.threaded_driver import ThreadedDriver
from diloco.runtime.virtual_driver import VirtualDriver
from diloco.train import data as data_lib
from diloco.train import state as train_state

_MODEL = flags.DEFINE_string("model", "small", "A preset of configs/decoupled.py or dp.py "
                             "(NAME, decoupled:NAME or dp:NAME; small = decoupled:cpu).")
_VIRTUAL = flags.DEFINE_bool("virtual_clock", False, "Run the learner on the virtual clock.")
_STEPS = flags.DEFINE_integer("steps", 48, "Timed steps per measurement.")
_WARMUP = flags.DEFINE_integer("warmup", 0, "Warm-up steps per measurement (0: H + 2).")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Alternated (bare, runtime) pairs.")
_DEVICES = flags.DEFINE_integer("devices", 0, "Devices of the learner group (0: all visible).")
_BATCH = flags.DEFINE_integer("batch_size", 0, "Override train.batch_size (0: the preset's).")
_FRAGMENTS = flags.DEFINE_integer("fragments", 24, "P (and H): one delivery per step.")
_SEQ = flags.DEFINE_integer("seq_len", 0, "Override data.seq_len (0: the preset's).")
_DTYPE = flags.DEFINE_string("dtype", "", "Override model.dtype ('' = the preset's).")


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_preset(model: str):
  """The ConfigDict of `--model`: `file:preset`, or a preset of decoupled.py, else of dp.py."""
  if model == "small":
    model = "decoupled:cpu"  # the name this bench always gave decoupled.py's CPU preset
  if ":" in model:
    name, preset = model.split(":", 1)
    return run_config.load(os.path.join(_REPO, "configs", name.removesuffix(".py") + ".py")
                           + ":" + preset)
  errors = []
  for name in ("decoupled", "dp"):
    try:
      return run_config.load(os.path.join(_REPO, "configs", name + ".py") + ":" + model)
    except ValueError as e:  # an unknown preset of that file
      errors.append(str(e))
  raise app.UsageError(f"--model={model!r}: " + "; ".join(errors))


def make_config(warmup: int) -> run_config.Config:
  cd = load_preset(_MODEL.value)
  num_devices = _DEVICES.value or len(jax.devices())
  cd.learners.count = 1
  cd.learners.devices = str(num_devices)
  cd.learners.speeds = ""
  cd.learners.step_jitter = 0.0
  cd.learners.faults = ""
  cd.learners.virtual_clock = _VIRTUAL.value
  cd.learners.share_devices = False
  cd.sync.num_fragments = _FRAGMENTS.value
  cd.sync.period = _FRAGMENTS.value
  cd.sync.quorum = 1
  cd.train.steps = warmup + _STEPS.value
  cd.train.eval_every = 0
  cd.log.progress_every_s = 1e9
  if _BATCH.value:
    cd.train.batch_size = _BATCH.value
  if _SEQ.value:
    cd.data.seq_len = _SEQ.value
  if _DTYPE.value:
    cd.model.dtype = _DTYPE.value
  return run_config.from_config_dict(cd)


def runtime_tokens_per_s(cfg: run_config.Config, warmup: int, step_fn
                         ) -> tuple[float, Runtime, dict[str, float]]:
  """One learner + syncer under `ThreadedDriver` (`VirtualDriver` on the virtual clock);
  tokens/s over the steps after `warmup`, and where the learner's other time went."""
  workdir = tempfile.mkdtemp(prefix="bench_learner_overhead_")
  try:
    rt = Runtime(cfg, workdir)
    if step_fn is not None:  # reuse the compiled step of the first runtime
      rt.slots[0].step_fn = step_fn
    stamps = {}  # local step -> wall time it was handed back (the virtual clock's spans)
    own_send_wait = []

    def on_step(slot):
      stamps[slot.learner.local_step] = time.perf_counter()

    rt.on_done = lambda slot: own_send_wait.append(slot.learner.send_wait_s)
    started = time.perf_counter()
    driver = (VirtualDriver if cfg.learners.virtual_clock else ThreadedDriver)(
        rt, on_eval=lambda now: 0.0, on_step=on_step)
    driver.run()
    rt.recorder.close()
    activity = rt.recorder.activity()
    spans = sorted((a for a in activity if a["kind"] == "step"), key=lambda a: a["local_step"])
    if len(spans) != cfg.train.steps:
      raise RuntimeError(f"expected {cfg.train.steps} step spans, got {len(spans)}")
    timed = spans[warmup:]
    if cfg.learners.virtual_clock:
      seconds = stamps[cfg.train.steps] - stamps[warmup]
      tokens = sum(a["tokens"] for a in timed)
      first_period = stamps[warmup] - started
    else:
      seconds = timed[-1]["end"] - spans[warmup - 1]["end"]
      tokens = sum(a["tokens"] for a in timed)
      first_period = spans[warmup - 1]["end"] - spans[0]["start"]
    steady_step = seconds / max(len(timed), 1)
    # Send waits on the wall clock are the learner's own (split off its step spans as "wait");
    # the virtual clock's shared sender counts them itself (they take no virtual time).
    sender = getattr(driver, "sender", None)
    send_wait = sum(own_send_wait) + (sender.wait_s if sender is not None else 0.0)
    waits = sum(a["end"] - a["start"] for a in activity if a["kind"] == "wait")
    spent = {
        # The first period's wall time beyond its steps at the steady rate: the per-fragment
        # copies and the other first-use programs compile there (the step is compiled ahead).
        "first_period_s": first_period,
        "first_period_compile_s": max(first_period - warmup * steady_step, 0.0),
        # Parked for a round not published by t + tau, on the driver's clock (virtual seconds
        # on the virtual clock); the wall clock's "wait" spans also hold its send waits.
        "late_round_wait_s": max(waits - (0.0 if sender is not None else sum(own_send_wait)),
                                 0.0),
        "send_wait_s": send_wait,
        # The virtual clock hands deliveries to the syncer at its next take: wall seconds spent
        # waiting for their values there.
        "send_handover_s": sender.drain_s if sender is not None else 0.0,
    }
    return tokens / seconds, rt, spent
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def bare_tokens_per_s(cfg: run_config.Config, warmup: int, spec: train_state.StateSpec,
                      step_fn) -> float:
  """The bare loop: batch, device_put, step, metrics read one step late."""
  state = train_state.create(cfg.model, spec, jax.random.key(cfg.seed))
  it = iter(data_lib.train_dataset(cfg.data, batch_size=cfg.train.batch_size, learner_id=0,
                                   num_learners=1, seed=cfg.seed))
  sharding = batch_sharding(spec.mesh)
  last = None
  start = None
  for i in range(warmup + _STEPS.value):
    if i == warmup:
      start = time.perf_counter()
    state, metrics = step_fn(state, jax.device_put(next(it), sharding))
    if last is not None:
      values = {k: float(v) for k, v in jax.device_get(last).items()}
      if not np.isfinite(values["train/loss"]):
        raise FloatingPointError(f"bare loop: non-finite loss at step {i}")
    last = metrics
  seconds = time.perf_counter() - start
  jax.block_until_ready(last)
  return _STEPS.value * cfg.train.batch_size * cfg.data.seq_len / seconds


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  warmup = _WARMUP.value or _FRAGMENTS.value + 2
  cfg = make_config(warmup)
  # The first runtime compiles the step; every later measurement reuses it.
  _, rt, first = runtime_tokens_per_s(cfg, warmup, None)
  spec, step_fn = rt.slots[0].spec, rt.slots[0].step_fn
  bare, runtime, spent = [], [], []
  for _ in range(_REPEATS.value):
    bare.append(bare_tokens_per_s(cfg, warmup, spec, step_fn))
    tokens_per_s, rt, later = runtime_tokens_per_s(cfg, warmup, step_fn)
    runtime.append(tokens_per_s)
    spent.append(later)
  bare_med, runtime_med = statistics.median(bare), statistics.median(runtime)

  def median(key):
    return round(statistics.median(s[key] for s in spent), 4)
  print(json.dumps({
      "bench": "learner_overhead", "model": _MODEL.value, "devices": spec.mesh.size,
      "clock": "virtual" if cfg.learners.virtual_clock else "wall",
      "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
      "dtype": cfg.model.dtype, "batch_size": cfg.train.batch_size,
      "seq_len": cfg.data.seq_len, "fragments": rt.plan.num_fragments,
      "period": cfg.sync.period, "steps": _STEPS.value, "warmup": warmup,
      "repeats": _REPEATS.value, "ratio": round(runtime_med / bare_med, 4),
      "runtime_tokens_per_s": round(runtime_med, 1), "bare_tokens_per_s": round(bare_med, 1),
      "runtime_all": [round(x, 1) for x in runtime], "bare_all": [round(x, 1) for x in bare],
      "merged_rounds": rt.syncer.rounds,
      # The first runtime compiles; the later ones reuse its step (their medians below).
      "first_period_compile_s": round(first["first_period_compile_s"], 4),
      "first_period_s": round(first["first_period_s"], 4),
      "late_round_wait_s": median("late_round_wait_s"),
      "late_round_wait_clock": "virtual" if cfg.learners.virtual_clock else "wall",
      "send_wait_s": median("send_wait_s"), "send_handover_s": median("send_handover_s"),
      "send_queue_bytes": cfg.sync.send_queue_bytes,
  }))


if __name__ == "__main__":
  app.run(main)
