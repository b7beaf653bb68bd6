"""Poison pills in a live multi-process run: bad entries planted in the store while a syncer and
two learners train. The syncer must keep merging, the learners keep stepping, and every planted
entry must end in the store's quarantine with its reason (so that no syncer reads it again).
A delivery claiming tokens it did not earn is one of them; an already merged delivery written
again (a replay) is refused as `replayed` and deleted."""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from diloco.delivery import Delivery
from diloco.distributed.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.processes]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TIMEOUT_S = 600


def _wait_for_rounds(store_root, proc, rounds):
  """Blocks until the run has committed `rounds` versions of fragment 0 (or fails)."""
  index = os.path.join(store_root, "merged", "index.json")
  deadline = time.monotonic() + _TIMEOUT_S / 2
  while time.monotonic() < deadline:
    assert proc.poll() is None, "the run ended before the planting"
    try:
      with open(index) as f:
        if json.load(f).get("0", 0) >= rounds:
          return
    except (FileNotFoundError, json.JSONDecodeError):
      pass
    time.sleep(0.5)
  raise AssertionError(f"no {rounds} rounds of fragment 0 within {_TIMEOUT_S / 2} s")


def _plant(store_root):
  """Writes one bad delivery of each kind as learner 0's current incarnation; returns
  {entry name: expected reason} and the run-clock time of the planting."""
  store = Store(store_root)
  version = store.merged.index()[0]
  values = store.merged.read(0, version)[0].tensors
  with open(os.path.join(store_root, "heartbeats", "l0.json")) as f:
    incarnation = json.load(f)["incarnation"]
  planted, step = {}, 10**6
  scratch_root = os.path.join(os.path.dirname(store_root), "scratch_store")
  scratch = Store(scratch_root)

  def put(tensors, reason, edit=None, steps=4, tokens=400):
    nonlocal step
    step += 1
    payload = Delivery(learner=0, incarnation=incarnation, fragment=0, local_step=step, steps=steps,
                       tokens=tokens, base_version=version, kind="values", tensors=tensors,
                       transit_s=0.0)
    name = f"f0_l0_i{incarnation}_s{step}"
    if edit is None:
      store.payloads.put(payload)
    else:  # damaged in a scratch store, then moved in whole: the syncer never sees it half-made
      scratch.payloads.put(payload)
      edit(os.path.join(scratch_root, "payloads", name))
      for part in (name, f"{name}.json"):  # the entry first, its commit marker last
        os.rename(os.path.join(scratch_root, "payloads", part),
                  os.path.join(store_root, "payloads", part))
    planted[name] = reason

  def marker(field, value):
    def edit(entry):
      with open(entry + ".json") as f:
        text = f.read()
      with open(entry + ".json", "w") as f:
        f.write(re.sub(rf'"{field}": [^,}}]+', f'"{field}": {value}', text))
    return edit

  def escape(entry):  # Orbax would read ../../x.npy, outside the entry
    with open(os.path.join(entry, "_METADATA")) as f:
      text = f.read()
    with open(os.path.join(entry, "_METADATA"), "w") as f:
      f.write(text.replace('"t0000"', '"../../x"'))

  def pad(entry):  # the first tensor file grows far past the fragment's bytes
    with open(os.path.join(entry, "t0000.npy"), "ab") as f:
      f.write(b"\0" * (1 << 20))

  # Bad-input kinds are generated here, at planting time: nothing read from the repository.
  huge = {k: np.full_like(v, 3e38) for k, v in values.items()}
  put(values, "bad_counters", marker("steps", "1e400"))
  put(values, "bad_time", marker("transit_s", '"soon"'))
  put(values, "bad_metadata", escape)
  put(values, "oversize", pad)
  put(huge, "too_large")
  put(values, "unearned", steps=1, tokens=2**53)  # a learner lying about its tokens
  with open(os.path.join(store_root, "run.json")) as f:
    origin = json.load(f)["start"]
  return planted, time.time() - origin


def _replay(store_root, workdir):
  """Writes a delivery that a committed round already merged again, under its own name (a
  learner replaying an old entry); returns its name and identity."""
  store = Store(store_root)
  with open(os.path.join(workdir, "tape.jsonl")) as f:
    record = json.loads(f.readline())
  old = record["admitted"][0]
  p = record["fragment"]
  version = store.merged.index()[p]
  values = store.merged.read(p, version)[0].tensors
  store.payloads.put(Delivery(learner=old["learner"], incarnation=old["incarnation"], fragment=p,
                              local_step=old["local_step"], steps=old["steps"],
                              tokens=old["tokens"], base_version=version, kind="values",
                              tensors=values, transit_s=0.0))
  return (f"f{p}_l{old['learner']}_i{old['incarnation']}_s{old['local_step']}",
          (p, old["learner"], old["incarnation"], old["local_step"]))


def test_planted_bad_entries_are_quarantined_while_training_goes_on(tmp_path):
  workdir = str(tmp_path / "run")
  store_root = os.path.join(workdir, "store")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.Popen(
      [sys.executable, "-m", "diloco.main", "--config=configs/multiprocess.py:tiny",
       f"--workdir={workdir}", "--role=launch", "--config.learners.count=2",
       "--config.train.steps=120", f"--config.launch.timeout_s={_TIMEOUT_S}"],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    _wait_for_rounds(store_root, proc, rounds=2)
    planted, planted_at = _plant(store_root)
    replayed, replayed_key = _replay(store_root, workdir)
    out, _ = proc.communicate(timeout=_TIMEOUT_S)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 0, out[-4000:]
  quarantine = Store(store_root).payloads.quarantined()
  assert {n: quarantine.get(n, {}).get("reason") for n in planted} == planted
  assert not any(n in os.listdir(os.path.join(store_root, "payloads")) for n in planted)
  with open(os.path.join(workdir, "tape.jsonl")) as f:
    tape = [json.loads(line) for line in f if line.strip()]
  after = [r for r in tape if r["closed_at"] > planted_at + 1.0 and r["admitted"]]
  assert len(after) >= 3, "the syncer stopped merging after the planting"
  with open(os.path.join(workdir, "activity.jsonl")) as f:
    steps = [json.loads(line) for line in f if line.strip()]
  for learner in (0, 1):
    mine = [r["local_step"] for r in steps if r["learner"] == learner and r["kind"] == "step"
            and r["end"] > planted_at + 1.0]
    assert mine and max(mine) > min(mine), f"learner {learner} stopped stepping"
  with open(os.path.join(store_root, "registry.json")) as f:
    counted = json.load(f)["rejected"]
  for reason in set(planted.values()):
    assert counted.get(reason, 0) >= 1, (reason, counted)
  # The replay is refused as `replayed` whatever its learner is doing when it is read (dead
  # or restarted by the chaos schedule), or as `departed` once a newer incarnation of that
  # learner merged (the ledger then drops the old incarnation's entries), and is merged
  # exactly once in the whole run.
  assert counted.get("replayed", 0) + counted.get("departed", 0) >= 1, counted
  assert replayed not in os.listdir(os.path.join(store_root, "payloads"))
  merges = [(r["fragment"], a["learner"], a["incarnation"], a["local_step"])
            for r in tape for a in r["admitted"]]
  assert merges.count(replayed_key) == 1 and len(set(merges)) == len(merges)
  assert all(os.path.exists(os.path.join(store_root, "quarantine", n)) for n in planted)
