"""NOT IN CI YET (fails: learner processes exit with code 1 under CI load and the launched run
hits launch.timeout_s; under investigation). Run by hand: python -m pytest -q -p no:cacheprovider
experiments/multiprocess_chaos_check.py --rootdir=. -c pyproject.toml

The multi-process runtime end to end: real processes, real signals, one seeded chaos run.

One launched run (3 learner processes + a syncer, tiny model) carries every fault the
runtime must survive: a SIGKILLed learner, a SIGSTOPped one, a SIGKILLed syncer, a
learner added mid-run and one retired, plus seeded random faults (at least 10 in all).
Each test checks one property of that run from what it left on disk. Every wait is
bounded (launch.timeout_s and the subprocess timeout).
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Named faults first; the seeded random ones come after the retirement (chaos window below).
CHAOS = "kill:0@4;add@6;stop:1@12+8;kill_syncer@24;retire:3@60"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("mp"))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
      [sys.executable, "-m", "diloco.main", "--config=configs/multiprocess.py:tiny",
       f"--workdir={workdir}", "--role=launch", f"--config.launch.chaos={CHAOS}",
       "--config.launch.chaos_faults=7", "--config.launch.chaos_start_s=62",
       "--config.launch.chaos_end_s=90", "--config.launch.timeout_s=1200",
       "--config.train.steps=200"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return workdir, proc.stdout


def _jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _tape(workdir):
  return _jsonl(os.path.join(workdir, "tape.jsonl"))


def _events(workdir):
  with open(os.path.join(workdir, "chaos.json")) as f:
    return json.load(f)


def test_chaos_run_finishes_learns_and_reports_goodput(run_dir):
  workdir, _ = run_dir
  with open(os.path.join(workdir, "accounting.json")) as f:
    acc = json.load(f)
  assert acc["chaos/events"] >= 10 and acc["chaos/applied"] >= 10
  assert acc["eval/loss"] < acc["eval/initial_loss"] - 0.5
  assert 0.0 < acc["accounting/goodput"] <= 1.0
  for name in ("loss.png", "timeline.png", "activity.jsonl"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0


def test_syncer_restart_keeps_versions_and_tape_exact(run_dir):
  workdir, stdout = run_dir
  assert "syncer: resumed at round" in open(os.path.join(workdir, "logs", "syncer.log")).read()
  tape = _tape(workdir)
  assert [r["round"] for r in tape] == list(range(len(tape)))  # no gap, no duplicate
  last = {}
  for r in tape:
    assert r["version"] == last.get(r["fragment"], 0) + 1  # strictly increasing, never reused
    last[r["fragment"]] = r["version"]
  # Learners kept training while the syncer was down: their steps went on.
  kill = next(e for e in _events(workdir) if e["event"].startswith("kill_syncer"))
  steps = [r for r in _jsonl(os.path.join(workdir, "activity.jsonl"))
           if r["kind"] == "step" and kill["at"] < r["end"] < kill["at"] + 3]
  assert steps, "no learner stepped in the 3 s after the syncer was killed"


def test_killed_learner_restarts_rejoins_and_contributes(run_dir):
  workdir, _ = run_dir
  kill = next(e for e in _events(workdir) if e["event"] == "kill:0@4")
  assert kill["applied"]
  tape = _tape(workdir)
  others = [r for r in tape if r["closed_at"] > kill["at"] and
            all(a["learner"] != 0 for a in r["admitted"])]
  assert others, "merges stopped while learner 0 was dead"
  later = [a for r in tape for a in r["admitted"] if a["learner"] == 0 and a["incarnation"] >= 1]
  assert later, "learner 0's new incarnation never contributed"
  assert "resumed its checkpoint" in open(os.path.join(workdir, "logs", "learner0.log")).read() \
      or "incarnation 1: joined" in open(os.path.join(workdir, "logs", "learner0.log")).read()


def test_stopped_learner_is_skipped_then_returns(run_dir):
  workdir, _ = run_dir
  stop = next(e for e in _events(workdir) if e["event"] == "stop:1@12+8")
  assert stop["applied"]
  tape = _tape(workdir)
  # After the heartbeat timeout (6 s) and before SIGCONT (8 s), rounds go on without it.
  window = [r for r in tape if stop["at"] + 6.5 < r["closed_at"] < stop["at"] + 8]
  assert all(a["learner"] != 1 for r in window for a in r["admitted"])
  back = [(r["closed_at"], a) for r in tape for a in r["admitted"]
          if a["learner"] == 1 and r["closed_at"] > stop["at"] + 8]
  assert back, "learner 1 never contributed again after SIGCONT"
  # Its late deliveries were judged by the staleness rule: admitted within the bound or
  # rejected as stale, never merged beyond it.
  assert all(a["staleness"] <= 8 for _, a in back)


def test_added_learner_joins_from_global_and_retired_one_leaves(run_dir):
  workdir, _ = run_dir
  tape = _tape(workdir)
  assert any(a["learner"] == 3 for r in tape for a in r["admitted"])
  log = open(os.path.join(workdir, "logs", "learner3.log")).read()
  assert "retired at local step" in log or "retire:3@60" in json.dumps(_events(workdir))
  retire = next(e for e in _events(workdir) if e["event"] == "retire:3@60")
  assert retire["applied"]
  assert all(a["learner"] != 3 for r in tape if r["closed_at"] > retire["at"] + 10
             for a in r["admitted"])
