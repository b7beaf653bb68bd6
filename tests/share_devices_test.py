"""`learners.share_devices`: M learners time-shared on the same devices (virtual clock only),
so that a comparison of M learners runs on one accelerator."""

import json
import os

import jax
import pytest
import runtime_configs

from diloco.errors import ConfigError
from diloco.runtime import decoupled


def test_share_devices_is_only_for_the_virtual_clock_and_excludes_device_groups():
  with pytest.raises(ConfigError, match="learners.share_devices"):
    runtime_configs.load(learners__share_devices=True, learners__virtual_clock=False)
  with pytest.raises(ConfigError, match="learners.share_devices"):
    runtime_configs.load(learners__share_devices=True, learners__virtual_clock=True,
                    learners__devices="2,2,2,2")


def test_learners_sharing_all_devices_train_and_merge_together(tmp_path):
  cfg = runtime_configs.load(learners__count=3, learners__share_devices=True,
                        learners__virtual_clock=True, train__steps=16)
  rt, _ = decoupled.run_with_runtime(cfg, str(tmp_path))
  assert len(rt.slots) == 3
  every = set(jax.devices())
  assert all(set(slot.spec.mesh.devices.flat) == every for slot in rt.slots)
  with open(os.path.join(tmp_path, "tape.jsonl")) as f:
    tape = [json.loads(line) for line in f]
  merged = {a["learner"] for r in tape for a in r["admitted"]}
  assert merged == {0, 1, 2}
  # 3 learners x 16 steps of `batch_size` sequences each reached the syncer.
  steps = {(a["learner"], a["local_step"]) for r in tape for a in r["admitted"]}
  assert max(s for _, s in steps) >= 16 - cfg.sync.period
