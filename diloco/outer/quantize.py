"""Quantised payloads: bf16, or int8/int4 symmetric max-abs codes with a per-block scale
(`quantize`, `dequantize`), optionally with error feedback (`quantize_with_feedback`)."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from diloco.outer import kernels


QUANT_BITS = (16, 8, 4)

@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedTensor:
  """A quantised payload.

  Attributes:
    values: bf16 values (bits 16), int8 codes (bits 8) or uint8 bytes holding two int4 codes
      each, low nibble first (bits 4); flat.
    scales: float32 scale per block (empty for bits 16).
    shape: shape of the original tensor.
    dtype: name of the original dtype (what `dequantize` returns).
    bits: 16, 8 or 4.
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
  return (1 << (bits - 1)) - 1  # 127 for int8, 7 for int4: symmetric, -qmax..qmax

def quantize(x: np.ndarray, bits: int, block: int = 128) -> QuantizedTensor:
  """Quantises `x` to bf16, or to int8/int4 with a symmetric max-abs scale per block.

  For int8/int4 the flattened tensor is cut into blocks of `block` elements (the tail padded with
  zeros), `scale = max|x| / qmax` per block (qmax 127 or 7) and `q = round(x / scale)`, so that
  `|x - q * scale| <= scale / 2`. int4 codes are packed two per byte.

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
  qmax = _qmax(bits)
  maxabs = np.max(np.abs(blocks), axis=1) if num_blocks else np.zeros((0,), work)
  if not np.all(np.isfinite(maxabs)):
    raise ValueError("cannot quantise non-finite values")
  scales = (maxabs / qmax).astype(np.float32)
  safe = np.where(scales > 0, scales, 1).astype(work)
  q = np.clip(np.rint(blocks / safe[:, None]), -qmax, qmax).astype(np.int8).reshape(-1)
  if bits == 4:
    if q.size % 2:
      q = np.concatenate([q, np.zeros(1, np.int8)])
    nib = (q & 0x0F).astype(np.uint8)
    q = nib[0::2] | (nib[1::2] << 4)
  return QuantizedTensor(q, scales, shape, dtype, bits, int(block))

def dequantize(q: QuantizedTensor) -> np.ndarray:
  """Reconstructs the tensor from a `QuantizedTensor`, in its original shape and dtype."""
  size = math.prod(q.shape)
  if q.bits == 16:
    return q.values.astype(q.dtype).reshape(q.shape)
  work = kernels.acc_dtype(np.dtype(q.dtype))
  if q.bits == 4:
    codes = np.empty(q.values.size * 2, np.int8)
    codes[0::2] = (q.values & 0x0F).astype(np.int8)
    codes[1::2] = (q.values >> 4).astype(np.int8)
    codes[codes >= 8] -= 16  # sign-extend the nibbles
  else:
    codes = q.values
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
    bits: 16, 8 or 4.
    block: elements per scale.

  Returns:
    `(payload, new_residual)`, the residual in float32 (float64 for float64 inputs).
  """
  x = np.asarray(x)
  work = kernels.acc_dtype(x.dtype)
  target = x.astype(work) if residual is None else x.astype(work) + residual
  payload = quantize(target.astype(x.dtype), bits, block)
  return payload, target - dequantize(payload).astype(work)
