"""The syncer against a NumPy oracle: quorum, grace, merge math, rejections."""

import numpy as np
import pytest

from diloco import fragments
from diloco.delivery import Delivery
from diloco.outer.merge import OuterConfig
from diloco.sync import syncer as syncer_lib
from diloco.sync.policy import SyncConfig
from diloco.transport import Heartbeat

SHAPES = {"embedder/embedding": (6, 4), "layers/0/w": (4, 4), "layers/1/w": (4, 3)}


def _params(seed):
  rng = np.random.default_rng(seed)
  return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _syncer(**sync):
  plan = fragments.plan_fragments(SHAPES, num_fragments=1)
  cfg = SyncConfig(**{"quorum": 2, "gamma": 0.0, "heartbeat_timeout_s": 10.0, **sync})
  return syncer_lib.Syncer(_params(0), plan, cfg, OuterConfig(), sync_delay_s=0.5)


def _payload(learner, tensors, *, steps=4, tokens=400, base=0, incarnation=0, fragment=0,
             step=None):
  """A delivery at local step `step` (default `steps`: its learner's first delivery)."""
  return Delivery(learner=learner, incarnation=incarnation, fragment=fragment,
                  local_step=steps if step is None else step, steps=steps, tokens=tokens,
                  base_version=base, kind="values", tensors=tensors, transit_s=0.0)


def _beats(now, *learners):
  return [Heartbeat(m, 0, 1, 1.0, now) for m in learners]


def _oracle(g0, thetas, tokens, steps, lr=0.7, mu=0.9):
  """Token weights, RDA (mean for the embedding), one Nesterov step from zero momentum."""
  w = np.array([t * t / s for t, s in zip(tokens, steps)], np.float64)
  w /= w.sum()
  out = {}
  for k in g0:
    d = [g0[k].astype(np.float64) - th[k] for th in thetas]
    if k == "embedder/embedding":
      grad = sum(wi * di for wi, di in zip(w, d))
    else:
      norms = [np.linalg.norm(di) for di in d]
      direction = sum(wi * di / n for wi, di, n in zip(w, d, norms))
      grad = sum(wi * n for wi, n in zip(w, norms)) * direction / np.linalg.norm(direction)
    b = grad  # mu * 0 + g
    out[k] = g0[k] - lr * (grad + mu * b)
  return out


def test_round_closes_at_quorum_and_matches_oracle():
  s = _syncer()
  g0 = s.global_params()
  thetas = [_params(1), _params(2)]
  merged, _ = s.tick(1.0, _beats(1.0, 0, 1), [_payload(0, thetas[0], tokens=400)])
  assert merged == []  # K = 2: one delivery is not a quorum
  merged, _ = s.tick(2.0, (), [_payload(1, thetas[1], tokens=200, steps=2)])
  assert len(merged) == 1 and merged[0].version == 1 and merged[0].published_at == 2.5
  expected = _oracle(g0, thetas, [400, 200], [4, 2])
  for k in SHAPES:
    np.testing.assert_allclose(s.params[k], expected[k], rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(merged[0].tensors[k], s.params[k])
  assert s.versions == [1]


def test_quorum_of_one_closes_immediately_without_grace():
  s = _syncer(quorum=1)
  merged, deadline = s.tick(1.0, _beats(1.0, 0, 1), [_payload(0, _params(1))])
  assert len(merged) == 1 and deadline is None


def test_grace_window_admits_a_later_learner():
  s = _syncer(quorum=1, gamma=0.8, tau=2)
  beats = [Heartbeat(0, 0, 1, 1.0, 0.0), Heartbeat(1, 0, 1, 2.0, 0.0)]
  merged, deadline = s.tick(1.0, beats, [_payload(0, _params(1))])
  # grace = clip(0.8 * (2 * 2.0 - 0 - 0), 0, 2.0) = 2.0 after quorum at t = 1.
  assert merged == [] and deadline == pytest.approx(3.0)
  merged, _ = s.tick(2.5, (), [_payload(1, _params(2))])
  assert len(merged) == 1 and s.last_quorum == 2  # both admitted


@pytest.mark.parametrize("mutate, reason", [
    (lambda p: dict(p, learner=7), "unknown_learner"),
    (lambda p: dict(p, incarnation=3), "wrong_incarnation"),
    (lambda p: dict(p, base_version=-1), "unknown_lineage"),
    (lambda p: dict(p, steps=0), "no_steps"),
    (lambda p: dict(p, tensors={**p["tensors"], "layers/0/w": np.zeros((2, 2), np.float32)}),
     "wrong_shape"),
    (lambda p: dict(p, tensors={**p["tensors"], "layers/0/w": np.full((4, 4), np.nan,
                                                                       np.float32)}),
     "non_finite"),
    (lambda p: dict(p, tensors={k: v.astype(np.float64) for k, v in p["tensors"].items()}),
     "wrong_dtype"),
    (lambda p: dict(p, tensors={"layers/0/w": p["tensors"]["layers/0/w"]}), "bad_payload"),
    # Counters out of range (docs/design.md 2.5, bad payloads): each used to raise out of
    # `tick`, or to overflow the token weights, and a crashed syncer process read the same
    # delivery again after restart.
    (lambda p: dict(p, tokens=0), "bad_counters"),
    (lambda p: dict(p, tokens=-5), "bad_counters"),
    (lambda p: dict(p, tokens=10**200), "bad_counters"),
    (lambda p: dict(p, steps=10**200), "bad_counters"),
    (lambda p: dict(p, tokens=True), "bad_counters"),
    (lambda p: dict(p, tokens=400.0), "bad_counters"),
    (lambda p: dict(p, local_step=-1), "bad_counters"),
    (lambda p: dict(p, base_version=-2), "bad_counters"),
    (lambda p: dict(p, fragment=10**30), "bad_payload"),
])
def test_bad_payloads_are_rejected_and_never_enter_g(mutate, reason):
  s = _syncer(quorum=1)
  g0 = s.global_params()
  fields = dict(learner=0, incarnation=0, fragment=0, local_step=4, steps=4, tokens=400,
                base_version=0, kind="values", tensors=_params(1), transit_s=0.0)
  merged, _ = s.tick(1.0, _beats(1.0, 0), [Delivery(**mutate(fields))])
  assert merged == [] and s.rejections[reason] == 1
  for k in SHAPES:
    np.testing.assert_array_equal(s.params[k], g0[k])


def test_a_bad_delivery_never_stops_the_good_ones():
  """Crafted counters are rejected one by one; the same learner's next good delivery merges."""
  s = _syncer(quorum=1)
  bad = [_payload(0, _params(1), tokens=t) for t in (0, -1, 10**200)]
  merged, _ = s.tick(1.0, _beats(1.0, 0), bad)
  assert merged == [] and s.rejections["bad_counters"] == 3
  merged, _ = s.tick(2.0, _beats(2.0, 0), [_payload(0, _params(1))])
  assert len(merged) == 1 and merged[0].version == 1
  assert all(np.isfinite(v).all() for v in s.params.values())


def test_dead_and_stale_learners_are_rejected():
  s = _syncer(quorum=1, max_staleness=1, heartbeat_timeout_s=5.0)
  s.tick(0.0, _beats(0.0, 0, 1), ())
  merged, _ = s.tick(20.0, _beats(20.0, 1), [_payload(0, _params(1))])  # learner 0 is dead
  assert merged == [] and s.rejections["learner_dead"] == 1
  for t in (21.0, 22.0):  # two rounds from learner 1: version 2
    s.tick(t, _beats(t, 1), [_payload(1, _params(int(t)), base=s.versions[0], step=int(t))])
  # A newer step from the old base (an older step would be refused as a replay first).
  merged, _ = s.tick(23.0, _beats(23.0, 1), [_payload(1, _params(5), base=0, step=30)])
  assert merged == [] and s.rejections["stale"] == 1 and s.versions == [2]


def test_fresh_learner_with_unknown_lineage_never_forms_a_quorum():
  s = _syncer(quorum=1)
  for t in range(1, 6):
    merged, _ = s.tick(float(t), _beats(float(t), 0), [_payload(0, _params(t), base=-1)])
    assert merged == []
  assert s.versions == [0] and s.rejections["unknown_lineage"] == 5


@pytest.mark.parametrize("bits, tol", [(16, 2e-2), (8, 5e-2)])
def test_quantised_delta_payload_matches_values_payload(bits, tol):
  from diloco import outer
  thetas = [_params(1), _params(2)]
  plain = _syncer(quorum=2)
  plain.tick(1.0, _beats(1.0, 0, 1), [_payload(0, thetas[0]), _payload(1, thetas[1])])
  quant = syncer_lib.Syncer(_params(0), plain.plan, SyncConfig(quorum=2, gamma=0.0),
                            OuterConfig(quantize_bits=bits), sync_delay_s=0.5)
  g0 = _params(0)
  payloads = []
  for m, theta in enumerate(thetas):
    delta = {k: outer.quantize(g0[k] - theta[k], bits, 16) for k in theta}
    payloads.append(Delivery(learner=m, incarnation=0, fragment=0, local_step=4, steps=4,
                             tokens=400, base_version=0, kind="delta", tensors=delta,
                             transit_s=0.0))
  merged, _ = quant.tick(1.0, _beats(1.0, 0, 1), payloads)
  assert len(merged) == 1 and sum(p.nbytes for p in payloads) < 0.6 * sum(
      v.nbytes for t in thetas for v in t.values())
  for k in SHAPES:
    np.testing.assert_allclose(quant.params[k], plain.params[k], atol=tol)
    assert not np.array_equal(quant.params[k], g0[k])


def test_base_anchor_equals_syncer_anchor_when_up_to_date():
  thetas = [_params(1), _params(2)]
  results = []
  for anchor in ("syncer", "base"):
    s = syncer_lib.Syncer(_params(0), fragments.plan_fragments(SHAPES, num_fragments=1),
                          SyncConfig(quorum=2, gamma=0.0), OuterConfig(anchor=anchor))
    s.tick(1.0, _beats(1.0, 0, 1), [_payload(0, thetas[0]), _payload(1, thetas[1])])
    results.append(s.params)
  for k in SHAPES:
    np.testing.assert_array_equal(results[0][k], results[1][k])


def test_deliveries_of_a_learner_that_left_are_merged_without_counting_to_quorum():
  # K = 2 of 3: learner 0 delivers, then retires before the round closes.
  s = _syncer()
  g0 = s.global_params()
  thetas = [_params(1), _params(2)]
  assert s.tick(1.0, _beats(1.0, 0, 1, 2), [_payload(0, thetas[0], tokens=400)])[0] == []
  s.forget(0, 0)
  # Its delivery stays, but only alive learners count: learner 1 alone is not a quorum of 2.
  assert s.tick(2.0, _beats(2.0, 1, 2), [])[0] == []
  merged, _ = s.tick(3.0, _beats(3.0, 1, 2), [_payload(1, thetas[1], tokens=200, steps=2)])
  assert merged == []  # learners 1 and 2 are alive: quorum 2, one counted delivery
  merged, _ = s.tick(4.0, _beats(4.0, 1, 2), [_payload(2, thetas[0], tokens=400)])
  assert len(merged) == 1
  expected = _oracle(g0, [thetas[0], thetas[1], thetas[0]], [400, 200, 400], [4, 2, 4])
  for k in SHAPES:
    np.testing.assert_allclose(merged[0].tensors[k], expected[k], rtol=2e-5, atol=2e-6)


def test_last_learner_leaving_flushes_its_delivery_into_a_round():
  s = _syncer(quorum=1, gamma=1.0)
  g0 = s.global_params()
  beats = [Heartbeat(0, 0, 1, 5.0, 1.0), Heartbeat(1, 0, 1, 5.0, 1.0)]
  theta = _params(3)
  merged, deadline = s.tick(1.0, beats, [_payload(0, theta)])
  assert merged == [] and deadline is not None  # K = 1 reached; the grace window is open
  s.forget(0, 0)
  s.forget(1, 0)  # nobody is left to wait for: the round closes with the flushed delivery
  merged, _ = s.tick(1.1, (), [])
  assert len(merged) == 1
  expected = _oracle(g0, [theta], [400], [4])
  for k in SHAPES:
    np.testing.assert_allclose(merged[0].tensors[k], expected[k], rtol=2e-5, atol=2e-6)
  assert s.pending_keys() == set() and s.alive(1.1) == []


@pytest.mark.parametrize("value, finite", [
    (1.0, True), (3e38, True),  # the sum of squares overflows: the exact check decides
    (np.nan, False), (np.inf, False), (-np.inf, False)])
def test_all_finite_matches_numpy(value, finite):
  x = np.ones((64, 33), np.float32)
  x[17, 5] = value
  assert syncer_lib._all_finite(x) is finite
  assert finite == bool(np.isfinite(x).all())


@pytest.mark.parametrize("without_time", [(0,), (1,), (0, 1)])
def test_a_restart_takes_heartbeats_of_learners_with_no_step_time_yet(without_time):
  """A learner registered before any step time (a restarted incarnation still compiling: its
  heartbeats say 0 s) has no step-time average in the durable state; the restarted syncer's
  next heartbeat of that learner starts one instead of raising (the syncer once crash-looped
  on it after a kill)."""
  s = _syncer()
  beats = [Heartbeat(m, 0, 1, 0.0 if m in without_time else 1.0, 1.0) for m in (0, 1)]
  s.tick(1.0, beats, [])
  state = s.export_state()
  assert {int(m) for m, v in state["step_ema"].items() if v is None} == set(without_time)
  again = _syncer()
  again.restore_state(state, {}, {}, s.rounds)
  again.tick(2.0, [Heartbeat(m, 0, 2, 0.5, 2.0) for m in (0, 1)], [])
  for m in (0, 1):
    want = 0.5 if m in without_time else 0.9 * 1.0 + 0.1 * 0.5  # fresh, or carried on
    assert again.registry[m].step_time == pytest.approx(want)


def _quorum_one_syncer(outer: OuterConfig):
  """K = 1 without grace, one fragment, no sync delay: every delivery closes its own round."""
  return syncer_lib.Syncer(_params(0), fragments.plan_fragments(SHAPES, num_fragments=1),
                           SyncConfig(quorum=1, gamma=0.0), outer, sync_delay_s=0.0)


@pytest.mark.parametrize("restart", [0, 1, 2, 3])
def test_outer_momentum_restarts_every_r_rounds_like_a_numpy_oracle(restart):
  """One learner, K = 1, five rounds: Nesterov whose buffer is zero after rounds R, 2R, ...
  (0: never, optax's sgd with Nesterov)."""
  lr, mu = 0.5, 0.9
  s = _quorum_one_syncer(OuterConfig(learning_rate=lr, momentum=mu, momentum_restart=restart))
  g = {k: v.astype(np.float64) for k, v in s.global_params().items()}
  b = {k: np.zeros_like(v) for k, v in g.items()}
  for r in range(1, 6):
    theta = _params(10 + r)
    merged, _ = s.tick(float(r), _beats(float(r), 0),
                       [_payload(0, theta, base=r - 1, step=4 * r)])
    assert [m.version for m in merged] == [r]
    for k in g:  # one delivery: RDA and the mean are the delivery itself
      grad = g[k] - theta[k]
      b[k] = mu * b[k] + grad
      g[k] = g[k] - lr * (grad + mu * b[k])
      if restart and r % restart == 0:
        b[k] = np.zeros_like(b[k])
      np.testing.assert_allclose(s.params[k], g[k], rtol=1e-4, atol=1e-5)
      np.testing.assert_allclose(s.momentum[k], b[k], rtol=1e-4, atol=1e-5)
  if restart:
    assert all(not s.momentum[k].any() for k in g) == (5 % restart == 0)


@pytest.mark.parametrize("rule", ["paper", "align"])
def test_align_drops_a_stale_deliverys_part_against_the_momentum_like_a_numpy_oracle(rule):
  """K = 1: learner 0 closes round 1 (momentum b = its outer gradient); learner 1 then
  delivers from version 0. Under "align", a tensor whose outer gradient d has d.b < 0 merges
  d - (d.b / b.b) b; one with d.b > 0 merges as under "paper"."""
  lr, mu = 0.5, 0.9
  s = _quorum_one_syncer(OuterConfig(learning_rate=lr, momentum=mu, stale=rule))
  g0 = {k: v.astype(np.float64) for k, v in s.global_params().items()}
  theta0 = _params(1)
  merged, _ = s.tick(1.0, _beats(1.0, 0, 1), [_payload(0, theta0)])
  assert [m.version for m in merged] == [1]
  b = {k: g0[k] - theta0[k] for k in g0}  # mu * 0 + g
  g1 = {k: g0[k] - lr * (b[k] + mu * b[k]) for k in g0}
  rng = np.random.default_rng(7)
  # layers/0: d = -b/2 + noise (against the momentum); layers/1: d = +b/2 + noise (with it).
  sign = {"embedder/embedding": -1.0, "layers/0/w": -1.0, "layers/1/w": 1.0}
  theta1 = {k: (g1[k] - sign[k] * 0.5 * b[k]
                + 0.01 * rng.standard_normal(SHAPES[k])).astype(np.float32) for k in g0}
  merged, _ = s.tick(2.0, (), [_payload(1, theta1, base=0)])
  assert [m.version for m in merged] == [2]
  corrected = 0
  for k in g0:
    d = g1[k] - theta1[k]
    dot = float(np.sum(d * b[k]))
    if rule == "align" and dot < 0:
      d = d - dot / float(np.sum(b[k] * b[k])) * b[k]
      corrected += 1
    assert (dot < 0) == (sign[k] < 0)
    mom = mu * b[k] + d
    np.testing.assert_allclose(s.params[k], g1[k] - lr * (d + mu * mom), rtol=1e-4, atol=1e-5)
  assert corrected == (2 if rule == "align" else 0)


def test_align_leaves_a_tensor_without_momentum_or_along_it_unchanged():
  from diloco.sync import outer_state
  g = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
  np.testing.assert_array_equal(outer_state.align_with_momentum(g.copy(), np.zeros_like(g)), g)
  np.testing.assert_array_equal(outer_state.align_with_momentum(g.copy(), 2 * g), g)
  out = outer_state.align_with_momentum(g.copy(), -g)  # exactly against: nothing is left
  np.testing.assert_allclose(out, np.zeros_like(g), atol=1e-6)
