"""The learner's hot path: sends off the stepping thread in every driver, bounded in bytes."""

import json
import os
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
import runtime_configs

from diloco.config import run_config
from diloco.learner import sender as sender_lib
from diloco.model.sharding import batch_sharding
from diloco.runtime import core, decoupled, virtual_driver
from diloco.train import data as data_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sender_blocks_only_when_the_byte_bound_is_hit_and_counts_the_wait():
  sender = sender_lib.Sender(limit_bytes=100, limit_count=8)
  release, sent = threading.Event(), []
  try:
    assert sender.submit("a", 60, lambda: (release.wait(), sent.append(1))) == 0.0
    assert sender.submit("b", 60, sent.append, 2) == 0.0  # another owner has its own bound
    threading.Timer(0.3, release.set).start()
    started = time.monotonic()
    waited = sender.submit("a", 60, sent.append, 3)  # 120 > 100 bytes: waits for the first
    assert release.is_set() and waited >= 0.2 and time.monotonic() - started >= 0.2
    assert sender.wait_s == pytest.approx(waited)
    assert sender.submit("a", 30, sent.append, 4) == 0.0  # 90 <= 100: goes at once
    sender.drain()
  finally:
    release.set()
    sender.close()
  assert sent == [1, 2, 3, 4]  # one worker: handed over in the order queued
  assert sender.pending_bytes() == 0 and sender.peak_bytes >= 120


def test_sender_lets_one_oversized_send_through_and_raises_a_failed_one():
  sender = sender_lib.Sender(limit_bytes=10, limit_count=8)
  sent = []
  sender.submit("a", 1000, sent.append, 1)  # nothing on its way: goes however large
  sender.drain("a")

  def fail():
    raise OSError("link down")

  sender.submit("a", 1, fail)
  with pytest.raises(OSError, match="link down"):
    sender.drain("a")
  sender.close()
  assert sent == [1]


def test_send_queue_bytes_is_validated():
  with pytest.raises(run_config.ConfigError, match="sync.send_queue_bytes"):
    runtime_configs.load(sync__send_queue_bytes=0)


class _InlineSender(sender_lib.Sender):
  """The synchronous send the virtual clock made before: each send runs at its delivery."""

  def submit(self, owner, nbytes, fn, *args):
    fn(*args)
    return 0.0


def _tape(workdir):
  """The rounds, without the syncer's wall-clock timings (`merge_wall_s`)."""
  with open(os.path.join(workdir, "tape.jsonl")) as f:
    rounds = [json.loads(line) for line in f]
  return [{k: v for k, v in r.items() if not k.endswith("_wall_s")} for r in rounds]


@pytest.mark.slow
def test_virtual_clock_sends_in_the_background_and_stays_bit_identical(tmp_path, monkeypatch):
  # Two learners, a fragment due every other step, quantised deltas with error feedback (state
  # the sender carries between sends), and a small byte bound so that final deliveries wait.
  cfg = runtime_configs.load(learners__count=2, learners__virtual_clock=True, train__steps=12,
                        sync__num_fragments=2, sync__period=4, outer__quantize_bits=8,
                        outer__error_feedback=True, sync__send_queue_bytes=1)
  background, _ = decoupled.run_with_runtime(cfg, str(tmp_path / "background"))
  sender = None

  class Recording(sender_lib.Sender):
    def __init__(self, *args):
      nonlocal sender
      super().__init__(*args)
      sender = self

  monkeypatch.setattr(virtual_driver, "Sender", _InlineSender)
  inline, _ = decoupled.run_with_runtime(cfg, str(tmp_path / "inline"))
  monkeypatch.setattr(virtual_driver, "Sender", Recording)
  again, _ = decoupled.run_with_runtime(cfg, str(tmp_path / "again"))
  assert background.syncer.rounds == inline.syncer.rounds > 0
  for k, v in inline.syncer.global_params().items():
    np.testing.assert_array_equal(background.syncer.global_params()[k], v, err_msg=k)
    np.testing.assert_array_equal(again.syncer.global_params()[k], v, err_msg=k)
  assert _tape(tmp_path / "background") == _tape(tmp_path / "inline") == _tape(tmp_path / "again")
  assert sender is not None and sender.pending_bytes() == 0 and sender.peak_bytes > 0


@pytest.mark.slow
@pytest.mark.parametrize("model,clock", [("tiny", "--virtual_clock"), ("dp:tiny", "")])
def test_bench_learner_overhead_reports_its_waits_apart(model, clock):
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  args = [sys.executable, os.path.join(REPO, "scripts", "bench_learner_overhead.py"),
          f"--model={model}", "--steps=4", "--fragments=4", "--repeats=1"] + ([clock] if clock
                                                                                else [])
  done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600,
                        check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(done.stdout.strip().splitlines()[-1])
  assert result["clock"] == ("virtual" if clock else "wall") and result["ratio"] > 0
  assert result["merged_rounds"] > 0
  for key in ("first_period_compile_s", "late_round_wait_s", "send_wait_s", "send_handover_s"):
    assert result[key] >= 0.0, key


@pytest.mark.slow
def test_wall_clock_eval_runs_off_the_learners_devices(tmp_path):

  cfg = runtime_configs.load(learners__count=2, learners__devices="2,2")
  rt = core.Runtime(cfg, str(tmp_path), devices=jax.devices()[:6])
  learners = {d for slot in rt.slots for d in slot.spec.mesh.devices.flat}
  assert rt.eval_device is not None and rt.eval_device not in learners
  batches = data_lib.eval_batches(cfg.data, batch_size=cfg.train.batch_size, num_batches=2)
  off = rt.evaluate(batches)
  rt.eval_device = None  # learner 0's mesh, as the virtual clock evaluates
  on = rt.evaluate([jax.device_put(b, batch_sharding(rt.slots[0].spec.mesh)) for b in batches])
  assert off == pytest.approx(on, rel=1e-5)
  virtual = runtime_configs.load(learners__count=2, learners__devices="2,2",
                            learners__virtual_clock=True)
  groups = [list(slot.spec.mesh.devices.flat) for slot in rt.slots]
  assert core._eval_device(virtual, jax.devices()[:6], groups) is None  # stays bit-identical
  assert core._eval_device(cfg, jax.devices()[:4], groups) is None  # a CPU host, all in use
