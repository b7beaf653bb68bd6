"""KV-cache decoding: the cached path against the full forward pass, sampling against NumPy
probabilities, and a model that memorised a text reproducing it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from diloco.model import decode, presets, transformer

BOS = 256


def _model(seed=0, **fields):
  # A window of 4 makes the local layer's window bite inside short sequences.
  cfg = dataclasses.replace(presets.get("tiny"), **{"sliding_window": 4, **fields})
  with nnx.use_eager_sharding(False):
    return transformer.Transformer(cfg, rngs=nnx.Rngs(seed))


def _varied(model):
  """Post-norm scales of 4 let the layers' outputs outweigh the token's own embedding in the
  residual stream, so that a random tied-embedding model does not just repeat its input."""
  for block in model.layers:
    for norm in (block.post_attn_norm, block.post_mlp_norm):
      norm.scale[...] = jnp.full_like(norm.scale[...], 3.0)
  return model


def _forward_fn(model):
  graphdef, state = nnx.split(model)
  fn = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)[0])
  return lambda tokens: np.asarray(fn(state, jnp.asarray(tokens)))


def _decode_fn(model):
  graphdef, state = nnx.split(model)
  fn = jax.jit(lambda state, t, p, c: nnx.merge(graphdef, state).decode(t, p, c))
  return lambda tokens, positions, cache: fn(state, jnp.asarray(tokens), jnp.asarray(positions),
                                             cache)


def test_cached_logits_equal_the_full_forward_pass():
  model = _varied(_model())
  tokens = np.random.RandomState(0).randint(0, 258, (2, 13)).astype(np.int32)
  full = _forward_fn(model)(tokens)
  step = _decode_fn(model)
  cache = model.init_cache(2, 16)
  prefill = 5
  positions = np.broadcast_to(np.arange(prefill), (2, prefill)).astype(np.int32)
  logits, cache = step(tokens[:, :prefill], positions, cache)
  got = [np.asarray(logits)]
  for t in range(prefill, tokens.shape[1]):  # one token at a time, teacher-forced
    logits, cache = step(tokens[:, t:t + 1], np.full((2, 1), t, np.int32), cache)
    got.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(got, axis=1), full, atol=2e-5, rtol=1e-5)


def _greedy_without_cache(model, prompt, steps):
  """The reference: the whole growing sequence through the model at every step, argmax of
  its last position. (Padded to the final length, so that one program serves every step:
  the model is causal, so the padding after the last real token changes nothing before it.)"""
  forward = _forward_fn(model)
  batch, length = prompt.shape
  seq = np.zeros((batch, length + steps), np.int32)
  seq[:, :length] = prompt
  for t in range(length, length + steps):
    seq[:, t] = forward(seq)[:, t - 1].argmax(-1)
  return seq[:, length:]


def test_greedy_decoding_with_the_cache_equals_the_step_by_step_reference():
  model = _varied(_model(seed=1))
  prompt = np.random.RandomState(1).randint(0, 258, (3, 6)).astype(np.int32)
  got = decode.generate(model, prompt, max_tokens=10)
  want = _greedy_without_cache(model, prompt, 10)
  np.testing.assert_array_equal(got, want)
  assert len(set(want.ravel().tolist())) > 5, want  # not a degenerate repeat
  # top_k=1 at any temperature is argmax too.
  one = decode.generate(model, prompt, max_tokens=10,
                        sampling=decode.Sampling(temperature=2.0, top_k=1), seed=5)
  np.testing.assert_array_equal(one, want)


def test_sampling_follows_the_tempered_top_k_softmax():
  logits = np.array([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]], np.float32)
  temperature, top_k, draws = 1.5, 3, 6000
  sampling = decode.Sampling(temperature=temperature, top_k=top_k)
  keys = jax.random.split(jax.random.key(0), draws)
  picks = np.asarray(jax.vmap(lambda k: decode.pick(jnp.asarray(logits), k, sampling))(keys))
  # NumPy oracle: softmax(logits / T) over the 3 largest logits, zero elsewhere.
  kept = np.argsort(logits[0])[-top_k:]
  p = np.zeros(6)
  z = np.exp(logits[0, kept] / temperature)
  p[kept] = z / z.sum()
  freq = np.bincount(picks.ravel(), minlength=6) / draws
  np.testing.assert_allclose(freq, p, atol=0.025)
  assert freq[p == 0].sum() == 0
  # vocab_limit: ids at or above it are never picked, even the largest logit.
  limited = decode.Sampling(temperature=1.0, vocab_limit=5)
  picks = np.asarray(jax.vmap(lambda k: decode.pick(jnp.asarray(logits), k, limited))(keys))
  assert picks.max() < 5
  assert int(decode.pick(jnp.asarray(logits), keys[0], decode.Sampling(vocab_limit=5))[0]) == 0


def test_same_seed_same_tokens_and_bad_settings_raise():
  model = _model()
  prompt = np.full((2, 3), 65, np.int32)
  settings = dict(max_tokens=6, sampling=decode.Sampling(temperature=1.0, top_k=20))
  a = decode.generate(model, prompt, seed=7, **settings)
  np.testing.assert_array_equal(a, decode.generate(model, prompt, seed=7, **settings))
  assert a.shape == (2, 6) and a.dtype == np.int32
  with pytest.raises(ValueError, match="temperature must be >= 0"):
    decode.Sampling(temperature=-0.5)
  with pytest.raises(ValueError, match="top_k must be >= 0"):
    decode.Sampling(top_k=-1)
  with pytest.raises(ValueError, match="max_tokens must be >= 1"):
    decode.generate(model, prompt, max_tokens=0)
  with pytest.raises(ValueError, match="prompt must be"):
    decode.generate(model, np.zeros((2, 0), np.int32), max_tokens=2)


TEXT = b"Learners train apart; the syncer merges their fragments."


def test_a_model_that_memorised_a_text_reproduces_it_from_its_prefix():
  model = _model(seed=2, sliding_window=16)
  sequence = np.concatenate([[BOS], np.frombuffer(TEXT, np.uint8)]).astype(np.int32)
  batch = jnp.asarray(np.tile(sequence, (4, 1)))
  graphdef, params = nnx.split(model)
  tx = optax.adamw(3e-3, weight_decay=0.0)
  opt_state = tx.init(params)

  def loss_fn(params, tokens):
    logits, _ = nnx.merge(graphdef, params)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  for _ in range(300):
    params, opt_state, loss = step(params, opt_state)
  assert float(loss) < 0.05, float(loss)
  trained = nnx.merge(graphdef, params)
  prefix = 12  # BOS and 11 bytes
  out = decode.generate(trained, sequence[None, :prefix], max_tokens=len(sequence) - prefix)
  assert bytes(out[0].astype(np.uint8)) == TEXT[prefix - 1:]
