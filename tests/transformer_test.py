"""Model shapes, parameter counts (closed form), attention masks, RoPE and MoE routing."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diloco.model import moe, transformer
from diloco.model import presets as model_presets


def expected_counts(c):
  """Closed-form parameter count of a preset, written independently of the model code."""
  attn = c.embed_dim * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
  qk_norm = 2 * c.head_dim if c.qk_norm else 0
  norms = 4 * c.embed_dim
  if c.num_experts:
    ffn_total = c.embed_dim * c.num_experts + 3 * c.num_experts * c.embed_dim * c.expert_mlp_dim
    ffn_active = (c.embed_dim * c.num_experts
                  + 3 * c.experts_per_token * c.embed_dim * c.expert_mlp_dim)
  else:
    ffn_total = ffn_active = 3 * c.embed_dim * c.mlp_dim
  embed = c.vocab_size * c.embed_dim
  per_layer = attn + qk_norm + norms
  total = embed + c.num_layers * (per_layer + ffn_total) + c.embed_dim
  active = embed + c.num_layers * (per_layer + ffn_active) + c.embed_dim
  return total, active


# Rough size classes promised by the preset names (billions of total parameters).
SIZE_CLASS = {"gemma_2b": (2.0, 3.0), "gemma_5b": (4.5, 6.0), "gemma_9b": (8.5, 10.0),
              "moe_2_8b": (2.6, 3.0), "moe_3_8b": (3.6, 4.0), "small": (0.005, 0.02),
              "m35": (0.034, 0.037), "nano": (0.000035, 0.000040),
              "mini": (0.00057, 0.00061)}


@pytest.mark.parametrize("name", model_presets.NAMES)
def test_preset_parameter_counts(name):
  cfg = model_presets.get(name)
  counts = transformer.param_counts(cfg)
  total, active = expected_counts(cfg)
  assert counts["total"] == total
  assert counts["active"] == active
  if name in SIZE_CLASS:
    low, high = SIZE_CLASS[name]
    assert low * 1e9 <= counts["total"] <= high * 1e9
  if cfg.num_experts:
    assert counts["active"] < counts["total"]


@pytest.mark.parametrize("smaller,larger", [("nano", "tiny"), ("tiny", "mini")])
def test_scaling_sizes_are_about_four_times_apart(smaller, larger):
  """experiments/scaling/ reads the gap's trend over nano, tiny and mini: 4x steps in N."""
  ratio = (transformer.param_counts(model_presets.get(larger))["total"]
           / transformer.param_counts(model_presets.get(smaller))["total"])
  assert 3.8 <= ratio <= 4.2


@pytest.mark.parametrize("name", ["gemma_2b", "moe_2_8b", "m35"])
def test_large_preset_forward_shapes_abstractly(name):
  cfg = model_presets.get(name)

  def forward(tokens):
    with nnx.use_eager_sharding(False):
      m = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
    return m(tokens)

  logits, aux = jax.eval_shape(forward, jax.ShapeDtypeStruct((2, 4096), jnp.int32))
  assert logits.shape == (2, 4096, cfg.vocab_size) and logits.dtype == jnp.float32
  assert aux.shape == ()


def _tiny(**overrides):
  cfg = dataclasses.replace(model_presets.get("tiny"), **overrides)
  with nnx.use_eager_sharding(False):
    return transformer.Transformer(cfg, rngs=nnx.Rngs(0)), cfg


def test_causal_and_sliding_window():
  m, _ = _tiny(num_layers=1, attention_pattern="L", sliding_window=4)
  tokens = jnp.arange(16, dtype=jnp.int32)[None]
  changed = tokens.at[0, 0].set(200)
  base, _ = m(tokens)
  out, _ = m(changed)
  diff = np.abs(np.asarray(out - base)).max(axis=-1)[0]
  assert diff[0] > 0 and diff[3] > 0         # inside the window of token 0
  assert np.all(diff[4:] == 0)               # one local layer sees 4 tokens back at most
  later = tokens.at[0, 10].set(200)
  out_later, _ = m(later)
  assert np.all(np.asarray(out_later - base)[0, :10] == 0)  # causal


def test_global_layer_sees_whole_prefix():
  m, _ = _tiny(num_layers=1, attention_pattern="G", sliding_window=4)
  tokens = jnp.arange(16, dtype=jnp.int32)[None]
  base, _ = m(tokens)
  out, _ = m(tokens.at[0, 0].set(200))
  assert np.abs(np.asarray(out - base))[0, 15].max() > 0


def test_logit_softcap_bounds_logits():
  m, cfg = _tiny(final_logit_softcap=0.5)
  logits, _ = m(jnp.arange(32, dtype=jnp.int32).reshape(2, 16))
  assert float(jnp.max(jnp.abs(logits))) <= cfg.final_logit_softcap


def test_rope_depends_only_on_relative_position():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)

  def score(m, n):
    qm = transformer.apply_rope(q, jnp.array([[m]]), 10_000.0)
    kn = transformer.apply_rope(k, jnp.array([[n]]), 10_000.0)
    return float(jnp.sum(qm * kn))

  assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-5)
  assert score(0, 0) == pytest.approx(float(jnp.sum(q * k)), rel=1e-6)
  assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)


def test_moe_routing_respects_capacity_and_top_k():
  rng = np.random.default_rng(1)
  t, e, k = 64, 4, 2
  logits = rng.normal(size=(t, e)) * 3
  logits[:, 0] += 4  # expert 0 is over-subscribed
  probs = jax.nn.softmax(jnp.asarray(logits, jnp.float32))
  capacity = moe.expert_capacity(t, e, k, 1.0)
  dispatch, combine, aux = moe.route(probs, k, capacity)
  dispatch, combine = np.asarray(dispatch), np.asarray(combine)
  assert capacity == math.ceil(t * k / e)
  per_expert = dispatch.sum(axis=(0, 2))
  assert per_expert.max() <= capacity and per_expert[0] == capacity   # the full one is cut
  assert np.all(dispatch.sum(axis=2) <= 1)                 # one slot per (token, expert)
  assert np.all(dispatch.sum(axis=(1, 2)) <= k)            # at most k experts per token
  assert np.all(dispatch.sum(axis=0) <= 1)                 # no slot is shared
  # Combine weights are the renormalised top-k gates of kept choices.
  top = np.sort(np.asarray(probs), axis=-1)[:, ::-1][:, :k]
  gates = top / top.sum(axis=-1, keepdims=True)
  full = dispatch.sum(axis=(1, 2)) == k
  np.testing.assert_allclose(combine.sum(axis=(1, 2))[full], gates.sum(axis=-1)[full], rtol=1e-5)
  assert np.isfinite(float(aux)) and float(aux) >= 1.0 - 1e-6


def test_moe_aux_loss_is_one_for_uniform_routing():
  # Closed form: E * sum_e f_e p_e with f_e = p_e = 1/E gives 1.
  t, e = 16, 4
  probs = jnp.full((t, e), 1.0 / e)
  probs = probs + jnp.eye(t, e) * 1e-4  # break top-k ties, routing stays balanced
  probs = probs / probs.sum(-1, keepdims=True)
  _, _, aux = moe.route(probs, 1, capacity=t)
  assert float(aux) == pytest.approx(1.0, abs=1e-3)


def test_moe_model_forward_is_finite():
  with nnx.use_eager_sharding(False):
    m = transformer.Transformer(model_presets.get("tiny_moe"), rngs=nnx.Rngs(0))
  logits, aux = m(jnp.arange(64, dtype=jnp.int32).reshape(2, 32) % 200)
  assert logits.shape == (2, 32, 384)
  assert np.isfinite(np.asarray(logits)).all() and np.isfinite(float(aux)) and float(aux) > 0
