"""Merging the learners' outer gradients of one fragment (docs/design.md 2.4).

- weights `w_m = tokens_m**2 / steps_m` (`token_weights`), normalised to sum to 1;
- per tensor, radial-directional averaging (RDA)
  `(sum_m w_m |d_m|) * unit(sum_m w_m unit(d_m))`, with `unit(0) = 0` and norms over the whole
  tensor: averaging M nearly orthogonal outer gradients no longer shrinks them by about
  `1 / sqrt(M)`, so the outer learning rate transfers across M. The embedding (and a tied head)
  gets the plain weighted mean `sum_m w_m d_m` (`merge_fragment`).

RDA reads every delta twice (once for its norm, once to accumulate), which is the minimum for an
exact RDA.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from diloco.outer import kernels
from diloco.outer.quantize import QUANT_BITS
from diloco.settings import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, OneOf, Range, frozen, setting

PyTree = Any


WEIGHT_SCHEMES = ("tokens2_per_step", "uniform", "tokens")

# The names of `METHODS`, the merge-method table below (each rule's reference and streamed
# forms), for `outer.merge`'s choice.
MERGE_METHODS = ("rda", "mean")


# Where a delivery's outer gradient is anchored (the syncer's `_outer_gradient`): "syncer", the
# current global fragment G (`outer_gradient`), or "base", G at the version it started from.
ANCHORS = ("syncer", "base")

# What a stale delivery counts for (the syncer's `_outer_gradient`): "paper", anchored like any
# other; "rebase", the learner's own progress from its base, scaled down by its staleness;
# "align", anchored like "paper" with, per tensor, its component against the outer momentum
# removed when the two point apart.
STALE_RULES = ("paper", "rebase", "align")

# RDA falls back to the weighted mean when |sum_m w_m unit(d_m)| <= RDA_DIRECTION_EPS * sum_m w_m
# (sums over the non-zero deltas). The float32 round-off of that sum is about 1e-7 of its bound,
# while M orthogonal deltas give about 1/sqrt(M), so 1e-4 separates "the unit vectors cancel" from
# any real direction.
RDA_DIRECTION_EPS = 1e-4

# `outer.quantize_bits`: 0 sends float32 values; the others are the codes of quantize.py.
QUANTIZE_BITS = (0,) + QUANT_BITS


@frozen
class OuterConfig:
  """The syncer's merge and Nesterov outer step (docs/design.md 2.4)."""
  # Outer SGD with Nesterov momentum on the merged outer gradient.
  learning_rate: float = setting(0.7, Range(low=0, low_open=True, finite=True))
  momentum: float = setting(0.9, FRACTION)
  # Outer-momentum restarts: every this many rounds of a fragment its momentum buffer is set
  # back to zero after the step (the next round starts Nesterov afresh). 0 = never.
  momentum_restart: int = setting(0, NON_NEGATIVE, "0 = never")
  # Merge weight of a delivery: tokens2_per_step (tokens^2 / steps) | tokens | uniform.
  weights: str = setting("tokens2_per_step", OneOf(WEIGHT_SCHEMES))
  # rda (radial-directional averaging of non-embedding tensors) | mean (weighted mean).
  merge: str = setting("rda", OneOf(MERGE_METHODS))
  # Outer gradient of a delivery: syncer (current G - theta) | base (G at its base - theta).
  anchor: str = setting("syncer", OneOf(ANCHORS))
  # What a stale delivery (base older than the fragment's current version) counts for. Both
  # count it toward the quorum with its token weight. "paper": its outer gradient is anchored
  # at the current G (docs/design.md 2.4). "rebase": it is the learner's own progress
  # G_base - theta, scaled by 1 / (1 + staleness), so it no longer undoes the rounds it missed.
  # "align": as "paper", then each tensor whose outer gradient d points against the fragment's
  # momentum b (d.b < 0) loses its component along b, d - (d.b / b.b) b: the pull back toward
  # the learner's older lineage, kept where it agrees with the trajectory (the projection case
  # of HeLoCo's direction-aware correction, arXiv 2606.00271).
  stale: str = setting("paper", OneOf(STALE_RULES))
  # 0 sends float32 values; 16 / 8 / 4 / 2 / 1 send a quantised delta from the base version
  # (bf16; int8, int4, int2 max-abs codes per block; 1 = sign times the block's mean |x|).
  quantize_bits: int = setting(0, OneOf(QUANTIZE_BITS), "0 = float32 values")
  quantize_block: int = setting(128, AT_LEAST_ONE)
  error_feedback: bool = False


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

def check_weights(weights: Sequence[float] | np.ndarray, num: int) -> np.ndarray:
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

def weighted_mean(deltas: Sequence[np.ndarray], weights: Sequence[float] | np.ndarray
                  ) -> np.ndarray:
  """`sum_m w_m d_m` with the weights normalised to sum to 1.

  Args:
    deltas: M arrays of one shape and floating dtype.
    weights: M non-negative weights, not all zero (normalised here).

  Returns:
    The weighted mean, in the deltas' dtype (accumulated in float32, or float64 for float64).
  """
  flats, shape, dtype = kernels.flatten_all(deltas)
  return kernels.finish(_mean_flat(flats, check_weights(weights, len(flats))), shape, dtype)

def mean_sum(flats: Sequence[np.ndarray], w: np.ndarray, acc: np.dtype) -> kernels.WeightedSum:
  """The weighted mean of flat deltas (normalised weights `w`) as a `kernels.WeightedSum`."""
  keep = [m for m in range(len(flats)) if w[m] > 0]
  return kernels.WeightedSum([flats[m] for m in keep], [w[m] for m in keep], acc)

def _mean_flat(flats: Sequence[np.ndarray], w: np.ndarray) -> np.ndarray:
  """`weighted_mean` of checked flat deltas, with normalised weights `w`."""
  acc = kernels.acc_dtype(flats[0].dtype)
  out = np.empty(flats[0].size, acc)
  mean = mean_sum(flats, w, acc)

  def block(lo: int, hi: int) -> None:
    scratch = mean.scratch(min(kernels.CHUNK, hi - lo))
    for s in range(lo, hi, kernels.CHUNK):
      mean.chunk(s, out[s:min(s + kernels.CHUNK, hi)], scratch)

  kernels.map_blocks(block, out.size)
  return out

def rda_into(flats: Sequence[np.ndarray], w: np.ndarray, acc: np.dtype,
              out: np.ndarray) -> float | None:
  """Writes the RDA direction `sum_m (w_m / |d_m|) d_m`, up to a positive factor, into `out`.

  Returns the factor that turns `out` into the RDA merge (0 with `out` zeroed when every weighted
  delta is zero), or None when the mean direction vanishes and the weighted mean applies instead.
  The caller applies it, so that a fused merge can do so in its own pass.
  """
  weighted = [m for m in range(len(flats)) if w[m] > 0]
  norms = dict(zip(weighted, map(math.sqrt, kernels.sq_norms([flats[m] for m in weighted], acc))))
  live = [m for m in weighted if norms[m] > 0]
  if not live:  # every weighted delta is zero, and so is their mean
    out[...] = 0
    return 0.0
  radius = sum(w[m] * norms[m] for m in live)
  factor, sq = kernels.combine([flats[m] for m in live], [w[m] / norms[m] for m in live], acc, out)
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
  flats, shape, dtype = kernels.flatten_all(deltas)
  return kernels.finish(_rda_flat(flats, check_weights(weights, len(flats))), shape, dtype)

def _rda_flat(flats: Sequence[np.ndarray], w: np.ndarray) -> np.ndarray:
  """`radial_directional_average` of checked flat deltas, with normalised weights `w`."""
  acc = kernels.acc_dtype(flats[0].dtype)
  out = np.empty(flats[0].size, acc)
  scale = rda_into(flats, w, acc, out)
  if scale is None:
    return _mean_flat(flats, w)
  np.multiply(out, kernels.scalar(scale, acc), out)
  return out

class Stream(Protocol):
  """One tensor's merged outer gradient, made chunk by chunk (for the fused round)."""

  def scratch(self, chunk: int) -> Any:
    """Buffers for one thread's chunks of at most `chunk` elements."""

  def chunk(self, s: int, out: np.ndarray, scratch: Any) -> None:
    """Writes elements `s:s + out.size` of the merged gradient into `out`."""


@dataclasses.dataclass(frozen=True)
class _Scaled:
  """A direction written in full, times its scale: the RDA merge's second pass."""
  direction: np.ndarray
  scale: np.ndarray

  def scratch(self, chunk: int) -> None:
    return None

  def chunk(self, s: int, out: np.ndarray, scratch: None) -> None:
    np.multiply(self.direction[s:s + out.size], self.scale, out)


def _mean_stream(flats: Sequence[np.ndarray], w: np.ndarray, acc: np.dtype,
                 workspace: np.ndarray | None) -> Stream:
  return mean_sum(flats, w, acc)


def _rda_stream(flats: Sequence[np.ndarray], w: np.ndarray, acc: np.dtype,
                workspace: np.ndarray | None) -> Stream:
  scale = rda_into(flats, w, acc, workspace)
  if scale is None:
    return mean_sum(flats, w, acc)
  return _Scaled(workspace, kernels.scalar(scale, acc))


@dataclasses.dataclass(frozen=True)
class MergeMethod:
  """A rule that merges one tensor's outer gradients from M learners, in its two forms:
  `reference(flats, w)` makes the whole merged gradient (`merge_fragment`), `stream(flats, w,
  acc, workspace)` the same values chunk by chunk for the fused round (`nesterov.merge_and_step`),
  with a flat buffer of the tensor's size when `workspace`. Both accumulate through
  `kernels.WeightedSum`, so they round identically (tests/outer_test.py holds every method of
  `METHODS` to that)."""
  name: str
  reference: Callable[[Sequence[np.ndarray], np.ndarray], np.ndarray]
  stream: Callable[[Sequence[np.ndarray], np.ndarray, np.dtype, np.ndarray | None], Stream]
  workspace: bool


METHODS = {m.name: m for m in (
    MergeMethod("rda", _rda_flat, _rda_stream, workspace=True),
    MergeMethod("mean", _mean_flat, _mean_stream, workspace=False),
)}
assert tuple(METHODS) == MERGE_METHODS, "name every method of the table in MERGE_METHODS"


def method_for(method: str, is_embedding: bool) -> MergeMethod:
  """The rule for one tensor under `outer.merge=method`: the embedding and a tied head take
  the weighted mean under any method (RDA's norm would mix token rows that moved with ones
  that did not)."""
  if method not in METHODS:
    raise ValueError(f"unknown merge method {method!r}; allowed: {MERGE_METHODS}")
  return METHODS["mean"] if is_embedding else METHODS[method]


def fragment_layout(deltas: Sequence[Sequence[np.ndarray] | Mapping[str, np.ndarray]],
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
  method_for(method, False)  # an unknown method is refused before anything is read
  keys, flags = fragment_layout(deltas, embedding_mask)
  w = check_weights(weights, len(deltas))
  merged = []
  for k, is_embedding in zip(keys, flags):
    flats, shape, dtype = kernels.flatten_all([d[k] for d in deltas])
    out = method_for(method, is_embedding).reference(flats, w)
    merged.append(kernels.finish(out, shape, dtype))
  return dict(zip(keys, merged)) if isinstance(deltas[0], Mapping) else merged

def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
  """Maps `fn` over the leaves of nested dicts (leaves: anything that is not a Mapping)."""
  if isinstance(tree, Mapping):
    for r in rest:
      if not isinstance(r, Mapping) or set(r.keys()) != set(tree.keys()):
        raise ValueError(f"trees differ in structure at keys {sorted(map(str, tree.keys()))}")
    return {k: tree_map(fn, tree[k], *(r[k] for r in rest)) for k in tree}
  return fn(tree, *rest)

def outer_gradient(anchor: PyTree, local: PyTree) -> PyTree:
  """The outer gradient `anchor - local` (arrays or nested dicts of arrays)."""
  return tree_map(lambda a, x: np.subtract(a, x), anchor, local)

def rebase_delta(delta: PyTree, anchor_from: PyTree, anchor_to: PyTree) -> PyTree:
  """Converts an outer gradient between anchors: `(anchor_to - anchor_from) + delta`.

  A learner based on version `G_base` may send `delta = G_base - theta`; the syncer's outer
  gradient with respect to its current `G_now` is then
  `G_now - theta = rebase_delta(delta, G_base, G_now)`.
  """
  return tree_map(lambda d, a, b: np.subtract(b, a) + d, delta, anchor_from, anchor_to)
