"""Hooks in the multi-process runtime (`log.hooks`): each learner process runs its learner's
hooks, the syncer process the syncer's, and a hook's stop ends the whole run through the
store's end marker (`RunLifecycle.request_end`, watched by `EndWatch`)."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from diloco.artifacts import export
from diloco.distributed.process_hooks import EndWatch
from diloco.distributed.store import Store
from diloco.observe import hooks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOP_AT = 32  # learner 0's hook ends the run at this step

_HOOKS = f"""
import json, os
import numpy as np
import diloco

HERE = os.path.dirname(__file__)

def _note(name, record):
  with open(os.path.join(HERE, name), "a") as f:
    f.write(json.dumps(record) + "\\n")

def steps(view):
  _note(f"learner_{{view.learner}}.jsonl", [view.step, view.metrics["train/loss"]])
  if view.learner == 0 and view.step >= {STOP_AT}:
    return diloco.STOP

def rounds(view):
  _note("syncer.jsonl", [view.step, view.metrics["fragment"], sorted(view.params),
                         float(sum(np.sum(np.square(a)) for a in view.params.values()))])

HOOKS = [diloco.Hook(steps, every=4), diloco.Hook(rounds, every=1, on="syncer", params=True)]
"""


def _jsonl(path):
  return [json.loads(line) for line in path.read_text().splitlines() if line]


def _wait(condition, timeout_s=20.0) -> bool:
  """Whether `condition()` came true within `timeout_s` (a bound on a hang, not a speed)."""
  deadline = time.monotonic() + timeout_s
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.05)
  return condition()


def test_end_watch_writes_the_marker_for_its_hooks_and_follows_anothers(tmp_path):
  store = Store(str(tmp_path / "store"))
  mine, theirs = hooks.HookRunner(), hooks.HookRunner()
  stopper = EndWatch(store.run, "learner 0", lambda: 1.5, poll_s=0.1)
  follower = EndWatch(store.run, "learner 1", lambda: 1.5, poll_s=0.1)
  stopper.watch(mine)
  follower.watch(theirs)
  time.sleep(0.3)
  assert not stopper.is_set() and not follower.is_set() and not store.run.end_requested()
  mine.request_stop("hook steps asked to stop at step 32")
  assert _wait(lambda: stopper.is_set() and follower.is_set())
  record = store.blobs.read_json("end.json")
  assert record == {"by": "learner 0", "reason": "hook steps asked to stop at step 32",
                    "at": 1.5}
  # A learner started after the end retires at once, and a second request keeps the first.
  late = EndWatch(store.run, "learner 2", lambda: 9.0, poll_s=0.1)
  late.watch(hooks.HookRunner())
  assert late.is_set()
  store.run.request_end({"by": "syncer"})
  assert store.blobs.read_json("end.json")["by"] == "learner 0"
  for w in (stopper, follower, late):
    w.close()
  assert not [t for t in threading.enumerate() if t.name == "run-end"]


@pytest.mark.slow
@pytest.mark.processes
def test_hooks_run_in_every_process_and_one_ends_the_whole_run(tmp_path):
  """Launched run, two learner processes with steps to spare: learner 0's hook stops the
  run at its step 32; learner 1 follows the end marker, both retire with their final
  deliveries, which the syncer merges before it evaluates and exports."""
  (tmp_path / "my_hooks.py").write_text(_HOOKS)
  workdir = tmp_path / "run"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
      [sys.executable, "-m", "diloco.main", "--config=configs/multiprocess.py:tiny",
       f"--workdir={workdir}", "--role=launch", "--config.learners.count=2",
       "--config.launch.chaos_faults=0", "--config.train.steps=100000",
       "--config.train.eval_every=0", "--config.sync.period=8",
       f"--config.log.hooks={tmp_path / 'my_hooks.py'}", "--config.launch.timeout_s=600"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=700, check=False)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-3000:]
  end = json.loads((workdir / "store" / "end.json").read_text())
  assert end["by"] == "learner 0", end
  assert end["reason"] == f"hook steps asked to stop at step {STOP_AT}", end

  logs = {m: (workdir / "logs" / f"learner{m}.log").read_text() for m in (0, 1)}
  assert "the run was ended early (end.json); retiring" in logs[1], logs[1][-2000:]
  last = {}
  for m, log in logs.items():
    line = [x for x in log.splitlines() if ": retired at local step " in x][-1]
    last[m] = int(line.split()[-1])
    assert "hook steps: " in log and "Traceback" not in log, log[-2000:]
  assert STOP_AT <= last[0] < STOP_AT + 40 and last[1] < 1000, last  # not 100,000 steps

  # Each learner process called its own learner's hook, at its steps 4, 8, ...
  for m in (0, 1):
    calls = _jsonl(tmp_path / f"learner_{m}.jsonl")
    assert calls and all(s % 4 == 0 and s <= last[m] for s, _ in calls), calls
  assert STOP_AT in [s for s, _ in _jsonl(tmp_path / "learner_0.jsonl")]

  # The syncer process called its hook after committed rounds, with G as it then was.
  tape = _jsonl(workdir / "tape.jsonl")
  fragment_of = {r["round"] + 1: r["fragment"] for r in tape}
  rounds = _jsonl(tmp_path / "syncer.jsonl")
  assert len(rounds) >= 3, rounds
  for r, fragment, paths, norm in rounds:
    assert fragment_of[r] == fragment and "embedder/embedding" in paths and norm > 0
  # Both learners' final deliveries reached G before the export.
  finals = {a["learner"] for r in tape for a in r["admitted"] if a.get("final")}
  assert finals == {0, 1}, finals
  assert export.export_dir(str(workdir)) is not None

