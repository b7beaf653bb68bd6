"""The tensors a syncer owns and the outer step that changes them, apart from round decisions.

`Syncer` decides when a fragment's round closes and whose deliveries it admits; this holds G
(the global fragments it owns), their Nesterov momentum, versions and the history of past
versions, and turns one round's deliveries into outer gradients, bounds them and merges them
(docs/design.md 2.4 step 3). Host-only NumPy, reusing scratch buffers across rounds.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence

import numpy as np

from diloco import fragments as fragments_lib
from diloco import outer
from diloco.delivery import Delivery
from diloco.outer import kernels
from diloco.outer.merge import OuterConfig
from diloco.sync import intake


def fragment_norm(tensors) -> float:
  """L2 norm over a fragment's tensors: float32 dot products (BLAS), no temporaries; inf if
  one overflows float32's sum of squares."""
  return math.sqrt(sum(intake.sum_of_squares(t) for t in tensors))


def align_with_momentum(grad: np.ndarray, momentum: np.ndarray) -> np.ndarray:
  """`outer.stale="align"` on one float32 tensor (in place when C-contiguous; returned): when
  `grad . momentum < 0`, removes the component of `grad` along `momentum` (chunk dots added
  in float64, as `kernels.sq_norms`); a zero momentum changes nothing."""
  grad = np.ascontiguousarray(grad, np.float32)
  g, b = grad.reshape(-1), momentum.reshape(-1)
  dot = sum((float(g[s:s + kernels.CHUNK].dot(b[s:s + kernels.CHUNK]))
             for s in range(0, g.size, kernels.CHUNK)), 0.0)
  if dot < 0:
    coeff = np.float32(dot / kernels.sq_norms([b], np.dtype(np.float32))[0])
    for s in range(0, g.size, kernels.CHUNK):
      g[s:s + kernels.CHUNK] -= coeff * b[s:s + kernels.CHUNK]
  return grad


class OuterState:
  """G, momentum, versions and version history of the owned fragments; one round's merge."""

  def __init__(self, global_params: dict[str, np.ndarray], plan: fragments_lib.FragmentPlan,
               owned: Sequence[int], outer_cfg: OuterConfig, max_staleness: int):
    self.plan = plan
    self.owned = tuple(owned)
    self.outer_cfg = outer_cfg
    self._max_staleness = max_staleness
    own_paths = [k for p in self.owned for k in plan.fragments[p]]
    self.params = {k: np.array(global_params[k], np.float32, order="C") for k in own_paths}
    self.momentum = {k: np.zeros_like(v) for k, v in self.params.items()}
    # Holds an RDA direction between merge passes; kept across rounds to spare page faults.
    self._merge_workspace = np.empty(max((v.size for v in self.params.values()), default=0),
                                     np.float32)
    self.versions = [0] * plan.num_fragments
    self._delta_pool: dict[tuple, np.ndarray] = {}
    # Per fragment, the norms of G and the momentum (the overflow bound of the next merge).
    self.norms = {p: self._measure(p) for p in self.owned}
    self.keep_history = (outer_cfg.anchor == "base" or outer_cfg.quantize_bits > 0
                         or outer_cfg.stale == "rebase")
    self.history: dict[int, dict[int, dict[str, np.ndarray]]] = {
        p: {0: self.fragment_values(p)} for p in self.owned
    } if self.keep_history else {}
    self.shapes = {k: v.shape for k, v in self.params.items()}

  def _measure(self, p: int) -> tuple[float, float]:
    paths = self.plan.fragments[p]
    return (fragment_norm(self.params[k] for k in paths),
            fragment_norm(self.momentum[k] for k in paths))

  def fragment_values(self, p: int) -> dict[str, np.ndarray]:
    return {path: self.params[path].copy() for path in self.plan.fragments[p]}

  def knows_base(self, p: int, base_version: int) -> bool:
    """Whether an outer gradient from `base_version` of fragment `p` can still be formed."""
    return not self.keep_history or base_version in self.history[p]

  def _outer_gradient(self, payload: Delivery, anchor_now: dict[str, np.ndarray],
                      slot: int) -> dict:
    """The delivery's outer gradient `anchor - theta` (docs/design.md 2.4 step 3).

    A stale delivery (its base is older than the current version) is anchored at the
    syncer's current G under `outer.stale="paper"`, so it also pulls G back toward the
    learner's older lineage; under `"rebase"` it is its own progress `G_base - theta`, scaled
    by `1 / (1 + staleness)` like a delayed gradient in staleness-aware asynchronous SGD;
    under `"align"` it is anchored as under "paper" and `align_with_momentum` drops, per
    tensor, the part that points against the outer momentum.
    """
    p, base = payload.fragment, payload.base_version
    staleness = self.versions[p] - base
    rebase = self.outer_cfg.stale == "rebase" and staleness > 0
    from_base = self.outer_cfg.anchor == "base" or rebase
    if payload.kind == "delta":
      grad = {k: outer.dequantize(q) for k, q in payload.tensors.items()}
      if not from_base:
        grad = outer.rebase_delta(grad, self.history[p][base], anchor_now)
    else:
      anchor = self.history[p][base] if from_base else anchor_now
      out = self._delta_buffers(slot, list(payload.tensors))
      grad = {k: np.subtract(anchor[k], x, out=out[k]) for k, x in payload.tensors.items()}
    if rebase:
      for g in grad.values():
        g *= np.float32(1.0 / (1.0 + staleness))
    if self.outer_cfg.stale == "align" and staleness > 0:
      grad = {k: align_with_momentum(g, self.momentum[k]) for k, g in grad.items()}
    return grad

  def _delta_buffers(self, slot: int, paths: list[str]) -> dict[str, np.ndarray]:
    """Scratch for the `slot`-th outer gradient of a round, reused across rounds.

    A fresh 64 MB array per delivery and round costs more in page faults than the subtraction
    itself. Buffers are keyed by shape (and rank among equal shapes in the fragment), not by
    path, so the pool holds about max M x one fragment, not M x the model.
    """
    rank: collections.Counter = collections.Counter()
    out = {}
    for k in paths:
      shape = self.params[k].shape
      key = (slot, shape, rank[shape])
      rank[shape] += 1
      if key not in self._delta_pool:
        self._delta_pool[key] = np.empty(shape, np.float32)
      out[k] = self._delta_pool[key]
    return out

  def bounded(self, p: int, entries: list, *, on_error: Callable[[Delivery, Exception], None],
              on_overflow: Callable[[Delivery], None]) -> tuple[list, list, list[float]]:
    """The round's (learner, pending) entries whose outer gradients keep G and the momentum
    within `intake.MAX_NORM`: (entries, outer gradients, their norms). Those whose gradient
    raised go to `on_error`, those that could overflow to `on_overflow`."""
    anchor_now = {k: self.params[k] for k in self.plan.fragments[p]}
    g_norm, b_norm = self.norms[p]
    kept, deltas, norms = [], [], []
    for m, e in entries:
      try:
        delta = self._outer_gradient(e.payload, anchor_now, len(kept))
      except Exception as err:  # noqa: BLE001  (the others still merge)
        on_error(e.payload, err)
        continue
      norm = fragment_norm(delta.values())
      if not intake.merge_bound(g_norm, b_norm, norm, self.outer_cfg.learning_rate,
                                self.outer_cfg.momentum) <= intake.MAX_NORM:
        on_overflow(e.payload)
        continue
      kept.append((m, e))
      deltas.append(delta)
      norms.append(norm)
    return kept, deltas, norms

  def merge(self, p: int, deltas: list, weights) -> dict[str, float]:
    """Merges outer gradients into G_p with one Nesterov step, in place on G and the momentum
    (published values are copies); `merge_and_step` checks everything before it updates
    anything. Returns the step's squared norms per path."""
    mask = {k: self.plan.is_embedding(k) for k in self.plan.fragments[p]}
    return outer.merge_and_step(
        self.params, self.momentum, deltas, weights, mask, self.outer_cfg.learning_rate,
        self.outer_cfg.momentum, method=self.outer_cfg.merge, workspace=self._merge_workspace)

  def commit(self, p: int) -> int:
    """After a merge: restarts the momentum of G_p at every `momentum_restart`-th round,
    measures G_p for the next bound, bumps its version, keeps its history; returns the new
    version."""
    restart = self.outer_cfg.momentum_restart
    if restart and (self.versions[p] + 1) % restart == 0:  # a restart: round R, 2R, ...
      for k in self.plan.fragments[p]:
        self.momentum[k].fill(0.0)
    # The bound keeps G and the momentum finite; checked here in the pass that also measures
    # them for the next round's bound. Failing it is a bug in the bound, not bad input.
    self.norms[p] = self._measure(p)
    if not all(math.isfinite(x) and x <= intake.MAX_NORM for x in self.norms[p]):
      raise FloatingPointError(f"syncer: fragment {p} left its bound after a merge: norms of G "
                               f"and momentum {self.norms[p]} (bound {intake.MAX_NORM:g})")
    self.versions[p] += 1
    version = self.versions[p]
    if self.keep_history:
      self.history[p][version] = self.fragment_values(p)
      for v in [v for v in self.history[p] if v < version - self._max_staleness]:
        del self.history[p][v]
    return version

  def restore(self, fragments: dict[int, tuple[int, dict, dict]],
              history: dict[int, dict[int, dict[str, np.ndarray]]]) -> None:
    """Takes back durable fragments `fragments[p] = (version, params, momentum)` and their
    history; another shard's fragments are skipped."""
    for p, (version, params, momentum) in fragments.items():
      if p not in self.norms:
        continue
      self.versions[p] = version
      self.params.update({k: np.array(v, np.float32, order="C") for k, v in params.items()})
      self.momentum.update({k: np.array(v, np.float32, order="C") for k, v in momentum.items()})
    if self.keep_history:
      for p, versions in history.items():
        if p not in self.norms:
          continue
        self.history[p] = {v: {k: np.array(x, np.float32) for k, x in t.items()}
                           for v, t in versions.items()}
    self.norms = {p: self._measure(p) for p in self.owned}
