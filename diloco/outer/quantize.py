"""Quantised payloads: bf16; int8/int4/int2 symmetric max-abs codes with a per-block scale; or
1-bit signs times the block's mean magnitude (`quantize`, `dequantize`), optionally with error
feedback (`quantize_with_feedback`). Codes narrower than a byte are packed, so a payload's
`nbytes` is what the precision really costs on the wire."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from diloco.outer import kernels

QUANT_BITS = (16, 8, 4, 2, 1)
# Bits whose codes share a byte, first code in the lowest bits.
_PACKED_BITS = (4, 2, 1)

@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedTensor:
  """A quantised payload.

  Attributes:
    values: bf16 values (bits 16), int8 codes (bits 8), or uint8 bytes holding 8 // bits codes
      each, first code in the lowest bits (bits 4, 2, 1); flat. 4- and 2-bit codes are two's
      complement; a 1-bit code is 1 for +scale and 0 for -scale.
    scales: float32 scale per block (empty for bits 16): the quantisation step, or for bits 1
      the block's mean absolute value.
    shape: shape of the original tensor.
    dtype: name of the original dtype (what `dequantize` returns).
    bits: 16, 8, 4, 2 or 1.
    block: consecutive elements of the flattened tensor that share a scale.
  """
  values: np.ndarray
  scales: np.ndarray
  shape: tuple[int, ...]
  dtype: str
  bits: int
  block: int

  @property
  def nbytes(self) -> int:
    """Payload bytes (values plus scales)."""
    return int(self.values.nbytes + self.scales.nbytes)

def _qmax(bits: int) -> int:
  return (1 << (bits - 1)) - 1  # 127, 7, 1 for 8, 4, 2 bits: symmetric, -qmax..qmax

def packed_size(codes: int, bits: int) -> int:
  """Bytes that `codes` codes of `bits` bits take (the store checks payloads against it)."""
  per_byte = 8 // bits if bits in _PACKED_BITS else 1
  return -(-codes // per_byte)

def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
  """Packs int8 codes into bytes, 8 // bits per byte, the first code in the lowest bits."""
  per_byte = 8 // bits
  fields = (codes.astype(np.uint8) & ((1 << bits) - 1))  # two's complement, truncated
  fields = np.concatenate([fields, np.zeros(-fields.size % per_byte, np.uint8)])
  fields = fields.reshape(-1, per_byte)
  packed = np.zeros(fields.shape[0], np.uint8)
  for i in range(per_byte):
    packed |= fields[:, i] << np.uint8(i * bits)
  return packed

def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
  """The int8 codes of `_pack`, sign-extended (all of them, padding included)."""
  per_byte = 8 // bits
  mask = np.uint8((1 << bits) - 1)
  fields = np.stack([(packed >> np.uint8(i * bits)) & mask for i in range(per_byte)], axis=1)
  codes = fields.reshape(-1).astype(np.int8)
  if bits == 1:
    return 2 * codes - 1  # 1 -> +1, 0 -> -1
  return np.where(codes >= 1 << (bits - 1), codes - (1 << bits), codes).astype(np.int8)

def quantize(x: np.ndarray, bits: int, block: int = 128) -> QuantizedTensor:
  """Quantises `x` to bf16, int8/int4/int2 with a symmetric max-abs scale per block, or signs.

  For 8, 4 and 2 bits the flattened tensor is cut into blocks of `block` elements (the tail
  padded with zeros), `scale = max|x| / qmax` per block (qmax 127, 7 or 1) and
  `q = round(x / scale)`, so that `|x - q * scale| <= scale / 2`; 2 bits are thus the ternary
  levels {-scale, 0, +scale}. 1 bit is signSGD with a scale: `sign(x) * mean|x|` over the
  block's real elements (zero counts as positive), which keeps each block's L1 norm. Codes
  narrower than a byte are packed, 2, 4 or 8 per byte.

  Raises:
    ValueError: unsupported bits, block < 1, or non-finite values.
  """
  if bits not in QUANT_BITS:
    raise ValueError(f"unsupported bits {bits}; allowed: {QUANT_BITS}")
  if not (isinstance(block, (int, np.integer)) and block >= 1):
    raise ValueError(f"block must be a positive int, got {block!r}")
  x = np.asarray(x)
  shape, dtype = tuple(x.shape), np.dtype(x.dtype).name
  if bits == 16:
    values = np.ascontiguousarray(x, dtype=ml_dtypes.bfloat16).reshape(-1)
    if not np.all(np.isfinite(values.astype(np.float32))):
      raise ValueError("cannot quantise non-finite values")
    return QuantizedTensor(values, np.zeros((0,), np.float32), shape, dtype, bits, int(block))
  work = kernels.acc_dtype(x.dtype)
  flat = x.reshape(-1).astype(work)
  num_blocks = -(-flat.size // block)
  padded = np.zeros(num_blocks * block, work)
  padded[:flat.size] = flat
  blocks = padded.reshape(num_blocks, block)
  if bits == 1:
    real = np.minimum(block, flat.size - block * np.arange(num_blocks))  # the tail is shorter
    scales = (np.sum(np.abs(blocks), axis=1) / np.maximum(real, 1)).astype(np.float32)
  else:
    maxabs = np.max(np.abs(blocks), axis=1) if num_blocks else np.zeros((0,), work)
    scales = (maxabs / _qmax(bits)).astype(np.float32)
  if not np.all(np.isfinite(scales)):  # a NaN or Inf anywhere in a block reaches its scale
    raise ValueError("cannot quantise non-finite values")
  if bits == 1:
    q = (blocks >= 0).astype(np.int8).reshape(-1)
  else:
    safe = np.where(scales > 0, scales, 1).astype(work)
    qmax = _qmax(bits)
    q = np.clip(np.rint(blocks / safe[:, None]), -qmax, qmax).astype(np.int8).reshape(-1)
  if bits in _PACKED_BITS:
    q = _pack(q, bits)
  return QuantizedTensor(q, scales, shape, dtype, bits, int(block))

def dequantize(q: QuantizedTensor) -> np.ndarray:
  """Reconstructs the tensor from a `QuantizedTensor`, in its original shape and dtype."""
  size = math.prod(q.shape)
  if q.bits == 16:
    return q.values.astype(q.dtype).reshape(q.shape)
  work = kernels.acc_dtype(np.dtype(q.dtype))
  codes = _unpack(q.values, q.bits) if q.bits in _PACKED_BITS else q.values
  codes = codes[:q.scales.size * q.block].reshape(q.scales.size, q.block)
  x = codes.astype(work) * q.scales.astype(work)[:, None]
  return x.reshape(-1)[:size].astype(q.dtype).reshape(q.shape)

def quantize_with_feedback(x: np.ndarray, residual: np.ndarray | None, bits: int,
                           block: int = 128) -> tuple[QuantizedTensor, np.ndarray]:
  """Quantises `x + residual` and returns the payload and the new residual (error feedback).

  The learner keeps `residual = (x + r) - dequantize(quantize(x + r))` and adds it to its next
  payload, so the sum of what it sent tracks the sum of what it meant to send to within one
  quantisation step.

  Args:
    x: the payload to send.
    residual: the residual carried from the previous payload, or None (zeros).
    bits: 16, 8, 4, 2 or 1.
    block: elements per scale.

  Returns:
    `(payload, new_residual)`, the residual in float32 (float64 for float64 inputs).
  """
  x = np.asarray(x)
  work = kernels.acc_dtype(x.dtype)
  target = x.astype(work) if residual is None else x.astype(work) + residual
  payload = quantize(target.astype(x.dtype), bits, block)
  return payload, target - dequantize(payload).astype(work)
