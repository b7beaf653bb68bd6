"""Inner optimizer: AdamW (or Muon on the layers' matrices) with linear warmup, cosine decay and
global-norm clipping."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import optax.contrib
from optax.contrib import MuonDimensionNumbers

from diloco.settings import FRACTION, NON_NEGATIVE, OneOf, Range, frozen, setting

INNER_OPTIMIZERS = ("adamw", "muon")


@frozen
class OptimConfig:
  """Inner AdamW (or Muon) with linear warmup then cosine decay."""
  # "adamw"; or "muon": Muon (optax.contrib.muon) on the layers' projection matrices, and on the
  # embedding (the tied head), the norms and the MoE router the AdamW of optax's Muon (Nesterov
  # moments, b1, b2, eps and weight_decay below, at learning_rate).
  name: str = setting("adamw", OneOf(INNER_OPTIMIZERS))
  # Peak learning rate, reached after `warmup_steps`.
  learning_rate: float = setting(3e-3, Range(low=0, low_open=True, finite=True))
  warmup_steps: int = setting(20, NON_NEGATIVE)
  # 0 means decay over all training steps.
  decay_steps: int = setting(0, NON_NEGATIVE, "0 = all training steps")
  # The final learning rate as a fraction of the peak.
  end_lr_fraction: float = setting(0.1, Range(low=0, high=1))
  b1: float = setting(0.9, FRACTION)
  b2: float = setting(0.95, FRACTION)
  eps: float = setting(1e-8, NON_NEGATIVE)
  weight_decay: float = setting(0.1, NON_NEGATIVE)
  # Clip the global gradient norm to this (0 = no clipping).
  grad_clip_norm: float = setting(1.0, NON_NEGATIVE, "0 = no clipping")
  # Weight of the z-loss (log^2 of the softmax normaliser) that keeps logits small.
  z_loss_weight: float = setting(1e-4, NON_NEGATIVE)
  # name="muon": the matrices' peak learning rate (on the same warmup and decay).
  muon_learning_rate: float = setting(0.02, Range(low=0, low_open=True, finite=True))
  # name="muon": the matrices' momentum (Nesterov).
  muon_beta: float = setting(0.95, FRACTION)


def decay_length(cfg: OptimConfig, total_steps: int) -> int:
  """The steps the schedule warms up and decays over: `decay_steps`, or all `total_steps`.
  With the rest of `cfg`, it is all of the run's length that the compiled step depends on."""
  return max(cfg.decay_steps or total_steps, cfg.warmup_steps + 1)


def lr_schedule(cfg: OptimConfig, total_steps: int, peak: float | None = None) -> optax.Schedule:
  """Warmup to `peak` (default `learning_rate`), then cosine decay to `end_lr_fraction` of it."""
  peak = cfg.learning_rate if peak is None else peak
  decay_steps = decay_length(cfg, total_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=cfg.warmup_steps,
      decay_steps=decay_steps, end_value=peak * cfg.end_lr_fraction)


def _decay_mask(params):
  # Matrices and the embedding decay; norm scales (vectors) do not.
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def at_schedule_step(opt_state, step: int):
  """`opt_state` with its learning-rate schedule at `step`.

  The schedule's position is the optimizer's own counter, not the train state's `step`: a
  learner that restarts with fresh AdamW state at local step t (a rejoin, a resumed
  single-controller run) must go on at the learning rate of step t, not warm up again. Adam's
  own count, which sets the bias correction of its fresh moments, stays as it is."""
  def place(s):
    if isinstance(s, optax.ScaleByScheduleState):
      return s._replace(count=jax.device_put(jnp.asarray(step, s.count.dtype),
                                             getattr(s.count, "sharding", None)))
    return s
  return jax.tree.map(place, opt_state,
                      is_leaf=lambda s: isinstance(s, optax.ScaleByScheduleState))


# A projection's axes are named by the letters after its last "_" (`q_DNH`: model width D to
# heads N x head width H; `down_EFD`: per expert E, F to D). Muon orthogonalises each as the
# matrix (inputs x outputs): the outputs are D for the projections back to the model width (a
# name ending in D), else everything after D; E and any axis in front of the named ones (the
# stacked layers of a scan) are batch axes.
_AXES = re.compile(r"_([A-Z]+)$")


def muon_dimensions(path: str, ndim: int) -> MuonDimensionNumbers | None:
  """Muon's (reduction, output) axes of the parameter at `path`, None for those AdamW takes:
  the embedding, the norms, the MoE router and anything without named axes."""
  found = _AXES.search(path)
  if found is None or "router" in path or len(found.group(1)) > ndim:
    return None
  letters = found.group(1)
  offset = ndim - len(letters)
  named = [(offset + i, c) for i, c in enumerate(letters) if c != "E"]
  if len(named) < 2:
    return None
  if named[-1][1] == "D":
    reduction, output = named[:-1], named[-1:]
  else:
    reduction, output = named[:1], named[1:]
  return MuonDimensionNumbers(reduction_axis=tuple(a for a, _ in reduction),
                              output_axis=tuple(a for a, _ in output))


def _muon_dimension_tree(params):
  """`muon_dimensions` of every parameter (optax also passes placeholders: no dimensions)."""
  def dims(path, leaf):
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    return muon_dimensions(name, leaf.ndim) if hasattr(leaf, "ndim") else None
  return jax.tree_util.tree_map_with_path(dims, params)


def inner_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  """clip_by_global_norm, then AdamW on the schedule (weight decay on matrices only), or Muon
  (`OptimConfig.name`)."""
  parts = []
  if cfg.grad_clip_norm:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
  if cfg.name == "muon":
    parts.append(optax.contrib.muon(
        lr_schedule(cfg, total_steps, cfg.muon_learning_rate), beta=cfg.muon_beta, eps=cfg.eps,
        weight_decay=cfg.weight_decay, adam_b1=cfg.b1, adam_b2=cfg.b2,
        adam_weight_decay=cfg.weight_decay, adam_learning_rate=lr_schedule(cfg, total_steps),
        muon_weight_dimension_numbers=_muon_dimension_tree))
  else:
    parts.append(optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=_decay_mask))
  return optax.chain(*parts)
