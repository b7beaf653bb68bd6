"""Gemma-style decoder-only language model in Flax NNX.

Shape legend: B batch, L length (queries), S length (keys), D embed, N query heads,
K kv heads, G = N / K query heads per kv head, H head dim, F mlp, V vocab, E experts,
C expert capacity, T = B * L tokens.

Every parameter carries logical axis names (`out_sharding`); `diloco.model.sharding` maps
them to mesh axes, so the model knows nothing about meshes.

Speed switches (`ModelConfig`), each computing the same function (tests/model_speed_test.py,
tests/embed_remat_test.py, tests/splash_test.py): `dtype` (bf16 compute over fp32 parameters),
`attention_impl` (the einsum reference, `jax.nn.dot_product_attention` or the Pallas splash
kernel), `scan_layers` (a `jax.lax.scan` over the layers), `remat` (a policy over the layer's
matmuls and its named values, `checkpoint_name`), `head_grad_dtype` (the output head's backward
in the compute dtype, `head_matmul`) and `embed_impl` (how the input embedding reads the table,
hence what its gradient is).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from diloco.model import moe, splash
from diloco.model.config import ModelConfig
from diloco.model.sharding import constrain
from diloco.model.tied_table import grad_to_param, head_matmul, one_hot_embed, resolve_embed_impl

_NEG_INF = -2.3819763e38  # large negative, finite in fp32 and bf16

# The values a layer names for the remat policies (`checkpoint_name`): q, k and v after their
# projections, norms and RoPE; the attention output before its output projection; the MLP's
# hidden activation (the input of its down projection).
ATTENTION_QKV, ATTENTION_OUT, MLP_HIDDEN = "attention_qkv", "attention_out", "mlp_hidden"

# Parameters that the layers only ever read cast to the compute dtype: the scanned path casts
# them once, before stacking, so that the stacked copy is in the compute dtype (half the bytes
# under bf16). Norm scales and the MoE router are read in float32 and stay as they are.
_COMPUTE_DTYPE_PARAMS = frozenset({"q_DNH", "k_DKH", "v_DKH", "o_NHD", "gate_DF", "up_DF",
                                   "down_FD", *moe.EXPERT_PARAM_NAMES})


def _param(rngs: nnx.Rngs, shape, names, dtype, scale: float) -> nnx.Param:
  init = jax.nn.initializers.normal(stddev=scale)
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names)


class RMSNorm(nnx.Module):
  """Gemma RMSNorm: x / rms(x) * (1 + scale), scale initialised to zero."""

  def __init__(self, dim: int, axis_name: str, *, param_dtype, eps: float = 1e-6):
    self.scale = nnx.Param(jnp.zeros((dim,), param_dtype), out_sharding=(axis_name,))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


def apply_rope(x_BLNH: jax.Array, positions_BL: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding on the two halves of the head dimension."""
  half = x_BLNH.shape[-1] // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle_BLH = positions_BL[..., None].astype(jnp.float32) * freq
  sin, cos = jnp.sin(angle_BLH)[:, :, None, :], jnp.cos(angle_BLH)[:, :, None, :]
  x1, x2 = jnp.split(x_BLNH.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BLNH.dtype)


class Attention(nnx.Module):
  """Grouped-query attention with RoPE, QK-norm and an optional sliding window."""

  def __init__(self, cfg: ModelConfig, *, local: bool, rngs: nnx.Rngs):
    d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pdt = jnp.dtype(cfg.param_dtype)
    self.q_DNH = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), pdt, d ** -0.5)
    self.k_DKH = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pdt, d ** -0.5)
    self.v_DKH = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pdt, d ** -0.5)
    self.o_NHD = _param(rngs, (n, h, d), ("heads", "head_dim", "embed"), pdt, (n * h) ** -0.5)
    self.qk_norm = cfg.qk_norm
    if cfg.qk_norm:
      self.q_norm = RMSNorm(h, "head_dim", param_dtype=pdt)
      self.k_norm = RMSNorm(h, "head_dim", param_dtype=pdt)
    self.local = local
    self.window = cfg.sliding_window
    self.rope_base = cfg.rope_base_local if local else cfg.rope_base_global
    self.scale = (cfg.query_pre_attn_scalar or h) ** -0.5
    self.groups = n // k
    self.dtype = jnp.dtype(cfg.dtype)
    self.impl = cfg.attention_impl

  def __call__(self, x_BLD, positions_BL, *, positions_are_arange: bool = False):
    """`positions_are_arange`: positions are 0..L-1 in every row, so that the fused path may
    build its causal and window masks from indices instead of reading the positions."""
    q_BLNH, k_BSKH, v_BSKH = self._project(x_BLD, positions_BL)
    if self.impl == "reference":
      out_BLNH = self._reference(q_BLNH * self.scale, k_BSKH, v_BSKH, positions_BL)
    else:
      out_BLNH = self._fused(q_BLNH, k_BSKH, v_BSKH, positions_BL, positions_are_arange)
    out_BLNH = checkpoint_name(out_BLNH, ATTENTION_OUT)
    return jnp.einsum("BLNH,NHD->BLD", out_BLNH, self.o_NHD[...].astype(self.dtype))

  def _project(self, x_BLD, positions_BL):
    """Queries, keys and values of `x_BLD`, normed and rotated."""
    dt = self.dtype
    q_BLNH = jnp.einsum("BLD,DNH->BLNH", x_BLD, self.q_DNH[...].astype(dt))
    k_BSKH = jnp.einsum("BSD,DKH->BSKH", x_BLD, self.k_DKH[...].astype(dt))
    v_BSKH = jnp.einsum("BSD,DKH->BSKH", x_BLD, self.v_DKH[...].astype(dt))
    if self.qk_norm:
      q_BLNH, k_BSKH = self.q_norm(q_BLNH), self.k_norm(k_BSKH)
    q_BLNH = apply_rope(q_BLNH, positions_BL, self.rope_base)
    k_BSKH = apply_rope(k_BSKH, positions_BL, self.rope_base)
    return tuple(checkpoint_name(a, ATTENTION_QKV) for a in (q_BLNH, k_BSKH, v_BSKH))

  def decode(self, x_BLD, positions_BL, cache):
    """Attention of L new positions over the keys and values cached so far (decoding).

    `cache` holds {"k": [B, S, K, H], "v": [B, S, K, H]}: slot s is position s. The new
    keys and values are written at positions_BL[0] (the same in every row), and the queries
    attend to slots at or before their own position (and within the window of a local layer),
    so unwritten slots are never read. Returns (out_BLD, the updated cache).
    """
    q_BLNH, k_BLKH, v_BLKH = self._project(x_BLD, positions_BL)
    start = positions_BL[0, 0]
    k_BSKH = jax.lax.dynamic_update_slice_in_dim(cache["k"], k_BLKH.astype(cache["k"].dtype),
                                                 start, axis=1)
    v_BSKH = jax.lax.dynamic_update_slice_in_dim(cache["v"], v_BLKH.astype(cache["v"].dtype),
                                                 start, axis=1)
    slots_BS = jnp.broadcast_to(jnp.arange(k_BSKH.shape[1]), (x_BLD.shape[0], k_BSKH.shape[1]))
    out_BLNH = self._reference(q_BLNH * self.scale, k_BSKH, v_BSKH, positions_BL, slots_BS)
    out_BLD = jnp.einsum("BLNH,NHD->BLD", out_BLNH, self.o_NHD[...].astype(self.dtype))
    return out_BLD, {"k": k_BSKH, "v": v_BSKH}

  def _mask_BLS(self, positions_BL, key_positions_BS=None):
    if key_positions_BS is None:
      key_positions_BS = positions_BL
    q_pos, k_pos = positions_BL[:, :, None], key_positions_BS[:, None, :]
    mask_BLS = k_pos <= q_pos
    if self.local:
      mask_BLS &= (q_pos - k_pos) < self.window
    return mask_BLS

  def _reference(self, q_BLNH, k_BSKH, v_BSKH, positions_BL, key_positions_BS=None):
    """Explicit GQA attention with the full float32 logits: the numerics of record.
    `key_positions_BS`: the keys' positions where they differ from the queries' (a cache)."""
    b, seq, n, h = q_BLNH.shape
    q_BLKGH = q_BLNH.reshape(b, seq, n // self.groups, self.groups, h)
    logits_BKGLS = jnp.einsum("BLKGH,BSKH->BKGLS", q_BLKGH, k_BSKH,
                              preferred_element_type=jnp.float32)
    mask_BLS = self._mask_BLS(positions_BL, key_positions_BS)
    logits_BKGLS = jnp.where(mask_BLS[:, None, None], logits_BKGLS, _NEG_INF)
    probs_BKGLS = jax.nn.softmax(logits_BKGLS, axis=-1).astype(self.dtype)
    out_BLKGH = jnp.einsum("BKGLS,BSKH->BLKGH", probs_BKGLS, v_BSKH)
    return out_BLKGH.reshape(b, seq, n, h)

  def _fused(self, q_BLNH, k_BSKH, v_BSKH, positions_BL, positions_are_arange):
    """`jax.nn.dot_product_attention` (GQA native, float32 softmax, Gemma's `scale`), or the
    splash kernel (`diloco.model.splash`) where `attention_impl` means it.

    With positions 0..L-1 the masks are causal plus `local_window_size`, which cuDNN and splash
    apply without materialising the logits; other positions need an explicit [B, 1, L, S] mask.
    """
    if positions_are_arange:
      mask, causal = None, True
      window = (self.window - 1, 0) if self.local else None
    else:
      mask, causal, window = self._mask_BLS(positions_BL)[:, None], False, None
    impl = resolve_attention_impl(self.impl, self.dtype)
    if impl == "splash" and positions_are_arange:
      problem = splash.supports(q_BLNH.shape[1], q_BLNH.shape[2], k_BSKH.shape[2])
      if not problem or self.impl == "splash":  # "auto" falls back to XLA for what it lacks
        return splash.attention(q_BLNH, k_BSKH, v_BSKH, scale=self.scale,
                                window=self.window if self.local else None)
    if impl == "splash":  # positions other than 0..L-1 (packed documents): XLA's, masked
      impl = "xla"
    kwargs = {"mask": mask, "scale": self.scale, "is_causal": causal,
              "local_window_size": window}
    if impl == "cudnn" and self.impl == "auto":
      try:
        return jax.nn.dot_product_attention(q_BLNH, k_BSKH, v_BSKH, implementation="cudnn",
                                            **kwargs)
      except (NotImplementedError, RuntimeError):  # shapes cuDNN lacks: XLA computes the same
        impl = "xla"
    return jax.nn.dot_product_attention(q_BLNH, k_BSKH, v_BSKH, implementation=impl, **kwargs)


def resolve_attention_impl(impl: str, dtype) -> str:
  """The attention implementation that `attention_impl` means on the mesh being traced.

  "auto" is Pallas' splash kernel on a TPU mesh (`diloco.model.splash`; XLA's attention for
  shapes it lacks), cuDNN on a GPU with a 16-bit compute dtype (cuDNN's flash attention has no
  float32 kernel), XLA otherwise (CPU). The platform is the mesh's (`splash.mesh_platform`), so
  that a TPU program compiled ahead of time on a CPU host is the TPU one.
  """
  if impl != "auto":
    return impl
  platform = splash.mesh_platform()
  if platform == "tpu":
    return "splash"
  half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  return "cudnn" if platform == "gpu" and half else "xla"


class GeGLU(nnx.Module):
  """Gated GELU feed-forward: down(gelu(x W_gate) * (x W_up))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f = cfg.embed_dim, cfg.mlp_dim
    pdt = jnp.dtype(cfg.param_dtype)
    self.gate_DF = _param(rngs, (d, f), ("embed", "mlp"), pdt, d ** -0.5)
    self.up_DF = _param(rngs, (d, f), ("embed", "mlp"), pdt, d ** -0.5)
    self.down_FD = _param(rngs, (f, d), ("mlp", "embed"), pdt, f ** -0.5)
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, x_BLD):
    dt = self.dtype
    gate_BLF = jax.nn.gelu(x_BLD @ self.gate_DF[...].astype(dt))
    h_BLF = constrain(gate_BLF * (x_BLD @ self.up_DF[...].astype(dt)), "batch", "length", "mlp")
    h_BLF = checkpoint_name(h_BLF, MLP_HIDDEN)
    return h_BLF @ self.down_FD[...].astype(dt)


class Block(nnx.Module):
  """Pre- and post-normed attention and feed-forward, each with a residual (Gemma 3)."""

  def __init__(self, cfg: ModelConfig, *, local: bool, rngs: nnx.Rngs):
    pdt = jnp.dtype(cfg.param_dtype)
    d = cfg.embed_dim
    self.pre_attn_norm = RMSNorm(d, "embed", param_dtype=pdt)
    self.attn = Attention(cfg, local=local, rngs=rngs)
    self.post_attn_norm = RMSNorm(d, "embed", param_dtype=pdt)
    self.pre_mlp_norm = RMSNorm(d, "embed", param_dtype=pdt)
    self.mlp = moe.MoE(cfg, rngs=rngs) if cfg.num_experts else GeGLU(cfg, rngs=rngs)
    self.post_mlp_norm = RMSNorm(d, "embed", param_dtype=pdt)

  def __call__(self, x_BLD, positions_BL, *, positions_are_arange: bool = False):
    attn_BLD = self.attn(self.pre_attn_norm(x_BLD), positions_BL,
                         positions_are_arange=positions_are_arange)
    return self._feed_forward(x_BLD + self.post_attn_norm(attn_BLD))

  def decode(self, x_BLD, positions_BL, cache):
    """The layer on new positions, attending over its KV cache: (x_BLD, the updated cache)."""
    attn_BLD, cache = self.attn.decode(self.pre_attn_norm(x_BLD), positions_BL, cache)
    return self._feed_forward(x_BLD + self.post_attn_norm(attn_BLD))[0], cache

  def _feed_forward(self, x_BLD):
    h_BLD = self.pre_mlp_norm(x_BLD)
    if isinstance(self.mlp, moe.MoE):
      h_BLD, aux = self.mlp(h_BLD)
    else:
      h_BLD, aux = self.mlp(h_BLD), jnp.zeros((), jnp.float32)
    x_BLD = x_BLD + self.post_mlp_norm(h_BLD)
    return constrain(x_BLD, "batch", "length", "embed"), aux


class Embedder(nnx.Module):
  """The token table, shared by the input embedding and the output head (tied)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    # std 1/sqrt(D): tied output logits start O(1); inputs are rescaled by sqrt(D).
    self.embedding = _param(rngs, (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"),
                            jnp.dtype(cfg.param_dtype), cfg.embed_dim ** -0.5)


class Transformer(nnx.Module):
  """Decoder-only LM with a scaled, tied token embedding.

  Returns `(logits_BLV, aux_loss)`; `aux_loss` is the summed MoE load-balancing
  loss (zero for a dense model), already multiplied by its weight.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pdt = jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.embedder = Embedder(cfg, rngs=rngs)
    pattern = cfg.attention_pattern
    self.layers = nnx.List([
        Block(cfg, local=pattern[i % len(pattern)] == "L", rngs=rngs)
        for i in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.embed_dim, "embed", param_dtype=pdt)

  def __call__(self, tokens_BL: jax.Array, positions_BL: jax.Array | None = None):
    x_BLD, aux = self.hidden(tokens_BL, positions_BL)
    return self.logits(x_BLD), aux

  def hidden(self, tokens_BL: jax.Array, positions_BL: jax.Array | None = None):
    """The final-normed hidden states and the weighted MoE aux loss: everything but the output
    head, so that a loss can apply the head a chunk of positions at a time
    (`model.loss_chunk`)."""
    cfg = self.cfg
    arange = positions_BL is None
    if arange:
      positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
    x_BLD = self._embed(tokens_BL)
    blocks = list(self.layers)
    aux = jnp.zeros((), jnp.float32)
    if cfg.scan_layers:
      x_BLD, aux, blocks = self._scan_layers(blocks, x_BLD, positions_BL, arange)
    for block in blocks:  # every layer, or those left over after the scanned groups
      gd, state = nnx.split(block)
      x_BLD, block_aux = _layer_fn(gd, cfg.remat, arange, True)(state, x_BLD, positions_BL)
      aux = aux + block_aux
    return self.final_norm(x_BLD), aux * cfg.moe_aux_loss_weight

  def _embed(self, tokens_BL: jax.Array) -> jax.Array:
    """The scaled input embedding, computed as `embed_impl` says: the rows are the same
    (bit for bit) on every path; the gradient differs in how it accumulates."""
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    table_VD = self.embedder.embedding[...]
    impl = resolve_embed_impl(cfg.embed_impl, cfg.vocab_size)
    if impl == "gather":  # backward: a scatter-add of B x L rows in the compute dtype
      x_BLD = table_VD.astype(dt)[tokens_BL]
    elif impl == "gather_f32":  # backward: the scatter-add accumulates in the parameter dtype
      x_BLD = table_VD[tokens_BL].astype(dt)
    else:  # one_hot: the backward is a matmul, so no contended scatter into frequent rows
      x_BLD = one_hot_embed(tokens_BL, table_VD.astype(dt))
    x_BLD = x_BLD * jnp.asarray(math.sqrt(cfg.embed_dim), dt)
    return constrain(x_BLD, "batch", "length", "embed")

  def init_cache(self, batch: int, length: int) -> list[dict[str, jax.Array]]:
    """Zeroed key/value caches of every layer for `length` positions (`decode`)."""
    cfg = self.cfg
    shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
    def zeros():
      return jnp.zeros(shape, jnp.dtype(cfg.dtype))
    return [{"k": zeros(), "v": zeros()} for _ in range(cfg.num_layers)]

  def decode(self, tokens_BL: jax.Array, positions_BL: jax.Array, cache):
    """(logits_BLV, updated cache) of L new tokens at positions_BL (the same in every row,
    consecutive), attending over the cached keys and values of the positions before them.

    The prompt goes in whole (prefill), then one token at a time; each call computes what
    `__call__` computes for those positions, with the reference attention (an explicit mask
    over the cache slots). The layers are unrolled whatever `scan_layers` says, and an MoE
    layer routes only the new tokens, so its expert capacity may differ from the full pass.
    """
    x_BLD = self._embed(tokens_BL)
    updated = []
    for block, layer_cache in zip(self.layers, cache):
      x_BLD, layer_cache = block.decode(x_BLD, positions_BL, layer_cache)
      updated.append(layer_cache)
    return self.logits(self.final_norm(x_BLD)), updated

  def head_table(self) -> jax.Array:
    """The tied table in the compute dtype, for `logits(x, table_VD)`: a caller that applies
    the head many times (the chunked loss) casts it once. No gradient flows through this copy:
    `logits` sends the table's gradient to the parameter, in the parameter's dtype, so that
    the chunks' contributions add up in float32 as they did with a cast per chunk."""
    return jax.lax.stop_gradient(self.embedder.embedding[...].astype(jnp.dtype(self.cfg.dtype)))

  def logits(self, x_BLD: jax.Array, table_VD: jax.Array | None = None) -> jax.Array:
    """The tied output head on hidden states: float32 logits, soft-capped. `table_VD`: the
    table from `head_table` (cast here when None)."""
    cfg = self.cfg
    param_VD = self.embedder.embedding[...]
    if table_VD is None:
      table_VD = param_VD.astype(jnp.dtype(cfg.dtype))
    else:
      table_VD = grad_to_param(param_VD, table_VD)
    x_BLD = x_BLD.astype(table_VD.dtype)
    if cfg.head_grad_dtype == "compute":
      logits_BLV = head_matmul(x_BLD, table_VD)
    else:  # the transpose of this dot multiplies float32 operands
      logits_BLV = jnp.einsum("BLD,VD->BLV", x_BLD, table_VD, preferred_element_type=jnp.float32)
    if cfg.final_logit_softcap:
      cap = cfg.final_logit_softcap
      logits_BLV = jnp.tanh(logits_BLV / cap) * cap
    return constrain(logits_BLV, "batch", "length", "vocab")

  def _scan_layers(self, blocks, x_BLD, positions_BL, arange):
    """Runs the first `len(pattern) * (num_layers // len(pattern))` layers as one scan.

    The scan steps over groups of len(pattern) consecutive layers, so that every step sees the
    same local/global sequence (a static property of each layer, as the fused attention needs
    it). The parameters are stored per layer (`layers/<i>/...`, the layout that fragments,
    checkpoints and exports name) and stacked here, inside the step: one fused copy per step,
    cast to the compute dtype first. Returns the layers it did not run.
    """
    cfg = self.cfg
    period = len(cfg.attention_pattern)
    groups = len(blocks) // period
    if groups < 2:  # nothing to gain: unroll
      return x_BLD, jnp.zeros((), jnp.float32), blocks
    graphdefs, stacked = [], []
    for j in range(period):
      members = [nnx.split(b) for b in blocks[j:groups * period:period]]
      graphdefs.append(members[0][0])
      stacked.append(_stack_states([state for _, state in members], jnp.dtype(cfg.dtype)))
    layer_fns = [_layer_fn(gd, cfg.remat, arange, False) for gd in graphdefs]

    def body(carry, states):
      x_BLD, aux = carry
      for fn, state in zip(layer_fns, states):
        x_BLD, block_aux = fn(state, x_BLD, positions_BL)
        aux = aux + block_aux
      return (x_BLD, aux), None

    (x_BLD, aux), _ = jax.lax.scan(body, (x_BLD, jnp.zeros((), jnp.float32)), tuple(stacked))
    return x_BLD, aux, blocks[groups * period:]


def _layer_fn(graphdef, remat: str, arange: bool, prevent_cse: bool):
  """`(state, x_BLD, positions_BL) -> (x_BLD, aux)` of one Block, under the remat policy."""

  def apply(state, x_BLD, positions_BL):
    return nnx.merge(graphdef, state)(x_BLD, positions_BL, positions_are_arange=arange)

  if remat == "none":
    return apply
  # Inside a scan the loop already keeps XLA from merging the recomputation away.
  return jax.checkpoint(apply, policy=remat_policy(remat), prevent_cse=prevent_cse)


def remat_policy(remat: str):
  """The `jax.checkpoint` policy of a `model.remat` value other than "none" (None: "full",
  save nothing but the inputs)."""
  policies = jax.checkpoint_policies
  if remat == "full":
    return None
  if remat == "save_attention":
    return policies.save_only_these_names(ATTENTION_OUT)
  if remat == "save_dots_and_attention":
    return policies.save_from_both_policies(policies.dots_with_no_batch_dims_saveable,
                                            policies.save_only_these_names(ATTENTION_OUT))
  if remat == "offload_dots":
    return policies.offload_dot_with_no_batch_dims("device", "pinned_host")
  return getattr(policies, remat)


def _stack_states(states, compute_dtype):
  """One State whose arrays stack those of `states` on a new leading "layers" axis.

  Kernels read only in the compute dtype are cast before stacking (the cast fuses into the
  stacking copy). The stacked arrays keep each parameter's sharding with the layer axis
  replicated, so that FSDP gathers one layer at a time inside the scan.
  """
  def is_var(v):
    return isinstance(v, nnx.Variable)
  variables = jax.tree_util.tree_leaves_with_path(states[0], is_leaf=is_var)
  values = [jax.tree.leaves(state) for state in states]
  treedef = jax.tree.structure(states[0])
  out = []
  for i, (path, var) in enumerate(variables):
    name = getattr(path[-1], "key", None)
    leaves = [v[i] for v in values]
    if name in _COMPUTE_DTYPE_PARAMS:
      leaves = [leaf.astype(compute_dtype) for leaf in leaves]
    stacked = jnp.stack(leaves)
    names = var.get_metadata().get("out_sharding")
    if names is not None:
      stacked = constrain(stacked, "layers", *names)
    out.append(stacked)
  return jax.tree.unflatten(treedef, out)


class _OneKey:
  """Stands in for `nnx.Rngs` where only shapes matter. Rngs counts its draws in a traced
  variable, and under `eval_shape` each count makes Flax probe the tracer's sharding, for
  which JAX walks the whole trace to build an error message that is then discarded: three
  quarters of the time for a 9B model. The shapes do not depend on the key."""

  def params(self) -> jax.Array:
    return jax.random.key(0)


def param_counts(cfg: ModelConfig) -> dict[str, int]:
  """Total and active (per token) parameter counts, from abstract shapes only."""
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=_OneKey()))
  leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  total = sum(math.prod(leaf.shape) for _, leaf in leaves)
  expert = sum(math.prod(leaf.shape) for path, leaf in leaves
               if any(getattr(k, "key", None) in moe.EXPERT_PARAM_NAMES for k in path))
  active = total - expert
  if cfg.num_experts:
    active += expert * cfg.experts_per_token // cfg.num_experts
  embedding = cfg.vocab_size * cfg.embed_dim
  return {"total": total, "active": active, "embedding": embedding,
          "non_embedding": total - embedding}
