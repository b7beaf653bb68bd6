"""Fidelity of the single-controller runtime to the paper's algorithm (docs/design.md 2.3-2.4).

Rounds must merge several equal-speed learners (the grace window works on the wall clock as on
the virtual clock), the learner protocol must survive the races and failures the design names,
and stale deliveries must count for what `outer.stale` says.
"""

import itertools
import json
import os

import numpy as np
import pytest
import runtime_configs

from diloco import fragments
from diloco.delivery import Delivery
from diloco.errors import ConfigError
from diloco.observe import accounting, fidelity
from diloco.outer.merge import OuterConfig
from diloco.runtime import decoupled
from diloco.sync import syncer as syncer_lib
from diloco.sync.policy import SyncConfig
from diloco.transport import Heartbeat


def _config(**dotted):
  return runtime_configs.load(**dotted)


def _tape(workdir):
  return accounting.read_jsonl(os.path.join(workdir, "tape.jsonl"))


# The grace window on the wall clock and on the virtual clock.

@pytest.mark.slow
def test_threaded_equal_learners_merge_together_like_the_virtual_clock(tmp_path):
  """4 equal-speed learners, K = 1, grace on: rounds merge several learners on the wall clock,
  and about as many as the deterministic virtual-clock run of the same config."""
  # Paced steps (0.3 s) keep the scheduling noise of a loaded 2-core host (the test suite runs
  # two workers) small against a step.
  step_s = 0.3
  common = dict(learners__min_step_s=step_s, train__steps=32)
  _, threaded = decoupled.run_with_runtime(_config(**common), str(tmp_path / "threaded"))
  _, virtual = decoupled.run_with_runtime(
      _config(learners__virtual_clock=True, **common), str(tmp_path / "virtual"))
  tape = _tape(str(tmp_path / "threaded"))
  per_round = threaded["accounting/mean_learners_per_round"]
  assert per_round >= 2.0, fidelity.fidelity_line(tape)
  assert threaded["accounting/median_grace_s"] > 0.0
  # Transit starts once the values are on the host: it never contains the step's compute.
  assert np.median([r["pull_s"] for r in tape]) < 0.5 * step_s
  # The window spends only slack the learners have: they (almost) never wait at t + tau.
  assert threaded["accounting/wait_fraction"] < 0.05
  assert virtual["accounting/mean_learners_per_round"] == 4.0
  assert per_round >= virtual["accounting/mean_learners_per_round"] - 1.5
  assert threaded["eval/loss"] < threaded["eval/initial_loss"]


def test_sync_time_uses_transit_not_compute_and_ignores_bad_measurements():
  """grace = clip(gamma (tau step - quorum - sync), 0, step) with sync = transit + merge,
  checked in closed form; NaN and negative measurements leave the EMAs alone."""
  shapes = {"w": (4,)}
  plan = fragments.plan_fragments(shapes, num_fragments=1)
  s = syncer_lib.Syncer({"w": np.zeros(4, np.float32)}, plan,
                        SyncConfig(quorum=1, gamma=0.8, tau=2), OuterConfig(),
                        sync_delay_s=0.1)

  local_steps = itertools.count(1)  # each delivery its own (merged exactly once)

  def deliver(now, learner, transit, lead=0.0):
    beats = [Heartbeat(m, 0, 1, 1.0, now) for m in (0, 1)]
    payload = Delivery(learner=learner, incarnation=0, fragment=0, local_step=next(local_steps),
                       steps=1, tokens=10, base_version=s.versions[0], kind="values",
                       tensors={"w": np.full(4, 0.1 * (learner + 1), np.float32)},
                       transit_s=transit, lead_s=lead)
    return s.tick(now, beats, [payload])

  _, deadline = deliver(1.0, 0, 1.0, lead=0.5)
  # No sync sample yet: grace = min(0.8 * (2 * 1.0 - 0 - 0), 1.0) = 1.0 after the quorum.
  assert deadline == pytest.approx(2.0)
  merged, _ = s.tick(2.0)
  assert len(merged) == 1
  # Lead EMA = 0.5 (the learner's values reached its host half a step after its delivery
  # point), sync EMA = 1.0 transit + 0.1 merge.
  _, deadline = deliver(3.0, 1, 1.0)
  assert deadline == pytest.approx(3.0 + 0.8 * (2.0 - 0.5 - 1.1))
  s.tick(10.0)
  for bad in (float("nan"), -1.0, float("inf")):
    before = s.timing.sync.value
    _, deadline = deliver(20.0, 0, bad)  # an unusable transit counts as no transit
    s.tick(30.0)
    assert s.timing.sync.value == pytest.approx(0.9 * before + 0.1 * 0.1)
  s._heartbeat(Heartbeat(0, 0, 1, float("nan"), 40.0))
  s._heartbeat(Heartbeat(0, 0, 1, float("inf"), 40.0))
  assert s.registry[0].step_time == pytest.approx(1.0)


# Learner protocol.

def test_period_not_above_tau_is_rejected():
  with pytest.raises(ConfigError, match=r"sync.period: must be greater than sync.tau=2"):
    _config(sync__period=2, sync__num_fragments=2)


@pytest.mark.slow
def test_retired_learner_leaves_and_k_equals_m_rounds_do_not_stall(tmp_path):
  """With K = M, a learner that retires must stop counting at once (not after the heartbeat
  timeout): the rounds right after it go on with the others and nobody waits for it."""
  cfg = _config(learners__count=2, learners__virtual_clock=True, sync__quorum=2,
                sync__gamma=0.0, sync__heartbeat_timeout_s=1000.0, train__steps=40,
                learners__faults="retire:1@12")
  rt, summary = decoupled.run_with_runtime(cfg, str(tmp_path))
  tape = _tape(str(tmp_path))
  # (Rounds with nobody alive are the final sync's, after learner 0 finished too.)
  after = [r for r in tape if r["closed_at"] > 13 and r["num_alive"]]
  assert all(a["final"] for r in tape if not r["num_alive"] for a in r["admitted"])
  assert after and all(r["quorum"] == 1 and r["num_alive"] == 1 for r in after)
  assert all(a["learner"] == 0 for r in after for a in r["admitted"] if a["local_step"] > 13)
  assert [s.status for s in rt.slots] == ["done", "retired"]
  assert rt.slots[0].resume.local_step == 40
  # Without the leave message learner 0 would block ~1000 s at every tau point.
  assert summary["accounting/wait_fraction"] < 0.1


@pytest.mark.slow
@pytest.mark.parametrize("virtual", [True, False])
def test_non_finite_learner_fails_alone_and_rejoins(tmp_path, virtual):
  """A learner whose step goes NaN fails alone and rejoins from the global fragments; on the
  virtual clock a second blow-up exceeds `nonfinite_retries=1` and retires it."""
  cfg = _config(learners__count=2, learners__virtual_clock=virtual, train__steps=30,
                learners__faults="nan:1@8;nan:1@20" if virtual else "nan:1@1",
                learners__nonfinite_retries=1,
                learners__min_step_s=0.0 if virtual else 0.1)
  rt, summary = decoupled.run_with_runtime(cfg, str(tmp_path))
  tape = _tape(str(tmp_path))
  assert rt.slots[1].nonfinite_failures == (2 if virtual else 1)
  assert [s.status for s in rt.slots] == ["done", "retired" if virtual else "done"]
  rejoined = [a for r in tape for a in r["admitted"] if a["learner"] == 1 and a["incarnation"] == 1]
  # The new incarnation starts from the published fragments (known lineage, some merged).
  assert rejoined and min(a["base_version"] for a in rejoined) >= 0
  assert max(a["base_version"] for a in rejoined) >= 1
  assert all(np.isfinite(v).all() for v in rt.syncer.params.values())
  assert np.isfinite(summary["eval/loss"]) and summary["eval/loss"] < summary["eval/initial_loss"]
  with open(os.path.join(tmp_path, "activity.jsonl")) as f:
    kinds = {(json.loads(line)["learner"], json.loads(line)["kind"]) for line in f}
  assert (1, "down") in kinds and (0, "down") not in kinds


@pytest.mark.slow
def test_rejoining_learner_delivers_each_slot_with_its_peers(tmp_path):
  """A learner down for a non-multiple of H steps comes back with its fragment schedule
  shifted (`fragments.aligned_phase`), so its deliveries land in its peers' rounds instead of
  rounds of its own, steps away from theirs."""
  cfg = _config(learners__virtual_clock=True, learners__speeds="1,1,1,1", train__steps=40,
                learners__faults="kill:1@10.5+3")
  rt, _ = decoupled.run_with_runtime(cfg, str(tmp_path))
  tape = _tape(str(tmp_path))
  # Rounds of the rejoined learner while its peers still train (it finishes after them: its
  # lost steps are redone at the end, alone).
  back = [r for r in tape if r["num_alive"] > 1 and
          any(a["learner"] == 1 and a["incarnation"] == 1 for a in r["admitted"])]
  assert len(back) >= 8
  assert all(len(r["admitted"]) >= 2 for r in back), [len(r["admitted"]) for r in back]
  # It did need a shift: its local steps no longer match its peers' (it lost steps while down).
  steps = {a["learner"]: a["local_step"] for a in back[-1]["admitted"]}
  assert steps[1] != steps[0]
  assert rt.slots[1].status == "done"


# Stale deliveries.

@pytest.mark.parametrize("rule", ["paper", "rebase"])
def test_stale_delivery_counts_as_its_rule_says(rule):
  """Learner A's round publishes v1; learner B, still based on v0, delivers next. Closed
  forms: "paper" anchors B at the current G (d = G1 - theta_B), "rebase" uses its own
  progress scaled by 1 / (1 + staleness) (d = (G0 - theta_B) / 2)."""
  plan = fragments.plan_fragments({"w": (3,)}, num_fragments=1)
  g0 = np.zeros(3, np.float32)
  lr, mu = 0.5, 0.0
  records = []
  s = syncer_lib.Syncer({"w": g0}, plan, SyncConfig(quorum=1, gamma=0.0, max_staleness=4),
                        OuterConfig(learning_rate=lr, momentum=mu, merge="mean", stale=rule),
                        on_round=records.append)
  beats = [Heartbeat(m, 0, 1, 1.0, 0.0) for m in (0, 1)]
  theta_a = np.array([1.0, 0.0, 0.0], np.float32)
  theta_b = np.array([0.0, 2.0, 0.0], np.float32)
  (m1,), _ = s.tick(0.0, beats, [Delivery(learner=0, incarnation=0, fragment=0, local_step=1,
                                          steps=1, tokens=10, base_version=0, kind="values",
                                          tensors={"w": theta_a}, transit_s=0.0)])
  g1 = g0 - lr * (g0 - theta_a)
  np.testing.assert_allclose(m1.tensors["w"], g1)
  (m2,), _ = s.tick(0.1, (), [Delivery(learner=1, incarnation=0, fragment=0, local_step=1, steps=1,
                                       tokens=10, base_version=0, kind="values",
                                       tensors={"w": theta_b}, transit_s=0.0)])
  d = g1 - theta_b if rule == "paper" else (g0 - theta_b) / 2
  np.testing.assert_allclose(m2.tensors["w"], g1 - lr * d, rtol=1e-6)
  assert [a["staleness"] for r in records for a in r["admitted"]] == [0, 1]
