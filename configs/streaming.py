"""Streaming DiLoCo baseline: P > 1 fragments, K = M, no grace, alpha = 0.5 mixing on receipt.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python -m diloco.main --config=configs/streaming.py:cpu --workdir=runs/streaming_cpu
Presets as in configs/decoupled.py.
"""

import os

import diloco


def get_config(preset: str = "cpu"):
  cfg = diloco.load_config_dict(
      os.path.join(os.path.dirname(__file__), "decoupled.py") + ":" + preset)
  cfg.sync.quorum = diloco.ALL_LEARNERS  # K = M, whatever --config.learners.count says
  cfg.sync.gamma = 0.0
  cfg.receipt.mode = "mix"
  cfg.receipt.mixing_alpha = 0.5
  return cfg
