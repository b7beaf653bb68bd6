"""Mixture-of-experts feed-forward: top-k router, capacity-limited dispatch, GeGLU experts.

Routing follows the GShard/Switch recipe: each token picks its top-k experts, the k
choices are served in priority order (every token's first choice before any second
choice), and an expert takes at most C = ceil(capacity_factor * T * k / E) tokens;
the rest are dropped (their residual stream passes through unchanged). The
load-balancing loss E * sum_e f_e * p_e is 1 for perfectly uniform routing.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from diloco.model.config import ModelConfig
from diloco.model.sharding import constrain

EXPERT_PARAM_NAMES = ("gate_EDF", "up_EDF", "down_EFD")


def expert_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
  return max(1, math.ceil(capacity_factor * num_tokens * k / num_experts))


def route(probs_TE: jax.Array, k: int, capacity: int):
  """Top-k routing under a per-expert capacity.

  Returns `(dispatch_TEC, combine_TEC, aux_loss)`: dispatch is 0/1, combine holds the
  renormalised gate of each kept (token, expert) pair at its slot.
  """
  t, e = probs_TE.shape
  gates_TK, experts_TK = jax.lax.top_k(probs_TE, k)
  gates_TK = gates_TK / jnp.sum(gates_TK, axis=-1, keepdims=True)
  choice_KTE = jax.nn.one_hot(experts_TK.T, e, dtype=jnp.int32)
  # Slot of each choice inside its expert, first choices of all tokens first.
  position_KTE = jnp.cumsum(choice_KTE.reshape(k * t, e), axis=0).reshape(k, t, e) - 1
  kept_KTE = choice_KTE * (position_KTE < capacity)
  slot_KTEC = jax.nn.one_hot(jnp.where(kept_KTE > 0, position_KTE, -1), capacity,
                             dtype=probs_TE.dtype)
  dispatch_TEC = jnp.sum(slot_KTEC, axis=0)
  combine_TEC = jnp.einsum("KTEC,TK->TEC", slot_KTEC, gates_TK)
  # Fraction of routed choices per expert times mean router probability per expert.
  fraction_E = jnp.mean(choice_KTE.astype(jnp.float32), axis=(0, 1))
  aux_loss = e * jnp.sum(fraction_E * jnp.mean(probs_TE.astype(jnp.float32), axis=0))
  return dispatch_TEC, combine_TEC, aux_loss


class MoE(nnx.Module):
  """E GeGLU experts behind a softmax top-k router."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f, e = cfg.embed_dim, cfg.expert_mlp_dim, cfg.num_experts
    pdt = jnp.dtype(cfg.param_dtype)
    init = jax.nn.initializers.normal
    self.router_DE = nnx.Param(init(d ** -0.5)(rngs.params(), (d, e), pdt),
                               out_sharding=("embed", None))
    self.gate_EDF = nnx.Param(init(d ** -0.5)(rngs.params(), (e, d, f), pdt),
                              out_sharding=("expert", "embed", "mlp"))
    self.up_EDF = nnx.Param(init(d ** -0.5)(rngs.params(), (e, d, f), pdt),
                            out_sharding=("expert", "embed", "mlp"))
    self.down_EFD = nnx.Param(init(f ** -0.5)(rngs.params(), (e, f, d), pdt),
                              out_sharding=("expert", "mlp", "embed"))
    self.k = cfg.experts_per_token
    self.capacity_factor = cfg.capacity_factor
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, x_BLD):
    dt = self.dtype
    b, seq, d = x_BLD.shape
    x_TD = x_BLD.reshape(b * seq, d)
    logits_TE = x_TD.astype(jnp.float32) @ self.router_DE[...].astype(jnp.float32)
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    e = probs_TE.shape[-1]
    capacity = expert_capacity(b * seq, e, self.k, self.capacity_factor)
    dispatch_TEC, combine_TEC, aux = route(probs_TE, self.k, capacity)
    x_ECD = jnp.einsum("TEC,TD->ECD", dispatch_TEC.astype(dt), x_TD)
    gate_ECF = jax.nn.gelu(jnp.einsum("ECD,EDF->ECF", x_ECD, self.gate_EDF[...].astype(dt)))
    up_ECF = jnp.einsum("ECD,EDF->ECF", x_ECD, self.up_EDF[...].astype(dt))
    h_ECF = constrain(gate_ECF * up_ECF, "expert", None, "mlp")
    y_ECD = jnp.einsum("ECF,EFD->ECD", h_ECF, self.down_EFD[...].astype(dt))
    y_TD = jnp.einsum("TEC,ECD->TD", combine_TEC.astype(dt), y_ECD)
    return y_TD.reshape(b, seq, d), aux
