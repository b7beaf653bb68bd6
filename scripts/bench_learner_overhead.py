"""Learner overhead: tokens/s of one learner inside the runtime over the bare train loop.

  python scripts/bench_learner_overhead.py --model=small              # 1 CPU device
  XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
    python scripts/bench_learner_overhead.py --model=tiny            # a 2-device group
  python scripts/bench_learner_overhead.py --model=small --devices=1 --batch_size=64 \\
    --seq_len=1024 --dtype=bfloat16                                  # one GPU / TPU chip

Nothing here is CPU-specific: the learner group is the first `--devices` of `jax.devices()`
(GPUs or TPU chips when present), the syncer merges on the host in NumPy.

The runtime side is `ThreadedDriver` on the wall clock with one learner (K = 1,
P = H = 24 so a fragment is delivered every step, the syncer thread merging and
publishing every round, tau = 2). Its throughput comes from the recorder's step spans:
(timed steps x tokens per step) over the wall time from the end of the last warm-up
step to the end of the last step, so waits and `sync_point` between steps count as
overhead. The bare side runs the same jitted `make_train_step` (the runtime slot's, so
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

from diloco.config import run_config as config_lib
from diloco.model.sharding import batch_sharding
from diloco.runtime.core import Runtime
from diloco.runtime.threaded_driver import ThreadedDriver
from diloco.train import data as data_lib
from diloco.train import state as train_state

_MODEL = flags.DEFINE_enum("model", "small", ["tiny", "small"], "Model preset.")
_STEPS = flags.DEFINE_integer("steps", 48, "Timed steps per measurement.")
_WARMUP = flags.DEFINE_integer("warmup", 0, "Warm-up steps per measurement (0: H + 2).")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Alternated (bare, runtime) pairs.")
_DEVICES = flags.DEFINE_integer("devices", 0, "Devices of the learner group (0: all visible).")
_BATCH = flags.DEFINE_integer("batch_size", 0, "Override train.batch_size (0: the preset's).")
_FRAGMENTS = flags.DEFINE_integer("fragments", 24, "P (and H): one delivery per step.")
_SEQ = flags.DEFINE_integer("seq_len", 0, "Override data.seq_len (0: the preset's).")
_DTYPE = flags.DEFINE_string("dtype", "", "Override model.dtype ('' = the preset's).")


def make_config(warmup: int) -> config_lib.Config:
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  preset = {"tiny": "tiny", "small": "cpu"}[_MODEL.value]
  cd = config_lib.load(os.path.join(repo, "configs", "decoupled.py") + ":" + preset)
  num_devices = _DEVICES.value or len(jax.devices())
  cd.learners.count = 1
  cd.learners.devices = str(num_devices)
  cd.learners.speeds = ""
  cd.learners.step_jitter = 0.0
  cd.learners.faults = ""
  cd.learners.virtual_clock = False
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
  return config_lib.from_config_dict(cd)


def runtime_tokens_per_s(cfg: config_lib.Config, warmup: int, step_fn) -> tuple[float, Runtime]:
  """One learner + syncer under `ThreadedDriver`; tokens/s over the steps after `warmup`."""
  workdir = tempfile.mkdtemp(prefix="bench_learner_overhead_")
  try:
    rt = Runtime(cfg, workdir)
    if step_fn is not None:  # reuse the compiled step of the first runtime
      rt.slots[0].step_fn = step_fn
    ThreadedDriver(rt, on_eval=lambda now: 0.0, on_step=lambda slot: None).run()
    rt.recorder.close()
    spans = sorted((a for a in rt.recorder.activity() if a["kind"] == "step"),
                   key=lambda a: a["local_step"])
    if len(spans) != cfg.train.steps:
      raise RuntimeError(f"expected {cfg.train.steps} step spans, got {len(spans)}")
    timed = spans[warmup:]
    seconds = timed[-1]["end"] - spans[warmup - 1]["end"]
    return sum(a["tokens"] for a in timed) / seconds, rt
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def bare_tokens_per_s(cfg: config_lib.Config, warmup: int, spec: train_state.StateSpec,
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
  _, rt = runtime_tokens_per_s(cfg, warmup, None)
  spec, step_fn = rt.slots[0].spec, rt.slots[0].step_fn
  bare, runtime = [], []
  for _ in range(_REPEATS.value):
    bare.append(bare_tokens_per_s(cfg, warmup, spec, step_fn))
    runtime.append(runtime_tokens_per_s(cfg, warmup, step_fn)[0])
  bare_med, runtime_med = statistics.median(bare), statistics.median(runtime)
  print(json.dumps({
      "bench": "learner_overhead", "model": _MODEL.value, "devices": spec.mesh.size,
      "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
      "dtype": cfg.model.dtype, "batch_size": cfg.train.batch_size,
      "seq_len": cfg.data.seq_len, "fragments": rt.plan.num_fragments,
      "period": cfg.sync.period, "steps": _STEPS.value, "warmup": warmup,
      "repeats": _REPEATS.value, "ratio": round(runtime_med / bare_med, 4),
      "runtime_tokens_per_s": round(runtime_med, 1), "bare_tokens_per_s": round(bare_med, 1),
      "runtime_all": [round(x, 1) for x in runtime], "bare_all": [round(x, 1) for x in bare],
      "merged_rounds": rt.syncer.rounds,
  }))


if __name__ == "__main__":
  app.run(main)
