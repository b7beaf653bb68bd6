"""Options nobody else tests, each against an independent expectation (docs/design.md 2.3, 2.4).

Receipt options (mixing, moment reset, non-blocking rounds) on a real `Learner`; quantised
payloads with and without error feedback sent by real learners through a real `Syncer`,
checked against a NumPy quantiser, a NumPy merge and optax's Nesterov SGD.
"""

import dataclasses
import json
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import runtime_configs

from diloco import fragments
from diloco import transport as transport_lib
from diloco.config import run_config
from diloco.learner import island
from diloco.learner import learner as learner_lib
from diloco.runtime import decoupled
from diloco.sync import syncer as syncer_lib

STEPS = 24  # train.steps: part of the compiled learner (its learning-rate schedule)


def _config(**dotted):
  """`configs/decoupled.py:tiny` with one learner on 2 devices, on the virtual clock, receipt
  overwrite (the options below are checked against that rule; receipt_test.py covers the rest)."""
  return runtime_configs.load(**{"learners__count": 1, "learners__devices": "2",
                            "learners__virtual_clock": True, "train__steps": STEPS,
                            "receipt__mode": "overwrite", **dotted})


def _compiled_key(cfg):
  """What `island.build_learner` compiles from: options outside it share one compilation."""
  return (cfg.model, cfg.optim, cfg.mesh, cfg.train.steps, cfg.train.batch_size,
          cfg.data.seq_len)


@dataclasses.dataclass
class Setup:
  """A compiled learner and what follows from it (fragment plan, version 0 of G)."""
  cfg: run_config.Config
  devices: tuple
  spec: object
  init_fn: object
  step_fn: object
  plan: fragments.FragmentPlan
  g0: dict


@pytest.fixture(scope="module")
def setup():
  """One compiled learner (2 devices) shared by every test of the module."""
  cfg = _config()
  devices = tuple(jax.devices()[:2])
  spec, init_fn, step_fn = island.build_learner(cfg, devices, 0)
  plan = island.fragment_plan(cfg, spec)
  g0 = island.initial_global(init_fn, cfg.seed)
  return Setup(cfg, devices, spec, init_fn, step_fn, plan, g0)


def _transport(s, cfg, cls=transport_lib.InMemoryTransport):
  """A transport holding version 0 of every fragment, as the runtime publishes it."""
  transport = cls()
  for merged in syncer_lib.Syncer(s.g0, s.plan, cfg.sync, cfg.outer).initial(0.0):
    transport.publish(merged)
  return transport


def _learner(s, cfg, transport, learner_id=0, num_groups=1, background_io=False):
  """A real learner that joined: it loaded the published fragments (docs/design.md 2.5)."""
  learner = learner_lib.Learner(
      learner_id=learner_id, incarnation=0, num_groups=num_groups, cfg=cfg, spec=s.spec,
      init_fn=s.init_fn, step_fn=s.step_fn, plan=s.plan, transport=transport,
      resume=learner_lib.Resume(), background_io=background_io)
  learner.load_global()
  return learner


def _publish(transport, p, version, tensors):
  """Publishes version `version` of fragment p (a copy of the current Merged with new fields)."""
  merged = dataclasses.replace(transport.latest(p), version=version, tensors=tensors)
  transport.publish(merged)
  return merged


def _random_fragment(s, p, seed):
  """Values for a published fragment, far from anything a learner holds."""
  rng = np.random.default_rng(seed)
  return {k: rng.standard_normal(s.g0[k].shape).astype(np.float32) for k in s.plan.fragments[p]}


def _delivered(steps, cfg):
  """Fragments delivered within local steps 1..steps (closed form of the 2.2 schedule)."""
  h, num = cfg.sync.period, cfg.sync.num_fragments
  return {p for t in range(1, steps + 1) for p in range(num) if t % h == p * h // num}


def _tokens_per_step(cfg):
  return cfg.train.batch_size * cfg.data.seq_len


def test_a_restarted_learner_goes_on_at_its_steps_learning_rate(setup):
  # A restart gives fresh AdamW state (docs/design.md 2.5); the schedule must not warm up again.
  learner = learner_lib.Learner(
      learner_id=0, incarnation=1, num_groups=1, cfg=setup.cfg, spec=setup.spec,
      init_fn=setup.init_fn, step_fn=setup.step_fn, plan=setup.plan,
      transport=_transport(setup, setup.cfg), resume=learner_lib.Resume(local_step=7),
      background_io=False)
  kinds = (optax.ScaleByScheduleState, optax.ScaleByAdamState)
  counts = [(type(s).__name__, int(s.count)) for s in jax.tree.leaves(
      learner.state["opt_state"], is_leaf=lambda s: isinstance(s, kinds)) if isinstance(s, kinds)]
  assert sorted(counts) == [("ScaleByAdamState", 0), ("ScaleByScheduleState", 7)]
  assert int(learner.state["step"]) == 7
  learner.close()


# receipt.mixing_alpha and receipt.reset_moments (docs/design.md 2.3, receipt).


def test_mixing_alpha_mixes_only_the_received_fragment(setup):
  alpha = 0.3
  cfg = _config(receipt__mode="mix", receipt__mixing_alpha=alpha)
  transport = _transport(setup, cfg)
  learner = _learner(setup, cfg, transport)
  for _ in range(3):
    learner.step(0.0, 1.0)
    learner.sync_point()  # nothing newer than version 0 is published: nothing changes
  p = next(p for p in range(setup.plan.num_fragments) if p not in _delivered(3, cfg)
           and len(setup.plan.fragments[p]) > 1)
  before = learner.params_flat()
  published = _random_fragment(setup, p, seed=1)
  _publish(transport, p, 1, published)
  assert p not in learner.sync_point()
  after = learner.params_flat()
  for k, v in after.items():
    if k in published:
      expected = np.float32(alpha) * before[k] + np.float32(1 - alpha) * published[k]
      np.testing.assert_allclose(v, expected, rtol=1e-6, atol=1e-7, err_msg=k)
      assert not np.allclose(v, published[k])  # mixed, not overwritten
    else:
      np.testing.assert_array_equal(v, before[k], err_msg=k)
  assert learner.base == [1 if q == p else 0 for q in range(setup.plan.num_fragments)]
  assert learner.steps[p] == 0 and learner.tokens[p] == 0
  others = [q for q in range(setup.plan.num_fragments) if q != p]
  assert all(learner.steps[q] == 3 for q in others)
  assert all(learner.tokens[q] == 3 * _tokens_per_step(cfg) for q in others)
  learner.step(0.0, 1.0)  # the compiled step accepts the mixed state
  learner.read_metrics()  # raises on non-finite values


def test_joining_learner_loads_the_published_fragments_despite_mixing(setup):
  # docs/design.md 2.5: a learner that joins or rejoins first loads the latest published global
  # fragments. Mixing is a receipt rule for a learner that trained; on a fresh init it would
  # start Streaming DiLoCo (alpha = 0.5) learners half from noise.
  cfg = _config(receipt__mode="mix", receipt__mixing_alpha=0.5)
  learner = _learner(setup, cfg, _transport(setup, cfg))
  params = learner.params_flat()
  for k, v in setup.g0.items():
    np.testing.assert_array_equal(params[k], v, err_msg=k)


def _adam_moments(state):
  """(mu, nu) of the AdamW state as flat host arrays (found by type, not by position)."""
  nodes = [n for n in jax.tree.leaves(state["opt_state"],
                                      is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))
           if isinstance(n, optax.ScaleByAdamState)]
  assert len(nodes) == 1
  mu, nu = jax.device_get((nodes[0].mu, nodes[0].nu))
  return ({k: np.asarray(v) for k, v in fragments.flatten_tree(mu).items()},
          {k: np.asarray(v) for k, v in fragments.flatten_tree(nu).items()})


@pytest.mark.parametrize("reset", [True, False])
def test_reset_moments_zeroes_exactly_the_received_fragment(setup, reset):
  cfg = _config(receipt__reset_moments=reset)
  transport = _transport(setup, cfg)
  learner = _learner(setup, cfg, transport)
  for _ in range(3):
    learner.step(0.0, 1.0)
    learner.sync_point()
  p = next(p for p in range(setup.plan.num_fragments) if p not in _delivered(3, cfg)
           and len(setup.plan.fragments[p]) > 1)
  mu0, nu0 = _adam_moments(learner.state)
  assert all(np.any(mu0[k] != 0) and np.any(nu0[k] != 0) for k in setup.plan.fragments[p])
  published = _random_fragment(setup, p, seed=2)
  _publish(transport, p, 1, published)
  assert p not in learner.sync_point()
  mu1, nu1 = _adam_moments(learner.state)
  assert mu1.keys() == mu0.keys() == setup.g0.keys()
  for k in mu0:
    if reset and k in published:
      assert not np.any(mu1[k]) and not np.any(nu1[k]), k
    else:
      np.testing.assert_array_equal(mu1[k], mu0[k], err_msg=k)
      np.testing.assert_array_equal(nu1[k], nu0[k], err_msg=k)
  params = learner.params_flat()
  for k, v in published.items():  # alpha = 0: overwritten whatever happens to the moments
    np.testing.assert_array_equal(params[k], v)
  learner.step(0.0, 1.0)  # the compiled step accepts the reset state
  learner.read_metrics()  # raises on non-finite values


# sync.block_on_late_round (docs/design.md 2.3, bounded overlap).


@pytest.mark.parametrize("block", [True, False])
def test_late_round_blocks_only_when_asked(setup, block):
  cfg = _config(sync__block_on_late_round=block)
  tau = cfg.sync.tau
  transport = _transport(setup, cfg)
  learner = _learner(setup, cfg, transport)
  learner.step(0.0, 1.0)  # local step 1 delivers the fragment at offset 1
  (p,) = [q for q in range(setup.plan.num_fragments) if q in _delivered(1, cfg)]
  assert learner.sync_point() == []
  for t in range(2, tau + 3):  # delivered at step 1: late at 1 + tau, and one step more
    learner.step(0.0, 1.0)
    own = learner.params_flat()
    blocked = learner.sync_point()
    assert blocked == ([p] if block and t == 1 + tau else [])
    if blocked:
      break  # a blocking learner does not step on; the runtime makes it wait here
    after = learner.params_flat()
    for k in setup.plan.fragments[p]:
      np.testing.assert_array_equal(after[k], own[k])  # keeps its own values
    assert learner.base[p] == 0 and learner.steps[p] == t
  published = _random_fragment(setup, p, seed=3)
  _publish(transport, p, 1, published)
  assert learner.sync_point() == []
  after = learner.params_flat()
  for k, v in published.items():
    np.testing.assert_array_equal(after[k], v)
  assert learner.base[p] == 1 and learner.steps[p] == 0 and learner.tokens[p] == 0


@pytest.fixture
def reuse_compiled(setup, monkeypatch):
  """Lets the runtime reuse the module's compiled learner for the same devices and config."""
  build = island.build_learner

  def cached(cfg, devices, index):
    if tuple(devices) == setup.devices and _compiled_key(cfg) == _compiled_key(setup.cfg):
      return setup.spec, setup.init_fn, setup.step_fn
    return build(cfg, devices, index)

  monkeypatch.setattr(island, "build_learner", cached)


@pytest.mark.slow
@pytest.mark.parametrize("block", [True, False])
def test_runtime_waits_for_late_rounds_only_when_blocking(tmp_path, reuse_compiled, block):
  # Rounds are published virtual_sync_s = 5 s after they close, later than t + tau = 2 steps.
  cfg = _config(learners__virtual_sync_s=5.0, sync__quorum=1, sync__gamma=0.0,
                sync__block_on_late_round=block)
  rt, _ = decoupled.run_with_runtime(cfg, str(tmp_path))
  with open(os.path.join(tmp_path, "activity.jsonl")) as f:
    spans = [json.loads(line) for line in f]
  # After its last step a finishing learner waits for the rounds of the deliveries it stepped
  # past, whatever the option (the final sync delivers each step once); before it, only a
  # blocking learner waits.
  last_step_end = max(s["end"] for s in spans if s["kind"] == "step")
  waits = [s for s in spans if s["kind"] == "wait" and s["start"] < last_step_end]
  assert bool(waits) == block
  assert sum(s["kind"] == "step" for s in spans) == cfg.train.steps
  assert rt.slots[0].status == "done"
  tape = rt.recorder.tape()
  assert tape
  # Merged results were applied: later deliveries build on published versions.
  assert max(a["base_version"] for r in tape for a in r["admitted"]) >= 1


# Quantised payloads with and without error feedback (docs/design.md 2.4).


def _quantize_oracle(x, bits, block):
  """Symmetric max-abs quantisation per block of the flattened tensor (tail zero-padded).

  Returns (codes as int8 per element, float32 scale per block).
  """
  qmax = 2 ** (bits - 1) - 1
  flat = np.asarray(x, np.float32).reshape(-1)
  padded = np.zeros(-(-flat.size // block) * block, np.float32)
  padded[:flat.size] = flat
  blocks = padded.reshape(-1, block)
  scales = (np.abs(blocks).max(axis=1) / np.float32(qmax)).astype(np.float32)
  codes = np.zeros_like(blocks)
  nz = scales > 0
  codes[nz] = np.rint(blocks[nz] / scales[nz, None])
  return np.clip(codes, -qmax, qmax).astype(np.int8).reshape(-1), scales


def _codes(q):
  """The int8 codes of a QuantizedTensor (int4: two per byte, low nibble first)."""
  if q.bits == 8:
    return np.asarray(q.values, np.int8)
  b = np.asarray(q.values, np.uint8)
  nibbles = np.stack([b & 0x0F, b >> 4], axis=1).reshape(-1).astype(np.int8)
  return np.where(nibbles >= 8, nibbles - 16, nibbles).astype(np.int8)


def _dequantize_oracle(q):
  size = int(np.prod(q.shape))
  codes = _codes(q)[:q.scales.size * q.block].reshape(-1, q.block)
  values = codes.astype(np.float32) * np.asarray(q.scales, np.float32)[:, None]
  return values.reshape(-1)[:size].reshape(q.shape)


@dataclasses.dataclass
class _Sent:
  """A captured delivery with the parameters its learner had when it made it."""
  learner: int
  payload: object
  theta: dict  # the learner's parameters of the fragment when it delivered


def _quantised_run(s, cfg, iterations):
  """Two real learners (the second steps every other tick) and a syncer, driven by hand.

  Payloads are read from the transport before the syncer takes them; the syncer polls every
  third tick, so deliveries of both learners meet in rounds, and a learner may deliver from
  a version that a round has meanwhile replaced (the syncer then re-anchors its delta).
  """
  rounds = []
  syncer = syncer_lib.Syncer(s.g0, s.plan, cfg.sync, cfg.outer, sync_delay_s=0.0,
                             on_round=rounds.append)
  transport = transport_lib.InMemoryTransport()
  published = {}
  for merged in syncer.initial(0.0):
    transport.publish(merged)
    published[(merged.fragment, merged.version)] = merged.tensors
  learners = [_learner(s, cfg, transport, learner_id=m, num_groups=2) for m in range(2)]
  deliveries, beats, payloads = [], [], []
  for i in range(1, iterations + 1):
    stepped = [m for m in range(2) if i % (m + 1) == 0]
    for m in stepped:
      learners[m].step(float(i), 1.0)
      new_beats, new_payloads, _ = transport.take()
      theta = learners[m].params_flat()
      for payload in new_payloads:
        deliveries.append(_Sent(m, payload, {k: theta[k] for k in payload.tensors}))
      beats += new_beats
      payloads += new_payloads
    if i % 3 == 0:
      merged, _ = syncer.tick(float(i), beats, payloads)
      beats, payloads = [], []
      for mg in merged:
        transport.publish(mg)
        published[(mg.fragment, mg.version)] = mg.tensors
    for m in stepped:
      learners[m].sync_point()
  for learner in learners:
    learner.close()
  assert not syncer.rejections
  return deliveries, rounds, published


def _check_payloads(s, cfg, deliveries, published):
  """(a) each payload is the oracle quantisation of `G_base - theta` (+ the residual);
  (b) with feedback, what was sent tracks what was meant to within half a quantisation step.

  Returns the per-block error bound violations of the cumulative sums (for the no-feedback
  contrast).
  """
  bits, block = cfg.outer.quantize_bits, cfg.outer.quantize_block
  feedback = cfg.outer.error_feedback
  residual, meant, sent = {}, {}, {}
  violations = 0
  for d in deliveries:
    payload = d.payload
    assert payload.kind == "delta"
    p = payload.fragment
    assert set(payload.tensors) == set(s.plan.fragments[p])
    base = published[(p, payload.base_version)]
    for k, q in payload.tensors.items():
      key = (d.learner, k)
      assert (q.bits, q.block, tuple(q.shape), q.dtype) == (bits, block, s.g0[k].shape,
                                                            "float32")
      delta = base[k] - d.theta[k]
      target = delta + residual[key] if feedback and key in residual else delta
      codes, scales = _quantize_oracle(target, bits, block)
      np.testing.assert_array_equal(np.asarray(q.scales), scales, err_msg=k)
      np.testing.assert_array_equal(_codes(q)[:codes.size], codes, err_msg=k)
      sent_now = _dequantize_oracle(q)
      if feedback:
        residual[key] = target - sent_now  # the learner's, as its next payload's codes prove
      meant[key] = meant.get(key, 0.0) + delta.astype(np.float64)
      sent[key] = sent.get(key, 0.0) + sent_now.astype(np.float64)
      if feedback:  # (b) summed over deliveries: sent + last residual = meant
        np.testing.assert_allclose(sent[key] + residual[key], meant[key], rtol=0,
                                   atol=1e-6 * np.abs(meant[key]).max(), err_msg=k)
      # Telescoping: sum(delta) - sum(sent) is the last residual, within half a step.
      err = np.zeros(scales.size * block)
      err[:delta.size] = np.abs(meant[key] - sent[key]).reshape(-1)
      bound = scales.astype(np.float64)[:, None] / 2 + 1e-6 * np.abs(meant[key]).max()
      bad = np.any(err.reshape(-1, block) > bound, axis=1)
      violations += int(bad.sum())
      if feedback:
        assert not bad.any(), (k, err.max())
  return violations


def _merge_oracle(deltas, weights, embedding, method):
  """Weighted mean (embedding or merge=mean) or radial-directional averaging, float64."""
  mean = sum(w * d for w, d in zip(weights, deltas))
  if method == "mean" or embedding:
    return mean
  norms = [np.linalg.norm(d) for d in deltas]
  direction = sum(w * d / n for w, d, n in zip(weights, deltas, norms) if n > 0)
  length = np.linalg.norm(direction)
  if length <= 1e-4 * sum(w for w, n in zip(weights, norms) if n > 0):
    return mean
  return sum(w * n for w, n in zip(weights, norms)) * direction / length


def _check_rounds(s, cfg, deliveries, rounds, published):
  """(c) every published version equals a NumPy merge of re-anchored dequantised deltas,
  weighted by tokens**2 / steps, followed by optax's Nesterov SGD (own G and momentum)."""
  tx = optax.sgd(cfg.outer.learning_rate, momentum=cfg.outer.momentum, nesterov=True)
  g = {p: {k: jnp.asarray(s.g0[k]) for k in s.plan.fragments[p]}
       for p in range(s.plan.num_fragments)}
  history = {(p, 0): {k: np.asarray(v, np.float64) for k, v in g[p].items()} for p in g}
  opt = {p: tx.init(g[p]) for p in g}
  by_key = {(d.learner, d.payload.fragment, d.payload.local_step): d for d in deliveries}
  joint = rebased = 0
  for record in rounds:
    p, version = record["fragment"], record["version"]
    admitted = [by_key[(a["learner"], p, a["local_step"])] for a in record["admitted"]]
    now = {k: np.asarray(v, np.float64) for k, v in g[p].items()}
    tokens = np.array([d.payload.tokens for d in admitted], np.float64)
    steps = np.array([d.payload.steps for d in admitted], np.float64)
    weights = tokens ** 2 / steps
    weights /= weights.sum()
    deltas = []
    for d in admitted:
      base = history[(p, d.payload.base_version)]
      rebased += d.payload.base_version != version - 1
      deltas.append({k: now[k] - base[k] + _dequantize_oracle(q).astype(np.float64)
                     for k, q in d.payload.tensors.items()})
    joint += len(admitted) > 1 and len(set(weights.tolist())) > 1
    grad = {k: jnp.asarray(_merge_oracle([d[k] for d in deltas], weights,
                                         s.plan.is_embedding(k), cfg.outer.merge), jnp.float32)
            for k in now}
    updates, opt[p] = tx.update(grad, opt[p], g[p])
    g[p] = optax.apply_updates(g[p], updates)
    history[(p, version)] = {k: np.asarray(v, np.float64) for k, v in g[p].items()}
    for k, v in g[p].items():
      step = np.abs(np.asarray(updates[k])).max()
      np.testing.assert_allclose(published[(p, version)][k], np.asarray(v), rtol=0,
                                 atol=1e-4 * step + 1e-6, err_msg=f"{k} v{version}")
  return joint, rebased


@pytest.mark.slow
@pytest.mark.parametrize("bits, feedback, merge", [
    (8, True, "mean"), (4, True, "rda"), (8, False, "rda"), (4, False, "mean")])
def test_quantised_payloads_through_the_syncer(setup, bits, feedback, merge):
  cfg = _config(outer__quantize_bits=bits, outer__error_feedback=feedback, outer__merge=merge,
                sync__gamma=0.0)
  deliveries, rounds, published = _quantised_run(setup, cfg, iterations=30)
  per_learner = [sum(d.learner == m for d in deliveries) for m in range(2)]
  assert min(per_learner) >= setup.plan.num_fragments  # several deliveries per tensor
  violations = _check_payloads(setup, cfg, deliveries, published)
  if not feedback:
    assert violations > 0  # without feedback the rounding errors accumulate
  joint, rebased = _check_rounds(setup, cfg, deliveries, rounds, published)
  # The scenario exercises what the oracle models: weighted merges of two learners, and
  # deltas from a replaced version re-anchored on the current G.
  assert joint > 0 and rebased > 0, (joint, rebased)


class _HoldFirstDelivery(transport_lib.InMemoryTransport):
  """Holds the first delivery until `release` is set: the learner's I/O thread falls behind."""

  def __init__(self):
    super().__init__()
    self.release = threading.Event()
    self._held = False

  def deliver(self, payload):
    if not self._held:
      self._held = True
      self.release.wait(timeout=120)  # a guard against a hang, not a timing assumption
    super().deliver(payload)


def test_background_delta_is_taken_from_the_base_it_names(setup):
  # The threaded runtime sends on a background thread. If that thread is tau steps behind
  # (slow host copy or link), the round of the delivery is applied before its delta is made.
  cfg = _config(outer__quantize_bits=8)
  transport = _transport(setup, cfg, cls=_HoldFirstDelivery)
  learner = _learner(setup, cfg, transport, background_io=True)
  try:
    learner.step(0.0, 1.0)  # delivers the fragment at offset 1; its send is held
    learner.step(0.0, 1.0)  # delivers the fragment at offset 2 from version 0
    (p,) = _delivered(2, cfg) - _delivered(1, cfg)
    theta = learner.params_flat()
    for _ in range(cfg.sync.tau):
      learner.sync_point()
      learner.step(0.0, 1.0)
    _publish(transport, p, 1, _random_fragment(setup, p, seed=4))
    learner.sync_point()  # t + tau: version 1 of p is applied
    assert learner.base[p] == 1
  finally:
    transport.release.set()
    learner.close()
  _, payloads, _ = transport.take()
  (payload,) = [x for x in payloads if x.fragment == p]
  assert payload.kind == "delta" and payload.base_version == 0
  for k, q in payload.tensors.items():
    np.testing.assert_allclose(_dequantize_oracle(q), setup.g0[k] - theta[k], rtol=0,
                               atol=np.max(q.scales) / 2 * 1.001 + 1e-7, err_msg=k)


# sync.send_queue: backpressure instead of an unbounded queue of deliveries.


def test_send_queue_makes_the_next_delivery_wait_for_the_oldest(setup):
  cfg = _config(sync__send_queue=1)
  transport = _transport(setup, cfg, cls=_HoldFirstDelivery)
  learner = _learner(setup, cfg, transport, background_io=True)
  released_before_return = []
  try:
    learner.step(0.0, 1.0)  # delivers; the I/O thread holds that send: one on its way
    assert learner.send_wait_s == 0.0
    threading.Timer(0.5, transport.release.set).start()
    learner.step(0.0, 1.0)  # delivers again: waits for the held send first
    released_before_return.append(transport.release.is_set())
  finally:
    transport.release.set()
    learner.close()
  assert released_before_return == [True]
  assert learner.send_wait_s > 0.0
  _, payloads, _ = transport.take()
  assert [p.local_step for p in payloads] == [1, 2]  # both sent, in order: nothing dropped


def test_send_queue_is_validated():
  with pytest.raises(run_config.ConfigError, match="sync.send_queue"):
    _config(sync__send_queue=0)
