"""The tied token table's two uses as matmuls, with gradients that stay in the compute dtype.

The input embedding reads rows of the table and the output head multiplies hidden states by it;
autodiff of either under bf16 compute gives float32 x float32 matmuls (the float32 cotangent of
a float32-accumulating dot upcasts its operands) or a bf16 scatter-add of every token's row.
These custom VJPs keep both directions bf16 x bf16 with float32 accumulation
(tests/head_speed_test.py, tests/embed_remat_test.py check the programs), and the table's
gradient leaves its dot in the table's dtype, as every layer weight's does: the compiler reduces
a gradient's partial sums across devices where its dot emits them, so a float32 result would
cross ICI, and the data-center network between slices, at twice the bytes
(tests/tpu_compile_test.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from diloco.model.sharding import constrain

# `embed_impl="auto"` takes the one-hot matmul up to this many vocabulary entries: its
# [B, L, V] one-hot input and its 2 * B * L * V * D FLOPs stay small next to a layer's.
EMBED_ONE_HOT_MAX_VOCAB = 8192


def resolve_embed_impl(impl: str, vocab_size: int) -> str:
  """The input embedding path that `embed_impl` means: "auto" is the one-hot matmul for small
  (byte) vocabularies, where a few rows take most of the tokens, and the float32 gather above
  `EMBED_ONE_HOT_MAX_VOCAB`, where the one-hot input and its matmul would cost too much."""
  if impl != "auto":
    return impl
  return "one_hot" if vocab_size <= EMBED_ONE_HOT_MAX_VOCAB else "gather_f32"


@jax.custom_vjp
def head_matmul(x_BLD: jax.Array, table_VD: jax.Array) -> jax.Array:
  """`einsum("BLD,VD->BLV")` with float32 logits whose backward stays in the operands' dtype.

  Autodiff of the float32-accumulating dot would hand its float32 cotangent to both backward
  dots, and so upcast the bf16 operands: two float32 matmuls of the head's size (TF32 on
  Hopper). Here the cotangent is cast to the operands' dtype and the backward dots accumulate
  in float32, as the forward does; with float32 operands this is autodiff's program.
  """
  return jnp.einsum("BLD,VD->BLV", x_BLD, table_VD, preferred_element_type=jnp.float32)


def _head_matmul_fwd(x_BLD, table_VD):
  return head_matmul(x_BLD, table_VD), (x_BLD, table_VD)


def _head_matmul_bwd(residuals, g_BLV):
  x_BLD, table_VD = residuals
  g_BLV = g_BLV.astype(table_VD.dtype)
  dx_BLD = jnp.einsum("BLV,VD->BLD", g_BLV, table_VD, preferred_element_type=jnp.float32)
  dtable_VD = jnp.einsum("BLV,BLD->VD", g_BLV, x_BLD, preferred_element_type=table_VD.dtype)
  return dx_BLD.astype(x_BLD.dtype), dtable_VD


head_matmul.defvjp(_head_matmul_fwd, _head_matmul_bwd)


@jax.custom_vjp
def one_hot_embed(tokens_BL: jax.Array, table_VD: jax.Array) -> jax.Array:
  """Rows `table_VD[tokens_BL]` as a one-hot matmul accumulated in float32 (exact rows).

  The backward is the transposed matmul, one-hot by cotangent, both in the table's dtype with
  float32 accumulation: no scatter, and no float32 x float32 dot under bf16 compute (autodiff
  would upcast both operands to the float32 cotangent of the accumulator, as in the head).
  """
  return _one_hot_matmul("BLV,VD->BLD", tokens_BL, table_VD, table_VD.shape[0])


def _one_hot_matmul(spec, tokens_BL, other, vocab, out_dtype=jnp.float32):
  dtype = other.dtype
  one_hot_BLV = constrain(jax.nn.one_hot(tokens_BL, vocab, dtype=dtype), "batch", "length",
                          "vocab")
  # A float32 product must not round (TF32 on GPUs): HIGHEST keeps the rows and sums exact.
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
  out = jnp.einsum(spec, one_hot_BLV, other, precision=precision,
                   preferred_element_type=out_dtype)
  return out.astype(dtype)


def _one_hot_embed_fwd(tokens_BL, table_VD):
  # The residual carries only the table's vocabulary size and dtype, not the table.
  return one_hot_embed(tokens_BL, table_VD), (tokens_BL, jnp.zeros((table_VD.shape[0], 0),
                                                                     table_VD.dtype))


def _one_hot_embed_bwd(residuals, g_BLD):
  tokens_BL, like_V0 = residuals
  g_BLD = g_BLD.astype(like_V0.dtype)
  return None, _one_hot_matmul("BLV,BLD->VD", tokens_BL, g_BLD, like_V0.shape[0], g_BLD.dtype)


one_hot_embed.defvjp(_one_hot_embed_fwd, _one_hot_embed_bwd)


@jax.custom_vjp
def grad_to_param(param, cast):
  """`cast` (a copy of `param` in another dtype, computed once), whose cotangent goes to
  `param` in `param`'s dtype, as if each use had cast `param` itself."""
  del param
  return cast


def _grad_to_param_fwd(param, cast):
  return cast, jnp.zeros((), param.dtype)  # the residual carries only param's dtype


def _grad_to_param_bwd(zero_of_param_dtype, g):
  return g.astype(zero_of_param_dtype.dtype), None  # None: no cotangent for the copy


grad_to_param.defvjp(_grad_to_param_fwd, _grad_to_param_bwd)
