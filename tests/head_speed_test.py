"""The output head's speed switches: `model.head_grad_dtype="compute"` runs the head's backward
matmuls in the compute dtype (float32 accumulation) and is autodiff's program under float32;
the chunked loss casts the tied table once. Checked on values and on the lowered program."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diloco import fragments as fragments_lib
from diloco.config import run_config
from diloco.model import presets as model_presets
from diloco.model import transformer
from diloco.train import mesh as mesh_lib
from diloco.train import step as train_step

V = 1000  # a vocabulary no other dimension of the program has: the head's dots name it
# 4 layers of pattern "LG" (two scanned groups under scan_layers), window 6 over 32 positions.
_BASE = {"vocab_size": V, "num_layers": 4, "attention_pattern": "LG", "sliding_window": 6}


def _cfg(**overrides):
  return dataclasses.replace(model_presets.get("tiny"), **{**_BASE, **overrides})


def _tokens(batch=4, length=33, seed=1):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, V)


def _split(cfg):
  with nnx.use_eager_sharding(False):
    return nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)))


def _loss_fn(graphdef, tokens):
  def loss(p):
    ce, z, aux = train_step._forward(graphdef, p, tokens)
    return ce + 1e-4 * z + aux
  return loss


def _loss_and_grads(cfg, tokens=None, mesh=None):
  """The train step's loss (cross-entropy + z-loss + aux) and its float32 gradients."""
  tokens = _tokens() if tokens is None else tokens
  graphdef, params = _split(cfg)
  fn = jax.jit(jax.value_and_grad(_loss_fn(graphdef, tokens)))
  if mesh is None:
    loss, grads = fn(params)
  else:
    with jax.set_mesh(mesh):
      loss, grads = fn(params)
  return np.asarray(loss), {k: np.asarray(v) for k, v in
                            fragments_lib.flatten_tree(nnx.to_pure_dict(grads)).items()}


@pytest.mark.parametrize("overrides", [
    {}, {"loss_chunk": 32}, {"scan_layers": True, "remat": "full", "loss_chunk": 24},
    {"final_logit_softcap": 0.0}])
def test_compute_is_autodiff_bit_for_bit_in_float32(overrides):
  """With float32 compute the custom backward is the transpose autodiff builds: the same
  loss and gradients to the bit (whole, chunked, scanned and rematerialised, uncapped)."""
  loss32, grads32 = _loss_and_grads(_cfg(head_grad_dtype="float32", **overrides))
  loss, grads = _loss_and_grads(_cfg(head_grad_dtype="compute", **overrides))
  np.testing.assert_array_equal(loss, loss32)
  assert grads.keys() == grads32.keys()
  for k in grads32:
    np.testing.assert_array_equal(grads[k], grads32[k], err_msg=k)


def _cosine(a, b):
  a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
  return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _assert_close_to_fp32(got, want):
  """tests/model_speed_test.py's bf16 tolerance: loss within 1%, every gradient tensor within
  cosine 0.99 and norm 5% of the float32 run, and float32 gradients."""
  (loss16, grads16), (loss32, grads32) = got, want
  assert abs(float(loss16) - float(loss32)) <= 0.01 * float(loss32)
  assert grads16.keys() == grads32.keys()
  for k in grads32:
    assert grads16[k].dtype == np.float32, k
    if np.linalg.norm(grads32[k]) > 0:
      assert _cosine(grads16[k], grads32[k]) > 0.99, k
      ratio = np.linalg.norm(grads16[k]) / np.linalg.norm(grads32[k])
      assert abs(ratio - 1) < 0.05, (k, ratio)


@pytest.mark.parametrize("overrides", [
    {}, {"loss_chunk": 32}, {"scan_layers": True, "remat": "full", "loss_chunk": 24},
    {"final_logit_softcap": 0.0, "attention_impl": "xla"}])
def test_bf16_head_backward_is_close_to_the_fp32_model(overrides):
  want = _loss_and_grads(_cfg(**overrides))
  got = _loss_and_grads(_cfg(dtype="bfloat16", head_grad_dtype="compute", **overrides))
  _assert_close_to_fp32(got, want)


def test_bf16_head_backward_under_sharding_constraints():
  """On a (data 2, fsdp 2, tensor 2) mesh the head's constraints shard the logits over the
  vocabulary: the same loss and gradients as one device, within the bf16 tolerance."""
  mesh = mesh_lib.learner_mesh(jax.devices(), run_config.MeshConfig(data=2, fsdp=2, tensor=2))
  cfg = _cfg(dtype="bfloat16", loss_chunk=32, scan_layers=True, remat="full")
  _assert_close_to_fp32(_loss_and_grads(cfg, mesh=mesh), _loss_and_grads(_cfg()))


def test_decode_logits_do_not_depend_on_the_switch():
  """The forward is the same dot under both values: decoding gives the same logits."""
  tokens = _tokens(batch=2, length=6)
  got = []
  for value in ("compute", "float32"):
    graphdef, params = _split(_cfg(dtype="bfloat16", head_grad_dtype=value))
    m = nnx.merge(graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    logits, _ = m.decode(tokens, positions, m.init_cache(2, 8))
    assert logits.dtype == jnp.float32
    got.append(np.asarray(logits))
  np.testing.assert_array_equal(got[0], got[1])


_DOT = re.compile(r"stablehlo\.dot_general .*:\s*\(tensor<([^>]*)>, tensor<([^>]*)>\)"
                  r"\s*->\s*tensor<([^>]*)>")


def _head_dots(text):
  """(operand dtypes, shapes) of every dot_general with a vocabulary-sized dimension."""
  dots = []
  for line in text.splitlines():
    match = _DOT.search(line)
    if not match:
      continue
    types = [t.split("x") for t in match.groups()]
    if any(str(V) in t[:-1] for t in types):
      dots.append(((types[0][-1], types[1][-1]), match.groups()))
  return dots


def _lowered_grad(cfg):
  graphdef, params = _split(cfg)
  return jax.jit(jax.grad(_loss_fn(graphdef, _tokens()))).lower(params).as_text()


@pytest.mark.parametrize("overrides", [{}, {"loss_chunk": 32, "scan_layers": True,
                                            "remat": "full"}])
def test_no_float32_dot_of_the_head_size_under_compute(overrides):
  """bf16 compute: the head's three dots (logits, and the two backward ones) take bf16
  operands under "compute"; under "float32" the backward multiplies float32 by float32."""
  fast = _head_dots(_lowered_grad(_cfg(dtype="bfloat16", head_grad_dtype="compute",
                                       **overrides)))
  slow = _head_dots(_lowered_grad(_cfg(dtype="bfloat16", head_grad_dtype="float32",
                                       **overrides)))
  assert len(fast) >= 3, fast  # the forward dot and the two backward ones
  assert all(dtypes == ("bf16", "bf16") for dtypes, _ in fast), fast
  assert any(dtypes == ("f32", "f32") for dtypes, _ in slow), slow  # so the check can fail


_TABLE_CAST = re.compile(
    rf"(%\S+) = stablehlo\.convert (%\S+) : \(tensor<{V}x64xf32>\) -> tensor<{V}x64xbf16>")
_RESULT = re.compile(r"(%[\w#]+)(?::\d+)? = stablehlo\.(\w+)")


def _table_casts(text):
  """Lines that convert a float32 [V, D] array to bf16, other than a matmul's result (the
  head's backward casts the table's gradient back to the dtype of the bf16 table)."""
  dots = {m.group(1) for m in _RESULT.finditer(text) if m.group(2) == "dot_general"}
  return [line for line in text.splitlines()
          if (m := _TABLE_CAST.search(line)) and m.group(2) not in dots]


@pytest.mark.parametrize("head_grad_dtype", ["compute", "float32"])
def test_the_chunked_loss_casts_the_table_once(head_grad_dtype):
  """The loss of 4 chunks and its gradient (the chunks recomputed) read one bf16 copy of the
  table, cast before the chunks' loops, and its gradient adds up in float32; casting inside
  the head (the table not passed in) converts it in the body of the forward loop and again
  in the body of the backward one."""
  cfg = _cfg(dtype="bfloat16", loss_chunk=32, head_grad_dtype=head_grad_dtype)
  graphdef, params = _split(cfg)
  x_BLD = jax.random.normal(jax.random.key(0), (4, 32, 64), jnp.float32).astype(jnp.bfloat16)
  targets_BL = _tokens(length=32)

  def lowered(loss_of):
    def loss(p):
      ce, z = loss_of(nnx.merge(graphdef, p))
      return jnp.mean(ce) + jnp.mean(z)
    return jax.jit(jax.value_and_grad(loss)).lower(params).as_text()

  text = lowered(lambda m: train_step.head_losses(m, x_BLD, targets_BL, 32))
  assert text.count("stablehlo.while") == 2  # the chunks, forward and backward
  casts = _table_casts(text)
  assert len(casts) == 1, casts
  main = text[text.index("func.func public @main"):]
  assert main.index(casts[0]) < main.index("stablehlo.while")  # before the loops
  # The loops read that bf16 copy, and the table's gradient adds up in float32 across chunks.
  loops = [sorted(re.findall(rf"tensor<{V}x64x(\w+)>", line)) for line in text.splitlines()
           if "stablehlo.while" in line]
  assert sorted(loops) == [["bf16"], ["bf16", "f32"]], loops
  per_chunk = _table_casts(lowered(
      lambda m: train_step.chunked_token_losses(m.logits, x_BLD, targets_BL, 32)))
  assert len(per_chunk) == 2, per_chunk  # so the checks above can fail
