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
Accumulation is in float32 (float64 for float64 inputs); norms are summed in float64. Weighted
sums take a Horner form (`_WeightedSum`): per input, the pass that streams it plus one in-cache
multiply. The merges use element-wise ufuncs rather than BLAS (no faster single-threaded, and
OpenBLAS threads collapsed on a busy host); instead, fixed blocks of the data are shared by
`MERGE_THREADS` Python threads (`_map_blocks`), with bit-identical results for any thread count.
`merge_and_step` fuses a fragment's merge with its Nesterov step (the syncer's round): it rounds
exactly like `merge_fragment` then `nesterov_step`, but never writes, re-reads and rescales the
merged gradient in full.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
import dataclasses
import math
import os
import threading
from typing import Any, TypeVar

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

# Threads, the caller's included, that share the work of one merge (`_map_blocks`); set it to 1
# for single-threaded merges. Results do not depend on it.
MERGE_THREADS = min(2, os.cpu_count() or 1)

_CHUNK = 1 << 16  # elements per streamed chunk: a few such buffers stay in a core's L2 cache
_NORM_CHUNKS = 4  # the read-only norm pass streams this many `_CHUNK`s per call
_BLOCK_CHUNKS = 8  # `_CHUNK`s per block, the unit of work that `_map_blocks` hands a thread

_T = TypeVar("_T")
_executor_lock = threading.Lock()
_executor_state: list[tuple[int, ThreadPoolExecutor]] = []  # (workers, executor) once created
os.register_at_fork(after_in_child=_executor_state.clear)  # a fork does not copy the threads


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


def _executor(workers: int) -> ThreadPoolExecutor:
  """The module's helper threads (created on first use, again after a fork)."""
  with _executor_lock:
    if not _executor_state or _executor_state[0][0] < workers:
      if _executor_state:
        _executor_state[0][1].shutdown(wait=False)
      _executor_state[:] = [(workers, ThreadPoolExecutor(workers, "diloco-merge"))]
    return _executor_state[0][1]


def _map_blocks(fn: Callable[[int, int], _T], n: int) -> list[_T]:
  """`[fn(lo, hi) for each block lo:hi of range(n)]`, the blocks shared by `MERGE_THREADS` threads.

  One core cannot keep enough memory reads in flight to use the host's bandwidth, and the merges'
  in-cache arithmetic costs about half as much as their streaming, so a second core takes about a
  quarter off a round. Blocks are fixed (`_BLOCK_CHUNKS` chunks) and results come back in block
  order, so the results do not depend on the thread count. Blocks are handed out one at a time (a
  core slowed by other work takes fewer), and the calling thread works too: when the helpers are
  busy elsewhere it simply does every block itself.
  """
  size = _CHUNK * _BLOCK_CHUNKS
  bounds = [(lo, min(lo + size, n)) for lo in range(0, n, size)]
  threads = min(MERGE_THREADS, len(bounds))
  if threads <= 1:
    return [fn(lo, hi) for lo, hi in bounds]
  results: list[Any] = [None] * len(bounds)
  lock = threading.Lock()
  taken = [0]

  def work() -> None:
    while True:
      with lock:
        j = taken[0]
        taken[0] += 1
      if j >= len(bounds):
        return
      results[j] = fn(*bounds[j])

  helpers = [_executor(threads - 1).submit(work) for _ in range(threads - 1)]
  try:
    work()
  finally:
    with lock:
      taken[0] = len(bounds)  # after an error, stop handing out blocks
    for h in helpers:
      if not h.cancel():
        h.result()  # waits for its block; raises its error
  return results


def _sq_norms(flats: Sequence[np.ndarray], acc: np.dtype) -> list[float]:
  """Squared L2 norms of flat arrays of one size, in one streaming pass.

  Chunk dot products (in `acc`) are added in float64. This pass only reads, so its chunks are
  `_NORM_CHUNKS` times longer: fewer calls, and the read stays at the memory bandwidth.
  """
  step = _CHUNK * _NORM_CHUNKS

  def block(lo: int, hi: int) -> list[float]:
    buf = None if all(f.dtype == acc for f in flats) else np.empty(min(step, hi - lo), acc)
    sums = []
    for f in flats:
      total = 0.0
      for s in range(lo, hi, step):
        c = f[s:min(s + step, hi)]
        if buf is not None:
          c = buf[:c.size]
          c[...] = f[s:s + c.size]
        total += float(c.dot(c))
      sums.append(total)
    return sums

  parts = _map_blocks(block, flats[0].size) if flats else []
  return [sum((p[m] for p in parts), 0.0) for m in range(len(flats))]


def _scalar(x: float, acc: np.dtype) -> np.ndarray:
  """`x` as a 0-d array of dtype `acc`.

  The ufuncs round it to `acc` as they would a Python float, but skip converting it on each call
  (about 0.6 us, a tenth of a chunk's arithmetic).
  """
  return np.asarray(x, acc)


class _WeightedSum:
  """Forms `sum_i c_i x_i` (flat inputs, all `c_i > 0`) chunk by chunk, in cache.

  Horner form: inputs in ascending coefficient order, `o = x_0 * r_1 + x_1`, then
  `o = o * r_i + x_i` with `r_i = c_{i-1} / c_i <= 1`, which leaves the sum divided by the
  largest coefficient (`factor`). Per input that is the pass that streams it plus one in-place
  multiply of the cached `o`: cheaper than scaling each input into a scratch chunk and adding
  that, and the partial sums stay within the inputs' range. When the coefficients span too many
  orders of magnitude for the ratios' products to stay normal numbers, the scaled inputs are
  summed directly instead (`factor` 1). Every merge path accumulates through here, so fused and
  unfused merges round identically.
  """

  def __init__(self, flats: Sequence[np.ndarray], coeffs: Sequence[float], acc: np.dtype):
    c = [float(x) for x in coeffs]
    order = sorted(range(len(c)), key=c.__getitem__)
    info = np.finfo(acc)
    self.direct = len(c) > 1 and c[order[0]] < c[order[-1]] * float(info.tiny / info.eps)
    if self.direct:
      order = list(range(len(c)))
      self.mults = [_scalar(x, acc) for x in c]
      self.factor = 1.0
    else:
      self.mults = [_scalar(c[order[i - 1]] / c[order[i]], acc) for i in range(1, len(c))]
      self.factor = c[order[-1]]
    self.inputs = [flats[i] for i in order]
    self.acc = acc
    self.narrow = any(f.dtype != acc for f in flats)
    self.factor_acc = _scalar(self.factor, acc)

  def scratch(self, chunk: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Buffers for one thread's chunks: the product one (direct sums) and the cast one."""
    return (np.empty(chunk, self.acc) if self.direct else None,
            np.empty(chunk, self.acc) if self.narrow else None)

  def scaled_chunk(self, s: int, o: np.ndarray,
                   scratch: tuple[np.ndarray | None, np.ndarray | None]) -> None:
    """Writes elements `s:s + o.size` of the sum, divided by `factor`, into `o`."""
    e = s + o.size
    tmp, cast = scratch
    mul, add = np.multiply, np.add
    for i, f in enumerate(self.inputs):
      x = f[s:e]
      if cast is not None:  # low-precision input: widen first
        x = cast[:o.size]
        x[...] = f[s:e]
      if self.direct:
        if i == 0:
          mul(x, self.mults[0], o)
        else:
          mul(x, self.mults[i], tmp[:o.size])
          add(o, tmp[:o.size], o)
      elif i == 0:
        if len(self.inputs) == 1:
          o[...] = x
        else:
          mul(x, self.mults[0], o)
      else:
        if i > 1:
          mul(o, self.mults[i - 1], o)
        add(o, x, o)

  def chunk(self, s: int, o: np.ndarray,
            scratch: tuple[np.ndarray | None, np.ndarray | None]) -> None:
    """Writes elements `s:s + o.size` of the sum into `o`."""
    self.scaled_chunk(s, o, scratch)
    if self.factor != 1.0:
      np.multiply(o, self.factor_acc, o)


def _combine(flats: Sequence[np.ndarray], coeffs: Sequence[float], acc: np.dtype,
             out: np.ndarray) -> tuple[float, float]:
  """Writes `sum_i coeffs[i] * flats[i] / factor` into `out`; returns `(factor, |out|^2)`.

  Each output chunk stays in cache while every input's chunk is added to it, so each input is
  read from memory once and the output written once. Plain ufuncs (no multithreaded BLAS) keep
  the result bit-reproducible. `out` is a flat buffer of dtype `acc` and the inputs' size; all
  coefficients are positive.
  """
  summer = _WeightedSum(flats, coeffs, acc)

  def block(lo: int, hi: int) -> float:
    scratch = summer.scratch(min(_CHUNK, hi - lo))
    sq = 0.0
    for s in range(lo, hi, _CHUNK):
      o = out[s:min(s + _CHUNK, hi)]
      summer.scaled_chunk(s, o, scratch)
      sq += float(o.dot(o))
    return sq

  return summer.factor, sum(_map_blocks(block, out.size), 0.0)


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
  return _finish(_mean_flat(flats, _check_weights(weights, len(flats))), shape, dtype)


def _mean_sum(flats: Sequence[np.ndarray], w: np.ndarray, acc: np.dtype) -> _WeightedSum:
  """The weighted mean of flat deltas (normalised weights `w`) as a `_WeightedSum`."""
  keep = [m for m in range(len(flats)) if w[m] > 0]
  return _WeightedSum([flats[m] for m in keep], [w[m] for m in keep], acc)


def _mean_flat(flats: Sequence[np.ndarray], w: np.ndarray) -> np.ndarray:
  """`weighted_mean` of checked flat deltas, with normalised weights `w`."""
  acc = _acc_dtype(flats[0].dtype)
  out = np.empty(flats[0].size, acc)
  mean = _mean_sum(flats, w, acc)

  def block(lo: int, hi: int) -> None:
    scratch = mean.scratch(min(_CHUNK, hi - lo))
    for s in range(lo, hi, _CHUNK):
      mean.chunk(s, out[s:min(s + _CHUNK, hi)], scratch)

  _map_blocks(block, out.size)
  return out


def _rda_into(flats: Sequence[np.ndarray], w: np.ndarray, acc: np.dtype,
              out: np.ndarray) -> float | None:
  """Writes the RDA direction `sum_m (w_m / |d_m|) d_m`, up to a positive factor, into `out`.

  Returns the factor that turns `out` into the RDA merge (0 with `out` zeroed when every weighted
  delta is zero), or None when the mean direction vanishes and the weighted mean applies instead.
  The caller applies it, so that a fused merge can do so in its own pass.
  """
  weighted = [m for m in range(len(flats)) if w[m] > 0]
  norms = dict(zip(weighted, map(math.sqrt, _sq_norms([flats[m] for m in weighted], acc))))
  live = [m for m in weighted if norms[m] > 0]
  if not live:  # every weighted delta is zero, and so is their mean
    out[...] = 0
    return 0.0
  radius = sum(w[m] * norms[m] for m in live)
  factor, sq = _combine([flats[m] for m in live], [w[m] / norms[m] for m in live], acc, out)
  direction_norm = factor * math.sqrt(sq)
  if not direction_norm > RDA_DIRECTION_EPS * sum(w[m] for m in live):
    return None
  return radius * factor / direction_norm


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
  return _finish(_rda_flat(flats, _check_weights(weights, len(flats))), shape, dtype)


def _rda_flat(flats: Sequence[np.ndarray], w: np.ndarray) -> np.ndarray:
  """`radial_directional_average` of checked flat deltas, with normalised weights `w`."""
  acc = _acc_dtype(flats[0].dtype)
  out = np.empty(flats[0].size, acc)
  scale = _rda_into(flats, w, acc, out)
  if scale is None:
    return _mean_flat(flats, w)
  np.multiply(out, _scalar(scale, acc), out)
  return out


def _fragment_layout(deltas: Sequence[Sequence[np.ndarray] | Mapping[str, np.ndarray]],
                     embedding_mask: Sequence[bool] | Mapping[str, bool] | None
                     ) -> tuple[list[Any], list[bool]]:
  """Checks that learners send the same tensors; returns the tensor keys and embedding flags."""
  if not deltas:
    raise ValueError("no deltas to merge")
  first = deltas[0]
  if isinstance(first, Mapping):
    keys = list(first.keys())
    for i, d in enumerate(deltas):
      if not isinstance(d, Mapping) or set(d.keys()) != set(keys):
        raise ValueError(f"learner {i} sends other tensors than learner 0: {sorted(keys)}")
    mask = dict(embedding_mask or {})
    if not set(mask) <= set(keys):
      raise ValueError(f"embedding_mask names unknown tensors: {sorted(set(mask) - set(keys))}")
    return keys, [bool(mask.get(k, False)) for k in keys]
  keys = list(range(len(first)))
  for i, d in enumerate(deltas):
    if isinstance(d, Mapping) or len(d) != len(keys):
      raise ValueError(f"learner {i} sends {len(d)} tensors, learner 0 sends {len(keys)}")
  flags = [False] * len(keys) if embedding_mask is None else [bool(f) for f in embedding_mask]
  if len(flags) != len(keys):
    raise ValueError(f"embedding_mask has {len(flags)} entries for {len(keys)} tensors")
  return keys, flags


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
  keys, flags = _fragment_layout(deltas, embedding_mask)
  w = _check_weights(weights, len(deltas))
  merged = []
  for k, is_embedding in zip(keys, flags):
    flats, shape, dtype = _flatten_all([d[k] for d in deltas])
    out = _mean_flat(flats, w) if method == "mean" or is_embedding else _rda_flat(flats, w)
    merged.append(_finish(out, shape, dtype))
  return dict(zip(keys, merged)) if isinstance(deltas[0], Mapping) else merged


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
  lr, mu = _scalar(lr, b.dtype), _scalar(mu, b.dtype)

  def block(lo: int, hi: int) -> None:
    tmp = np.empty(min(_CHUNK, hi - lo), b.dtype)
    for s in range(lo, hi, _CHUNK):
      e = min(s + _CHUNK, hi)
      _nesterov_chunk(pf[s:e], bf[s:e], gf[s:e], tmp[:e - s], lr, mu)

  _map_blocks(block, pf.size)
  return p, b


def _nesterov_chunk(p: np.ndarray, b: np.ndarray, g: np.ndarray, t: np.ndarray, lr: np.ndarray,
                    mu: np.ndarray) -> None:
  """The Nesterov step on one chunk, in place; `t` ends holding the step subtracted from `p`.

  Shared by `nesterov_step` and `merge_and_step` so that both round as optax does; `lr` and `mu`
  come from `_scalar` with the momentum's dtype.
  """
  mul, add = np.multiply, np.add
  mul(b, mu, b)  # b = mu * b + g
  add(b, g, b)
  mul(b, mu, t)  # step = lr * (g + mu * b)
  add(t, g, t)
  mul(t, lr, t)
  np.subtract(p, t, out=p, casting="unsafe")


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


def _inplace_flat(a: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
  """A flat view of `a` for in-place updates; `a` must be a writeable C-contiguous ndarray."""
  if not (isinstance(a, np.ndarray) and a.flags.c_contiguous and a.flags.writeable):
    raise ValueError(f"{what} must be writeable C-contiguous NumPy arrays")
  if a.shape != shape:
    raise ValueError(f"{what} has shape {a.shape}, the deltas {shape}")
  return a.reshape(-1)


def _merge_and_step_tensor(flats: Sequence[np.ndarray], w: np.ndarray, acc: np.dtype,
                           pf: np.ndarray, bf: np.ndarray, lr: float, mu: float,
                           direction: np.ndarray | None) -> float:
  """`merge_and_step` on one tensor: RDA through `direction` if given, else the weighted mean."""
  scale = None if direction is None else _rda_into(flats, w, acc, direction)
  mean = _mean_sum(flats, w, acc) if scale is None else None
  scale = None if scale is None else _scalar(scale, acc)
  lr_b, mu_b = _scalar(lr, bf.dtype), _scalar(mu, bf.dtype)

  def block(lo: int, hi: int) -> float:
    chunk = min(_CHUNK, hi - lo)
    g, step = np.empty(chunk, acc), np.empty(chunk, bf.dtype)
    scratch = mean.scratch(chunk) if mean is not None else None
    sq = 0.0
    for s in range(lo, hi, _CHUNK):
      e = min(s + _CHUNK, hi)
      gc, t = g[:e - s], step[:e - s]
      if mean is not None:
        mean.chunk(s, gc, scratch)
      else:
        np.multiply(direction[s:e], scale, gc)
      _nesterov_chunk(pf[s:e], bf[s:e], gc, t, lr_b, mu_b)
      sq += float(t.dot(t))
    return sq

  return sum(_map_blocks(block, pf.size), 0.0)


def merge_and_step(params: Sequence[np.ndarray] | Mapping[str, np.ndarray],
                   momentum: Sequence[np.ndarray] | Mapping[str, np.ndarray],
                   deltas: Sequence[Sequence[np.ndarray] | Mapping[str, np.ndarray]],
                   weights: Sequence[float] | np.ndarray,
                   embedding_mask: Sequence[bool] | Mapping[str, bool] | None,
                   lr: float, mu: float, method: str = "rda", *,
                   workspace: np.ndarray | None = None) -> list[float] | dict[str, float]:
  """`merge_fragment` then `nesterov_step(..., inplace=True)`, in fewer passes over memory.

  A syncer round is bound by memory traffic. Here a weighted-mean tensor's merged gradient is
  made chunk by chunk and consumed by the Nesterov step while still in cache (one pass over the
  deltas), and an RDA tensor's direction is written once, its rescale folded into the Nesterov
  pass, so the merged gradient is never written, re-read and rescaled in full. The result rounds
  exactly like the unfused pair, except that narrow (bf16) deltas' merged gradient is not
  rounded to bf16 before the step.

  Args:
    params: the global tensors `G`, updated in place: a dict (it may hold other tensors too) or
      a sequence, keyed like each learner's deltas, of writeable C-contiguous arrays of the
      deltas' shapes.
    momentum: the Nesterov momentum, same structure and requirements, updated in place.
    deltas: one entry per learner, as for `merge_fragment`.
    weights: M non-negative weights, as for `merge_fragment`.
    embedding_mask: tensors merged by the weighted mean, as for `merge_fragment`.
    lr: outer learning rate.
    mu: momentum coefficient.
    method: `rda` or `mean`, as for `merge_fragment`.
    workspace: optional flat writeable buffer of the accumulation dtype (float32; float64 for
      float64 deltas) with at least as many elements as the largest RDA tensor, aliasing no
      other argument; it holds an RDA direction between its two passes. Keeping one across
      rounds spares a fresh allocation's page faults; by default one is allocated per call.

  Returns:
    Per tensor (a dict or list like the deltas), the squared L2 norm of the step
    `lr * (g + mu * b)` taken from the params (chunks' float32 sums added in float64).

  Raises:
    ValueError: as `merge_fragment`, or params, momentum or workspace unfit; nothing is updated
      then.
  """
  if method not in MERGE_METHODS:
    raise ValueError(f"unknown merge method {method!r}; allowed: {MERGE_METHODS}")
  keys, flags = _fragment_layout(deltas, embedding_mask)
  w = _check_weights(weights, len(deltas))
  for what, tree in (("params", params), ("momentum", momentum)):
    has = set(tree.keys()) if isinstance(tree, Mapping) else set(range(len(tree)))
    if isinstance(tree, Mapping) != isinstance(deltas[0], Mapping) or not set(keys) <= has:
      raise ValueError(f"{what} lacks some of the deltas' tensors {keys}")
  tensors = []  # everything is checked before anything is updated
  for k, is_embedding in zip(keys, flags):
    flats, shape, dtype = _flatten_all([d[k] for d in deltas])
    pf = _inplace_flat(params[k], shape, "params")
    bf = _inplace_flat(momentum[k], shape, "momentum")
    tensors.append((flats, _acc_dtype(dtype), pf, bf, method == "rda" and not is_embedding))
  sizes = {}  # accumulation dtype -> largest RDA tensor
  for flats, acc, _, _, rda in tensors:
    if rda:
      sizes[acc] = max(sizes.get(acc, 0), flats[0].size)
  if workspace is None:
    buffers = {acc: np.empty(n, acc) for acc, n in sizes.items()}
  elif not (isinstance(workspace, np.ndarray) and workspace.ndim == 1
            and workspace.flags.c_contiguous and workspace.flags.writeable
            and set(sizes) <= {workspace.dtype}
            and workspace.size >= max(sizes.values(), default=0)):
    raise ValueError(f"workspace must be a writeable flat {sorted(map(str, sizes))} array of at "
                     f"least {max(sizes.values(), default=0)} elements")
  else:
    buffers = {workspace.dtype: workspace}
  step_sq = [_merge_and_step_tensor(flats, w, acc, pf, bf, lr, mu,
                                    buffers[acc][:flats[0].size] if rda else None)
             for flats, acc, pf, bf, rda in tensors]
  return dict(zip(keys, step_sq)) if isinstance(deltas[0], Mapping) else step_sq


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
