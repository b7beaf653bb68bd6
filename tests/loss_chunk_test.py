"""`model.loss_chunk`: the output head and the loss applied a chunk of tokens (the whole batch,
loss_chunk // batch positions) at a time give the full computation's losses and gradients, and
the full logits never appear."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diloco import fragments as fragments_lib
from diloco.model import presets as model_presets
from diloco.model import transformer
from diloco.train import step as train_step

B, L, D, V = 2, 19, 8, 50


def _oracle(x, w, targets):
  """NumPy: log-sum-exp over the vocabulary minus the target logit, and (log Z)^2."""
  logits = x.astype(np.float64) @ w.astype(np.float64)
  top = logits.max(-1, keepdims=True)
  log_z = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
  target = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  return log_z - target, log_z ** 2


# Tokens per chunk at batch B = 2: 1 and 3 tokens are one position, then 4, 7, 19, 32 positions.
@pytest.mark.parametrize("chunk", [1, 3, 8, 14, 38, 64])
def test_chunked_losses_match_numpy_and_the_unchunked_gradients(chunk):
  rng = np.random.default_rng(chunk)
  x = rng.normal(size=(B, L, D)).astype(np.float32)
  w = rng.normal(size=(D, V)).astype(np.float32)
  targets = rng.integers(0, V, size=(B, L))
  head = lambda w_: lambda x_: x_ @ w_  # noqa: E731

  ce, z = jax.jit(lambda x_, w_: train_step.chunked_token_losses(
      head(w_), x_, jnp.asarray(targets), chunk))(x, w)
  want_ce, want_z = _oracle(x, w, targets)
  assert ce.shape == z.shape == (B, L)
  np.testing.assert_allclose(ce, want_ce, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(z, want_z, rtol=1e-5, atol=1e-4)

  def total(loss_fn):
    return jax.jit(jax.grad(lambda x_, w_: jnp.sum(sum(loss_fn(x_, w_))), argnums=(0, 1)))(x, w)

  got = total(lambda x_, w_: train_step.chunked_token_losses(head(w_), x_,
                                                             jnp.asarray(targets), chunk))
  want = total(lambda x_, w_: train_step.token_losses(x_ @ w_, jnp.asarray(targets)))
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def _loss_and_grads(cfg, tokens):
  graphdef, params = _graphdef_and_params(cfg)

  def loss(p):
    ce, z, aux = train_step._forward(graphdef, p, tokens)
    return ce + 1e-4 * z + aux

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  return float(value), {k: np.asarray(v) for k, v in
                        fragments_lib.flatten_tree(nnx.to_pure_dict(grads)).items()}


@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_the_model_loss_is_the_same_with_chunks(preset):
  tokens = jax.random.randint(jax.random.key(3), (2, 21), 0, 259)  # 20 targets: chunks of 6
  base = model_presets.get(preset)
  want_loss, want_grads = _loss_and_grads(base, tokens)
  got_loss, got_grads = _loss_and_grads(dataclasses.replace(base, loss_chunk=12), tokens)
  assert got_loss == pytest.approx(want_loss, rel=1e-6)
  assert got_grads.keys() == want_grads.keys()
  for k in want_grads:
    np.testing.assert_allclose(got_grads[k], want_grads[k], rtol=2e-5, atol=2e-6, err_msg=k)


def _graphdef_and_params(cfg):
  with nnx.use_eager_sharding(False):
    return nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)))


def test_the_full_logits_never_appear_in_the_compiled_step():
  tokens = jnp.zeros((2, 65), jnp.int32)  # 64 targets, chunks of 32 tokens: 16 positions

  def compiled(chunk):
    cfg = dataclasses.replace(model_presets.get("tiny"), vocab_size=4096, loss_chunk=chunk)
    graphdef, params = _graphdef_and_params(cfg)
    loss = lambda p: train_step._forward(graphdef, p, tokens)[0]  # noqa: E731
    return jax.jit(jax.grad(loss)).lower(params).compile().as_text()

  assert "f32[2,64,4096]" in compiled(0)  # so the check below can fail
  chunked = compiled(32)
  assert "f32[2,64,4096]" not in chunked and "f32[2,16,4096]" in chunked


@pytest.mark.parametrize("batch, chunk, want", [
    (1, 16, 4), (2, 16, 8), (4, 16, 16), (4, 64, 4), (8, 4, 64), (2, 0, 0), (2, 128, 0)])
def test_the_chunk_count_follows_tokens(batch, chunk, want):
  """A chunk holds the whole batch and chunk // batch positions (at least one): the number of
  chunks over 64 positions (0: no chunks, the whole logits at once) grows with the batch."""
  cfg = dataclasses.replace(model_presets.get("tiny"), loss_chunk=chunk)
  graphdef, params = _graphdef_and_params(cfg)
  tokens = jnp.zeros((batch, 65), jnp.int32)
  jaxpr = str(jax.make_jaxpr(lambda p: train_step._forward(graphdef, p, tokens))(params))
  lengths = [int(n) for n in re.findall(r"\blength=(\d+)", jaxpr)]
  assert lengths == ([want] if want else []), lengths
  assert train_step.chunk_positions(chunk, batch) == max(1, chunk // batch)


def test_evaluate_scores_the_same_with_chunks():
  """`diloco.cli.evaluate` applies the head in chunks of tokens too, to the same sums."""
  from diloco.cli import evaluate
  tokens = jax.random.randint(jax.random.key(4), (4, 21), 0, 259)
  sums = []
  for chunk in (0, 8):  # 8 tokens over a batch of 4: chunks of 2 positions
    graphdef, params = _graphdef_and_params(
        dataclasses.replace(model_presets.get("tiny"), loss_chunk=chunk))
    sums.append(float(evaluate._loss_sum(graphdef, params, tokens)))
  assert sums[1] == pytest.approx(sums[0], rel=1e-6)


def test_token_losses_match_a_numpy_log_softmax_and_scatter_nothing():
  """The target logit comes from an index comparison: the same values as a gather (exactly:
  one non-zero term per sum) and an elementwise gradient, no scatter in the program."""
  rng = np.random.default_rng(3)
  logits = rng.standard_normal((3, 5, 37)).astype(np.float32) * 4
  targets = rng.integers(0, 37, (3, 5)).astype(np.int32)
  ce, z = train_step.token_losses(jnp.asarray(logits), jnp.asarray(targets))
  picked = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  log_z = np.log(np.exp(logits.astype(np.float64)).sum(-1))
  np.testing.assert_allclose(np.asarray(ce), log_z - picked, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(z), log_z ** 2, rtol=1e-5)
  grad = jax.grad(lambda x: train_step.token_losses(x, jnp.asarray(targets))[0].sum())
  expected = np.exp(logits - log_z[..., None]) - np.eye(37, dtype=np.float32)[targets]
  np.testing.assert_allclose(np.asarray(grad(jnp.asarray(logits))), expected, atol=1e-5)
  text = jax.jit(grad).lower(jnp.asarray(logits)).as_text()
  assert "scatter" not in text and "gather" not in text
