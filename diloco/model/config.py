"""The model's configuration: the one config group that the model package needs, kept here so
that the model and its presets do not import the rest of the configuration."""

from __future__ import annotations

import dataclasses


def _frozen(cls):
  return dataclasses.dataclass(frozen=True, kw_only=True, slots=True)(cls)


@_frozen
class ModelConfig:
  """A Gemma-style decoder-only LM (see `diloco.model.transformer`)."""
  name: str = "custom"
  vocab_size: int = 384
  embed_dim: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  mlp_dim: int = 256
  # One letter per layer, repeated cyclically: L = local sliding window, G = global.
  attention_pattern: str = "LG"
  sliding_window: int = 64
  rope_base_local: float = 10_000.0
  rope_base_global: float = 1_000_000.0
  qk_norm: bool = True
  # Queries are scaled by query_pre_attn_scalar**-0.5; 0 means head_dim.
  query_pre_attn_scalar: float = 0.0
  # 0 disables soft-capping of the final logits.
  final_logit_softcap: float = 0.0
  # Mixture of experts: num_experts = 0 gives the dense GeGLU MLP in every layer.
  num_experts: int = 0
  experts_per_token: int = 2
  expert_mlp_dim: int = 0
  capacity_factor: float = 1.25
  moe_aux_loss_weight: float = 0.01
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: bool = False
  # The model class, by registered name (`diloco.model.registry`); "transformer" is this one.
  arch: str = "transformer"
  # A module to import first, so that it registers `arch`: a dotted module name or a .py file.
  module: str = ""
