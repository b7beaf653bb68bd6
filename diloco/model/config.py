"""The model's configuration: the one config group that the model package needs, kept here so
that the model and its presets do not import the rest of the configuration."""

from __future__ import annotations

from diloco.settings import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, OneOf, frozen, require, setting

# How much of each layer's forward pass is kept for the backward pass (`jax.checkpoint`):
# "none" keeps everything (no remat), "full" keeps only the layer's inputs and recomputes the
# rest; the next three name `jax.checkpoint_policies` (dots_saveable keeps matmul outputs). The
# last three use the layer's named values (`checkpoint_name`): "save_attention" keeps only the
# attention output before its projection (not a dot: the dots policies recompute it),
# "save_dots_and_attention" keeps that and the matmul outputs without batch dimensions,
# "offload_dots" moves those matmul outputs to pinned host memory. With cuDNN attention the
# backward still reruns its forward kernel for the softmax statistics under every policy but
# "none" (measured; docs/decisions/model_and_speed.md, "Learner speed: the embedding gradient, named remat").
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable",
                  "nothing_saveable", "save_attention", "save_dots_and_attention",
                  "offload_dots")
# How the input embedding reads the table: "gather" rows of the compute-dtype table (its
# gradient is a scatter-add in the compute dtype), "gather_f32" rows of the parameter-dtype
# table cast afterwards (the scatter-add accumulates in the parameter dtype), "one_hot" a
# one-hot matmul (its gradient is a matmul: no scatter, float32 accumulation); "auto" is
# "one_hot" up to 8192 entries (byte vocabularies), "gather_f32" above
# (`tied_table.resolve_embed_impl`).
EMBED_IMPLS = ("auto", "gather", "gather_f32", "one_hot")
# "reference": the explicit einsum/softmax path (the numerics of record); the others go through
# `jax.nn.dot_product_attention`: "xla" on any backend, "cudnn" (fused flash attention, GPU,
# bf16/fp16), "auto" (cuDNN on a GPU backend where it supports the shapes, XLA elsewhere).
ATTENTION_IMPLS = ("reference", "xla", "cudnn", "splash", "auto")
# Compute and parameter dtypes.
DTYPES = ("float32", "bfloat16")


# The fields that change how the model computes, not what its parameters are: a run may
# resume with other values of these (e.g. remat or smaller loss chunks after running out of
# memory, bf16 compute on an accelerator after a CPU start).
SPEED_SWITCHES = ("dtype", "remat", "scan_layers", "attention_impl", "loss_chunk",
                  "head_grad_dtype", "embed_impl")
# The dtype of the output head's two backward matmuls: "compute" casts the float32 cotangent
# of the logits to `dtype` (float32 accumulation), "float32" runs them in float32 (TF32 on
# Hopper, half the bf16 rate). The forward is the same: compute-dtype operands, float32 logits.
HEAD_GRAD_DTYPES = ("compute", "float32")


def layout(model_fields: dict) -> dict:
  """A model config's fields (as a dict) without its speed switches: what a checkpoint of its
  parameters must match."""
  return {k: v for k, v in model_fields.items() if k not in SPEED_SWITCHES}


@frozen
class ModelConfig:
  """A Gemma-style decoder-only LM (see `diloco.model.transformer`)."""
  name: str = "custom"
  vocab_size: int = setting(384, AT_LEAST_ONE)
  embed_dim: int = setting(64, AT_LEAST_ONE)
  num_layers: int = setting(2, AT_LEAST_ONE)
  num_heads: int = setting(4, AT_LEAST_ONE)
  num_kv_heads: int = setting(2, AT_LEAST_ONE)
  head_dim: int = setting(16, AT_LEAST_ONE)
  mlp_dim: int = setting(256, AT_LEAST_ONE)
  # One letter per layer, repeated cyclically: L = local sliding window, G = global.
  attention_pattern: str = "LG"
  sliding_window: int = setting(64, AT_LEAST_ONE)
  rope_base_local: float = setting(10_000.0, POSITIVE)
  rope_base_global: float = setting(1_000_000.0, POSITIVE)
  qk_norm: bool = True
  # Queries are scaled by query_pre_attn_scalar**-0.5; 0 means head_dim.
  query_pre_attn_scalar: float = setting(0.0, NON_NEGATIVE)
  # 0 disables soft-capping of the final logits.
  final_logit_softcap: float = setting(0.0, NON_NEGATIVE, "0 = off")
  # Mixture of experts: num_experts = 0 gives the dense GeGLU MLP in every layer.
  num_experts: int = setting(0, NON_NEGATIVE, "0 = dense")
  experts_per_token: int = setting(2, AT_LEAST_ONE)
  expert_mlp_dim: int = setting(0, NON_NEGATIVE)
  capacity_factor: float = setting(1.25, POSITIVE)
  moe_aux_loss_weight: float = setting(0.01, NON_NEGATIVE)
  # Compute dtype (activations, matmul inputs); parameters, gradients and optimizer state stay
  # in param_dtype. Norms, softmax, logits and the loss always run in float32.
  dtype: str = setting("float32", OneOf(DTYPES))
  param_dtype: str = setting("float32", OneOf(DTYPES))
  remat: str = setting("none", OneOf(REMAT_POLICIES))  # applied to every layer
  # Run the layers as a `jax.lax.scan` over groups of len(attention_pattern) layers, so that
  # compile time does not grow with depth. The stored parameters keep their per-layer layout.
  scan_layers: bool = False
  attention_impl: str = setting("reference", OneOf(ATTENTION_IMPLS))
  # Apply the output head and the loss to this many tokens (batch x positions) at a time (0: all
  # at once), so that the float32 (batch, length, vocab) logits are never held whole. A
  # chunk keeps the whole batch and max(1, loss_chunk // batch) positions of it.
  loss_chunk: int = setting(0, NON_NEGATIVE, "0 = the whole sequence at once")
  head_grad_dtype: str = setting("compute", OneOf(HEAD_GRAD_DTYPES))
  # How the input embedding reads the table (EMBED_IMPLS); the same values either way.
  embed_impl: str = setting("auto", OneOf(EMBED_IMPLS))
  # The model class, by registered name (`diloco.model.registry`); "transformer" is this one.
  arch: str = "transformer"
  # A module to import first, so that it registers `arch`: a dotted module name or a .py file.
  module: str = ""

  def check(self) -> None:
    """The rules that relate the model's fields (each field's own rule is beside it)."""
    require(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads",
            f"must divide model.num_heads={self.num_heads}, got {self.num_kv_heads}")
    require(bool(self.attention_pattern) and set(self.attention_pattern) <= {"L", "G"},
            "model.attention_pattern",
            f"must be a string of L and G, got {self.attention_pattern!r}")
    if self.num_experts:
      require(1 <= self.experts_per_token <= self.num_experts, "model.experts_per_token",
              f"must be in [1, num_experts={self.num_experts}], got {self.experts_per_token}")
      require(self.expert_mlp_dim >= 1, "model.expert_mlp_dim", "must be >= 1 for an MoE model")
    if self.attention_impl == "cudnn":
      require(self.dtype == "bfloat16", "model.attention_impl",
              f"'cudnn' needs model.dtype='bfloat16', got {self.dtype!r} (use 'auto' or 'xla')")
