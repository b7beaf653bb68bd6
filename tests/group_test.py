"""S syncer shards in one process (diloco/sync/group.py) against one syncer: the same G.

One scripted run of heartbeats and deliveries (several learners and fragments, stale
deliveries, rejected ones, a learner that leaves after its final-sync deliveries) is fed to a
plain `Syncer` and to groups of S = 1, 2, 3 shards; with gamma = 0 (windows of 0) or K = M
(rounds close when all delivered) the shards' per-shard EMAs decide nothing, so every tick
publishes bit-identical fragments. With grace on, each shard's windows follow its own EMAs
(docs/design.md 3.1): G may differ, but every fragment still closes as many rounds.
"""

import collections
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco import fragments
from diloco.delivery import Delivery
from diloco.errors import ConfigError
from diloco.outer.merge import OuterConfig
from diloco.sync import group as syncer_group
from diloco.sync import intake, ownership, policy
from diloco.sync import syncer as syncer_lib
from diloco.sync.policy import SyncConfig
from diloco.transport import Heartbeat

SHAPES = {"embedder/embedding": (12, 4), "layers/0/w": (4, 8), "layers/0/b": (8,),
          "layers/1/w": (8, 4), "layers/1/b": (4,), "head/w": (4, 6)}
P = 6
LEARNERS = 3


def _plan():
  return fragments.plan_fragments(SHAPES, num_fragments=P, scheme="tensor")


def _g0():
  rng = np.random.default_rng(0)
  return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _sync(**overrides):
  return SyncConfig(**{"num_fragments": P, "period": P, "tau": 1, "quorum": 2, "gamma": 0.0,
                       "heartbeat_timeout_s": 5.0, "max_staleness": 3, **overrides})


def _script(plan, versions_of, steps=14):
  """Yields (now, beats, payloads, left) ticks; `versions_of()` gives the reference syncer's
  current versions (the bases learners would have loaded)."""
  rng = np.random.default_rng(1)
  local = [0] * LEARNERS
  g = _g0()
  for t in range(1, steps + 1):
    now = float(t)
    live = [m for m in range(LEARNERS) if not (m == 2 and t > 8)]
    beats = [Heartbeat(learner=m, incarnation=0, local_step=local[m], step_time=1.0 + 0.1 * m,
                       time=now) for m in live]
    payloads, left = [], []
    versions = versions_of()
    for m in live:
      local[m] += 1
      p = (t + m) % P
      base = versions[p]
      if m == 1 and t % 4 == 0 and base > 0:
        base -= 1  # a stale delivery (within max_staleness)
      if m == 0 and t == 5:
        base = versions[p] + 3  # from the future: rejected
      final = m == 2 and t == 8
      frags = range(P) if final else [p]
      for q in frags:
        tensors = {k: g[k] + rng.standard_normal(g[k].shape).astype(np.float32) * 0.1
                   for k in plan.fragments[q]}
        payloads.append(Delivery(
            learner=m, incarnation=0, fragment=q, local_step=local[m], steps=1, tokens=64,
            base_version=base if q == p else versions[q], kind="values", tensors=tensors,
            transit_s=0.01 * (m + 1), lead_s=0.02, final=final))
    if t == 6:  # a delivery naming no fragment: shard 0 rejects it
      payloads.append(Delivery(learner=1, incarnation=0, fragment=P + 4, local_step=local[1],
                               steps=1, tokens=64, base_version=0, kind="values", tensors={},
                               transit_s=0.0))
    if t == 9:
      left.append((2, 0))
    yield now, beats, payloads, left


def _build(shards, sync, tape=None):
  """A plain `Syncer` (shards None) or a group of `shards` shards, taping into `tape`."""
  on_round = None if tape is None else tape.append
  if shards is None:
    return syncer_lib.Syncer(_g0(), _plan(), sync, OuterConfig(), sync_delay_s=0.25,
                             on_round=on_round)
  return syncer_group.SyncerGroup(_g0(), _plan(), dataclasses.replace(sync, shards=shards),
                                  OuterConfig(), sync_delay_s=0.25, on_round=on_round)


def _run(syncers, script_steps=14):
  """Feeds the same script to every syncer; the per-tick outputs of each."""
  reference = syncers[0]
  outputs = [[] for _ in syncers]
  for now, beats, payloads, left in _script(_plan(), lambda: list(reference.versions),
                                            script_steps):
    for s, out in zip(syncers, outputs):
      merged, deadline = s.tick(now, beats, payloads, left)
      out.append((merged, deadline, list(s.versions), s.global_params(), s.rounds))
  # After the last tick, let the final rounds time out.
  for s, out in zip(syncers, outputs):
    merged, deadline = s.tick(100.0)
    out.append((merged, deadline, list(s.versions), s.global_params(), s.rounds))
  return outputs


def _assert_same(a, b):
  (merged_a, deadline_a, versions_a, g_a, rounds_a) = a
  (merged_b, deadline_b, versions_b, g_b, rounds_b) = b
  assert versions_a == versions_b and rounds_a == rounds_b and deadline_a == deadline_b
  assert [(m.fragment, m.version, m.published_at) for m in merged_a] == [
      (m.fragment, m.version, m.published_at) for m in merged_b]
  for ma, mb in zip(merged_a, merged_b):
    assert all(np.array_equal(ma.tensors[k], mb.tensors[k]) for k in ma.tensors)
  assert g_a.keys() == g_b.keys()
  assert all(np.array_equal(g_a[k], g_b[k]) for k in g_a)


@pytest.mark.parametrize("sync", [_sync(), _sync(quorum=0)], ids=["gamma0_K2", "K_eq_M"])
def test_shards_publish_the_same_g_as_one_syncer_bit_for_bit(sync):
  tapes = [[] for _ in range(4)]
  syncers = [_build(None, sync, tapes[0])] + [_build(s, sync, tapes[1 + i])
                                              for i, s in enumerate((1, 2, 3))]
  outputs = _run(syncers)
  for other in outputs[1:]:
    for a, b in zip(outputs[0], other):
      _assert_same(a, b)
  plain = syncers[0]
  assert min(plain.versions) >= 1 and sum(plain.versions) > P  # not a trivial script
  reasons = collections.Counter(r["reason"] for r in tapes[0])
  assert reasons["final_all_delivered"] + reasons["final_timeout"] >= 1
  assert max(a["staleness"] for r in tapes[0] for a in r["admitted"]) >= 1
  for s in syncers[1:]:
    assert s.rejections == plain.rejections  # rejected once, however many shards
  # The base from the future and the delivery naming no fragment.
  assert plain.rejections[policy.REJECT_UNKNOWN_LINEAGE] == 1
  assert plain.rejections[intake.REJECT_BAD_PAYLOAD] == 1
  for tape, group in zip(tapes[1:], syncers[1:]):
    # The tape reads as one syncer's: rounds numbered run-wide, each tagged with its owner.
    assert [r["round"] for r in tape] == list(range(len(tape)))
    assert [(r["fragment"], r["version"]) for r in tape] == [
        (r["fragment"], r["version"]) for r in tapes[0]]
    assert all(r["shard"] == group.assignment[r["fragment"]] for r in tape)
    assert {r["shard"] for r in tape} == set(range(group.num_shards))
    per_shard = collections.Counter(r["shard"] for r in tape)
    assert [per_shard[s] for s in range(group.num_shards)] == [sh.rounds for sh in group.shards]
    rejected = sum(len(r["rejected"]) for r in tape)
    assert rejected == sum(len(r["rejected"]) for r in tapes[0])


def test_with_grace_each_shard_keeps_its_own_emas_but_merges_every_fragment():
  """gamma > 0: a shard's grace windows follow its own quorum/sync/lead EMAs, so G may differ
  from one syncer's (by design); every fragment still closes the same number of rounds."""
  sync = _sync(gamma=0.8, tau=2)
  syncers = [_build(None, sync), _build(2, sync), _build(3, sync)]
  outputs = _run(syncers, script_steps=14)
  final_versions = [out[-1][2] for out in outputs]
  assert final_versions[1] == final_versions[0] and final_versions[2] == final_versions[0]
  assert all(s.settled() for s in syncers)


def test_routing_state_and_checkpoint_state_round_trip():
  sync = _sync()
  group = _build(2, sync)
  owner = ownership.assign(_plan().num_elements, 2)
  assert group.assignment == owner
  for p in range(P):
    assert set(group.fragment_values(p)) == set(_plan().fragments[p])
    assert set(group.shards[owner[p]].params) >= set(_plan().fragments[p])
    assert group.owner(p) == owner[p]
  assert group.owner(P) == group.owner(-1) == group.owner("0") == 0  # shard 0 rejects those
  _run([group], script_steps=10)
  states = group.export_states()
  assert len(states) == 2 and sum(s["rounds"] for s in states) == group.rounds
  fresh = _build(2, sync)
  plan = _plan()
  versions = group.versions
  frags = {p: (versions[p], {k: group.params[k] for k in plan.fragments[p]},
               {k: group.momentum[k] for k in plan.fragments[p]}) for p in range(P)}
  fresh.restore_states(states, frags, {})
  assert fresh.versions == group.versions and fresh.rounds == group.rounds
  assert all(np.array_equal(fresh.global_params()[k], group.global_params()[k]) for k in SHAPES)
  with pytest.raises(ConfigError, match="sync.shards"):
    _build(3, sync).restore_states(states, frags, {})


def test_a_bad_heartbeat_is_counted_once():
  group = _build(3, _sync())
  bad = Heartbeat(learner=0, incarnation=0, local_step=1, step_time=1.0, time=float("nan"))
  group.tick(1.0, [bad])
  assert group.rejections[intake.REJECT_BAD_HEARTBEAT] == 1


@settings(max_examples=60, deadline=None)
@given(fragment=st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                          st.text(max_size=3), st.none(), st.booleans()),
       shards=st.integers(1, 3))
def test_any_fragment_field_is_routed_and_rejected_once_or_merged_never_raising(fragment,
                                                                                 shards):
  """The class of a delivery's `fragment` field (any int, huge, negative, float, text, None,
  bool): a valid index reaches its owner only; anything else goes to shard 0, which rejects it
  once. Nothing raises out of `tick`, and no G changes unless the fragment is a real one."""
  group = _build(shards, _sync(quorum=1))
  plan, g0 = _plan(), _g0()
  valid = type(fragment) is int and 0 <= fragment < P  # noqa: E721  (bool is not an index)
  tensors = ({k: g0[k] + 1.0 for k in plan.fragments[fragment]} if valid else
             {k: g0[k] + 1.0 for k in plan.fragments[0]})
  delivery = Delivery(learner=0, incarnation=0, fragment=fragment, local_step=1, steps=1,
                      tokens=64, base_version=0, kind="values", tensors=tensors)
  merged, _ = group.tick(1.0, [Heartbeat(0, 0, 1, 0.1, 1.0)], [delivery])
  rejected = sum(sum(shard.rejections.values()) for shard in group.shards)
  if valid:
    assert [m.fragment for m in merged] == [fragment] and rejected == 0
    assert group.versions == [int(p == fragment) for p in range(P)]
  else:
    assert merged == [] and rejected == 1 and group.versions == [0] * P
    assert sum(group.shards[0].rejections.values()) == 1
    assert all(np.array_equal(v, g0[k]) for k, v in group.global_params().items())
