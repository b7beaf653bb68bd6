"""The final sync (`sync.final_sync`): a learner that finishes or retires on purpose delivers
every fragment before it leaves (`learner_loop.leave`), and the run ends only once the syncer
has merged those deliveries, so every learner's last local step reaches G."""

import os

import pytest

from diloco.observe import accounting
from diloco.runtime import decoupled

import run_config

STEPS = 24  # tiny: H = 8 over P = 8 fragments, so at step 24 only fragment 0 is due


def _run(tmp_path, **dotted):
  cfg = run_config.load(**{"learners__count": 2, "learners__devices": "2,2",
                           "train__steps": STEPS, **dotted})
  rt, summary = decoupled.run_with_runtime(cfg, str(tmp_path))
  return rt, summary, accounting.read_jsonl(os.path.join(str(tmp_path), "tape.jsonl"))


def _last_rounds(tape, num_fragments):
  last = {}
  for r in tape:
    last[r["fragment"]] = r
  assert sorted(last) == list(range(num_fragments))
  return last


def _admitted(record):
  return {(a["learner"], a["local_step"]) for a in record["admitted"]}


def test_every_learners_last_step_is_in_the_last_round_of_every_fragment(tmp_path):
  """keep_local receipts keep every local step, so at step 24 every learner holds progress on
  every fragment: fragment 0 is due at 24, the others go as final deliveries at 24, and the
  last round of each fragment merges both learners' step 24."""
  rt, summary, tape = _run(tmp_path, learners__virtual_clock=True, sync__receipt="keep_local")
  assert [s.status for s in rt.slots] == ["done", "done"]
  last = _last_rounds(tape, rt.plan.num_fragments)
  for p, r in last.items():
    assert _admitted(r) == {(0, STEPS), (1, STEPS)}, (p, r["admitted"])
    assert all(a["final"] == (p != 0) for a in r["admitted"]), (p, r["admitted"])
  assert rt.syncer.settled()
  assert summary["accounting/goodput"] > 0.9, summary["accounting/goodput"]


def test_with_overwrite_only_a_fragment_overwritten_at_the_last_step_keeps_its_delivery(tmp_path):
  """Overwrite drops the tau steps between a delivery and its receipt. Fragment p is due at
  steps = p (mod H = 8), tau = 2: fragment 6, delivered at 22, is overwritten by its merge at
  step 24 and has nothing left to deliver; every other fragment's last round holds step 24."""
  rt, _, tape = _run(tmp_path, learners__virtual_clock=True, sync__receipt="overwrite")
  assert [s.status for s in rt.slots] == ["done", "done"]
  for p, r in _last_rounds(tape, rt.plan.num_fragments).items():
    step = STEPS - 2 if p == 6 else STEPS
    assert _admitted(r) == {(0, step), (1, step)}, (p, r["admitted"])
  assert rt.syncer.settled()


def test_without_final_sync_the_steps_after_a_fragments_last_slot_are_lost(tmp_path):
  """The contrast: the last rounds of fragments 1..7 hold steps 17..23, not 24."""
  rt, _, tape = _run(tmp_path, learners__virtual_clock=True, sync__final_sync=False,
                     sync__receipt="overwrite")
  last = _last_rounds(tape, rt.plan.num_fragments)
  assert _admitted(last[0]) == {(0, STEPS), (1, STEPS)}
  for p in range(1, rt.plan.num_fragments):
    assert {step for _, step in _admitted(last[p])} == {STEPS - 8 + p}, (p, last[p]["admitted"])


def test_a_retired_learner_delivers_every_fragment_at_its_retirement_step(tmp_path):
  """(keep_local: it holds progress on every fragment when it retires.)"""
  rt, _, tape = _run(tmp_path, learners__virtual_clock=True, sync__receipt="keep_local",
                     learners__faults="retire:1@10.5")
  assert [s.status for s in rt.slots] == ["done", "retired"]
  retired_at = rt.slots[1].resume.local_step
  assert 0 < retired_at < STEPS
  for p in range(rt.plan.num_fragments):
    steps = [a["local_step"] for r in tape if r["fragment"] == p for a in r["admitted"]
             if a["learner"] == 1]
    assert max(steps) == retired_at, (p, steps)
  for p, r in _last_rounds(tape, rt.plan.num_fragments).items():
    assert (0, STEPS) in _admitted(r), (p, r["admitted"])


@pytest.mark.slow
def test_threaded_run_merges_every_learners_final_deliveries(tmp_path):
  """On the wall clock the syncer thread merges the final deliveries before it stops: the last
  round of every fragment holds both finishing learners' last step, and the retired learner's
  last step reached every fragment. (Paced 0.2 s steps: the retirement at 6 s of the run's
  clock, which includes loading, falls well inside 48 steps even on a loaded host.)"""
  steps = 48
  rt, summary, tape = _run(tmp_path, learners__count=3, learners__devices="2,2,2",
                           train__steps=steps, learners__min_step_s=0.2,
                           learners__faults="retire:2@6.0", sync__receipt="keep_local")
  assert [s.status for s in rt.slots] == ["done", "done", "retired"]
  for p, r in _last_rounds(tape, rt.plan.num_fragments).items():
    assert {(0, steps), (1, steps)} <= _admitted(r), (p, r["admitted"])
  retired_at = rt.slots[2].resume.local_step
  assert 0 < retired_at < steps
  for p in range(rt.plan.num_fragments):
    assert (2, retired_at) in {(a["learner"], a["local_step"]) for r in tape
                               if r["fragment"] == p for a in r["admitted"]}, p
  assert rt.syncer.settled()
  assert summary["eval/loss"] < summary["eval/initial_loss"]
