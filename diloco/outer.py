"""Outer (syncer-side) math of Decoupled DiLoCo on NumPy arrays (DESIGN.md 2.4).

Sign convention: the outer gradient (pseudo-gradient) of learner m is
`d_m = anchor - theta_m`, the anchor being the syncer's current global fragment `G`
(or the version the learner started from). A descent step is then `G <- G - lr * d`, so a
learner that moved its parameters away from `G` pulls `G` the same way.

A round of fragment p:
- weights `w_m = tokens_m**2 / steps_m` (`token_weights`), normalised to sum to 1;
- per tensor, radial-directional averaging (RDA)
  `(sum_m w_m |d_m|) * unit(sum_m w_m unit(d_m))`, with `unit(0) = 0` and norms over the whole
  tensor: averaging M nearly orthogonal outer gradients no longer shrinks them by about
  `1 / sqrt(M)`, so the outer learning rate transfers across M. The embedding (and a tied head)
  gets the plain weighted mean `sum_m w_m d_m` (`merge_fragment`);
- an outer SGD step with Nesterov momentum on `G`, identical to
  `optax.sgd(lr, momentum=mu, nesterov=True)`: `b = mu*b + g; G = G - lr*(g + mu*b)`.

Payloads may be quantised (`quantize`/`dequantize`: bf16, or int8/int4 symmetric max-abs with a
per-block scale), optionally with error feedback (`quantize_with_feedback`).

The merges stream over the data in cache-sized chunks with preallocated accumulators: RDA reads
every delta twice (once for its norm, once to accumulate), which is the minimum for an exact RDA.
Accumulation is in float32 (float64 for float64 inputs); norms are summed in float64. The merges
use element-wise ufuncs rather than multithreaded BLAS matrix products: those were no faster
single-threaded and collapsed on a busy host, and ufuncs keep merges bit-reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
import dataclasses
import math
from typing import Any

import ml_dtypes
import numpy as np

PyTree = Any

WEIGHT_SCHEMES = ("tokens2_per_step", "uniform", "tokens")
MERGE_METHODS = ("rda", "mean")
QUANT_BITS = (16, 8, 4)

# RDA falls back to the weighted mean when |sum_m w_m unit(d_m)| <= RDA_DIRECTION_EPS * sum_m w_m
# (sums over the non-zero deltas). The float32 round-off of that sum is about 1e-7 of its bound,
# while M orthogonal deltas give about 1/sqrt(M), so 1e-4 separates "the unit vectors cancel" from
# any real direction.
RDA_DIRECTION_EPS = 1e-4

_CHUNK = 1 << 16  # elements per streamed chunk: a few such buffers stay in a core's L2 cache


def token_weights(tokens: Sequence[float] | np.ndarray, steps: Sequence[float] | np.ndarray,
                  scheme: str = "tokens2_per_step") -> np.ndarray:
  """Normalised per-learner merge weights.

  Args:
    tokens: tokens each learner processed on the fragment since it last received it.
    steps: inner steps each learner took on the fragment since it last received it.
    scheme: `tokens2_per_step` (`tokens**2 / steps`: tokens times tokens per step), `tokens`
      or `uniform`.

  Returns:
    float64 weights summing to 1; learners with `steps == 0` get weight 0.

  Raises:
    ValueError: unknown scheme, mismatched lengths, negative or non-finite counters, or all
      weights zero.
  """
  tok = np.asarray(tokens, dtype=np.float64).reshape(-1)
  stp = np.asarray(steps, dtype=np.float64).reshape(-1)
  if tok.shape != stp.shape:
    raise ValueError(f"tokens and steps differ in length: {tok.size} vs {stp.size}")
  if not (np.all(np.isfinite(tok)) and np.all(np.isfinite(stp))):
    raise ValueError(f"non-finite counters: tokens={tok.tolist()}, steps={stp.tolist()}")
  if np.any(tok < 0) or np.any(stp < 0):
    raise ValueError(f"negative counters: tokens={tok.tolist()}, steps={stp.tolist()}")
  active = stp > 0
  if scheme == "tokens2_per_step":
    raw = np.where(active, tok * tok / np.where(active, stp, 1.0), 0.0)
  elif scheme == "tokens":
    raw = np.where(active, tok, 0.0)
  elif scheme == "uniform":
    raw = active.astype(np.float64)
  else:
    raise ValueError(f"unknown weight scheme {scheme!r}; allowed: {WEIGHT_SCHEMES}")
  total = raw.sum()
  if not total > 0:
    raise ValueError(f"all weights are zero (tokens={tok.tolist()}, steps={stp.tolist()})")
  return raw / total


def _check_weights(weights: Sequence[float] | np.ndarray, num: int) -> np.ndarray:
  """Validates weights for `num` deltas and normalises them to sum to 1 (float64)."""
  w = np.asarray(weights, dtype=np.float64).reshape(-1)
  if w.size != num:
    raise ValueError(f"{w.size} weights for {num} deltas")
  if not np.all(np.isfinite(w)) or np.any(w < 0):
    raise ValueError(f"weights must be finite and non-negative, got {w.tolist()}")
  total = w.sum()
  if not total > 0:
    raise ValueError(f"weights sum to zero: {w.tolist()}")
  return w / total


def _acc_dtype(dtype: np.dtype) -> np.dtype:
  return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _flatten_all(deltas: Sequence[np.ndarray]) -> tuple[list[np.ndarray], tuple[int, ...],
                                                        np.dtype]:
  """Checks that deltas share one shape and dtype; returns flat (contiguous) views."""
  if not deltas:
    raise ValueError("no deltas to merge")
  arrays = [np.asarray(d) for d in deltas]
  shape, dtype = arrays[0].shape, arrays[0].dtype
  for i, a in enumerate(arrays):
    if a.shape != shape or a.dtype != dtype:
      raise ValueError(f"delta {i} is {a.dtype}{a.shape}, delta 0 is {dtype}{shape}")
  if not (np.issubdtype(dtype, np.floating) or dtype == ml_dtypes.bfloat16):
    raise ValueError(f"deltas must be floating point, got {dtype}")
  return [np.ascontiguousarray(a).reshape(-1) for a in arrays], shape, dtype


def _chunks(n: int) -> range:
  return range(0, n, _CHUNK)


def _rchunks(n: int) -> Iterator[int]:
  return reversed(range(0, n, _CHUNK))


def _sq_norm(flat: np.ndarray, acc: np.dtype) -> float:
  """Squared L2 norm in one streaming pass, chunk partial sums added in float64."""
  total = 0.0
  buf = None if flat.dtype == acc else np.empty(min(_CHUNK, flat.size), acc)
  for s in _chunks(flat.size):
    c = flat[s:s + _CHUNK]
    if buf is not None:
      c = buf[:c.size]
      c[...] = flat[s:s + _CHUNK]
    total += float(np.dot(c, c))
  return total


def _combine(flats: Sequence[np.ndarray], coeffs: Sequence[float],
             acc: np.dtype) -> tuple[np.ndarray, float]:
  """Returns `sum_i coeffs[i] * flats[i]` (dtype `acc`) and its squared norm, in one pass.

  Each output chunk stays in cache while every input's chunk is scaled and added to it, so each
  input is read from memory once and the output written once. Chunks run from the end backwards:
  the norm pass that usually precedes this one went forwards, so the data it read last is still
  in the last-level cache. Plain ufuncs (no multithreaded BLAS) keep the result bit-reproducible.
  """
  n = flats[0].size if flats else 0
  if not flats or n == 0:
    return np.zeros(n, acc), 0.0
  out = np.empty(n, acc)
  chunk = min(_CHUNK, n)
  tmp = np.empty(chunk, acc)
  cast = None if all(f.dtype == acc for f in flats) else np.empty(chunk, acc)
  sq = 0.0
  for s in _rchunks(n):
    o = out[s:s + chunk]
    t = tmp[:o.size]
    for i, (f, c) in enumerate(zip(flats, coeffs)):
      x = f[s:s + chunk]
      if x.dtype != acc:  # low-precision input: widen before multiplying
        cast[:x.size] = x
        x = cast[:x.size]
      if i == 0:
        np.multiply(x, float(c), out=o)
      else:
        np.multiply(x, float(c), out=t)
        o += t
    sq += float(np.dot(o, o))
  return out, sq


def _finish(out: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  return out.reshape(shape).astype(dtype, copy=False)


def weighted_mean(deltas: Sequence[np.ndarray], weights: Sequence[float] | np.ndarray
                  ) -> np.ndarray:
  """`sum_m w_m d_m` with the weights normalised to sum to 1.

  Args:
    deltas: M arrays of one shape and floating dtype.
    weights: M non-negative weights, not all zero (normalised here).

  Returns:
    The weighted mean, in the deltas' dtype (accumulated in float32, or float64 for float64).
  """
  flats, shape, dtype = _flatten_all(deltas)
  w = _check_weights(weights, len(flats))
  keep = [m for m in range(len(flats)) if w[m] > 0]
  out, _ = _combine([flats[m] for m in keep], [w[m] for m in keep], _acc_dtype(dtype))
  return _finish(out, shape, dtype)


def radial_directional_average(deltas: Sequence[np.ndarray],
                               weights: Sequence[float] | np.ndarray) -> np.ndarray:
  """Radial-directional average `(sum_m w_m |d_m|) * unit(sum_m w_m unit(d_m))`.

  Norms are over the whole tensor, `unit(0) = 0`, weights are normalised to sum to 1. When the
  mean direction vanishes (`|sum_m w_m unit(d_m)| <= RDA_DIRECTION_EPS * sum_m w_m` over the
  non-zero deltas) the weighted mean is returned instead. Two streaming passes over the deltas.

  Args:
    deltas: M arrays of one shape and floating dtype.
    weights: M non-negative weights, not all zero.

  Returns:
    The merged array, in the deltas' dtype.
  """
  flats, shape, dtype = _flatten_all(deltas)
  w = _check_weights(weights, len(flats))
  acc = _acc_dtype(dtype)
  norms = [math.sqrt(_sq_norm(f, acc)) if w[m] > 0 else 0.0 for m, f in enumerate(flats)]
  live = [m for m in range(len(flats)) if w[m] > 0 and norms[m] > 0]
  if not live:  # every weighted delta is zero, and so is their mean
    return np.zeros(shape, dtype)
  radius = sum(w[m] * norms[m] for m in live)
  out, sq = _combine([flats[m] for m in live], [w[m] / norms[m] for m in live], acc)
  direction_norm = math.sqrt(sq)
  if not direction_norm > RDA_DIRECTION_EPS * sum(w[m] for m in live):
    return weighted_mean(deltas, w)
  np.multiply(out, radius / direction_norm, out=out)
  return _finish(out, shape, dtype)


def merge_fragment(deltas: Sequence[Sequence[np.ndarray] | Mapping[str, np.ndarray]],
                   weights: Sequence[float] | np.ndarray,
                   embedding_mask: Sequence[bool] | Mapping[str, bool] | None,
                   method: str = "rda") -> list[np.ndarray] | dict[str, np.ndarray]:
  """Merges one fragment's outer gradients from M learners, tensor by tensor.

  Args:
    deltas: one entry per learner: a sequence or a dict of the fragment's tensors (same keys or
      length and shapes for every learner).
    weights: M non-negative weights (e.g. from `token_weights`).
    embedding_mask: per tensor, whether it is the embedding or a tied head (weighted mean under
      any method); a sequence for sequence deltas, a dict (missing keys count as False) for dict
      deltas, or None for no embedding.
    method: `rda` (RDA on every non-embedding tensor) or `mean` (weighted mean everywhere).

  Returns:
    The merged tensors, a list or dict like the learners' entries.
  """
  if method not in MERGE_METHODS:
    raise ValueError(f"unknown merge method {method!r}; allowed: {MERGE_METHODS}")
  if not deltas:
    raise ValueError("no deltas to merge")
  w = _check_weights(weights, len(deltas))
  first = deltas[0]
  if isinstance(first, Mapping):
    keys = list(first.keys())
    for i, d in enumerate(deltas):
      if not isinstance(d, Mapping) or set(d.keys()) != set(keys):
        raise ValueError(f"learner {i} sends other tensors than learner 0: {sorted(keys)}")
    mask = dict(embedding_mask or {})
    if not set(mask) <= set(keys):
      raise ValueError(f"embedding_mask names unknown tensors: {sorted(set(mask) - set(keys))}")
    flags = [bool(mask.get(k, False)) for k in keys]
  else:
    keys = list(range(len(first)))
    for i, d in enumerate(deltas):
      if isinstance(d, Mapping) or len(d) != len(keys):
        raise ValueError(f"learner {i} sends {len(d)} tensors, learner 0 sends {len(keys)}")
    flags = [False] * len(keys) if embedding_mask is None else [bool(f) for f in embedding_mask]
    if len(flags) != len(keys):
      raise ValueError(f"embedding_mask has {len(flags)} entries for {len(keys)} tensors")
  merged = []
  for k, is_embedding in zip(keys, flags):
    per_learner = [d[k] for d in deltas]
    if method == "mean" or is_embedding:
      merged.append(weighted_mean(per_learner, w))
    else:
      merged.append(radial_directional_average(per_learner, w))
  return dict(zip(keys, merged)) if isinstance(first, Mapping) else merged


def _tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
  """Maps `fn` over the leaves of nested dicts (leaves: anything that is not a Mapping)."""
  if isinstance(tree, Mapping):
    for r in rest:
      if not isinstance(r, Mapping) or set(r.keys()) != set(tree.keys()):
        raise ValueError(f"trees differ in structure at keys {sorted(map(str, tree.keys()))}")
    return {k: _tree_map(fn, tree[k], *(r[k] for r in rest)) for k in tree}
  return fn(tree, *rest)


def outer_gradient(anchor: PyTree, local: PyTree) -> PyTree:
  """The outer gradient `anchor - local` (arrays or nested dicts of arrays)."""
  return _tree_map(lambda a, x: np.subtract(a, x), anchor, local)


def rebase_delta(delta: PyTree, anchor_from: PyTree, anchor_to: PyTree) -> PyTree:
  """Converts an outer gradient between anchors: `(anchor_to - anchor_from) + delta`.

  A learner based on version `G_base` may send `delta = G_base - theta`; the syncer's outer
  gradient with respect to its current `G_now` is then
  `G_now - theta = rebase_delta(delta, G_base, G_now)`.
  """
  return _tree_map(lambda d, a, b: np.subtract(b, a) + d, delta, anchor_from, anchor_to)


def _nesterov_leaf(p: np.ndarray, b: np.ndarray | None, g: np.ndarray, lr: float, mu: float,
                   inplace: bool) -> tuple[np.ndarray, np.ndarray]:
  """One Nesterov step on one array, streamed in chunks; returns (params, momentum)."""
  g = np.asarray(g)
  if b is None:
    b = np.zeros(np.shape(p), np.asarray(p).dtype)
  elif not inplace:
    b = np.array(b, order="C", copy=True)
  if not inplace:
    p = np.array(p, order="C", copy=True)
  for a in (p, b):
    if not (isinstance(a, np.ndarray) and a.flags.c_contiguous and a.flags.writeable):
      raise ValueError("inplace=True needs writeable C-contiguous NumPy params and momentum")
  if p.shape != b.shape or p.shape != g.shape:
    raise ValueError(f"shapes differ: params {p.shape}, momentum {b.shape}, grad {g.shape}")
  pf, bf, gf = p.reshape(-1), b.reshape(-1), np.ascontiguousarray(g).reshape(-1)
  tmp = np.empty(min(_CHUNK, pf.size), b.dtype)
  lr, mu = float(lr), float(mu)
  for s in _chunks(pf.size):
    bc, gc = bf[s:s + _CHUNK], gf[s:s + _CHUNK]
    t = tmp[:bc.size]
    bc *= mu  # b = mu * b + g, rounded as optax rounds it
    bc += gc
    np.multiply(bc, mu, out=t)  # u = g + mu * b
    t += gc
    t *= lr
    np.subtract(pf[s:s + _CHUNK], t, out=pf[s:s + _CHUNK], casting="unsafe")
  return p, b


def nesterov_step(params: PyTree, momentum: PyTree | None, grad: PyTree, lr: float, mu: float,
                  *, inplace: bool = False) -> tuple[PyTree, PyTree]:
  """One outer SGD step with Nesterov momentum, exactly `optax.sgd(lr, mu, nesterov=True)`.

  `b = mu * b + g; params = params - lr * (g + mu * b)`, with `g = anchor - theta` the outer
  gradient (so a positive `lr` moves `params` towards the learners).

  Args:
    params: array or nested dict of arrays (the global fragment `G`).
    momentum: momentum buffer with the structure of `params`, or None for zeros.
    grad: the merged outer gradient, same structure.
    lr: outer learning rate.
    mu: momentum coefficient.
    inplace: update `params` and `momentum` in place (C-contiguous writeable arrays); avoids
      two copies on the syncer.

  Returns:
    `(new_params, new_momentum)`.
  """
  if momentum is None:
    momentum = _tree_map(lambda p: None, params)
  pairs = _tree_map(lambda p, b, g: _nesterov_leaf(p, b, g, lr, mu, inplace),
                    params, momentum, grad)
  if isinstance(pairs, tuple):
    return pairs
  return _tree_map(lambda pb: pb[0], pairs), _tree_map(lambda pb: pb[1], pairs)


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
  work = _acc_dtype(x.dtype)
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
  work = _acc_dtype(np.dtype(q.dtype))
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
  work = _acc_dtype(x.dtype)
  target = x.astype(work) if residual is None else x.astype(work) + residual
  payload = quantize(target.astype(x.dtype), bits, block)
  return payload, target - dequantize(payload).astype(work)
