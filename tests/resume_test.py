"""Durable single-controller runs (diloco/runtime/run_checkpoint.py): snapshot, restore, kill,
resume."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
import runtime_configs

from diloco import fragments
from diloco.errors import ConfigError
from diloco.learner.learner import Resume
from diloco.outer.merge import OuterConfig
from diloco.runtime import decoupled, run_checkpoint
from diloco.sync.group import SyncerGroup
from diloco.sync.policy import SyncConfig

REPO = os.path.dirname(os.path.dirname(__file__))


def _config(preset="tiny", **dotted):
  return runtime_configs.load(f"decoupled.py:{preset}", periodic_eval=True, **dotted)


def _jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


class _Recorder:
  def __init__(self, tape):
    self.tape = tape

  def mark(self):
    return len(self.tape), 0


def _fake_runtime(workdir, cfg, syncer, plan, slots):
  """What `take_snapshot` and `restore` read of a Runtime, without devices or learners."""
  return types.SimpleNamespace(
      workdir=str(workdir), cfg=cfg, lock=threading.Lock(), syncer=syncer, plan=plan,
      recorder=_Recorder([]), slots=slots, faults=[], clock_start=0.0)


def _slot(index, **fields):
  defaults = {"learner": None, "status": "idle", "incarnation": -1, "resume": Resume()}
  return types.SimpleNamespace(index=index, **dict(defaults, **fields))


def _syncer(plan, shapes, sync=SyncConfig(num_fragments=2)):
  """The runtime's syncer (`sync.shards` shards); `_set` moves its fragments' state."""
  params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
  return SyncerGroup(params, plan, sync, OuterConfig())


def _set(syncer, versions, rounds=None):
  for p, v in enumerate(versions):
    syncer.shards[syncer.assignment[p]].versions[p] = v
  for s, shard in enumerate(syncer.shards):
    shard.rounds = 0 if rounds is None else rounds[s]


SHAPES = {"a/w": (3, 4), "b/w": (5,), "c/0/w": (2, 2)}


def test_snapshot_restore_round_trip(tmp_path):
  cfg = _config()
  plan = fragments.plan_fragments(SHAPES, 2, "balanced")
  syncer = _syncer(plan, SHAPES)
  rng = np.random.default_rng(0)
  g = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
  b = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
  for k in SHAPES:
    syncer.params[k][...] = g[k]
    syncer.momentum[k][...] = b[k]
  _set(syncer, [5, 3], [8])
  slots = [_slot(0, status="up", incarnation=2, resume=Resume(11, {"next_index": 11})),
           _slot(1, status="done", incarnation=0, resume=Resume(64, {"next_index": 64})),
           _slot(2)]
  rt = _fake_runtime(tmp_path, cfg, syncer, plan, slots)
  snap = run_checkpoint.take_snapshot(rt, run_checkpoint.ResumePoints(),
                                      run_checkpoint.MergedSteps(), 12.5, initial_loss=6.0)
  for k in SHAPES:  # the syncer moves on after the snapshot; the checkpoint must not
    syncer.params[k] += 1.0
    syncer.momentum[k] -= 1.0
  _set(syncer, [6, 3], [9])
  ckpt = run_checkpoint.RunCheckpointer(str(tmp_path), cfg)
  assert ckpt.save(snap) == 1
  ckpt.close()

  loaded = run_checkpoint.RunCheckpointer(str(tmp_path), cfg).load()
  fresh = _syncer(plan, SHAPES)
  fresh_slots = [_slot(i) for i in range(3)]
  restart = run_checkpoint.restore(_fake_runtime(tmp_path, cfg, fresh, plan, fresh_slots),
                                   loaded)
  for k in SHAPES:
    np.testing.assert_array_equal(fresh.params[k], g[k])
    np.testing.assert_array_equal(fresh.momentum[k], b[k])
  assert fresh.versions == [5, 3] and fresh.rounds == 8
  assert [m.version for m in fresh.initial(0.0)] == [5, 3]  # published as they were
  assert restart == [0]  # the finished and the idle learner stay as they were
  assert (fresh_slots[0].incarnation, fresh_slots[0].resume.local_step,
          fresh_slots[0].resume.data_state) == (2, 11, {"next_index": 11})
  assert (fresh_slots[1].status, fresh_slots[1].resume.local_step) == ("done", 64)
  assert fresh_slots[2].status == "idle"


def test_a_sharded_syncer_round_trips_and_another_shard_count_is_refused(tmp_path):
  cfg = _config(sync__shards=2)
  plan = fragments.plan_fragments(SHAPES, 3, "tensor")
  sync = SyncConfig(num_fragments=3, shards=2)
  syncer = _syncer(plan, SHAPES, sync)
  assert sorted(set(syncer.assignment)) == [0, 1]
  rng = np.random.default_rng(1)
  for k in SHAPES:
    syncer.params[k][...] = rng.standard_normal(SHAPES[k])
    syncer.momentum[k][...] = rng.standard_normal(SHAPES[k])
  expected = syncer.global_params()
  rounds = [2 * syncer.assignment.count(s) for s in range(2)]
  _set(syncer, [2, 2, 2], rounds)
  snap = run_checkpoint.take_snapshot(_fake_runtime(tmp_path, cfg, syncer, plan, []),
                                      run_checkpoint.ResumePoints(),
                                      run_checkpoint.MergedSteps(), 3.0, initial_loss=6.0)
  assert len(snap.meta["syncer_shards"]) == 2 and snap.meta["rounds"] == 6
  run_checkpoint.check_resumable(snap, cfg, "w")
  for other in (1, 3):
    with pytest.raises(ConfigError, match=r"^sync.shards: .* 2 syncer shard\(s\), this run asks "
                                          f"for {other}"):
      run_checkpoint.check_resumable(snap, _config(sync__shards=other), "w")
  fresh = _syncer(plan, SHAPES, sync)
  run_checkpoint.restore(_fake_runtime(tmp_path, cfg, fresh, plan, []), snap)
  assert fresh.versions == [2, 2, 2] and fresh.rounds == 6
  assert [s.rounds for s in fresh.shards] == rounds
  for k in SHAPES:
    np.testing.assert_array_equal(fresh.params[k], expected[k])
    np.testing.assert_array_equal(fresh.momentum[k], syncer.momentum[k])
  one = _syncer(plan, SHAPES, dataclasses.replace(sync, shards=1))
  with pytest.raises(ConfigError, match="sync.shards"):
    run_checkpoint.restore(_fake_runtime(tmp_path, cfg, one, plan, []), snap)
  # A single syncer's checkpoint (and one written before shards existed) asks for S = 1.
  single = _saved_run(tmp_path, _config(), [1, 1])
  with pytest.raises(ConfigError, match="sync.shards: .* 1 syncer shard"):
    run_checkpoint.check_resumable(single, _config(sync__shards=2), "w")
  old = {k: v for k, v in single.meta["identity"]["sync"].items() if k not in ("shards", "shard")}
  single.meta["identity"] = dict(single.meta["identity"], sync=old)
  run_checkpoint.check_resumable(single, _config(), "w")


def _saved_run(tmp_path, cfg, versions):
  plan = fragments.plan_fragments(SHAPES, 2, "balanced")
  syncer = _syncer(plan, SHAPES)
  _set(syncer, versions)
  rt = _fake_runtime(tmp_path, cfg, syncer, plan, [])
  return run_checkpoint.take_snapshot(rt, run_checkpoint.ResumePoints(),
                                      run_checkpoint.MergedSteps(), 1.0, initial_loss=6.0)


@pytest.mark.parametrize("what,bad", [("params", np.nan), ("momentum", np.inf),
                                      ("params", -np.inf)])
def test_a_checkpoint_whose_g_is_not_finite_is_refused(tmp_path, what, bad):
  """As the multi-process `recover` refuses a non-finite version: one line naming the
  checkpoint and the tensor, and the fresh syncer keeps its values."""
  cfg = _config()
  plan = fragments.plan_fragments(SHAPES, 2, "balanced")
  syncer = _syncer(plan, SHAPES)
  getattr(syncer, what)["b/w"][2] = bad
  snap = run_checkpoint.take_snapshot(_fake_runtime(tmp_path, cfg, syncer, plan, []),
                                      run_checkpoint.ResumePoints(),
                                      run_checkpoint.MergedSteps(), 1.0, initial_loss=6.0)
  ckpt = run_checkpoint.RunCheckpointer(str(tmp_path), cfg)
  ckpt.save(snap)
  ckpt.close()
  loaded = run_checkpoint.RunCheckpointer(str(tmp_path), cfg).load()
  fresh = _syncer(plan, SHAPES)
  with pytest.raises(ConfigError) as e:
    run_checkpoint.restore(_fake_runtime(tmp_path, cfg, fresh, plan, []), loaded)
  message = str(e.value)
  assert "\n" not in message and "not finite" in message and "b/w" in message
  assert message.startswith(os.path.join(str(tmp_path), run_checkpoint.DIRECTORY, "1", what))
  assert all(np.all(fresh.params[k] == 0) for k in SHAPES) and fresh.versions == [0, 0]


def test_torn_checkpoint_is_ignored(tmp_path):
  cfg = _config()
  ckpt = run_checkpoint.RunCheckpointer(str(tmp_path), cfg)
  ckpt.save(_saved_run(tmp_path, cfg, [1, 1]))
  ckpt.close()
  root = tmp_path / run_checkpoint.DIRECTORY
  # A save killed midway: Orbax's tmp directory of step 2, never renamed, its commit missing.
  torn = root / "2.orbax-checkpoint-tmp-1767225600"
  shutil.copytree(root / "1", torn)
  for marker in torn.rglob("commit_success.txt"):
    marker.unlink()
  ckpt = run_checkpoint.RunCheckpointer(str(tmp_path), cfg)
  assert ckpt.latest_step() == 1
  assert ckpt.load().meta["versions"] == [1, 1]
  assert ckpt.save(_saved_run(tmp_path, cfg, [2, 1])) == 2  # numbering goes on
  ckpt.close()
  assert run_checkpoint.RunCheckpointer(str(tmp_path), cfg).load().meta["versions"] == [2, 1]


def test_finished_run_or_other_config_is_refused(tmp_path):
  cfg = _config()
  snap = _saved_run(tmp_path, cfg, [1, 1])
  run_checkpoint.check_resumable(snap, cfg, "w")
  with pytest.raises(ConfigError, match=r"different config \(sync.period: 8 -> 4\)"):
    run_checkpoint.check_resumable(snap, _config(sync__period=4), "w")
  run_checkpoint.check_resumable(snap, _config(log__progress_every_s=1.0), "w")
  # The model's speed switches may change; its shape may not.
  run_checkpoint.check_resumable(snap, _config(model__remat="full", model__loss_chunk=8), "w")
  with pytest.raises(ConfigError, match=r"different config \(model.embed_dim: 64 -> 32\)"):
    run_checkpoint.check_resumable(snap, _config(model__embed_dim=32), "w")
  # A snapshot written before the switches were left out of the identity still resumes.
  old = dict(snap.meta["identity"], model=dataclasses.asdict(cfg.model))
  run_checkpoint.check_resumable(dataclasses.replace(snap, meta=dict(snap.meta, identity=old)),
                                 _config(model__dtype="bfloat16"), "w")
  snap.meta["finished"] = True
  with pytest.raises(ConfigError, match="holds a finished run"):
    run_checkpoint.check_resumable(snap, cfg, "w")


class _Killed(Exception):
  pass


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 2])
def test_virtual_clock_resume_reaches_the_same_versions(tmp_path, monkeypatch, shards):
  # Without grace and with K = 1, every delivery is a round of its own, so the versions count
  # deliveries: M learners x steps / H per fragment, if the resume loses and repeats none.
  # With two syncer shards (each checkpointed and restored) the count is the same.
  m, steps, h = 2, 24, 8
  cfg = _config(learners__count=m, learners__virtual_clock=True, sync__gamma=0.0,
                train__steps=steps, train__eval_every=0, checkpoint__every_rounds=10,
                receipt__mode="overwrite", sync__shards=shards)
  workdir = str(tmp_path)
  save = run_checkpoint.RunCheckpointer.save

  def save_then_die(self, snapshot):
    step = save(self, snapshot)
    if step == 2:
      self.wait()
      raise _Killed
    return step

  monkeypatch.setattr(run_checkpoint.RunCheckpointer, "save", save_then_die)
  with pytest.raises(_Killed):
    decoupled.run_with_runtime(cfg, workdir)
  monkeypatch.undo()
  saved = run_checkpoint.RunCheckpointer(workdir, cfg).load().meta
  assert 0 < saved["rounds"] < m * steps
  rt, summary = decoupled.run_with_runtime(cfg, workdir)
  # The final sync (`receipt.final_sync`) adds one round per fragment with progress left at step
  # 24, merging both learners' final deliveries: all but fragment 0 (due at 24). Fragment 6
  # (due at 22, its round received at 22 + tau = 24, the last step) keeps its last tau steps
  # and delivers them too.
  finals = [0 if p == 0 else 1 for p in range(cfg.sync.num_fragments)]
  assert rt.syncer.versions == [m * steps // h + f for f in finals]
  tape = _jsonl(os.path.join(workdir, "tape.jsonl"))
  assert [r["round"] for r in tape] == list(range(m * steps + sum(finals)))
  resumed = {a["learner"] for r in tape[saved["rounds"]:] for a in r["admitted"]
             if a["incarnation"] == 1}
  assert resumed == {0, 1}  # both learners came back as incarnation 1
  assert {r["shard"] for r in tape} == set(range(shards))
  assert len(saved.get("syncer_shards") or [saved["syncer"]]) == shards
  assert np.isfinite(summary["eval/loss"])


def _committed_steps(root):
  if not os.path.isdir(root):
    return []
  return sorted(int(n) for n in os.listdir(root) if n.isdigit())


@pytest.mark.slow
def test_killed_main_command_resumes(tmp_path):
  """Half the preset's steps, checkpointed twice as often: the kill still lands after the
  first checkpoint (about step 8 of 32), 24 steps of at least 0.15 s before the run would end."""
  workdir = str(tmp_path / "run")
  short = dict(train__steps=32, checkpoint__every_rounds=16)
  command = [sys.executable, "-m", "diloco.main", "--config=configs/decoupled.py:tiny",
             f"--workdir={workdir}", "--config.learners.min_step_s=0.15",
             "--config.train.steps=32", "--config.checkpoint.every_rounds=16"]
  env = dict(os.environ, PYTHONPATH=REPO)
  root = os.path.join(workdir, run_checkpoint.DIRECTORY)
  with open(tmp_path / "first.log", "w") as log:
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
      deadline = time.monotonic() + 300
      while not _committed_steps(root) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
      proc.send_signal(signal.SIGKILL)
    finally:
      proc.wait()
  assert proc.returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-3000:]
  cfg = _config(**short)
  saved = run_checkpoint.RunCheckpointer(workdir, cfg).load().meta
  assert not saved["finished"]
  before = _jsonl(os.path.join(workdir, "tape.jsonl"))[:saved["rounds"]]

  result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "resumed from" in result.stdout
  final = run_checkpoint.RunCheckpointer(workdir, cfg).load().meta
  assert final["finished"]
  assert all(v >= s for v, s in zip(final["versions"], saved["versions"]))
  assert sum(final["versions"]) > sum(saved["versions"])
  tape = _jsonl(os.path.join(workdir, "tape.jsonl"))
  assert [r["round"] for r in tape] == list(range(len(tape)))
  assert tape[:len(before)] == before  # the checkpointed rounds, kept as they were
  keys = [(r["fragment"], a["learner"], a["incarnation"], a["local_step"])
          for r in tape for a in r["admitted"]]
  assert len(keys) == len(set(keys))
  for slot in saved["slots"]:
    # The next incarnation starts after the resume point (or after a step of its own merged
    # before it was noted), not at 0.
    start = max(slot["local_step"], slot["merged_step"])
    mine = [a["local_step"] for r in tape[len(before):] for a in r["admitted"]
            if a["learner"] == slot["index"] and a["incarnation"] == slot["incarnation"] + 1]
    assert mine and min(mine) > start > 0
    steps = [s["local_step"] for s in _jsonl(os.path.join(workdir, "activity.jsonl"))
             if s["learner"] == slot["index"] and s["incarnation"] == slot["incarnation"] + 1
             and s["kind"] == "step"]
    assert steps[0] == start + 1 and steps[-1] == cfg.train.steps
  with open(os.path.join(workdir, "accounting.json")) as f:
    summary = json.load(f)
  assert np.isfinite(summary["eval/loss"])
  assert summary["eval/loss"] < summary["eval/initial_loss"]


def test_every_rounds_is_validated():
  with pytest.raises(ConfigError, match="checkpoint.every_rounds"):
    _config(checkpoint__every_rounds=-1)
