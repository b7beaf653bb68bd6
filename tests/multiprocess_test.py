"""The multi-process runtime end to end: real processes, real signals, one seeded chaos run.

One launched run (3 learner processes + a syncer, tiny model) carries every fault the
runtime must survive: a SIGKILLed learner, a SIGSTOPped one, a SIGKILLed syncer, a
learner added mid-run (at its peers' step: `learners.join_schedule=cohort`) and one retired,
plus seeded random faults (at least 10 in all).
Each test checks one property of that run from what it left on disk. Every wait is
bounded (launch.timeout_s and the subprocess timeout).
"""

import json
import os
import subprocess
import sys

import pytest

from diloco.observe import report

# These tests start a syncer and learners: the README's test command runs them after the fast
# tests, beside at most one other file of process tests.
pytestmark = [pytest.mark.slow, pytest.mark.processes]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Named faults first; the seeded random ones come after the retirement (chaos window below).
CHAOS = "add@2;kill:0@5;stop:1@12+8;kill_syncer@24;retire:3@55"
MAX_STALENESS = 8


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("mp"))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
      [sys.executable, "-m", "diloco.main", "--config=configs/multiprocess.py:tiny",
       f"--workdir={workdir}", "--role=launch", f"--config.launch.chaos={CHAOS}",
       "--config.launch.chaos_faults=6", "--config.launch.chaos_start_s=57",
       "--config.launch.chaos_end_s=75", "--config.launch.timeout_s=900",
       "--config.train.steps=300", "--config.learners.min_step_s=0.25",
       "--config.learners.join_schedule=cohort",
       f"--config.sync.max_staleness={MAX_STALENESS}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=1000, check=False)
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


def test_console_echoes_the_evals_and_ends_with_the_report_table(run_dir):
  workdir, stdout = run_dir
  with open(os.path.join(workdir, "accounting.json")) as f:
    acc = json.load(f)
  assert set(report.RUN_KEYS) <= set(acc)
  assert all(k.startswith("accounting/") for k in set(acc) - set(report.RUN_KEYS))
  evals = [r for r in _jsonl(os.path.join(workdir, "metrics.jsonl")) if "eval/loss" in r]
  steps = [r["step"] for r in evals]
  assert len(steps) == len(set(steps)) >= 3, steps  # one record per step
  # Every eval but the final one is echoed as the syncer writes it; the final one is in the
  # table only.
  echoed = [line for line in stdout.splitlines() if ": global eval/loss " in line]
  assert echoed and len(echoed) <= len(evals) - 1, echoed
  assert all(f"step {r['step']}: global eval/loss {r['eval/loss']:.4f}" in stdout
             for r in evals[:-1] if f"step {r['step']}:" in stdout)
  final = f"{acc['eval/loss']:.4f}"
  assert [line for line in stdout.splitlines() if final in line] == [
      f"  eval loss       {final} at step {evals[-1]['step']} "
      f"(initial {acc['eval/initial_loss']:.4f})"]
  assert "run summary" in stdout and "done: {" not in stdout


def test_syncer_restart_keeps_versions_and_tape_exact(run_dir):
  workdir, stdout = run_dir
  assert "syncer: resumed at round" in open(os.path.join(workdir, "logs", "syncer.log")).read()
  tape = _tape(workdir)
  assert [r["round"] for r in tape] == list(range(len(tape)))  # no gap, no duplicate
  last = {}
  for r in tape:
    assert r["version"] == last.get(r["fragment"], 0) + 1  # strictly increasing, never reused
    last[r["fragment"]] = r["version"]
  # Learners kept training while the syncer was down: steps ended after the kill and before
  # the restarted syncer closed its first round.
  kill = next(e for e in _events(workdir) if e["event"].startswith("kill_syncer"))
  back = min(r["closed_at"] for r in tape if r["closed_at"] > kill["at"])
  steps = [r for r in _jsonl(os.path.join(workdir, "activity.jsonl"))
           if r["kind"] == "step" and kill["at"] < r["end"] < back]
  assert steps, "no learner stepped between the syncer's kill and its first round after it"


def test_every_delivery_merged_at_most_once_and_no_committed_round_lost(run_dir):
  workdir, _ = run_dir
  tape = _tape(workdir)
  merged = [(r["fragment"], a["learner"], a["incarnation"], a["local_step"])
            for r in tape for a in r["admitted"]]
  assert len(merged) == len(set(merged)), "a delivery was merged twice across the syncer kill"
  # What the store says was committed is exactly what the tape holds: the syncer's final
  # registry and the merged index name the tape's last round and versions.
  with open(os.path.join(workdir, "store", "registry.json")) as f:
    registry = json.load(f)
  with open(os.path.join(workdir, "store", "merged", "index.json")) as f:
    index = {int(p): v for p, v in json.load(f).items()}
  last = {p: 0 for p in index}
  for r in tape:
    last[r["fragment"]] = r["version"]
  assert registry["rounds"] == len(tape)
  assert registry["versions"] == [last[p] for p in sorted(last)]
  assert index == last


# Seconds between a round's `published_at` and its commit marker on a loaded host (the write of
# a tiny model's fragment takes milliseconds; one CI run saw a join land inside the window).
_COMMIT_WINDOW_S = 2.0


def test_a_joining_learner_builds_on_what_was_published_when_it_joined(run_dir):
  """Every incarnation (first start, restart after a kill, added learner) starts from the
  versions published before it joined, or newer: its first delivery of each fragment is based
  on at least the version the tape shows published before its join."""
  workdir, _ = run_dir
  tape = _tape(workdir)
  joins = {(r["learner"], r["incarnation"]): r["start"]
           for r in _jsonl(os.path.join(workdir, "activity.jsonl")) if r["kind"] == "load"}
  first = {}
  for r in tape:
    for a in r["admitted"]:
      key = (a["learner"], a["incarnation"], r["fragment"])
      if key not in first or a["local_step"] < first[key][0]:
        first[key] = (a["local_step"], a["base_version"])
  checked = 0
  for (learner, incarnation, p), (_, base) in first.items():
    joined = joins[(learner, incarnation)]
    # `published_at` is when the merge ended; the version becomes durable (data, marker, index)
    # only after its write, so a join inside that window may not see it yet.
    published = max([r["version"] for r in tape if r["fragment"] == p
                     and r["published_at"] < joined - _COMMIT_WINDOW_S], default=0)
    assert base >= published, (learner, incarnation, p, base, published)
    checked += published > 0
  assert checked, "no learner joined after a merge: the check saw nothing"


def test_killed_learner_restarts_rejoins_and_contributes(run_dir):
  workdir, _ = run_dir
  kill = next(e for e in _events(workdir) if e["event"] == "kill:0@5")
  assert kill["applied"]
  tape = _tape(workdir)
  revived = min(a["arrived_at"] for r in tape for a in r["admitted"]
                if a["learner"] == 0 and a["incarnation"] >= 1)  # ValueError: never came back
  down = [r for r in tape if kill["at"] < r["closed_at"] < revived]
  assert any(a["learner"] != 0 for r in down for a in r["admitted"]), \
      "merges stopped while learner 0 was down"
  # Only what it delivered before it died can still be merged (the round was already open):
  # its old incarnation, at steps it reached. (Arrival times can trail the kill by a syncer
  # poll, so they are no test of that.)
  reached = max(r["local_step"] for r in _jsonl(os.path.join(workdir, "activity.jsonl"))
                if r["learner"] == 0 and r["incarnation"] == 0 and r["kind"] == "step")
  late = [(a["incarnation"], a["local_step"]) for r in down for a in r["admitted"]
          if a["learner"] == 0]
  assert all(i == 0 and t <= reached + 1 for i, t in late), (late, reached)
  log = open(os.path.join(workdir, "logs", "learner0.log")).read()
  assert "learner 0 incarnation 1: joined" in log


def test_stopped_learner_is_skipped_then_returns(run_dir):
  workdir, _ = run_dir
  stop = next(e for e in _events(workdir) if e["event"] == "stop:1@12+8")
  assert stop["applied"]
  tape = _tape(workdir)
  # SIGCONT comes no earlier than 8 s after SIGSTOP: rounds closed in between closed while it
  # was stopped.
  during = [r for r in tape if stop["at"] < r["closed_at"] < stop["at"] + 8]
  assert during, "no round closed while learner 1 was stopped"
  # Once its heartbeat timed out, rounds went on without it (it no longer receives them),
  # and a stopped learner makes no new deliveries: only steps it reached before SIGSTOP.
  without = [r for r in during if 1 not in r["receivers"]]
  assert without and all(r["admitted"] for r in without), "rounds stopped without learner 1"
  activity = _jsonl(os.path.join(workdir, "activity.jsonl"))
  reached = max(a["local_step"] for a in activity if a["learner"] == 1 and a["kind"] == "step"
                and a["end"] <= stop["at"])
  assert all(a["local_step"] <= reached + 1 for r in during for a in r["admitted"]
             if a["learner"] == 1)
  back = [a for r in tape if r["closed_at"] > stop["at"] + 8 for a in r["admitted"]
          if a["learner"] == 1]
  assert back, "learner 1 never contributed again after SIGCONT"
  # Its late deliveries were judged by the staleness rule: admitted within the bound (or
  # rejected as stale), never merged beyond it.
  assert all(a["staleness"] <= MAX_STALENESS for a in back)


def test_added_learner_joins_from_global_and_retired_one_leaves(run_dir):
  workdir, _ = run_dir
  tape = _tape(workdir)
  retire = next(e for e in _events(workdir) if e["event"] == "retire:3@55")
  assert retire["applied"]
  assert any(a["learner"] == 3 for r in tape if r["closed_at"] < retire["at"]
             for a in r["admitted"]), "the added learner never contributed before retiring"
  log = open(os.path.join(workdir, "logs", "learner3.log")).read()
  # learners.join_schedule=cohort: it starts at its live peers' step (their learning rate).
  joined_at = int(log.split("learner 3 incarnation 0: joined at local step")[1].split()[0])
  assert 0 < joined_at < 300
  assert "learner 3 incarnation 0: retired at local step" in log
  # Nothing it did after retiring is merged: only steps up to the one it retired at.
  retired_at = int(log.split("learner 3 incarnation 0: retired at local step")[1].split()[0])
  assert all(a["local_step"] <= retired_at for r in tape for a in r["admitted"]
             if a["learner"] == 3)


def test_final_sync_merges_every_finished_learners_last_steps(run_dir):
  """`receipt.final_sync` (on by default): a learner that finishes (or retires) delivers every
  fragment with progress not yet delivered, and the syncer merges every one of those final
  deliveries before it stops and exports. (A fragment whose merged version overwrote the
  learner's values at its last step holds no progress and is not delivered again.)"""
  workdir, _ = run_dir
  tape = _tape(workdir)
  merged = {(a["learner"], a["incarnation"], r["fragment"], a["local_step"])
            for r in tape for a in r["admitted"] if a.get("final")}
  made = []
  for name in os.listdir(os.path.join(workdir, "logs")):
    if name.startswith("learner"):
      with open(os.path.join(workdir, "logs", name)) as f:
        for line in f:
          if ": final deliveries of fragments [" in line:
            words = line.split()
            m, incarnation, step = int(words[1]), int(words[3].rstrip(":")), int(words[-1])
            fragments = json.loads(line[line.index("["):line.index("]") + 1])
            made.append((m, incarnation, step, fragments))
  finished = [x for x in made if x[2] == 300]
  assert len(finished) >= 3 and any(x[2] < 300 for x in made), made  # and the retired one
  assert sum(len(x[3]) for x in made) >= 2 * len(made), made
  for m, incarnation, step, fragments in made:
    for p in fragments:
      assert (m, incarnation, p, step) in merged, (m, incarnation, p, step)
