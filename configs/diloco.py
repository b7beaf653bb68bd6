"""Synchronous DiLoCo baseline: P = 1, K = M, no grace window, large H.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python -m diloco.main --config=configs/diloco.py:cpu --workdir=runs/diloco_cpu
Every round waits for all learners (the slowest sets the pace); compare its timeline
with configs/decoupled.py's. Presets as in configs/decoupled.py.
"""

import os

import diloco


def get_config(preset: str = "cpu"):
  cfg = diloco.load_config_dict(
      os.path.join(os.path.dirname(__file__), "decoupled.py") + ":" + preset)
  cfg.sync.num_fragments = 1
  cfg.sync.quorum = diloco.ALL_LEARNERS  # K = M, whatever --config.learners.count says
  cfg.sync.gamma = 0.0
  cfg.receipt.mode = "overwrite"  # DiLoCo's rule: every learner restarts from the merged G
  cfg.sync.period = {"tiny": 16, "nano": 16, "mini": 16, "cpu": 40, "m35": 30}.get(preset, 100)
  return cfg
