"""Tokens/s and model FLOP utilisation (MFU) of the train step on the visible devices.

  python scripts/bench_train_step.py --preset=small                 # 1 CPU device
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/bench_train_step.py
  python scripts/bench_train_step.py --preset=gemma_2b --batch_size=4   # one GPU / TPU chip

MFU is reported against three denominators:
- `mfu`: the device's published bf16 dense peak (`PEAK_BF16_FLOPS`, matched on
  `jax.devices()[0].device_kind`; null, with the kind printed, for a device not in the table);
- `mfu_vs_bf16_matmul`: a large jitted bf16 matmul measured in the same run on the same
  devices (what this software stack reaches on this chip);
- `mfu_vs_fp32_matmul`: the same in fp32, the baseline of the CPU runs.
Model FLOPs per token follow the PaLM convention: 6 x (matmul parameters, including the tied
output head) plus 12 x layers x heads x head_dim x sequence length for attention (full, not
causal- or window-reduced). The tokens are random ids: this measures the step, not the data
pipeline. `host_ops` lists host callbacks, infeed/outfeed and send/recv in the compiled step
(none expected: nothing in the step waits on the host). Prints one JSON line last.
"""

from __future__ import annotations

import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diloco.config import run_config as config_lib
from diloco.errors import ConfigError
from diloco.model import transformer as model
from diloco.model.sharding import batch_sharding
from diloco.train import mesh as mesh_lib
from diloco.train import optim
from diloco.train import state as train_state
from diloco.train import step as train_step

_PRESET = flags.DEFINE_string("preset", "small", "configs/dp.py preset to measure.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps (after 2 warm-up steps).")
_BATCH = flags.DEFINE_integer("batch_size", 0, "Global batch (0 = the preset's).")
_SEQ = flags.DEFINE_integer("seq_len", 0, "Sequence length (0: 2048 on accelerators, the "
                            "preset's on CPU).")
_DTYPE = flags.DEFINE_string("dtype", "", "Compute dtype, float32 or bfloat16 ('' = preset's).")
_SCAN = flags.DEFINE_enum("scan_layers", "", ["", "true", "false"], "'' = the preset's.")
_REMAT = flags.DEFINE_string("remat", "", "Remat policy ('' = the preset's).")
_ATTN = flags.DEFINE_string("attention_impl", "", "reference|xla|cudnn|auto ('' = preset's).")
_CHUNK = flags.DEFINE_integer("loss_chunk", -1, "Tokens per output-head chunk (-1 = the "
                              "config's, 0 = the whole batch).")
_LAYERS = flags.DEFINE_integer("num_layers", 0, "Override the depth (0 = the preset's).")
_MESH = flags.DEFINE_string("mesh", "", "data,fsdp,tensor sizes ('' = the preset's mesh if it "
                            "fits the devices, else FSDP over all of them).")
_MATMUL = flags.DEFINE_integer("matmul_size", 0, "Side of the square matmul baselines (0: 8192 "
                               "on accelerators, 1024 on CPU).")
_PROFILE = flags.DEFINE_string("profile_dir", "", "Write a jax.profiler trace of 3 timed steps.")

# Published dense bf16 peaks per device (FLOP/s), from the vendors' data sheets: NVIDIA H100
# (SXM 989.4 TFLOP/s, PCIe 756, NVL 835), H200 (SXM 989.4, NVL 835), A100 (312); Google Cloud
# TPU v4 (275), v5e (197), v5p (459), v6e Trillium (918). Matched in order on the lower-cased
# device_kind ("NVIDIA H100 80GB HBM3", "TPU v5 lite", ...); the first substring wins.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("h100 pcie", 756e12), ("h100 nvl", 835e12), ("h100", 989.4e12),
    ("h200 nvl", 835e12), ("h200", 989.4e12), ("gh200", 989.4e12),
    ("a100", 312e12),
    ("tpu v5 lite", 197e12), ("tpu v5e", 197e12), ("tpu v5p", 459e12), ("tpu v5", 459e12),
    ("tpu v6 lite", 918e12), ("tpu v6e", 918e12), ("tpu v4", 275e12),
)
_HOST_OPS = re.compile(r"callback|infeed|outfeed|\bsend\b|\brecv\b|send-done|recv-done")


def peak_flops_per_device(device_kind: str) -> float | None:
  """Published bf16 dense FLOP/s of one device of `device_kind`, None if unknown."""
  kind = device_kind.lower()
  for key, peak in PEAK_BF16_FLOPS:
    if key in kind:
      return peak
  return None


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


def matmul_flops_per_s(devices, n: int, dtype) -> float:
  """FLOP/s of an [n*D, n] @ [n, n] matmul in `dtype` with rows sharded over the D devices."""
  mesh = jax.make_mesh((len(devices),), ("d",), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,))
  rng = np.random.default_rng(0)
  a = jax.device_put(rng.standard_normal((n * len(devices), n), np.float32).astype(dtype),
                     NamedSharding(mesh, P("d")))
  b = jax.device_put(rng.standard_normal((n, n), np.float32).astype(dtype),
                     NamedSharding(mesh, P()))
  mm = jax.jit(lambda x, y: x @ y)
  seconds = _timed(lambda: mm(a, b).block_until_ready(), 5)
  return 2.0 * n * len(devices) * n * n / seconds


def make_config() -> config_lib.Config:
  """The dp.py preset with the command line's speed switches; data checks do not apply."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cd = config_lib.load(os.path.join(repo, "configs", "dp.py") + ":" + _PRESET.value)
  accelerator = jax.default_backend() != "cpu"
  with cd.unlocked():
    cd.data.source = config_lib.base_config("tiny").data.source  # random ids are fed instead
    cd.data.path = ""
    cd.data.seq_len = _SEQ.value or (2048 if accelerator else cd.data.seq_len)
    if _BATCH.value:
      cd.train.batch_size = _BATCH.value
    if _DTYPE.value:
      cd.model.dtype = _DTYPE.value
    if _SCAN.value:
      cd.model.scan_layers = _SCAN.value == "true"
    if _REMAT.value:
      cd.model.remat = _REMAT.value
    if _ATTN.value:
      cd.model.attention_impl = _ATTN.value
    if _CHUNK.value >= 0:
      cd.model.loss_chunk = _CHUNK.value
    if _LAYERS.value:
      cd.model.num_layers = _LAYERS.value
    num_devices = len(jax.devices())
    if _MESH.value:
      cd.mesh.data, cd.mesh.fsdp, cd.mesh.tensor = config_lib.parse_ints(_MESH.value, "--mesh")
    else:
      try:
        mesh_lib.resolve_shape(config_lib.MeshConfig(**cd.mesh.to_dict()), num_devices)
      except ConfigError:
        cd.mesh.data, cd.mesh.fsdp, cd.mesh.tensor = 1, -1, 1
  return config_lib.from_config_dict(cd)


def host_ops(compiled) -> list[str]:
  """Instructions of the compiled step that involve the host (callbacks, feeds, send/recv)."""
  try:
    text = compiled.as_text()
  except (NotImplementedError, RuntimeError):  # a backend that cannot print it: say so
    return ["<HLO text unavailable>"]
  return sorted({m.group(0) for m in _HOST_OPS.finditer(text or "")})


def main(argv):
  del argv
  cfg = make_config()
  batch_size, seq_len = cfg.train.batch_size, cfg.data.seq_len
  devices = jax.devices()
  mesh = mesh_lib.learner_mesh(devices, cfg.mesh)
  total = 1000
  spec = train_state.make_spec(cfg.model, optim.inner_optimizer(cfg.optim, total), mesh)
  state = train_state.create(cfg.model, spec, jax.random.key(0))
  step_fn = train_step.make_train_step(spec, cfg.optim, optim.lr_schedule(cfg.optim, total))
  rng = np.random.default_rng(0)
  batches = [jax.device_put(rng.integers(0, cfg.model.vocab_size, (batch_size, seq_len + 1),
                                         dtype=np.int32), batch_sharding(mesh))
             for _ in range(2)]
  with jax.set_mesh(mesh):
    start = time.perf_counter()
    compiled = step_fn.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - start
    for i in range(2):
      state, metrics = compiled(state, batches[i % 2])
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for i in range(_STEPS.value):
      state, metrics = compiled(state, batches[i % 2])
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - start) / _STEPS.value
    if _PROFILE.value:
      with jax.profiler.trace(_PROFILE.value):
        for i in range(3):
          state, metrics = compiled(state, batches[i % 2])
        jax.block_until_ready(metrics)
  loss = float(metrics["train/loss"])
  if not np.isfinite(loss):
    raise FloatingPointError(f"non-finite loss {loss} after {_STEPS.value + 2} steps")
  tokens = batch_size * seq_len
  model_flops = flops_per_token(cfg.model, seq_len) * tokens / step_s
  kind = devices[0].device_kind
  peak = peak_flops_per_device(kind)
  peak_total = None if peak is None else peak * len(devices)
  n = _MATMUL.value or (1024 if jax.default_backend() == "cpu" else 8192)
  mm_bf16 = matmul_flops_per_s(devices, n, jnp.bfloat16)
  mm_fp32 = matmul_flops_per_s(devices, n, np.float32)
  memory = devices[0].memory_stats() or {}
  m = cfg.model
  print(json.dumps({
      "bench": "train_step", "preset": _PRESET.value, "backend": jax.default_backend(),
      "device_kind": kind, "devices": len(devices), "mesh": dict(mesh.shape),
      "batch_size": batch_size, "seq_len": seq_len, "num_layers": m.num_layers,
      "dtype": m.dtype, "param_dtype": m.param_dtype, "scan_layers": m.scan_layers,
      "remat": m.remat, "attention_impl": m.attention_impl, "loss_chunk": m.loss_chunk,
      "compiled_temp_bytes": getattr(compiled.memory_analysis(), "temp_size_in_bytes", None),
      "attention_resolved": (m.attention_impl if m.attention_impl == "reference" else
                             model.resolve_attention_impl(m.attention_impl, m.dtype)),
      "compile_s": round(compile_s, 3), "step_s": round(step_s, 5),
      "tokens_per_s": round(tokens / step_s, 1), "loss": round(loss, 4),
      "model_flops_per_token": flops_per_token(m, seq_len), "model_flops_per_s": model_flops,
      "peak_flops_per_s": peak_total,
      "mfu": None if peak_total is None else round(model_flops / peak_total, 4),
      "matmul_size": n, "matmul_bf16_flops_per_s": mm_bf16,
      "mfu_vs_bf16_matmul": round(model_flops / mm_bf16, 4),
      "matmul_fp32_flops_per_s": mm_fp32, "mfu_vs_fp32_matmul": round(model_flops / mm_fp32, 4),
      "peak_bytes_in_use": memory.get("peak_bytes_in_use"),
      "host_ops": host_ops(compiled),
  }))


if __name__ == "__main__":
  app.run(main)
