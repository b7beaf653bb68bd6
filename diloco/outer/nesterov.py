"""The outer optimizer: SGD with Nesterov momentum on the global parameters (docs/design.md 2.4).

`nesterov_step` is identical to `optax.sgd(lr, momentum=mu, nesterov=True)`:
`b = mu*b + g; G = G - lr*(g + mu*b)`. `merge_and_step` fuses a fragment's merge with its
Nesterov step (the syncer's round): it rounds exactly like `merge.merge_fragment` then
`nesterov_step`, but never writes, re-reads and rescales the merged gradient in full.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from diloco.outer import kernels, merge

PyTree = Any


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
  lr, mu = kernels.scalar(lr, b.dtype), kernels.scalar(mu, b.dtype)

  def block(lo: int, hi: int) -> None:
    tmp = np.empty(min(kernels.CHUNK, hi - lo), b.dtype)
    for s in range(lo, hi, kernels.CHUNK):
      e = min(s + kernels.CHUNK, hi)
      _nesterov_chunk(pf[s:e], bf[s:e], gf[s:e], tmp[:e - s], lr, mu)

  kernels.map_blocks(block, pf.size)
  return p, b

def _nesterov_chunk(p: np.ndarray, b: np.ndarray, g: np.ndarray, t: np.ndarray, lr: np.ndarray,
                    mu: np.ndarray) -> None:
  """The Nesterov step on one chunk, in place; `t` ends holding the step subtracted from `p`.

  Shared by `nesterov_step` and `merge_and_step` so that both round as optax does; `lr` and `mu`
  come from `kernels.scalar` with the momentum's dtype.
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
    momentum = merge.tree_map(lambda p: None, params)
  pairs = merge.tree_map(lambda p, b, g: _nesterov_leaf(p, b, g, lr, mu, inplace),
                    params, momentum, grad)
  if isinstance(pairs, tuple):
    return pairs
  return merge.tree_map(lambda pb: pb[0], pairs), merge.tree_map(lambda pb: pb[1], pairs)

def _inplace_flat(a: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
  """A flat view of `a` for in-place updates; `a` must be a writeable C-contiguous ndarray."""
  if not (isinstance(a, np.ndarray) and a.flags.c_contiguous and a.flags.writeable):
    raise ValueError(f"{what} must be writeable C-contiguous NumPy arrays")
  if a.shape != shape:
    raise ValueError(f"{what} has shape {a.shape}, the deltas {shape}")
  return a.reshape(-1)

def _merge_and_step_tensor(merged: merge.Stream, acc: np.dtype, pf: np.ndarray,
                           bf: np.ndarray, lr: float, mu: float) -> float:
  """`merge_and_step` on one tensor: each chunk of the merged gradient, made by `merged`, is
  consumed by the Nesterov step while in cache; returns the step's squared norm."""
  lr_b, mu_b = kernels.scalar(lr, bf.dtype), kernels.scalar(mu, bf.dtype)

  def block(lo: int, hi: int) -> float:
    chunk = min(kernels.CHUNK, hi - lo)
    g, step = np.empty(chunk, acc), np.empty(chunk, bf.dtype)
    scratch = merged.scratch(chunk)
    sq = 0.0
    for s in range(lo, hi, kernels.CHUNK):
      e = min(s + kernels.CHUNK, hi)
      gc, t = g[:e - s], step[:e - s]
      merged.chunk(s, gc, scratch)
      _nesterov_chunk(pf[s:e], bf[s:e], gc, t, lr_b, mu_b)
      sq += float(t.dot(t))
    return sq

  return sum(kernels.map_blocks(block, pf.size), 0.0)

def merge_and_step(params: Sequence[np.ndarray] | Mapping[str, np.ndarray],
                   momentum: Sequence[np.ndarray] | Mapping[str, np.ndarray],
                   deltas: Sequence[Sequence[np.ndarray] | Mapping[str, np.ndarray]],
                   weights: Sequence[float] | np.ndarray,
                   embedding_mask: Sequence[bool] | Mapping[str, bool] | None,
                   lr: float, mu: float, method: str = "rda", *,
                   workspace: np.ndarray | None = None) -> list[float] | dict[str, float]:
  """`merge.merge_fragment` then `nesterov_step(..., inplace=True)`, in fewer passes over memory.

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
    deltas: one entry per learner, as for `merge.merge_fragment`.
    weights: M non-negative weights, as for `merge.merge_fragment`.
    embedding_mask: tensors merged by the weighted mean, as for `merge.merge_fragment`.
    lr: outer learning rate.
    mu: momentum coefficient.
    method: a name of the merge-method table `merge.METHODS`, as for `merge.merge_fragment`.
    workspace: optional flat writeable buffer of the accumulation dtype (float32; float64 for
      float64 deltas) with at least as many elements as the largest tensor whose method needs
      one (`merge.MergeMethod.workspace`: RDA's direction), aliasing no
      other argument; it holds an RDA direction between its two passes. Keeping one across
      rounds spares a fresh allocation's page faults; by default one is allocated per call.

  Returns:
    Per tensor (a dict or list like the deltas), the squared L2 norm of the step
    `lr * (g + mu * b)` taken from the params (chunks' float32 sums added in float64).

  Raises:
    ValueError: as `merge.merge_fragment`, or params, momentum or workspace unfit; nothing is
      updated
      then.
  """
  merge.method_for(method, False)  # an unknown method is refused before anything is read
  keys, flags = merge.fragment_layout(deltas, embedding_mask)
  w = merge.check_weights(weights, len(deltas))
  for what, tree in (("params", params), ("momentum", momentum)):
    has = set(tree.keys()) if isinstance(tree, Mapping) else set(range(len(tree)))
    if isinstance(tree, Mapping) != isinstance(deltas[0], Mapping) or not set(keys) <= has:
      raise ValueError(f"{what} lacks some of the deltas' tensors {keys}")
  tensors = []  # everything is checked before anything is updated
  for k, is_embedding in zip(keys, flags):
    flats, shape, dtype = kernels.flatten_all([d[k] for d in deltas])
    pf = _inplace_flat(params[k], shape, "params")
    bf = _inplace_flat(momentum[k], shape, "momentum")
    tensors.append((flats, kernels.acc_dtype(dtype), pf, bf, merge.method_for(method,
                                                                             is_embedding)))
  sizes = {}  # accumulation dtype -> largest tensor whose method needs a workspace
  for flats, acc, _, _, rule in tensors:
    if rule.workspace:
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
  step_sq = [_merge_and_step_tensor(
      rule.stream(flats, w, acc, buffers[acc][:flats[0].size] if rule.workspace else None),
      acc, pf, bf, lr, mu) for flats, acc, pf, bf, rule in tensors]
  return dict(zip(keys, step_sq)) if isinstance(deltas[0], Mapping) else step_sq
