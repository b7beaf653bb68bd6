"""Inner optimizer: AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from diloco.settings import FRACTION, NON_NEGATIVE, Range, frozen, setting


@frozen
class OptimConfig:
  """Inner AdamW with linear warmup then cosine decay."""
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


def decay_length(cfg: OptimConfig, total_steps: int) -> int:
  """The steps the schedule warms up and decays over: `decay_steps`, or all `total_steps`.
  With the rest of `cfg`, it is all of the run's length that the compiled step depends on."""
  return max(cfg.decay_steps or total_steps, cfg.warmup_steps + 1)


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  decay_steps = decay_length(cfg, total_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=decay_steps, end_value=cfg.learning_rate * cfg.end_lr_fraction)


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


def inner_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  """clip_by_global_norm, then AdamW on the schedule (weight decay on matrices only)."""
  parts = []
  if cfg.grad_clip_norm:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
  parts.append(optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, mask=_decay_mask))
  return optax.chain(*parts)
