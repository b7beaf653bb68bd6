"""Inner optimizer: AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import jax
import optax

from diloco.config_lib import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  decay_steps = max(cfg.decay_steps or total_steps, cfg.warmup_steps + 1)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=decay_steps, end_value=cfg.learning_rate * cfg.end_lr_fraction)


def _decay_mask(params):
  # Matrices and the embedding decay; norm scales (vectors) do not.
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def inner_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  """clip_by_global_norm, then AdamW on the schedule (weight decay on matrices only)."""
  parts = []
  if cfg.grad_clip_norm:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
  parts.append(optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, mask=_decay_mask))
  return optax.chain(*parts)
