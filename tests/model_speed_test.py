"""The model's speed switches compute the same function: scan vs loop, remat vs none, fused vs
reference attention, bf16 vs fp32 compute (within a stated tolerance); the stored parameter
layout does not depend on them; bad values are one-line errors naming the field."""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from script_import import import_script

from diloco import fragments as fragments_lib
from diloco.config import run_config
from diloco.errors import ConfigError
from diloco.model import presets as model_presets
from diloco.model import transformer
from diloco.model.sharding import batch_sharding
from diloco.train import mesh as mesh_lib
from diloco.train import optim
from diloco.train import state as train_state
from diloco.train import step as train_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 5 layers of pattern "LG": two scanned groups of (L, G) and one local layer left over; a
# window of 6 over 20 tokens, so that the local layers really differ from the global ones.
_BASE = {"num_layers": 5, "attention_pattern": "LG", "sliding_window": 6}


def _cfg(preset="tiny", **overrides):
  return dataclasses.replace(model_presets.get(preset), **{**_BASE, **overrides})


def _tokens(batch=2, length=20, seed=1):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, 259)


@functools.cache
def _run(cfg, batch=2, length=20, packed=False):
  """`_loss_and_grads` on fixed tokens, cached: the baselines are shared between cases."""
  tokens = _tokens(batch, length)
  positions = _packed_positions(batch, length - 1) if packed else None
  return _loss_and_grads(cfg, tokens, positions)


def _loss_and_grads(cfg, tokens, positions=None):
  """Loss (mean log Z minus the target logit, plus aux) and its gradients w.r.t. the params."""
  with nnx.use_eager_sharding(False):
    m = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(m)

  def loss_fn(p):
    logits, aux = nnx.merge(graphdef, p)(tokens[:, :-1], positions)
    ce, _ = train_step.token_losses(logits, tokens[:, 1:])
    return jnp.mean(ce) + aux, logits

  (loss, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
  jaxpr = str(jax.make_jaxpr(loss_fn)(params))
  return float(loss), logits, nnx.to_pure_dict(grads), jaxpr


def _flat(grads):
  return {k: np.asarray(v) for k, v in fragments_lib.flatten_tree(grads).items()}


def _assert_same_grads(got, want, rtol):
  """Equal up to float32 reassociation: a rematerialised or scanned program sums in another
  order, so an element's error scales with its tensor's largest value, not with its own (a
  near-zero element of a large tensor may differ by 1e-3 of itself; seen on jax 0.12)."""
  got, want = _flat(got), _flat(want)
  assert got.keys() == want.keys()
  for k in want:
    scale = float(np.max(np.abs(want[k])))
    np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=rtol * scale, err_msg=k)


@pytest.mark.parametrize("preset, scan, remat", [
    ("tiny", True, "none"), ("tiny", False, "full"), ("tiny", True, "dots_saveable"),
    ("tiny", False, "dots_with_no_batch_dims_saveable"), ("tiny_moe", True, "nothing_saveable")])
def test_scan_and_remat_give_the_loop_loss_and_grads(preset, scan, remat):
  loss0, _, grads0, jaxpr0 = _run(_cfg(preset))
  loss, _, grads, jaxpr = _run(_cfg(preset, scan_layers=scan, remat=remat))
  # The switch is really on: a scan / checkpoint primitive appears in the traced program.
  assert ("scan[" in jaxpr) == scan and "scan[" not in jaxpr0
  assert ("checkpoint[" in jaxpr or "remat" in jaxpr) == (remat != "none")
  np.testing.assert_allclose(loss, loss0, rtol=1e-6)
  _assert_same_grads(grads, grads0, rtol=1e-5)


@pytest.mark.slow
def test_scan_handles_a_pattern_longer_than_two_and_a_remainder():
  # A 2:1 pattern (Gemma's is 5:1) over 8 layers: two scanned groups of 3 (the fewest that
  # scan), two local layers after them.
  cfg = _cfg(num_layers=8, attention_pattern="LLG", sliding_window=4)
  tokens = _tokens(length=17)
  loss0, _, grads0, _ = _loss_and_grads(cfg, tokens)
  loss, _, grads, jaxpr = _loss_and_grads(dataclasses.replace(cfg, scan_layers=True), tokens)
  assert "scan[" in jaxpr
  np.testing.assert_allclose(loss, loss0, rtol=1e-6)
  _assert_same_grads(grads, grads0, rtol=1e-5)


def _packed_positions(batch, length):
  """Two documents per row, positions restarting at the boundary (not 0..L-1)."""
  cut = np.array([length // 3, length // 2])[:batch]
  pos = np.stack([np.concatenate([np.arange(c), np.arange(length - c)]) for c in cut])
  return jnp.asarray(pos, jnp.int32)


@pytest.mark.parametrize("kv_heads, packed", [(2, False), (1, True), (4, False), (2, True)])
def test_fused_attention_matches_reference(kv_heads, packed):
  # query_pre_attn_scalar other than head_dim: Gemma's scaling must go through `scale=`.
  common = {"num_kv_heads": kv_heads, "query_pre_attn_scalar": 64.0}
  loss0, logits0, grads0, jaxpr0 = _run(_cfg(**common), packed=packed)
  loss, logits, grads, jaxpr = _run(_cfg(attention_impl="xla", **common), packed=packed)
  assert jaxpr != jaxpr0  # a different program computes the same function
  np.testing.assert_allclose(np.asarray(logits), np.asarray(logits0), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(loss, loss0, rtol=1e-6)
  _assert_same_grads(grads, grads0, rtol=1e-4)


def test_fused_local_window_is_the_reference_window():
  # One local layer, window 4: token 0 reaches outputs 0..3 and no further, on both paths.
  tokens = jnp.arange(16, dtype=jnp.int32)[None]
  changed = tokens.at[0, 0].set(200)
  for impl in ("reference", "xla"):
    cfg = _cfg(num_layers=1, attention_pattern="L", sliding_window=4, attention_impl=impl)
    with nnx.use_eager_sharding(False):
      m = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
    diff = np.abs(np.asarray(m(changed)[0] - m(tokens)[0])).max(axis=-1)[0]
    assert diff[3] > 0 and np.all(diff[4:] == 0), impl


def test_auto_attention_is_xla_off_gpu_and_cudnn_only_for_16_bit():
  assert jax.default_backend() == "cpu"
  assert transformer.resolve_attention_impl("auto", jnp.bfloat16) == "xla"
  assert transformer.resolve_attention_impl("xla", jnp.float32) == "xla"
  assert transformer.resolve_attention_impl("cudnn", jnp.bfloat16) == "cudnn"


def _cosine(a, b):
  a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
  return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("impl, scan", [("reference", False), ("xla", True)])
def test_bf16_compute_is_close_to_fp32_with_fp32_grads(impl, scan):
  """bf16 compute over fp32 parameters: loss within 1% and every gradient tensor within
  cosine 0.99 and norm 5% of the fp32 run; logits and gradients are float32."""
  loss32, _, grads32, _ = _run(_cfg(attention_impl=impl), 4, 33)
  loss16, logits16, grads16, jaxpr = _run(
      _cfg(dtype="bfloat16", attention_impl=impl, scan_layers=scan), 4, 33)
  assert "bf16" in jaxpr
  assert logits16.dtype == jnp.float32
  assert abs(loss16 - loss32) <= 0.01 * loss32
  g32, g16 = _flat(grads32), _flat(grads16)
  for k in g32:
    assert g16[k].dtype == np.float32, k
    if np.linalg.norm(g32[k]) > 0:
      assert _cosine(g16[k], g32[k]) > 0.99, k
      ratio = np.linalg.norm(g16[k]) / np.linalg.norm(g32[k])
      assert abs(ratio - 1) < 0.05, (k, ratio)


def test_stored_layout_and_fragments_do_not_depend_on_the_switches():
  """Scan is a compute-time transformation: same param paths, shapes, dtypes and fragments."""
  def layout(cfg):
    _, abstract = train_state.abstract_params(cfg)
    flat = fragments_lib.flatten_tree(nnx.to_pure_dict(abstract))
    return {k: (tuple(v.shape), str(v.dtype)) for k, v in flat.items()}

  base = layout(_cfg())
  fast = layout(_cfg(scan_layers=True, remat="full", attention_impl="xla", dtype="bfloat16"))
  assert fast == base
  assert any(k.startswith("layers/4/") for k in base)
  assert all(dtype == "float32" for _, dtype in fast.values())
  for scheme in ("balanced", "layer"):
    plans = [fragments_lib.plan_fragments({k: s for k, (s, _) in lay.items()}, 4, scheme)
             for lay in (base, fast)]
    assert plans[0] == plans[1]


@pytest.mark.slow
def test_train_step_on_an_fsdp_mesh_with_every_switch(tiny_config, replace):
  """The real train step, FSDP x tensor over 8 devices: bf16 + scan + remat + fused attention
  takes the same first step as the fp32 reference path, within the bf16 tolerance."""
  def first_step(model_cfg):
    cfg = replace(replace(tiny_config, "model", **{**dataclasses.asdict(model_cfg), "name": "t"}),
                  "mesh", data=2, fsdp=2, tensor=2)
    mesh = mesh_lib.learner_mesh(jax.devices(), cfg.mesh)
    spec = train_state.make_spec(cfg.model, optim.inner_optimizer(cfg.optim, 10), mesh)
    state = train_state.create(cfg.model, spec, jax.random.key(0))
    step_fn = train_step.make_train_step(spec, cfg.optim, optim.lr_schedule(cfg.optim, 10))
    batch = jax.device_put(np.asarray(_tokens(batch=8, length=cfg.data.seq_len + 1)),
                           batch_sharding(mesh))
    with jax.set_mesh(mesh):
      state, metrics = step_fn(state, batch)
    return jax.device_get(metrics), state

  base_cfg = dataclasses.replace(tiny_config.model, num_layers=4)
  m0, _ = first_step(base_cfg)
  m1, state = first_step(dataclasses.replace(
      base_cfg, dtype="bfloat16", scan_layers=True, remat="dots_saveable", attention_impl="xla"))
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state["params"]))
  assert abs(m1["train/loss"] - m0["train/loss"]) <= 0.01 * m0["train/loss"]
  assert abs(m1["train/grad_norm"] / m0["train/grad_norm"] - 1) < 0.05


@pytest.mark.parametrize("field, value, message", [
    ("remat", "sometimes", r"model.remat: must be one of \('none', 'full'"),
    ("remat", True, r"model.remat must be str, got True"),  # the old boolean field
    ("attention_impl", "flash", r"model.attention_impl: must be one of \('reference', 'xla'"),
    ("attention_impl", "cudnn", r"model.attention_impl: 'cudnn' needs model.dtype='bfloat16'"),
    ("dtype", "float16", r"model.dtype: must be one of \('float32', 'bfloat16'\)"),
    ("scan_layers", "yes", r"model.scan_layers must be bool, got 'yes'"),
    ("loss_chunk", -1, r"model.loss_chunk: must be >= 0 \(0 = the whole sequence at once\)"),
    ("loss_chunk", "1k", r"model.loss_chunk must be int, got '1k'"),
])
def test_bad_speed_switches_name_the_field(field, value, message):
  from configs import dp
  raw = dp.get_config("tiny").to_dict()  # a plain dict: ConfigDict would refuse other types
  raw["model"][field] = value
  with pytest.raises(ConfigError, match=message):
    run_config.from_config_dict(raw)


def test_accelerator_presets_turn_the_switches_on():
  for name in ("gemma_2b", "gemma_5b", "gemma_9b", "moe_2_8b", "moe_3_8b"):
    cfg = model_presets.get(name)
    assert (cfg.dtype, cfg.param_dtype, cfg.scan_layers, cfg.remat, cfg.attention_impl,
            cfg.loss_chunk) == ("bfloat16", "float32", True, "full", "auto", 1024), name
  tiny = model_presets.get("tiny")
  assert (tiny.dtype, tiny.scan_layers, tiny.remat, tiny.attention_impl, tiny.loss_chunk) == (
      "float32", False, "none", "reference", 0)


def test_peak_table_matches_device_kinds_and_unknown_is_none():
  bench = import_script("bench_train_step")
  assert bench.peak_flops_per_device("NVIDIA H100 80GB HBM3") == 989.4e12
  assert bench.peak_flops_per_device("NVIDIA H100 PCIe") == 756e12
  assert bench.peak_flops_per_device("NVIDIA H200") == 989.4e12
  assert bench.peak_flops_per_device("NVIDIA A100-SXM4-80GB") == 312e12
  assert bench.peak_flops_per_device("TPU v5 lite") == 197e12
  assert bench.peak_flops_per_device("TPU v5p") == 459e12
  assert bench.peak_flops_per_device("TPU v6 lite") == 918e12
  assert bench.peak_flops_per_device("TPU v4") == 275e12
  assert bench.peak_flops_per_device("cpu") is None


def test_train_step_has_no_host_round_trips(tiny_config, replace):
  """Nothing in the compiled step waits on the host: no callbacks, infeed/outfeed, send/recv
  (the CPU check of what a GPU profile would show as device idle time inside the step)."""
  model_cfg = dataclasses.replace(tiny_config.model, scan_layers=True, remat="full",
                                  attention_impl="xla", dtype="bfloat16", num_layers=4)
  cfg = replace(tiny_config, "model", **dataclasses.asdict(model_cfg))
  mesh = mesh_lib.learner_mesh(jax.devices()[:2], run_config.MeshConfig(data=1, fsdp=2))
  spec = train_state.make_spec(cfg.model, optim.inner_optimizer(cfg.optim, 10), mesh)
  step_fn = train_step.make_train_step(spec, cfg.optim, optim.lr_schedule(cfg.optim, 10))
  with jax.set_mesh(mesh):
    batch = jax.ShapeDtypeStruct((4, cfg.data.seq_len + 1), jnp.int32,
                                 sharding=batch_sharding(mesh))
    text = step_fn.lower(spec.abstract, batch).compile().as_text()
  assert "while" in text  # the scanned layers
  for op in ("callback", "infeed", "outfeed", " send(", " recv("):
    assert op not in text, op


@pytest.mark.slow
def test_bench_train_step_prints_mfu_json_on_cpu():
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  out = subprocess.run(
      [sys.executable, os.path.join(REPO, "scripts", "bench_train_step.py"), "--preset=tiny",
       "--steps=2", "--batch_size=2", "--seq_len=32", "--matmul_size=128", "--dtype=bfloat16",
       "--scan_layers=true", "--remat=dots_saveable", "--attention_impl=auto",
       "--num_layers=4"],
      capture_output=True, text=True, env=env, timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  row = json.loads(out.stdout.strip().splitlines()[0])  # the variant; the summary is last
  assert row["backend"] == "cpu" and row["device_kind"] == "cpu"
  assert row["mfu"] is None and row["peak_flops_per_s"] is None  # cpu is not in the table
  assert (row["dtype"], row["scan_layers"], row["remat"], row["attention_resolved"]) == (
      "bfloat16", True, "dots_saveable", "xla")
  assert row["seq_len"] == 32 and row["num_layers"] == 4 and row["host_ops"] == []
  assert row["tokens_per_s"] > 0 and 0 < row["mfu_vs_bf16_matmul"] and row["compile_s"] > 0
  # tokens/s and MFU are the same measurement in two units.
  flops = row["model_flops_per_token"] * row["tokens_per_s"]
  assert flops == pytest.approx(row["model_flops_per_s"], rel=1e-3)
