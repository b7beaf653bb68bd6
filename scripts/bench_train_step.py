"""Tokens/s, MFU and HFU of the train step on the visible devices, for one setting or a sweep.

  python scripts/bench_train_step.py --preset=small                 # 1 CPU device
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/bench_train_step.py
  python scripts/bench_train_step.py --preset=gemma_2b --batch_size=4   # one GPU / TPU chip
  python scripts/bench_train_step.py --preset=gemma_2b --time_budget_s=300 \
    --variants="batch_size=4,remat=full;batch_size=8,remat=dots_with_no_batch_dims_saveable"

A sweep (`--variants`, `;` between variants, `,` between key=value pairs) runs in one process:
the state is built once per parameter layout and reused, and each variant is compiled, warmed
up and timed in turn. Keys are the bench's own `batch_size`, `seq_len`, `mesh`, `steps` and
`data`, and any `ModelConfig` field (values parsed to the field's type). A variant that runs
out of memory is recorded as `"error": "oom"`, one that would not fit `--time_budget_s` as
`"error": "skipped"`. Each variant prints one JSON line when it ends; the last line is a
summary listing them all, with the versions, XLA flags and the matmul baselines.

FLOPs per token are counted two ways (`diloco/train/flops.py`): as MaxText counts them (causal
attention, windowed on sliding-window layers), which `mfu` uses, and PaLM's full attention,
which `mfu_full_attention` keeps for continuity. `hfu` adds what the remat policy recomputes
(`hfu_recompute` names the estimate). `mfu` is against the device's published bf16 dense peak
(`PEAK_BF16_FLOPS`, null for a device not in the table); `mfu_vs_bf16_matmul` and
`mfu_vs_fp32_matmul` against large matmuls timed in the same run (a chain of
`--matmul_chain` calls with one sync at the end). `attention_resolved` is read from the
compiled step (a cuDNN fused-attention custom call, else "xla"). Tokens are random ids, or
windows of the default byte corpus with `--data=corpus` (real token frequencies). `host_ops`
lists host callbacks, infeed/outfeed and send/recv in the compiled step (none expected).
"""

from __future__ import annotations

import dataclasses
import gc
import gzip
import json
import os
import platform
import re
import sys
import time
import typing

import flax
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from absl import app, flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diloco.config import run_config
from diloco.errors import ConfigError
from diloco.model.config import ModelConfig
from diloco.model.sharding import batch_sharding
from diloco.programs import program_digest
from diloco.train import data as data_lib
from diloco.train import flops as flops_lib
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
_ATTN = flags.DEFINE_string("attention_impl", "", "reference|xla|cudnn|splash|auto ('' = preset's).")
_CHUNK = flags.DEFINE_integer("loss_chunk", -1, "Tokens per output-head chunk (-1 = the "
                              "config's, 0 = the whole batch).")
_LAYERS = flags.DEFINE_integer("num_layers", 0, "Override the depth (0 = the preset's).")
_MESH = flags.DEFINE_string("mesh", "", "data,fsdp,tensor sizes ('' = the preset's mesh if it "
                            "fits the devices, else FSDP over all of them).")
_MATMUL = flags.DEFINE_integer("matmul_size", 0, "Side of the square matmul baselines (0: 8192 "
                               "on accelerators, 1024 on CPU).")
_MATMUL_CHAIN = flags.DEFINE_integer("matmul_chain", 10, "Matmuls timed back to back, with one "
                                     "sync at the end, per baseline.")
_PROFILE = flags.DEFINE_string("profile_dir", "", "Write a jax.profiler trace of 3 timed steps "
                               "(of each variant, in v<index>/ under it, in a sweep).")
_HLO_DIR = flags.DEFINE_string("hlo_dir", "", "Write each variant's compiled program text "
                               "(gzipped HLO) here, to digest again off the device.")
_VARIANTS = flags.DEFINE_string("variants", "", "';'-separated variants of ','-separated "
                                "key=value pairs (see the module docstring); '' = the flags.")
_BUDGET = flags.DEFINE_float("time_budget_s", 0.0, "Start no variant that would end past this "
                             "many seconds after the start (estimated from the previous "
                             "ones); 0 = no limit.")
_DATA = flags.DEFINE_enum("data", "random", ["random", "corpus"], "Token ids: uniform random, or "
                          "windows of the default corpus (stdlib bytes).")

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
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
# The variant keys that are the bench's own (the rest must be ModelConfig fields).
BENCH_KEYS = {"batch_size": int, "seq_len": int, "mesh": str, "steps": int, "data": str}
_OOM = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")
_ENV = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
        "XLA_PYTHON_CLIENT_ALLOCATOR")
_WARMUP = 2


def peak_flops_per_device(device_kind: str) -> float | None:
  """Published bf16 dense FLOP/s of one device of `device_kind`, None if unknown."""
  kind = device_kind.lower()
  for key, peak in PEAK_BF16_FLOPS:
    if key in kind:
      return peak
  return None


def matmul_flops_per_s(devices, n: int, dtype, chain: int = 10) -> float:
  """FLOP/s of an [n*D, n] @ [n, n] matmul in `dtype` with rows sharded over the D devices,
  `chain` calls dispatched back to back and one sync at the end (as a train step queues)."""
  mesh = jax.make_mesh((len(devices),), ("d",), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,))
  rng = np.random.default_rng(0)
  a = jax.device_put(rng.standard_normal((n * len(devices), n), np.float32).astype(dtype),
                     NamedSharding(mesh, P("d")))
  b = jax.device_put(rng.standard_normal((n, n), np.float32).astype(dtype),
                     NamedSharding(mesh, P()))
  mm = jax.jit(lambda x, y: x @ y)
  mm(a, b).block_until_ready()  # compile / warm up
  start = time.perf_counter()
  for _ in range(chain):
    out = mm(a, b)
  out.block_until_ready()
  seconds = (time.perf_counter() - start) / chain
  return 2.0 * n * len(devices) * n * n / seconds


def parse_variants(text: str) -> list[dict[str, typing.Any]]:
  """`--variants` as one dict per variant, values parsed to their key's type. A piece without
  '=' continues the previous value, so `mesh=1,8,1` keeps its commas. ConfigError names a key
  that is neither a bench key nor a ModelConfig field, or a value of the wrong type."""
  types = {**BENCH_KEYS, **typing.get_type_hints(ModelConfig)}
  variants = []
  for raw in filter(None, (v.strip() for v in text.split(";"))):
    pairs: list[list[str]] = []
    for piece in raw.split(","):
      if "=" in piece:
        pairs.append([s.strip() for s in piece.split("=", 1)])
      elif pairs:
        pairs[-1][1] += "," + piece.strip()
      else:
        raise ConfigError(f"--variants: {piece!r} in {raw!r} is not key=value")
    variant = {}
    for key, value in pairs:
      if key not in types:
        raise ConfigError(f"--variants: unknown key {key!r} in {raw!r}; keys are "
                          f"{sorted(BENCH_KEYS)} and the ModelConfig fields")
      variant[key] = _parse_value(key, value, types[key])
    variants.append(variant)
  return variants or [{}]


def _parse_value(key: str, value: str, kind) -> typing.Any:
  """`value` as `kind` (bool, int, float or str), or ConfigError naming `key`."""
  try:
    if kind is bool:
      if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(value)
      return value.lower() in ("true", "1")
    return kind(value) if kind in (int, float, str) else value
  except ValueError:
    raise ConfigError(f"--variants: {key}={value!r} is not a {kind.__name__}") from None


def variant_name(variant: dict) -> str:
  return ",".join(f"{k}={v}" for k, v in variant.items())


def make_config(variant: dict | None = None) -> run_config.Config:
  """The dp.py preset with the command line's speed switches, then `variant`'s; data checks
  do not apply (the bench feeds its own tokens)."""
  variant = variant or {}
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cd = run_config.load(os.path.join(repo, "configs", "dp.py") + ":" + _PRESET.value)
  accelerator = jax.default_backend() != "cpu"
  seq_len = variant.get("seq_len", _SEQ.value)
  batch_size = variant.get("batch_size", _BATCH.value)
  mesh = variant.get("mesh", _MESH.value)
  with cd.unlocked():
    cd.data.source = run_config.base_config("tiny").data.source  # the bench feeds the tokens
    cd.data.path = ""
    cd.data.seq_len = seq_len or (2048 if accelerator else cd.data.seq_len)
    if batch_size:
      cd.train.batch_size = batch_size
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
    if mesh:
      cd.mesh.data, cd.mesh.fsdp, cd.mesh.tensor = run_config.parse_ints(mesh, "--mesh")
    else:
      try:
        mesh_lib.resolve_shape(run_config.MeshConfig(**cd.mesh.to_dict()), num_devices)
      except ConfigError:
        cd.mesh.data, cd.mesh.fsdp, cd.mesh.tensor = 1, -1, 1
  cfg = run_config.from_config_dict(cd)
  fields = {k: v for k, v in variant.items() if k not in BENCH_KEYS}
  if fields:
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **fields))
    run_config.validate(cfg)
  return cfg


def host_ops(compiled) -> list[str]:
  """Instructions of the compiled step that involve the host (callbacks, feeds, send/recv)."""
  text = _program_text(compiled)
  if text is None:  # a backend that cannot print it: say so
    return ["<HLO text unavailable>"]
  return sorted({m.group(0) for m in _HOST_OPS.finditer(text)})


def compiled_attention(compiled) -> str | None:
  """"cudnn" if the compiled program calls cuDNN's fused attention, else "xla" (None: no
  program text), so that a silent fallback from the requested kernel shows."""
  text = _program_text(compiled)
  if text is None:
    return None
  targets = {t.lower() for t in _CUSTOM_CALL.findall(text)}
  return "cudnn" if any("cudnn" in t and "fmha" in t for t in targets) else "xla"


def _program_text(compiled) -> str | None:
  try:
    return compiled.as_text() or ""
  except (NotImplementedError, RuntimeError):
    return None


def program_summary(text: str | None) -> dict | None:
  """What the compiled step does (`diloco.programs.program_digest`): FLOPs by dot operand dtypes,
  scatters and their dtypes, loops, host transfers, the attention kernel. Read from the program
  the device runs, so a claim about the step rests on it; a parse failure is reported, not
  raised (the timing stands on its own)."""
  if text is None:
    return None
  try:
    summary = program_digest.digest_hlo_text(text).summary()
  except Exception as e:  # noqa: BLE001
    return {"error": f"{type(e).__name__}: {e}"[:300]}
  summary.pop("memory", None)  # the compiled executable's figures are in the row already
  return summary


def versions() -> dict:
  """The software stack and the environment switches that the figures depend on."""
  try:
    platform_version = jax.devices()[0].client.platform_version
  except (AttributeError, RuntimeError):
    platform_version = None
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
          "python": platform.python_version(), "platform_version": platform_version,
          "env": {name: os.environ.get(name) for name in _ENV}}


class Tokens:
  """Two batches of token ids per variant: uniform random ids, or consecutive windows of the
  default corpus (its train split, byte tokenizer), read once for the whole sweep."""

  def __init__(self, needed: int):
    self._stream = None
    if needed:
      cfg = data_lib.DataConfig(source="stdlib", tokenizer="byte", seq_len=2,
                                max_bytes=max(2 * needed, 8_000_000))
      self._stream = data_lib.split_tokens(cfg)["train"]
      if len(self._stream) < needed:
        raise ConfigError(f"--data=corpus: {len(self._stream)} tokens, {needed} needed")

  def batches(self, source: str, vocab_size: int, batch_size: int,
              seq_len: int) -> list[np.ndarray]:
    shape = (batch_size, seq_len + 1)
    if source == "random":
      rng = np.random.default_rng(0)
      return [rng.integers(0, vocab_size, shape, dtype=np.int32) for _ in range(2)]
    if vocab_size < data_lib.vocab_size(data_lib.DataConfig()):
      raise ConfigError(f"--data=corpus: model.vocab_size={vocab_size} is below the byte "
                        "tokenizer's")
    size = batch_size * (seq_len + 1)
    return [self._stream[i * size:(i + 1) * size].reshape(shape).astype(np.int32)
            for i in range(2)]


class Sweep:
  """Runs the variants one by one, keeping one training state alive between those that share
  its parameter layout (shapes, dtypes and shardings)."""

  def __init__(self, tokens: Tokens, baselines: dict):
    self.tokens, self.baselines = tokens, baselines
    self.state, self.layout = None, None
    self.build_s = 0.0  # the last build of a state
    self.built_s = 0.0  # the current variant's (0: it reused the state)

  def _state_for(self, cfg, spec):
    self.built_s = 0.0
    layout = _layout(spec)
    live = self.state is not None and not any(
        leaf.is_deleted() for leaf in jax.tree.leaves(self.state))
    if live and layout == self.layout:
      return
    self.drop_state()  # a donated state that a failed step left deleted is rebuilt too
    start = time.perf_counter()
    self.state = train_state.create(cfg.model, spec, jax.random.key(0))
    jax.block_until_ready(self.state)
    self.layout = layout
    self.build_s = self.built_s = time.perf_counter() - start

  def drop_state(self):
    self.state = self.layout = None
    gc.collect()

  def needs_build(self, cfg) -> bool:
    """Whether `cfg` would build a new state (for the time estimate)."""
    return _layout(self._spec(cfg)) != self.layout

  @staticmethod
  def _spec(cfg):
    mesh = mesh_lib.learner_mesh(jax.devices(), cfg.mesh)
    return train_state.make_spec(cfg.model, optim.inner_optimizer(cfg.optim, 1000), mesh)

  def run(self, cfg, source: str, steps: int, profile_dir: str, hlo_path: str = "") -> dict:
    """Compiles, warms up and times one variant; the figures as a dict."""
    spec = self._spec(cfg)
    self._state_for(cfg, spec)
    mesh = spec.mesh
    step_fn = train_step.make_train_step(spec, cfg.optim, optim.lr_schedule(cfg.optim, 1000))
    batch_size, seq_len = cfg.train.batch_size, cfg.data.seq_len
    batches = [jax.device_put(b, batch_sharding(mesh))
               for b in self.tokens.batches(source, cfg.model.vocab_size, batch_size, seq_len)]
    with jax.set_mesh(mesh):
      start = time.perf_counter()
      compiled = step_fn.lower(self.state, batches[0]).compile()
      compile_s = time.perf_counter() - start
      for i in range(_WARMUP):
        self.state, metrics = compiled(self.state, batches[i % 2])
      jax.block_until_ready(metrics)
      times = []
      for i in range(steps):
        start = time.perf_counter()
        self.state, metrics = compiled(self.state, batches[i % 2])
        jax.block_until_ready(metrics)  # the step's program completes as a whole
        times.append(time.perf_counter() - start)
      if profile_dir:
        with jax.profiler.trace(profile_dir):
          for i in range(3):
            self.state, metrics = compiled(self.state, batches[i % 2])
          jax.block_until_ready(metrics)
    loss = float(metrics["train/loss"])
    row = self._figures(cfg, compiled, mesh, times, compile_s)
    text = _program_text(compiled)
    row["program"] = program_summary(text)
    if hlo_path and text:
      os.makedirs(os.path.dirname(hlo_path) or ".", exist_ok=True)
      with gzip.open(hlo_path, "wt") as f:
        f.write(text)
    row["data"], row["state_build_s"] = source, round(self.built_s, 3)  # 0: reused
    row["loss"] = round(loss, 4)
    if not np.isfinite(loss):
      row["error"] = "failed"
      row["message"] = f"non-finite loss {loss} after {steps + _WARMUP} steps"
    return row

  def _figures(self, cfg, compiled, mesh, times, compile_s) -> dict:
    m, devices = cfg.model, mesh.devices.flatten().tolist()
    batch_size, seq_len = cfg.train.batch_size, cfg.data.seq_len
    tokens = batch_size * seq_len
    median, p90 = float(np.median(times)), float(np.percentile(times, 90))
    attention = compiled_attention(compiled)
    full = flops_lib.flops_per_token(m, seq_len)
    causal = flops_lib.causal_flops_per_token(m, seq_len)
    extra, estimate = flops_lib.recompute_flops_per_token(m, seq_len, attention or "xla",
                                                         batch_size)
    hardware = None if extra is None else causal + extra
    peak = peak_flops_per_device(devices[0].device_kind)
    peak_total = None if peak is None else peak * len(devices)
    def per_s(f):
      return None if f is None else f * tokens / median
    def ratio(f, d):
      return None if f is None or d is None else round(per_s(f) / d, 4)
    analysis = compiled.memory_analysis()
    memory = devices[0].memory_stats() or {}
    mm_bf16, mm_fp32 = (self.baselines["matmul_bf16_flops_per_s"],
                        self.baselines["matmul_fp32_flops_per_s"])
    return {
        "backend": jax.default_backend(), "device_kind": devices[0].device_kind,
        "devices": len(devices), "mesh": dict(mesh.shape),
        "batch_size": batch_size, "seq_len": seq_len, "num_layers": m.num_layers,
        "dtype": m.dtype, "param_dtype": m.param_dtype, "scan_layers": m.scan_layers,
        "remat": m.remat, "attention_impl": m.attention_impl,
        "attention_requested": m.attention_impl, "attention_resolved": attention,
        "loss_chunk": m.loss_chunk, "steps": len(times), "compile_s": round(compile_s, 3),
        "step_s": float(f"{median:.6g}"), "step_s_p90": float(f"{p90:.6g}"),  # 6 significant figures, also for ms steps
        "tokens_per_s": round(tokens / median, 1),
        "model_flops_per_token": causal, "model_flops_per_token_full_attention": full,
        "hardware_flops_per_token": hardware, "hfu_recompute": estimate,
        "model_flops_per_s": per_s(causal), "peak_flops_per_s": peak_total,
        "mfu": ratio(causal, peak_total), "mfu_full_attention": ratio(full, peak_total),
        "hfu": ratio(hardware, peak_total),
        "mfu_vs_bf16_matmul": ratio(causal, mm_bf16), "mfu_vs_fp32_matmul": ratio(causal, mm_fp32),
        "compiled_temp_bytes": getattr(analysis, "temp_size_in_bytes", None),
        "compiled_argument_bytes": getattr(analysis, "argument_size_in_bytes", None),
        "peak_bytes_in_use": memory.get("peak_bytes_in_use"),
        "host_ops": host_ops(compiled),
    }


def _layout(spec) -> tuple:
  """What a state must match to be reused: its tree, shapes, dtypes and shardings."""
  return (jax.tree.structure(spec.abstract),
          tuple((a.shape, a.dtype, a.sharding) for a in jax.tree.leaves(spec.abstract)))


def is_oom(error: BaseException) -> bool:
  """Whether `error` is the device running out of memory (XLA's RESOURCE_EXHAUSTED)."""
  return any(marker in str(error) for marker in _OOM)


def _emit(row: dict) -> None:
  print(json.dumps(row), flush=True)


def main(argv):
  del argv
  start = time.perf_counter()
  try:
    variants = parse_variants(_VARIANTS.value)
    configs = [make_config(v) for v in variants]
    sources = [v.get("data", _DATA.value) for v in variants]
    unknown = sorted(set(sources) - {"random", "corpus"})
    if unknown:
      raise ConfigError(f"--variants: data={unknown[0]!r}; allowed: random, corpus")
    tokens = Tokens(max([2 * c.train.batch_size * (c.data.seq_len + 1)
                         for c, s in zip(configs, sources) if s == "corpus"], default=0))
  except ConfigError as e:
    sys.exit(f"bench_train_step: {e}")
  devices = jax.devices()
  n = _MATMUL.value or (1024 if jax.default_backend() == "cpu" else 8192)
  baselines = {"matmul_size": n, "matmul_chain": _MATMUL_CHAIN.value}
  for name, dtype in (("bf16", jnp.bfloat16), ("fp32", np.float32)):
    rate = matmul_flops_per_s(devices, n, dtype, _MATMUL_CHAIN.value)
    baselines[f"matmul_{name}_flops_per_s"] = rate
    baselines[f"matmul_{name}_tflops"] = float(f"{rate / 1e12:.4g}")  # a slow CPU too
  gc.collect()
  sweep = Sweep(tokens, baselines)
  rows, durations, failed = [], [], False
  for index, (variant, cfg, source) in enumerate(zip(variants, configs, sources)):
    head = {"bench": "train_step", "preset": _PRESET.value, "index": index,
            "variant": variant_name(variant)}
    steps = variant.get("steps", _STEPS.value)
    if _BUDGET.value and durations:
      estimate = float(np.median(durations)) + (sweep.build_s if sweep.needs_build(cfg) else 0)
      if time.perf_counter() - start + estimate > _BUDGET.value:
        head.update(error="skipped", message=f"estimated {estimate:.1f} s would pass "
                    f"--time_budget_s={_BUDGET.value}")
    if "error" not in head:
      began = time.perf_counter()
      profile = _PROFILE.value and (os.path.join(_PROFILE.value, f"v{index}")
                                    if len(variants) > 1 else _PROFILE.value)
      hlo_path = _HLO_DIR.value and os.path.join(_HLO_DIR.value, f"v{index}.hlo.txt.gz")
      try:
        head.update(sweep.run(cfg, source, steps, profile, hlo_path))
      except Exception as e:  # noqa: BLE001  (one variant's failure is a result)
        head.update(error="oom" if is_oom(e) else "failed", error_type=type(e).__name__,
                    message=str(e).splitlines()[0][:500] if str(e) else "")
      durations.append(time.perf_counter() - began - sweep.built_s)
      jax.clear_caches()
      gc.collect()
    failed |= head.get("error") == "failed"
    rows.append(head)
    _emit(head)
  sweep.drop_state()
  _emit({"bench": "train_step", "summary": True, "preset": _PRESET.value,
         "backend": jax.default_backend(), "device_kind": devices[0].device_kind,
         "devices": len(devices), **versions(), **baselines,
         "wall_s": round(time.perf_counter() - start, 1), "variants": rows})
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
