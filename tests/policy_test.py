"""Closed-form checks of the syncer policy (diloco/sync/policy.py)."""

import dataclasses

import pytest

from diloco.delivery import Delivery
from diloco.sync import policy
from diloco.sync.policy import SyncConfig

CFG = policy.PolicyConfig(quorum=1, tau=2, gamma=0.8, heartbeat_timeout_s=10.0, max_staleness=2)


def _learner(lid=0, inc=0, hb=100.0):
  return policy.LearnerStatus(learner_id=lid, incarnation=inc, last_heartbeat=hb, step_time=1.0)


def _delivery(lid=0, inc=0, base=3, steps=5):
  return Delivery(learner=lid, incarnation=inc, fragment=1, local_step=steps, steps=steps,
                  tokens=10 * steps, base_version=base, kind="values")


def test_defaults_are_the_sync_groups():
  cfg = policy.PolicyConfig.from_config(SyncConfig())
  assert (cfg.quorum, cfg.tau, cfg.gamma, cfg.heartbeat_timeout_s, cfg.max_staleness) == (
      1, 2, 0.8, 30.0, 8)  # docs/design.md 2.3-2.4
  assert cfg.ema_decay == 0.9
  assert policy.PolicyConfig.from_config(SyncConfig(), gamma=0.0).gamma == 0.0


@pytest.mark.parametrize("field,value", [("quorum", -1), ("tau", -1), ("gamma", -0.1),
                                         ("heartbeat_timeout_s", 0.0), ("max_staleness", -1),
                                         ("ema_decay", 1.0)])
def test_config_rejects_bad_values_naming_the_field(field, value):
  with pytest.raises(ValueError, match=field):
    policy.PolicyConfig.from_config(SyncConfig(), **{field: value})


def test_config_is_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    CFG.quorum = 3  # type: ignore[misc]


def test_ema():
  ema = policy.Ema(0.5)
  assert ema.get(7.0) == 7.0
  ema = ema.update(4.0)
  assert ema.get() == 4.0
  ema = ema.update(2.0)
  assert ema.get() == pytest.approx(3.0)
  assert policy.Ema(0.5).update(1.0) is not ema


def test_liveness_by_heartbeat_timeout():
  assert policy.is_alive(100.0, 110.0, 10.0)
  assert not policy.is_alive(100.0, 110.5, 10.0)
  statuses = [_learner(0, hb=100.0), _learner(1, hb=80.0), _learner(2, hb=105.0)]
  assert [s.learner_id for s in policy.alive_learners(statuses, 108.0, 10.0)] == [0, 2]


def test_eligible_delivery():
  ok, reason = policy.check_delivery(_delivery(), learner=_learner(), current_version=4,
                                     now=101.0, config=CFG)
  assert (ok, reason) == (True, policy.OK)


@pytest.mark.parametrize("delivery,learner,version,now,reason", [
    (_delivery(), None, 4, 101.0, policy.REJECT_UNKNOWN_LEARNER),
    (_delivery(), _learner(hb=80.0), 4, 101.0, policy.REJECT_DEAD),
    (_delivery(inc=0), _learner(inc=1), 4, 101.0, policy.REJECT_INCARNATION),
    (_delivery(base=5), _learner(), 4, 101.0, policy.REJECT_UNKNOWN_LINEAGE),
    (_delivery(base=-1), _learner(), 4, 101.0, policy.REJECT_UNKNOWN_LINEAGE),
    (_delivery(steps=0), _learner(), 4, 101.0, policy.REJECT_NO_STEPS),
    (_delivery(base=1), _learner(), 4, 101.0, policy.REJECT_STALE),
])
def test_rejections_give_the_reason(delivery, learner, version, now, reason):
  assert policy.check_delivery(delivery, learner=learner, current_version=version, now=now,
                               config=CFG) == (False, reason)


def test_staleness_bound_is_inclusive():
  # staleness = 4 - 2 = 2 = max_staleness: accepted; base 1 (staleness 3) was rejected above.
  assert policy.staleness(4, 2) == 2
  assert policy.check_delivery(_delivery(base=2), learner=_learner(), current_version=4,
                               now=101.0, config=CFG)[0]


def test_fresh_learner_with_unknown_lineage_never_forms_quorum():
  # A freshly initialised learner reports a base version the syncer never published.
  assert not policy.is_known_lineage(0, -1)
  assert policy.is_known_lineage(0, 0)


@pytest.mark.parametrize("k,alive,expected", [(1, 8, 1), (8, 8, 8), (8, 3, 3), (4, 0, 1)])
def test_required_quorum(k, alive, expected):
  assert policy.required_quorum(k, alive) == expected


def test_grace_window_closed_form_and_clipping():
  # 0.8 * (2 * 1.0 - 0.2 - 0.3) = 1.2, clipped to step_time 1.0.
  assert policy.grace_window(gamma=0.8, tau=2, step_time=1.0, quorum_time=0.2,
                             sync_time=0.3) == 1.0
  # 0.5 * (2 * 1.0 - 0.2 - 0.3) = 0.75, inside [0, step_time].
  assert policy.grace_window(gamma=0.5, tau=2, step_time=1.0, quorum_time=0.2,
                             sync_time=0.3) == pytest.approx(0.75)
  # No slack left: clipped to 0.
  assert policy.grace_window(gamma=0.8, tau=2, step_time=1.0, quorum_time=1.5,
                             sync_time=0.9) == 0.0
  # gamma = 0 disables it.
  assert policy.grace_window(gamma=0.0, tau=2, step_time=1.0, quorum_time=0.0,
                             sync_time=0.0) == 0.0


def test_slowest_step_time():
  assert policy.slowest_step_time([1.0, None, 1.3, 0.9]) == 1.3
  assert policy.slowest_step_time([None], default=2.0) == 2.0


def _decide(arrivals, *, alive, now, k=1, gamma=0.8, quorum_time=0.0):
  cfg = dataclasses.replace(CFG, quorum=k, gamma=gamma)
  return policy.decide_round(arrivals, num_alive=alive, opened_at=10.0, now=now, config=cfg,
                             step_time=1.0, quorum_time=quorum_time, sync_time=0.5)


def test_round_waits_for_quorum():
  d = _decide([10.0], alive=4, now=10.5, k=2)
  assert (d.close, d.deadline, d.quorum, d.reason) == (False, None, 2, "waiting_for_quorum")


def test_round_keeps_admitting_during_grace():
  # grace = clip(0.8 * (2 - 0.25 - 0.5), 0, 1) = 1.0 after quorum at 10.5.
  d = _decide([10.0, 10.5], alive=4, now=10.6, k=2, quorum_time=0.25)
  assert not d.close and d.reason == "in_grace"
  assert d.grace == pytest.approx(1.0)
  assert d.deadline == pytest.approx(11.5)
  assert d.quorum_reached_at == 10.5 and d.quorum_wait == pytest.approx(0.5)
  d = _decide([10.0, 10.5], alive=4, now=11.5, k=2, quorum_time=0.25)
  assert d.close and d.reason == "grace_expired"


def test_round_closes_at_once_without_grace():
  d = _decide([10.0], alive=4, now=10.0, gamma=0.0)
  assert d.close and d.reason == "quorum_reached" and d.grace == 0.0


def test_round_closes_when_all_alive_delivered():
  d = _decide([10.0, 10.1, 10.2], alive=3, now=10.2, k=1)
  assert d.close and d.reason == "all_delivered"


def test_quorum_capped_by_alive_learners():
  # K = 8 but only 2 alive: the round closes once both delivered.
  d = _decide([10.0, 10.3], alive=2, now=10.3, k=8)
  assert d.close and d.quorum == 2


def test_quorum_zero_means_all_alive_learners():
  assert [policy.required_quorum(0, n) for n in (0, 1, 3, 8)] == [1, 1, 3, 8]
  waiting = _decide([10.0, 10.3], alive=3, now=10.3, k=0, gamma=0.0)
  assert not waiting.close and waiting.quorum == 3
  d = _decide([10.0, 10.3, 10.4], alive=3, now=10.4, k=0, gamma=0.0)
  assert d.close and d.quorum == 3
