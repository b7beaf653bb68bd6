"""Streamed, multi-threaded array kernels that every outer merge and step runs on.

The merges stream over the data in cache-sized chunks (`CHUNK`) with preallocated accumulators.
Accumulation is in float32 (float64 for float64 inputs); norms are summed in float64. Weighted
sums take a Horner form (`WeightedSum`): per input, the pass that streams it plus one in-cache
multiply. The kernels use element-wise ufuncs rather than BLAS (no faster single-threaded, and
OpenBLAS threads collapsed on a busy host); instead, fixed blocks of the data are shared by
`MERGE_THREADS` Python threads (`map_blocks`), with bit-identical results for any thread count.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import ml_dtypes
import numpy as np

# Threads, the caller's included, that share the work of one merge (`map_blocks`); set it to 1
# for single-threaded merges. Results do not depend on it.
MERGE_THREADS = min(2, os.cpu_count() or 1)

CHUNK = 1 << 16  # elements per streamed chunk: a few such buffers stay in a core's L2 cache

NORM_CHUNKS = 4  # the read-only norm pass streams this many `CHUNK`s per call

BLOCK_CHUNKS = 8  # `CHUNK`s per block, the unit of work that `map_blocks` hands a thread

_T = TypeVar("_T")

_executor_lock = threading.Lock()

_executor_state: list[tuple[int, ThreadPoolExecutor]] = []  # (workers, executor) once created

os.register_at_fork(after_in_child=_executor_state.clear)  # a fork does not copy the threads

def acc_dtype(dtype: np.dtype) -> np.dtype:
  return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)

def flatten_all(deltas: Sequence[np.ndarray]) -> tuple[list[np.ndarray], tuple[int, ...],
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

def map_blocks(fn: Callable[[int, int], _T], n: int) -> list[_T]:
  """`[fn(lo, hi) for each block lo:hi of range(n)]`, the blocks shared by `MERGE_THREADS` threads.

  One core cannot keep enough memory reads in flight to use the host's bandwidth, and the merges'
  in-cache arithmetic costs about half as much as their streaming, so a second core takes about a
  quarter off a round. Blocks are fixed (`BLOCK_CHUNKS` chunks) and results come back in block
  order, so the results do not depend on the thread count. Blocks are handed out one at a time (a
  core slowed by other work takes fewer), and the calling thread works too: when the helpers are
  busy elsewhere it simply does every block itself.
  """
  size = CHUNK * BLOCK_CHUNKS
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

def sq_norms(flats: Sequence[np.ndarray], acc: np.dtype) -> list[float]:
  """Squared L2 norms of flat arrays of one size, in one streaming pass.

  Chunk dot products (in `acc`) are added in float64. This pass only reads, so its chunks are
  `NORM_CHUNKS` times longer: fewer calls, and the read stays at the memory bandwidth.
  """
  step = CHUNK * NORM_CHUNKS

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

  parts = map_blocks(block, flats[0].size) if flats else []
  return [sum((p[m] for p in parts), 0.0) for m in range(len(flats))]

def scalar(x: float, acc: np.dtype) -> np.ndarray:
  """`x` as a 0-d array of dtype `acc`.

  The ufuncs round it to `acc` as they would a Python float, but skip converting it on each call
  (about 0.6 us, a tenth of a chunk's arithmetic).
  """
  return np.asarray(x, acc)

class WeightedSum:
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
      self.mults = [scalar(x, acc) for x in c]
      self.factor = 1.0
    else:
      self.mults = [scalar(c[order[i - 1]] / c[order[i]], acc) for i in range(1, len(c))]
      self.factor = c[order[-1]]
    self.inputs = [flats[i] for i in order]
    self.acc = acc
    self.narrow = any(f.dtype != acc for f in flats)
    self.factor_acc = scalar(self.factor, acc)

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

def combine(flats: Sequence[np.ndarray], coeffs: Sequence[float], acc: np.dtype,
             out: np.ndarray) -> tuple[float, float]:
  """Writes `sum_i coeffs[i] * flats[i] / factor` into `out`; returns `(factor, |out|^2)`.

  Each output chunk stays in cache while every input's chunk is added to it, so each input is
  read from memory once and the output written once. Plain ufuncs (no multithreaded BLAS) keep
  the result bit-reproducible. `out` is a flat buffer of dtype `acc` and the inputs' size; all
  coefficients are positive.
  """
  summer = WeightedSum(flats, coeffs, acc)

  def block(lo: int, hi: int) -> float:
    scratch = summer.scratch(min(CHUNK, hi - lo))
    sq = 0.0
    for s in range(lo, hi, CHUNK):
      o = out[s:min(s + CHUNK, hi)]
      summer.scaled_chunk(s, o, scratch)
      sq += float(o.dot(o))
    return sq

  return summer.factor, sum(map_blocks(block, out.size), 0.0)

def finish(out: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  return out.reshape(shape).astype(dtype, copy=False)
