"""The final sync (`receipt.final_sync`): a learner that finishes or retires on purpose delivers
every fragment before it leaves (`learner_loop.leave`), and the run ends only once the syncer
has merged those deliveries, so every learner's last local step reaches G."""

import itertools
import os
import random

import pytest
import runtime_configs

from diloco import fragments as fragments_lib
from diloco.learner.receipt import RECEIPT_MODES
from diloco.observe import accounting
from diloco.runtime import decoupled

STEPS = 24  # tiny: H = 8 over P = 8 fragments, so at step 24 only fragment 0 is due


def _run(tmp_path, **dotted):
  """A run of 2 learners (unless overridden); returns its runtime, summary and tape."""
  cfg = runtime_configs.load(**{"learners__count": 2, "learners__devices": "2,2",
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
  rt, summary, tape = _run(tmp_path, learners__virtual_clock=True, receipt__mode="keep_local")
  assert [s.status for s in rt.slots] == ["done", "done"]
  last = _last_rounds(tape, rt.plan.num_fragments)
  for p, r in last.items():
    assert _admitted(r) == {(0, STEPS), (1, STEPS)}, (p, r["admitted"])
    assert all(a["final"] == (p != 0) for a in r["admitted"]), (p, r["admitted"])
  assert rt.syncer.settled()
  assert summary["accounting/goodput"] > 0.9, summary["accounting/goodput"]


def _draw(count: int, seed: int, wanted) -> list[tuple[int, int, int, int]]:
  """`count` distinct schedules (steps, H, tau, P) drawn at random for which `wanted(steps,
  period, tau, num)` holds."""
  rng, drawn = random.Random(seed), []
  while len(drawn) < count:
    period = rng.choice([4, 6, 8])
    num = rng.choice([p for p in (2, 4, 8) if p <= period])
    tau = rng.randint(2, period - 1)
    steps = rng.randint(max(period + tau, 10), 3 * period)
    schedule = (steps, period, tau, num)
    if wanted(*schedule) and schedule not in drawn:
      drawn.append(schedule)
  return drawn


def _schedules(count: int, seed: int = 0) -> list[tuple[int, int, int, int]]:
  """Schedules where a regular receipt lands exactly on the last step: some fragment is due at
  `steps - tau`, and its round is received at `steps`."""
  return _draw(count, seed, lambda steps, period, tau, num: bool(
      fragments_lib.due_fragments(steps - tau, period, num)))


def _ending_schedules(count: int, seed: int = 1) -> list[tuple[int, int, int, int]]:
  """Schedules where some fragment is delivered within tau steps of the end (at
  `steps - tau < t < steps`), so that its round lands after the learner's last step."""
  return _draw(count, seed, lambda steps, period, tau, num: any(
      fragments_lib.due_fragments(t, period, num) for t in range(steps - tau + 1, steps)))


def _check_same_last_round(tape, steps, learners, num_fragments):
  """Every fragment's last round holds every learner's last step."""
  for p, r in _last_rounds(tape, num_fragments).items():
    assert {(m, steps) for m in learners} <= _admitted(r), (p, r["admitted"])


def _check_claimed_once(rt, tape, steps, learners):
  """Every learner's steps are claimed at most once per fragment across all its admitted
  deliveries (a delivery claims local steps local_step-steps+1 .. local_step), the last claim
  ends at its last step, and under `keep_local`, which discards no step, every step is claimed
  exactly once: the claimed steps sum to `steps`."""
  for p in range(rt.plan.num_fragments):
    for m in learners:
      spans = sorted((a["local_step"] - a["steps"] + 1, a["local_step"]) for r in tape
                     if r["fragment"] == p for a in r["admitted"] if a["learner"] == m)
      assert all(a[1] < b[0] for a, b in itertools.pairwise(spans)), (p, m, spans)
      assert spans[-1][1] == steps, (p, m, spans)
      if rt.cfg.receipt.mode == "keep_local":
        assert sum(b - a + 1 for a, b in spans) == steps, (p, m, spans)


def _check_last_rounds(rt, tape, steps, tau, learners, same_round=True):
  """Every learner's last step is merged into every fragment, in its last round when
  `same_round` (the virtual clock; on the wall clock with a quorum below M a learner that
  finishes first may have its final deliveries merged in a round of their own). A fragment
  whose round is received at the last step has its last tau steps delivered once more, as
  final deliveries that merge no step twice (an admitted delivery covers local steps
  local_step-steps+1 .. local_step)."""
  num = rt.plan.num_fragments
  received_last = fragments_lib.due_fragments(steps - tau, rt.cfg.sync.period, num)
  assert received_last, "the schedule must receive a regular round at the last step"
  if same_round:
    _check_same_last_round(tape, steps, learners, num)
  for p in received_last:
    finals = [a for r in tape if r["fragment"] == p for a in r["admitted"] if a["final"]]
    assert sorted(a["learner"] for a in finals) == list(learners), (p, finals)
    assert all(a["steps"] == tau for a in finals), (p, finals)
    for m in learners:
      spans = sorted((a["local_step"] - a["steps"] + 1, a["local_step"]) for r in tape
                     if r["fragment"] == p for a in r["admitted"] if a["learner"] == m)
      assert all(a[1] < b[0] for a, b in itertools.pairwise(spans)), (p, m, spans)
  _check_claimed_once(rt, tape, steps, learners)


@pytest.mark.parametrize("receipt", RECEIPT_MODES)
def test_a_round_received_at_the_last_step_keeps_the_steps_the_final_sync_delivers(tmp_path,
                                                                                   receipt):
  """The fragment whose regular round (delivered at steps - tau) is received exactly at the
  last step: the receipt keeps the last tau steps (`Learner.keep_progress`), whatever the
  receipt mode, and the final sync delivers them; without that, overwrite and mix lost them
  and that fragment's last round held steps - tau. A property over drawn (steps, H, tau, P),
  on the virtual clock."""
  for i, (steps, period, tau, num) in enumerate(_schedules(3)):
    rt, _, tape = _run(tmp_path / str(i), learners__virtual_clock=True, receipt__mode=receipt,
                       train__steps=steps, sync__period=period, sync__tau=tau,
                       sync__num_fragments=num)
    assert [s.status for s in rt.slots] == ["done", "done"], (steps, period, tau, num)
    _check_last_rounds(rt, tape, steps, tau, learners=(0, 1))
    assert rt.syncer.settled()


@pytest.mark.slow
@pytest.mark.parametrize("receipt", RECEIPT_MODES)
def test_threaded_run_keeps_the_steps_of_a_round_received_at_the_last_step(tmp_path, receipt):
  """The same on the wall clock (paced steps; a late round is waited for at the last step,
  where the receipt keeps the progress too): tau = 3, H = 8, P = 8, 21 steps, so fragment 2's
  round of step 18 is received at step 21."""
  steps, tau = 21, 3
  rt, _, tape = _run(tmp_path, train__steps=steps, sync__tau=tau, receipt__mode=receipt,
                     learners__min_step_s=0.1)
  assert [s.status for s in rt.slots] == ["done", "done"]
  _check_last_rounds(rt, tape, steps, tau, learners=(0, 1), same_round=False)
  assert rt.syncer.settled()


@pytest.mark.parametrize("receipt", RECEIPT_MODES)
def test_a_round_landing_after_the_last_step_claims_no_step_twice(tmp_path, receipt):
  """A fragment delivered within tau steps of the end has its round land after the last step:
  the finishing learner takes it in at its last sync point (waiting for it if need be),
  keeping the steps since, and the final sync delivers only those; before, the final delivery
  counted from the previous receipt and claimed the steps up to the outstanding delivery a
  second time. A property over drawn (steps, H, tau, P), on the virtual clock, read from the
  run's tape."""
  for i, (steps, period, tau, num) in enumerate(_ending_schedules(3)):
    rt, _, tape = _run(tmp_path / str(i), learners__virtual_clock=True, receipt__mode=receipt,
                       train__steps=steps, sync__period=period, sync__tau=tau,
                       sync__num_fragments=num)
    assert [s.status for s in rt.slots] == ["done", "done"], (steps, period, tau, num)
    last = _last_rounds(tape, rt.plan.num_fragments)
    for p, r in last.items():
      assert {(0, steps), (1, steps)} <= _admitted(r), (p, r["admitted"])
    _check_claimed_once(rt, tape, steps, learners=(0, 1))
    assert rt.syncer.settled()


@pytest.mark.slow
def test_threaded_run_claims_no_step_twice_when_a_round_lands_after_the_last_step(tmp_path):
  """The same on the wall clock, for one drawn schedule, without blocking on late rounds: the
  finishing learner waits for its outstanding rounds all the same (it has no steps left to
  hold up)."""
  steps, period, tau, num = _ending_schedules(1, seed=2)[0]
  rt, _, tape = _run(tmp_path, train__steps=steps, sync__period=period, sync__tau=tau,
                     sync__num_fragments=num, receipt__mode="overwrite",
                     sync__block_on_late_round=False, learners__min_step_s=0.1)
  assert [s.status for s in rt.slots] == ["done", "done"]
  _check_claimed_once(rt, tape, steps, learners=(0, 1))  # each learner's last claim: its last step
  assert rt.syncer.settled()


def test_without_final_sync_the_steps_after_a_fragments_last_slot_are_lost(tmp_path):
  """The contrast: the last rounds of fragments 1..7 hold steps 17..23, not 24."""
  rt, _, tape = _run(tmp_path, learners__virtual_clock=True, receipt__final_sync=False,
                     receipt__mode="overwrite")
  last = _last_rounds(tape, rt.plan.num_fragments)
  assert _admitted(last[0]) == {(0, STEPS), (1, STEPS)}
  for p in range(1, rt.plan.num_fragments):
    assert {step for _, step in _admitted(last[p])} == {STEPS - 8 + p}, (p, last[p]["admitted"])


def test_a_retired_learner_delivers_every_fragment_at_its_retirement_step(tmp_path):
  """(keep_local: it holds progress on every fragment when it retires.)"""
  rt, _, tape = _run(tmp_path, learners__virtual_clock=True, receipt__mode="keep_local",
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
  """On the wall clock the syncer thread merges the final deliveries before it stops: every
  fragment has merged both finishing learners' last step, and the retired learner's
  last step reached every fragment. (Paced 0.2 s steps: the retirement at 6 s of the run's
  clock, which includes loading, falls well inside 48 steps even on a loaded host.)"""
  steps = 48
  rt, summary, tape = _run(tmp_path, learners__count=3, learners__devices="2,2,2",
                           train__steps=steps, learners__min_step_s=0.2,
                           learners__faults="retire:2@6.0", receipt__mode="keep_local")
  assert [s.status for s in rt.slots] == ["done", "done", "retired"]
  for p in range(rt.plan.num_fragments):  # each finishing learner's last step reached every one
    assert {0, 1} <= {a["learner"] for r in tape if r["fragment"] == p
                      for a in r["admitted"] if a["local_step"] == steps}, p
  retired_at = rt.slots[2].resume.local_step
  assert 0 < retired_at < steps
  for p in range(rt.plan.num_fragments):
    assert (2, retired_at) in {(a["learner"], a["local_step"]) for r in tape
                               if r["fragment"] == p for a in r["admitted"]}, p
  assert rt.syncer.settled()
  assert summary["eval/loss"] < summary["eval/initial_loss"]
