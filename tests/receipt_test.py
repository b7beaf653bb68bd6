"""Receipt modes and the final sync (docs/design.md 2.3) on a real `Learner` and `Syncer`.

Every expectation is a NumPy closed form of the design's rules: overwrite theta_p = G_p;
keep_local theta_p = G_p + (theta_p - theta_p as delivered); the counters of a kept step are
carried by the next delivery; a final-sync delivery's round waits for every live learner.
"""

import numpy as np
import options_test
import pytest
from options_test import setup  # noqa: F401  (the module's compiled learner)

from diloco import fragments
from diloco import transport as transport_lib
from diloco.delivery import Delivery
from diloco.outer.merge import OuterConfig
from diloco.sync import policy
from diloco.sync import syncer as syncer_lib
from diloco.sync.policy import SyncConfig


class _Capture(transport_lib.InMemoryTransport):
  """The in-memory transport, keeping every delivery it carried."""

  def __init__(self):
    super().__init__()
    self.sent = []

  def deliver(self, payload):
    self.sent.append(payload)
    super().deliver(payload)


def _first_delivery(setup, cfg, transport):  # noqa: F811
  """A learner that took one step (delivering fragment p there) and tau steps more; returns
  (learner, p, its fragment as delivered, its fragment just before the receipt)."""
  learner = options_test._learner(setup, cfg, transport)
  learner.step(0.0, 1.0)
  (p,) = options_test._delivered(1, cfg)
  delivered = {k: learner.params_flat()[k] for k in setup.plan.fragments[p]}
  for _ in range(cfg.sync.tau - 1):
    learner.step(0.0, 1.0)
    assert learner.sync_point() == []
  learner.step(0.0, 1.0)
  before = learner.params_flat()
  return learner, p, delivered, before


@pytest.mark.parametrize("quantize_bits", [0, 8])
def test_keep_local_adds_the_progress_since_delivery(setup, quantize_bits):  # noqa: F811
  cfg = options_test._config(receipt__mode="keep_local", outer__quantize_bits=quantize_bits)
  tau, tps = cfg.sync.tau, options_test._tokens_per_step(cfg)
  transport = _Capture()
  for merged in syncer_lib.Syncer(setup.g0, setup.plan, cfg.sync, cfg.outer).initial(0.0):
    transport.publish(merged)
  learner, p, delivered, before = _first_delivery(setup, cfg, transport)
  published = options_test._random_fragment(setup, p, seed=7)
  options_test._publish(transport, p, 1, published)
  assert learner.sync_point() == []
  after = learner.params_flat()
  for k in setup.plan.fragments[p]:
    expected = published[k] + (before[k] - delivered[k])
    np.testing.assert_allclose(after[k], expected, rtol=1e-6, atol=1e-6, err_msg=k)
    assert not np.allclose(after[k], published[k])  # the local progress is really kept
  for k in set(after) - set(published):
    np.testing.assert_array_equal(after[k], before[k], err_msg=k)
  # The tau steps made since the delivery are counted, so the next delivery carries them.
  assert learner.base[p] == 1
  assert learner.steps[p] == tau and learner.tokens[p] == tau * tps
  # That next delivery (H steps after the first) claims H steps: tau kept + H - tau new.
  h = cfg.sync.period
  while learner.local_step < 1 + h:
    learner.step(0.0, 1.0)
    learner.sync_point()
  last = [d for d in transport.sent if d.fragment == p][-1]
  assert last.local_step == 1 + h and last.steps == h and last.tokens == h * tps
  assert last.base_version == 1
  if quantize_bits:  # a delta from the received G_p: minus everything since the receipt base
    assert last.kind == "delta"
  learner.close()


def test_keep_local_without_a_delivery_keeps_all_progress_since_the_last_receipt(setup):  # noqa: F811
  cfg = options_test._config(receipt__mode="keep_local")
  transport = options_test._transport(setup, cfg)
  learner = options_test._learner(setup, cfg, transport)
  for _ in range(3):
    learner.step(0.0, 1.0)
    learner.sync_point()
  p = next(q for q in range(setup.plan.num_fragments) if q not in options_test._delivered(3, cfg))
  before = learner.params_flat()
  published = options_test._random_fragment(setup, p, seed=8)
  options_test._publish(transport, p, 1, published)
  assert p not in learner.sync_point()
  after = learner.params_flat()
  for k in setup.plan.fragments[p]:  # reference: G_p as loaded at the join (version 0)
    np.testing.assert_allclose(after[k], published[k] + (before[k] - setup.g0[k]),
                               rtol=1e-6, atol=1e-6, err_msg=k)
  assert learner.steps[p] == 3  # nothing of it was delivered: every step still counts


def test_overwrite_drops_the_progress_and_a_join_always_overwrites(setup):  # noqa: F811
  cfg = options_test._config(receipt__mode="overwrite")
  transport = options_test._transport(setup, cfg)
  learner, p, _, _ = _first_delivery(setup, cfg, transport)
  published = options_test._random_fragment(setup, p, seed=9)
  options_test._publish(transport, p, 1, published)
  learner.sync_point()
  after = learner.params_flat()
  for k, v in published.items():
    np.testing.assert_array_equal(after[k], v)
  assert learner.steps[p] == 0 and learner.tokens[p] == 0
  # A (re)joining learner under keep_local loads G exactly: its own values are only its init.
  joiner = options_test._learner(setup, options_test._config(receipt__mode="keep_local"), transport)
  loaded = joiner.params_flat()
  for k in setup.g0:
    expected = published[k] if k in published else setup.g0[k]
    np.testing.assert_array_equal(loaded[k], expected, err_msg=k)
  learner.close()
  joiner.close()


def test_deliver_final_sends_every_fragment_with_undelivered_steps_once(setup):  # noqa: F811
  cfg = options_test._config()
  transport = _Capture()
  for merged in syncer_lib.Syncer(setup.g0, setup.plan, cfg.sync, cfg.outer).initial(0.0):
    transport.publish(merged)
  learner = options_test._learner(setup, cfg, transport)
  steps = 5
  for _ in range(steps):
    learner.step(0.0, 1.0)
    learner.sync_point()
  scheduled = {d.fragment for d in transport.sent if d.local_step == steps}
  sent = learner.deliver_final()
  finals = [d for d in transport.sent if d.final]
  assert sorted(sent) == sorted(d.fragment for d in finals)
  # Every fragment but those delivered on schedule at this very step, each once, at this step.
  assert set(sent) == set(range(setup.plan.num_fragments)) - scheduled
  assert all(d.local_step == steps and d.steps >= 1 for d in finals)
  params = learner.params_flat()
  for d in finals:
    for k, v in d.tensors.items():
      np.testing.assert_array_equal(v, params[k])
  assert learner.deliver_final() == []  # nothing new since: nothing is sent twice
  learner.close()


def _payload(learner, step, *, final=False, value=1.0):
  return Delivery(learner=learner, incarnation=0, fragment=0, local_step=step, steps=step,
                  tokens=10 * step, base_version=0, kind="values",
                  tensors={"w": np.full(3, value, np.float32)}, transit_s=0.0, final=final)


def test_syncer_final_round_waits_for_every_live_learner_then_merges_them_together():
  # Learner 0 finishes and delivers final; learners 1 and 2 still train. K = 1 would close at
  # once; the final round waits for both, and merges the three as one mean (lr 1, mu 0).
  plan = fragments.plan_fragments({"w": (3,)}, num_fragments=1)
  records = []
  s = syncer_lib.Syncer({"w": np.zeros(3, np.float32)}, plan,
                        SyncConfig(quorum=1, gamma=0.0, heartbeat_timeout_s=10.0),
                        OuterConfig(learning_rate=1.0, momentum=0.0, merge="mean",
                                    weights="uniform"), on_round=records.append)
  def beats(now):
    return [transport_lib.Heartbeat(m, 0, 4, 1.0, now) for m in (0, 1, 2)]
  merged, deadline = s.tick(0.0, beats(0.0), [_payload(0, 4, final=True, value=3.0)],
                            left=[(0, 0)])
  assert merged == [] and deadline == 10.0 and not s.settled()
  merged, _ = s.tick(1.0, beats(1.0)[1:], [_payload(1, 4, value=6.0)])
  assert merged == [] and not s.settled()
  (m,), _ = s.tick(2.0, beats(2.0)[1:], [_payload(2, 4, value=9.0)])
  np.testing.assert_allclose(m.tensors["w"], np.full(3, 6.0))  # G = mean of the three
  assert s.settled()
  (record,) = records
  assert record["reason"] == "final_all_delivered"
  assert sorted((a["learner"], a["final"]) for a in record["admitted"]) == [
      (0, True), (1, False), (2, False)]


def test_syncer_final_round_stops_waiting_after_the_heartbeat_timeout():
  plan = fragments.plan_fragments({"w": (3,)}, num_fragments=1)
  s = syncer_lib.Syncer({"w": np.zeros(3, np.float32)}, plan,
                        SyncConfig(quorum=1, gamma=0.0, heartbeat_timeout_s=10.0),
                        OuterConfig(learning_rate=1.0, momentum=0.0, merge="mean"))
  def beat(m, now):
    return transport_lib.Heartbeat(m, 0, 4, 1.0, now)
  merged, deadline = s.tick(0.0, [beat(0, 0.0), beat(1, 0.0)],
                            [_payload(0, 4, final=True, value=3.0)], left=[(0, 0)])
  assert merged == [] and deadline == 10.0
  # Learner 1 keeps its heartbeat fresh but never delivers: the round closes at the deadline.
  merged, _ = s.tick(9.0, [beat(1, 9.0)])
  assert merged == []
  (m,), _ = s.tick(10.0, [beat(1, 10.0)])
  np.testing.assert_allclose(m.tensors["w"], np.full(3, 3.0))
  assert s.settled()


def test_final_round_decision_closed_forms():
  decide = policy.decide_final_round
  waiting = decide([1.0], num_alive=2, final_since=0.5, opened_at=0.5, now=2.0, timeout_s=10.0)
  assert not waiting.close and waiting.deadline == 10.5 and waiting.reason == "final_waiting"
  closed = decide([1.0, 3.0], num_alive=2, final_since=0.5, opened_at=0.5, now=3.0,
                  timeout_s=10.0)
  assert closed.close and closed.reason == "final_all_delivered"
  late = decide([1.0], num_alive=2, final_since=0.5, opened_at=0.5, now=10.5, timeout_s=10.0)
  assert late.close and late.reason == "final_timeout"
  alone = decide([], num_alive=0, final_since=4.0, opened_at=4.0, now=4.0, timeout_s=10.0)
  assert alone.close and alone.reason == "final_all_delivered"
