"""Config presets as the runtime tests use them: quiet, one eval batch, no periodic eval
(unless asked), the preset's learning-rate schedule at any length, with `group__field=value`
overrides (a key without `__` sets a top-level field such as `seed`)."""

import os

from diloco.config import run_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(spec: str = "decoupled.py:tiny", *, periodic_eval: bool = False,
         **dotted) -> run_config.Config:
  """`configs/<spec>` (file:preset) with the overrides, validated and frozen."""
  cfg = run_config.load(os.path.join(REPO, "configs", spec))
  # The learning rate warms up and decays over the preset's length whatever `train.steps` a
  # test sets (unless it sets `optim__decay_steps`): the compiled step depends on the schedule,
  # not on the length, so tests of many lengths share the preset's programs and compile cache.
  cfg.optim.decay_steps = cfg.optim.decay_steps or cfg.train.steps
  if not periodic_eval:
    cfg.train.eval_every = 0
  cfg.train.eval_batches = 1
  cfg.log.progress_every_s = 1e9
  for key, value in dotted.items():
    if "__" in key:
      group, field = key.split("__")
      setattr(cfg[group], field, value)
    else:
      setattr(cfg, key, value)
  return run_config.from_config_dict(cfg)
