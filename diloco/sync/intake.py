"""What the syncer accepts from learners: checks of every field that crosses the trust boundary.

A delivery or heartbeat comes from another process (or a file in the store) and may be corrupt
or crafted. Each check here runs before the field is used, returns one fixed reason word per
kind of problem (counted and written to the tape by the syncer) and never raises: a value of a
wrong type is a rejection like any other. The checks are O(1) per field plus the one pass over
each tensor that the syncer needs anyway (finiteness and magnitude from one sum of squares).

Magnitudes are bounded so that the merge can never overflow float32: every tensor set the
syncer holds (G, the momentum, a delivery, an outer gradient) keeps an L2 norm of at most
`MAX_NORM`, far beyond any real model (norms of 1e2-1e4) and far below float32's overflow of a
sum of squares (about 1.8e19 squared). `merge_bound` says, before a round touches G, how large
G and the momentum could become; a delivery that could push them past `MAX_NORM` is refused.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_dtypes
import numpy as np

from diloco import outer

REJECT_BAD_PAYLOAD = "bad_payload"
REJECT_WRONG_SHAPE = "wrong_shape"
REJECT_WRONG_DTYPE = "wrong_dtype"
REJECT_NON_FINITE = "non_finite"
REJECT_BAD_COUNTERS = "bad_counters"
REJECT_BAD_TIME = "bad_time"  # a time field that is not a number at all
# A time that is a number but no usable measurement (NaN, inf, negative, over a week) is not a
# reason to drop a delivery's progress: docs/design.md 2.4 says such measurements are ignored. The
# syncer counts them under this word (`Syncer.ignored`) and leaves them out of its EMAs.
IGNORED_TIME = "bad_time_ignored"
REJECT_TOO_LARGE = "too_large"  # a delivery's values alone exceed MAX_NORM
REJECT_OVERFLOW = "overflow"  # merging it could take G or the momentum past MAX_NORM
REJECT_BAD_HEARTBEAT = "bad_heartbeat"
REJECT_WRONG_SHARD = "wrong_shard"  # a fragment another syncer shard owns (sync/ownership.py)
# A delivery whose ingestion or merge raised: the syncer survives it (and the multi-process
# runtime moves its store entry to quarantine, so a restarted syncer never reads it again).
REJECT_INGEST_ERROR = "ingest_error"
REJECT_MERGE_ERROR = "merge_error"
# Counters that are integers in range but cannot be true of an honest learner: more tokens
# than its steps can hold (`steps x tokens_per_step`), or more steps than its local step.
REJECT_UNEARNED = "unearned"
# A learner id at or beyond the configured number of learners (no such data shard exists).
REJECT_LEARNER_RANGE = "learner_out_of_range"
# A delivery identity (learner, incarnation, fragment, local step) already merged, or older
# than one already merged from the same incarnation (`diloco.sync.ledger`).
REJECT_REPLAYED = "replayed"
# A delivery or heartbeat of an incarnation that left for good or was superseded.
REJECT_DEPARTED = "departed"

# Counters beyond 2**53 are not exact in float64 (the token weights square them); no real run
# comes near it, so a larger one is a corrupt or crafted delivery.
MAX_COUNTER = 2**53
# A duration longer than a week (transit, lead, step time) is a broken clock or a crafted value.
MAX_DURATION_S = 7 * 24 * 3600.0
MAX_NORM = 1e18
# Incarnations are counted per learner from 0, one per start: 2**31 starts is no real run.
MAX_INCARNATION = 2**31 - 1
# A restart takes the next incarnation (a crash loop skips a few): a heartbeat that jumps
# further ahead of the registered one is a crafted or corrupt record.
MAX_INCARNATION_JUMP = 1024


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the run's config says an honest delivery can hold (None: not known, not checked).

  `tokens_per_step`: tokens one inner step consumes (`train.batch_size x data.seq_len`);
  `max_learners`: learner ids are `0..max_learners-1` (one data shard each).
  """
  tokens_per_step: int | None = None
  max_learners: int | None = None

  def __post_init__(self):
    for name in ("tokens_per_step", "max_learners"):
      value = getattr(self, name)
      if value is not None and not is_count(value, 1):
        raise ValueError(f"intake.Limits.{name} = {value!r}; allowed: an integer >= 1 or None")


def check_earned(payload: Any, limits: Limits) -> str | None:
  """The reason a delivery's counters cannot be true (its weight would be claimed, not
  earned), or None. Call after `check_payload` (the counters are integers in range).

  An honest learner counts `steps` and `tokens` together since its last applied merge, and
  every step adds `tokens_per_step`, so `tokens <= steps x tokens_per_step` and
  `steps <= local_step`. The merge weights (`tokens^2 / steps`, `tokens`) are then bounded
  by what those steps consumed.
  """
  if limits.max_learners is not None and payload.learner >= limits.max_learners:
    return REJECT_LEARNER_RANGE
  if payload.incarnation > MAX_INCARNATION:
    return REJECT_BAD_COUNTERS
  if payload.steps > payload.local_step:
    return REJECT_UNEARNED
  if (limits.tokens_per_step is not None
      and payload.tokens > payload.steps * limits.tokens_per_step):
    return REJECT_UNEARNED
  return None


def heartbeat_time(beat: Any, now: float) -> float | None:
  """The time to record for a heartbeat, or None if its `time` is not a finite number.

  A time ahead of `now` (a skewed or crafted clock) is recorded as `now`: a heartbeat can
  never keep its learner alive beyond the timeout after the syncer last heard from it.
  """
  t = as_float(beat.time)
  if t is None or not math.isfinite(t):
    return None
  return min(t, float(now))


def is_count(x: Any, low: int) -> bool:
  """An integer (not a bool) in [low, MAX_COUNTER]."""
  return (isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
          and low <= x <= MAX_COUNTER)


def is_number(x: Any) -> bool:
  """A real number (int or float, not a bool), of any value."""
  return (isinstance(x, (int, float, np.floating, np.integer))
          and not isinstance(x, (bool, np.bool_)))


def as_float(x: Any) -> float | None:
  """`x` as a float, or None if it is not a number; an int too large for a float is inf
  (so `math.isfinite` and comparisons on it never raise)."""
  if not is_number(x):
    return None
  try:
    return float(x)
  except OverflowError:
    return math.inf if x > 0 else -math.inf


def is_duration(x: Any) -> bool:
  """A usable time measurement: a real number, finite, in [0, MAX_DURATION_S]."""
  f = as_float(x)
  return f is not None and math.isfinite(f) and 0.0 <= f <= MAX_DURATION_S


def sum_of_squares(x: np.ndarray) -> float:
  """`sum(x**2)` with float32 dot products (BLAS): inf when x holds a NaN/Inf or overflows."""
  flat = x.ravel()
  with np.errstate(over="ignore", invalid="ignore"):
    return float(np.dot(flat, flat))


def all_finite(x: np.ndarray) -> bool:
  """`np.isfinite(x).all()` without its full-size temporary in the common case: a sum of squares
  is finite unless x holds a NaN/Inf (or overflows, when the exact check decides)."""
  return math.isfinite(sum_of_squares(x)) or bool(np.isfinite(x.ravel()).all())


def check_heartbeat(beat: Any, limits: Limits | None = None) -> bool:
  """Whether a heartbeat's ids are counters (the learner within `limits`, the incarnation
  within MAX_INCARNATION); its times are checked where they are used."""
  max_learners = None if limits is None else limits.max_learners
  return (is_count(beat.learner, 0) and is_count(beat.incarnation, 0)
          and is_count(beat.local_step, 0) and beat.incarnation <= MAX_INCARNATION
          and (max_learners is None or beat.learner < max_learners))


def check_payload(payload: Any, fragments: list[list[str]],
                  shapes: dict[str, tuple]) -> str | None:
  """The reason a delivery must be rejected, or None if every field is usable.

  `fragments[p]` lists fragment p's parameter paths and `shapes` their shapes.
  """
  if not (is_count(payload.fragment, 0) and payload.fragment < len(fragments)):
    return REJECT_BAD_PAYLOAD
  if not (is_count(payload.learner, 0) and is_count(payload.incarnation, 0)
          and is_count(payload.local_step, 0) and is_count(payload.steps, 0)
          and is_count(payload.tokens, 0) and is_count(payload.base_version, -1)
          and (payload.tokens > 0 or payload.steps == 0)):  # steps without tokens
    return REJECT_BAD_COUNTERS
  if not (is_number(payload.transit_s) and is_number(payload.lead_s)):
    return REJECT_BAD_TIME
  if (not isinstance(payload.tensors, dict) or payload.kind not in ("values", "delta")
      or set(payload.tensors) != set(fragments[payload.fragment])):
    return REJECT_BAD_PAYLOAD
  sum_sq = 0.0
  for path, tensor in payload.tensors.items():
    if payload.kind == "delta":
      if not _well_formed_quantized(tensor, shapes[path]):
        return REJECT_BAD_PAYLOAD
      with np.errstate(over="ignore", invalid="ignore"):  # huge scales: refused just below
        values = outer.dequantize(tensor)
    else:
      values = tensor
    if not isinstance(values, np.ndarray):
      return REJECT_BAD_PAYLOAD
    if values.shape != tuple(shapes[path]):
      return REJECT_WRONG_SHAPE
    if values.dtype != np.float32:
      return REJECT_WRONG_DTYPE
    sq = sum_of_squares(values)
    if not math.isfinite(sq):
      return REJECT_TOO_LARGE if np.isfinite(values.ravel()).all() else REJECT_NON_FINITE
    sum_sq += sq
  if math.sqrt(sum_sq) > MAX_NORM:
    return REJECT_TOO_LARGE
  return None


def _well_formed_quantized(q: Any, shape: tuple) -> bool:
  """A quantised tensor whose fields `outer.dequantize` can use without raising."""
  if not isinstance(q, outer.QuantizedTensor):
    return False
  if (q.bits not in outer.QUANT_BITS or not is_count(q.block, 1)
      or tuple(q.shape) != tuple(shape) or q.dtype != "float32"):
    return False
  if not (isinstance(q.values, np.ndarray) and isinstance(q.scales, np.ndarray)):
    return False
  size = int(np.prod(shape))
  blocks = -(-size // q.block)
  if q.bits == 16:
    return q.values.dtype == ml_dtypes.bfloat16 and q.values.size == size
  codes = np.int8 if q.bits == 8 else np.uint8
  return (q.values.dtype == codes and q.scales.dtype == np.float32 and q.scales.size == blocks
          and q.values.size == outer.packed_size(blocks * q.block, q.bits))


def merge_bound(g_norm: float, b_norm: float, delta_norm: float, lr: float, mu: float) -> float:
  """An upper bound on the norms of everything a merge computes (docs/design.md 2.4 steps 5-6).

  The merged outer gradient is a convex combination of directions scaled by a weighted mean of
  norms (RDA) or a weighted mean (embedding), so its norm is at most the largest delivery's
  `delta_norm`; then `b' = mu b + g` and `G' = G - lr (g + mu b')` by the triangle inequality.
  """
  b_new = abs(mu) * b_norm + delta_norm
  step = abs(lr) * (delta_norm + abs(mu) * b_new)
  return max(delta_norm, b_new, step, g_norm + step)
