"""The input embedding's paths (`model.embed_impl`) and the named remat policies compute the
same function as the reference paths; what differs is checked on the lowered program: the
embedding gradient's scatter (or none) and the residuals each remat policy saves."""

import contextlib
import dataclasses
import functools
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diloco.config import run_config
from diloco.errors import ConfigError
from diloco.model import config as model_config
from diloco.model import presets as model_presets
from diloco.model import tied_table, transformer
from diloco.programs import program_digest

_IMPLS = ("gather", "gather_f32", "one_hot", "auto")
_SPACE = 32  # the byte that takes ~28% of the byte corpus's tokens


def _tokens(batch, length, *, contended=False, seed=0):
  """Uniform ids over the tiny vocabulary; `contended`: one id at ~30% of the positions."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 384, (batch, length))
  if contended:
    tokens[rng.random((batch, length)) < 0.3] = _SPACE
  return jnp.asarray(tokens, jnp.int32)


def _embed_fn(impl, dtype, tokens, upstream_BLD):
  """(state, f): f(state) = (sum(embedding * upstream), embedding) of the tiny model."""
  cfg = dataclasses.replace(model_presets.get("tiny"), embed_impl=impl, dtype=dtype)
  with nnx.use_eager_sharding(False):
    graphdef, state = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)))

  def f(state):
    x_BLD = nnx.merge(graphdef, state)._embed(tokens)
    return jnp.sum(x_BLD.astype(jnp.float32) * upstream_BLD), x_BLD

  return state, f


def _embed_and_grad(impl, dtype, tokens, upstream_BLD):
  """The embedded rows (float32) and the embedding table's gradient, as NumPy arrays."""
  state, f = _embed_fn(impl, dtype, tokens, upstream_BLD)
  (_, x_BLD), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(state)
  table = np.asarray(nnx.to_pure_dict(state)["embedder"]["embedding"])
  grad = np.asarray(nnx.to_pure_dict(grads)["embedder"]["embedding"])
  return np.asarray(x_BLD.astype(jnp.float32)), grad, table


def _oracle(table, tokens, upstream_BLD, dtype):
  """NumPy, float64: the scaled rows and np.add.at of the cotangent that reaches them (the
  upstream gradient in the compute dtype, times sqrt(D) = 8, exact in any dtype)."""
  scale = np.sqrt(table.shape[1])
  rows = table[np.asarray(tokens)].astype(np.float64) * scale
  cotangent = np.asarray(jnp.asarray(upstream_BLD).astype(dtype).astype(jnp.float32),
                         np.float64) * scale
  grad = np.zeros(table.shape, np.float64)
  np.add.at(grad, np.asarray(tokens), cotangent)
  return rows, grad


def _upstream(tokens, seed=1):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(*tokens.shape, 64)), jnp.float32)


def test_auto_is_one_hot_for_byte_vocabularies_and_the_f32_gather_above():
  assert tied_table.resolve_embed_impl("auto", 384) == "one_hot"
  assert tied_table.resolve_embed_impl("auto", tied_table.EMBED_ONE_HOT_MAX_VOCAB) == "one_hot"
  assert tied_table.resolve_embed_impl("auto", tied_table.EMBED_ONE_HOT_MAX_VOCAB + 1) == "gather_f32"
  assert tied_table.resolve_embed_impl("auto", model_presets.get("gemma_2b").vocab_size) == (
      "gather_f32")
  for impl in _IMPLS[:3]:
    assert tied_table.resolve_embed_impl(impl, 262_144) == impl
  assert model_config.ModelConfig().embed_impl == "auto"


@pytest.mark.parametrize("contended", [False, True])
def test_every_embed_impl_matches_the_numpy_oracle_at_float32(contended):
  tokens = _tokens(4, 64, contended=contended)
  upstream = _upstream(tokens)
  outs = {impl: _embed_and_grad(impl, "float32", tokens, upstream) for impl in _IMPLS}
  table = outs["gather"][2]
  rows, grad = _oracle(table, tokens, upstream, jnp.float32)
  for impl, (x, g, _) in outs.items():
    # The rows are exact on every path (a one-hot row times the table at HIGHEST precision).
    np.testing.assert_array_equal(x, outs["gather"][0], err_msg=impl)
    np.testing.assert_allclose(x, rows, rtol=0, atol=0, err_msg=impl)
    # The gradient sums the same values in another order: float32 reassociation only.
    np.testing.assert_allclose(g, grad, rtol=1e-6, atol=1e-6 * np.max(np.abs(grad)),
                               err_msg=impl)


def test_bf16_embed_gradients_and_the_contended_row():
  """bf16 compute, one id at 30% of 2048 positions: the bf16 scatter-add of "gather" rounds
  every one of ~600 additions into that row; "gather_f32" accumulates in float32 and
  "one_hot" in the matmul's float32 accumulator (rounded once, to bf16)."""
  tokens = _tokens(8, 256, contended=True)
  upstream = _upstream(tokens)
  outs = {impl: _embed_and_grad(impl, "bfloat16", tokens, upstream) for impl in _IMPLS}
  table = outs["gather"][2]
  rows, grad = _oracle(table, tokens, upstream, jnp.bfloat16)
  want_rows = np.asarray(jnp.asarray(rows, jnp.float32).astype(jnp.bfloat16)
                         .astype(jnp.float32))
  errors = {}
  for impl, (x, g, _) in outs.items():
    np.testing.assert_array_equal(x, want_rows, err_msg=impl)  # bf16 rows, bit for bit
    scale = np.max(np.abs(grad[_SPACE]))
    errors[impl] = np.max(np.abs(g[_SPACE] - grad[_SPACE])) / scale
    # Every path within bf16's relative precision of each element, but for "gather"'s
    # accumulated rounding (a few percent on the contended row).
    tol = 0.2 if impl == "gather" else 2 ** -8
    np.testing.assert_allclose(g, grad, rtol=tol, atol=tol * np.max(np.abs(grad)), err_msg=impl)
  assert errors["gather_f32"] < 1e-6 and errors["one_hot"] <= 2 ** -8, errors
  assert errors["gather"] > 10 * max(errors["gather_f32"], errors["one_hot"]), errors
  assert errors["auto"] == errors["one_hot"]


def _lowered_embed_grad(impl, dtype):
  tokens = _tokens(2, 16)
  state, f = _embed_fn(impl, dtype, tokens, _upstream(tokens))
  return jax.jit(jax.grad(lambda s: f(s)[0])).lower(state).as_text()


def _scatter_dtypes(impl, dtype):
  """The element types of the scatters in the embedding gradient's lowered StableHLO."""
  text = _lowered_embed_grad(impl, dtype)
  # The op's signature ends its region: `}) : (...) -> tensor<384x64xbf16>`.
  return {re.search(r"-> tensor<384x64x(\w+)>", text[m.end():]).group(1)
          for m in re.finditer(r"stablehlo\.scatter", text)}


def test_the_lowered_embedding_gradient_scatters_as_each_impl_says():
  assert _scatter_dtypes("gather", "bfloat16") == {"bf16"}
  assert _scatter_dtypes("gather_f32", "bfloat16") == {"f32"}
  assert _scatter_dtypes("one_hot", "bfloat16") == set()
  assert _scatter_dtypes("auto", "bfloat16") == set()
  assert _scatter_dtypes("one_hot", "float32") == set()
  assert _scatter_dtypes("gather", "float32") == {"f32"}


def test_the_one_hot_gradient_is_a_bf16_matmul():
  """Under bf16 compute the table's gradient (one-hot by cotangent) takes bf16 operands and
  returns bf16, as a layer weight's does (TPU and GPU matmul units accumulate it in float32):
  no float32 x float32 dot of the vocabulary's size (TF32 on GPUs), and partial sums that cross
  devices in bf16 (`tied_table`). The rows' own dot is dead code in this linear function's
  gradient."""
  dots = program_digest.stablehlo_dots(_lowered_embed_grad("one_hot", "bfloat16"))
  assert [d.result.shape for d in dots] == [(384, 64)], dots
  assert {(d.lhs.dtype, d.rhs.dtype, d.result.dtype) for d in dots} == {("bf16", "bf16", "bf16")}
  dots = program_digest.stablehlo_dots(_lowered_embed_grad("one_hot", "float32"))
  assert {(d.lhs.dtype, d.rhs.dtype, d.result.dtype) for d in dots} == {("f32", "f32", "f32")}
  assert all('HIGHEST' in t for t in re.findall(
      r"stablehlo\.dot_general.*", _lowered_embed_grad("one_hot", "float32"))), "precision"


def test_bad_embed_impl_names_the_field_and_is_a_speed_switch():
  from configs import dp
  raw = dp.get_config("tiny").to_dict()
  raw["model"]["embed_impl"] = "scatter"
  with pytest.raises(ConfigError, match=r"model.embed_impl: must be one of \('auto', 'gather'"):
    run_config.from_config_dict(raw)
  # A run may resume with another embedding path: the parameters are the same.
  fields = dataclasses.asdict(model_presets.get("tiny"))
  assert model_config.layout(fields) == model_config.layout({**fields, "embed_impl": "gather"})


# Remat policies. 5 layers of pattern "LG": two scanned groups and one layer left over.
_BASE = {"num_layers": 5, "attention_pattern": "LG", "sliding_window": 6}
_NEW_POLICIES = ("save_attention", "save_dots_and_attention", "offload_dots")


def _cfg(**overrides):
  return dataclasses.replace(model_presets.get("tiny"), **{**_BASE, **overrides})


@functools.cache
def _loss_and_grads(cfg):
  """Next-token cross-entropy (float32) on fixed tokens and its gradients, flat."""
  tokens = _tokens(2, 20, seed=3)
  with nnx.use_eager_sharding(False):
    graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)))

  def loss_fn(p):
    logits, aux = nnx.merge(graphdef, p)(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)) + aux

  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
  flat = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads))
  return float(loss), {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("remat", [p for p in model_config.REMAT_POLICIES if p != "none"])
def test_every_remat_policy_gives_the_gradients_of_no_remat(remat, scan):
  loss0, grads0 = _loss_and_grads(_cfg(scan_layers=scan))
  loss, grads = _loss_and_grads(_cfg(scan_layers=scan, remat=remat))
  np.testing.assert_allclose(loss, loss0, rtol=1e-6)
  assert grads.keys() == grads0.keys()
  for k, want in grads0.items():
    # Recomputed values are summed in another order: float32 reassociation only.
    np.testing.assert_allclose(grads[k], want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)),
                               err_msg=k)


def _saved_residuals(remat, **overrides):
  """`jax.ad_checkpoint.print_saved_residuals` of the model's hidden states, one line each:
  `f32[2,20,4,16] named 'attention_out' from ...`, `f32<host>[...] output of device_put ...`."""
  cfg = _cfg(remat=remat, **overrides)
  tokens = _tokens(2, 20)
  with nnx.use_eager_sharding(False):
    graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(
        lambda p: jnp.sum(nnx.merge(graphdef, p).hidden(tokens)[0]), params)
  return out.getvalue().splitlines()


def _count(lines, shape, text=""):
  return sum(1 for line in lines if line.startswith(shape) and text in line)


def test_named_policies_save_what_they_say():
  b_l_n_h, b_l_k_h, layers = "f32[2,20,4,16]", "f32[2,20,2,16]", _BASE["num_layers"]
  saved = {p: _saved_residuals(p) for p in ("full", "dots_with_no_batch_dims_saveable",
                                            *_NEW_POLICIES)}
  # "full" keeps no per-head value of any layer; "save_attention" one per layer, the named
  # attention output, and nothing else per head.
  assert _count(saved["full"], b_l_n_h) == _count(saved["full"], b_l_k_h) == 0
  assert _count(saved["save_attention"], b_l_n_h, "named 'attention_out'") == layers
  assert _count(saved["save_attention"], b_l_n_h) == layers
  assert _count(saved["save_attention"], b_l_k_h) == 0
  # The dots policy keeps the q/k/v projections but recomputes the attention itself; adding
  # the name keeps its output too.
  dots, both = saved["dots_with_no_batch_dims_saveable"], saved["save_dots_and_attention"]
  assert _count(dots, b_l_n_h, "attention_out") == 0
  assert _count(both, b_l_n_h, "named 'attention_out'") == layers
  assert _count(both, b_l_n_h) == _count(dots, b_l_n_h) + layers
  assert _count(both, b_l_k_h) == _count(dots, b_l_k_h) == 2 * layers
  # "offload_dots" keeps the same matmul outputs, in pinned host memory, none on the device.
  off = saved["offload_dots"]
  assert _count(off, "f32<host>[2,20,4,16]") == _count(dots, b_l_n_h) == layers
  assert _count(off, "f32<host>[2,20,2,16]") == 2 * layers
  assert _count(off, b_l_n_h) == _count(off, b_l_k_h) == 0
  assert len(off) == len(dots)


def test_save_attention_under_scan_saves_the_stacked_attention_output():
  lines = _saved_residuals("save_attention", scan_layers=True)
  # Two scanned groups of (L, G): one [groups, B, L, N, H] array per pattern position, plus
  # the layer left over.
  assert _count(lines, "f32[2,2,20,4,16]") == 2
  assert _count(lines, "f32[2,20,4,16]", "named 'attention_out'") == 1
  assert not any(line.startswith("f32[2,2,20,4,16]") for line in _saved_residuals(
      "full", scan_layers=True))


@pytest.mark.slow
def test_offload_and_named_policies_run_the_sharded_train_step(tiny_config, replace):
  """The real train step on an FSDP x tensor mesh of 8 CPU devices: host offload lowers and
  runs on the CPU backend (so the config need not refuse it there), and the first step's
  metrics are those of no remat, scanned or not."""
  from diloco.model.sharding import batch_sharding
  from diloco.train import mesh as mesh_lib
  from diloco.train import optim
  from diloco.train import state as train_state
  from diloco.train import step as train_step

  def first_step(**model_fields):
    cfg = replace(replace(tiny_config, "model", num_layers=4, **model_fields),
                  "mesh", data=2, fsdp=2, tensor=2)
    mesh = mesh_lib.learner_mesh(jax.devices(), cfg.mesh)
    spec = train_state.make_spec(cfg.model, optim.inner_optimizer(cfg.optim, 10), mesh)
    state = train_state.create(cfg.model, spec, jax.random.key(0))
    step_fn = train_step.make_train_step(spec, cfg.optim, optim.lr_schedule(cfg.optim, 10))
    batch = jax.device_put(np.asarray(_tokens(8, cfg.data.seq_len + 1)), batch_sharding(mesh))
    with jax.set_mesh(mesh):
      _, metrics = step_fn(state, batch)
    return jax.device_get(metrics)

  want = first_step()
  for remat, scan in [("offload_dots", False), ("offload_dots", True),
                      ("save_attention", True)]:
    got = first_step(remat=remat, scan_layers=scan)
    for key in ("train/loss", "train/grad_norm"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=f"{remat} {key}")
