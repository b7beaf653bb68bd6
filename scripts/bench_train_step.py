"""Tokens/s and model FLOP utilisation (MFU) of the train step on the visible devices.

  python scripts/bench_train_step.py                        # 1 CPU device
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/bench_train_step.py

The denominator is measured in the same run: the FLOP/s of a large jitted fp32 matmul
sharded over the same devices as the train step. Model FLOPs per token follow the
PaLM convention: 6 x (matmul parameters, including the tied output head) plus
12 x layers x heads x head_dim x sequence length for attention. Prints one JSON line last.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import app, flags
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco import config_lib
from diloco.model import transformer as model
from diloco.model.sharding import batch_sharding
from diloco.train import data
from diloco.train import mesh as mesh_lib
from diloco.train import optim
from diloco.train import state as train_state
from diloco.train import step as train_step

_PRESET = flags.DEFINE_string("preset", "small", "configs/dp.py preset to measure.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps (after 3 warm-up steps).")
_BATCH = flags.DEFINE_integer("batch_size", 0, "Override train.batch_size (0 = preset's).")
_MATMUL = flags.DEFINE_integer("matmul_size", 2048, "Side of the square matmul baseline.")


def flops_per_token(cfg: config_lib.ModelConfig, seq_len: int) -> float:
  counts = model.param_counts(cfg)
  norms = cfg.num_layers * (4 * cfg.embed_dim + 2 * cfg.head_dim) + cfg.embed_dim
  router = cfg.num_layers * cfg.embed_dim * cfg.num_experts
  matmul_params = counts["active"] - norms - router  # the embedding stays: it is the head
  attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
  return 6.0 * matmul_params + attention


def _timed(fn, repeats: int) -> float:
  fn()  # compile / warm up
  start = time.perf_counter()
  for _ in range(repeats):
    fn()
  return (time.perf_counter() - start) / repeats


def matmul_flops_per_s(devices, n: int) -> float:
  """FLOP/s of an [n*D, n] @ [n, n] fp32 matmul with rows sharded over the D devices."""
  mesh = jax.make_mesh((len(devices),), ("d",), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,))
  a = jax.device_put(np.random.default_rng(0).standard_normal(
      (n * len(devices), n), np.float32), NamedSharding(mesh, P("d")))
  b = jax.device_put(np.random.default_rng(1).standard_normal((n, n), np.float32),
                     NamedSharding(mesh, P()))
  mm = jax.jit(lambda x, y: x @ y)
  seconds = _timed(lambda: mm(a, b).block_until_ready(), 5)
  return 2.0 * n * len(devices) * n * n / seconds


def main(argv):
  del argv
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cfg = config_lib.from_config_dict(
      config_lib.load(os.path.join(repo, "configs", "dp.py") + ":" + _PRESET.value))
  batch_size = _BATCH.value or cfg.train.batch_size
  devices = jax.devices()
  mesh = mesh_lib.learner_mesh(devices, cfg.mesh)
  total = 1000
  spec = train_state.make_spec(cfg.model, optim.inner_optimizer(cfg.optim, total), mesh)
  state = train_state.create(cfg.model, spec, jax.random.key(0))
  step_fn = train_step.make_train_step(spec, cfg.optim, optim.lr_schedule(cfg.optim, total))
  it = iter(data.train_dataset(cfg.data, batch_size=batch_size))
  batches = [jax.device_put(next(it), batch_sharding(mesh)) for _ in range(4)]
  with jax.set_mesh(mesh):
    for i in range(3):
      state, metrics = step_fn(state, batches[i % 4])
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for i in range(_STEPS.value):
      state, metrics = step_fn(state, batches[i % 4])
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - start) / _STEPS.value
  tokens = batch_size * cfg.data.seq_len
  model_flops = flops_per_token(cfg.model, cfg.data.seq_len) * tokens / step_s
  peak = matmul_flops_per_s(devices, _MATMUL.value)
  print(json.dumps({
      "preset": _PRESET.value, "devices": len(devices), "backend": jax.default_backend(),
      "batch_size": batch_size, "seq_len": cfg.data.seq_len, "step_s": round(step_s, 4),
      "tokens_per_s": round(tokens / step_s, 1), "model_flops_per_s": model_flops,
      "matmul_flops": peak, "mfu": round(model_flops / peak, 3),
  }))


if __name__ == "__main__":
  app.run(main)
