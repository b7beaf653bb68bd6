"""Attention through the Pallas splash kernel that ships with JAX (TPU flash attention).

On a TPU mesh `attention_impl="auto"` (and `"splash"`) runs this kernel instead of XLA's
attention, which materialises the [L, S] logits: splash streams blocks of keys through VMEM and
skips the blocks the causal or sliding-window mask empties, so it neither holds the logits nor
computes the masked band. Off TPU the same kernel runs in Pallas' interpreter (slow, exact), so
that the CPU tests check its numbers against the reference attention.

The kernel is a `pallas_call`, which the SPMD partitioner cannot split: on a mesh it runs in a
`shard_map` over the activations' own sharding (batch over data x fsdp, query heads over
tensor, keys and values replicated over tensor as the kv heads are), each shard attending its
local query heads to the kv heads they read.
"""

from __future__ import annotations

import functools

import jax

from diloco.model.sharding import logical_spec

# Block sizes the kernel is built with, largest first: a sequence is split into blocks of the
# first that divides it (512 is what the kernel's authors tune for long sequences).
BLOCKS = (512, 256, 128)


def mesh_platform() -> str:
  """The platform of the mesh being traced under (`jax.set_mesh`), else the default backend's:
  a program lowered for TPU devices on a CPU host (`diloco compile`) is a TPU program."""
  device = jax.sharding.get_abstract_mesh().abstract_device
  return device.platform if device is not None else jax.default_backend()


def block_size(length: int) -> int | None:
  """The kernel's block for a sequence of `length`, None when no block divides it."""
  return next((b for b in BLOCKS if length % b == 0), None)


def _tensor_shards() -> int:
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else dict(mesh.shape).get("tensor", 1)


def supports(length: int, num_heads: int, num_kv_heads: int) -> str:
  """Why splash cannot run this attention on the current mesh ("" when it can)."""
  if block_size(length) is None:
    return f"the sequence length {length} is not a multiple of {BLOCKS[-1]}"
  local, groups = num_heads // _tensor_shards(), num_heads // num_kv_heads
  if num_heads % _tensor_shards() or (local % groups and groups % local):
    return (f"{num_heads} query heads over tensor={_tensor_shards()} split the groups of "
            f"{groups} heads per kv head")
  return ""


def _kernel(length: int, heads: int, window: int | None, interpret: bool):
  """A multi-query kernel over `heads` query heads sharing one key and value head (built at
  each trace: it holds arrays, which a cache would leak from one trace into the next; the
  mask's block tables are cached by Pallas itself)."""
  # Imported here: Pallas adds about half a second to every process that imports the model.
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as kernel,
  )
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
  shape = (length, length)
  one = (masks.CausalMask(shape) if window is None
         else masks.LocalMask(shape, window_size=(window - 1, 0), offset=0))
  b = block_size(length)
  sizes = kernel.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                            block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
  return kernel.make_splash_mqa(masks.MultiHeadMask([one] * heads), block_sizes=sizes,
                                head_shards=1, q_seq_shards=1, interpret=interpret)


def _local(q_BLNH, k_BSKH, v_BSKH, *, groups: int, window: int | None, interpret: bool):
  """Attention of one shard's query heads (already scaled) to the kv heads they read."""
  b, length, n, h = q_BLNH.shape
  kv_local = max(1, n // groups)
  start = 0
  if _tensor_shards() > 1:
    start = jax.lax.axis_index("tensor") * n // groups
  k_BSKH = jax.lax.dynamic_slice_in_dim(k_BSKH, start, kv_local, axis=2)
  v_BSKH = jax.lax.dynamic_slice_in_dim(v_BSKH, start, kv_local, axis=2)
  g = n // kv_local
  q_BKGLH = q_BLNH.reshape(b, length, kv_local, g, h).transpose(0, 2, 3, 1, 4)
  k_BKSH, v_BKSH = k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3)
  attend = _kernel(length, g, window, interpret)
  out_BKGLH = jax.vmap(jax.vmap(attend))(q_BKGLH, k_BKSH, v_BKSH)
  return out_BKGLH.transpose(0, 3, 1, 2, 4).reshape(b, length, n, h)


def attention(q_BLNH, k_BSKH, v_BSKH, *, scale: float, window: int | None) -> jax.Array:
  """Causal attention (within `window` positions when given) of positions 0..L-1, GQA: query
  head n reads kv head n // (N / K). The softmax runs in float32; the output has q's dtype."""
  n, k = q_BLNH.shape[2], k_BSKH.shape[2]
  problem = supports(q_BLNH.shape[1], n, k)
  if problem:
    raise ValueError(f"model.attention_impl='splash': {problem}")
  local = functools.partial(_local, groups=n // k, window=window,
                            interpret=mesh_platform() != "tpu")
  q_BLNH = (q_BLNH * scale).astype(q_BLNH.dtype)
  if jax.sharding.get_abstract_mesh().empty:
    return local(q_BLNH, k_BSKH, v_BSKH)
  q_spec = logical_spec(("batch", "length", "heads", "head_dim"))
  kv_spec = logical_spec(("batch", "length", "kv_heads", "head_dim"))
  return jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                       check_vma=False)(q_BLNH, k_BSKH, v_BSKH)
