"""The trust boundary against well-typed input: no learner, file or clock steers G, merges
twice, or stalls the syncer (docs/design.md 2.4; docs/decisions/store_and_trust.md).

Each case crafts one delivery, heartbeat or store entry against the real `Syncer`, `Store`,
`SyncerStoreLink`, `sync_once`/`recover` and `Lease`, and checks what G, the counters and the
store hold afterwards.
"""

import io
import json
import math
import os
import shutil
import threading
import time

import numpy as np
import pytest

from diloco import fragments
from diloco.delivery import Delivery
from diloco.distributed import hosts as hosts_lib
from diloco.distributed import syncer_process
from diloco.distributed.learner_link import LearnerStoreLink
from diloco.distributed.store import Store, blob_io, global_view
from diloco.distributed.store.entry_check import StoreError
from diloco.distributed.store.lease import Lease, LeaseHeld
from diloco.distributed.store.names import NON_FINITE
from diloco.distributed.syncer_link import SyncerStoreLink
from diloco.observe import fidelity
from diloco.outer.merge import OuterConfig
from diloco.sync import intake, policy, rejections
from diloco.sync import syncer as syncer_lib
from diloco.sync.policy import SyncConfig
from diloco.transport import Heartbeat, Merged

SHAPES = {"embedder/embedding": (6, 4), "layers/0/w": (4, 4), "layers/1/w": (4, 3)}
PLAN = fragments.plan_fragments(SHAPES, num_fragments=1)
EXPECTED = {0: dict(SHAPES)}
TOKENS_PER_STEP = 100
LIMITS = intake.Limits(tokens_per_step=TOKENS_PER_STEP, max_learners=4)


def _params(seed):
  rng = np.random.default_rng(seed)
  return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _syncer(quorum=1, limits=LIMITS, timeout=30.0, **sync):
  records = []
  cfg = SyncConfig(quorum=quorum, gamma=0.0, heartbeat_timeout_s=timeout, **sync)
  s = syncer_lib.Syncer(_params(0), PLAN, cfg, OuterConfig(), sync_delay_s=0.0,
                        on_round=records.append, limits=limits)
  return s, records


def _delivery(learner=0, step=4, incarnation=0, **fields):
  base = {"learner": learner, "incarnation": incarnation, "fragment": 0, "local_step": step,
          "steps": 4, "tokens": 4 * TOKENS_PER_STEP, "base_version": 0, "kind": "values",
          "tensors": _params(10 + step), "transit_s": 0.01, "lead_s": 0.0}
  return Delivery(**dict(base, **fields))


def _beat(now, learner=0, incarnation=0, step_time=1.0, time=None):
  return Heartbeat(learner, incarnation, 1, step_time, now if time is None else time)


def _reasons(records):
  return [r["reason"] for rec in records for r in rec["rejected"]]


def _unchanged(s, before):
  return all(np.array_equal(s.params[k], before[k]) for k in before)


# 1. Weights are earned, not claimed.
@pytest.mark.parametrize("fields, reason", [
    ({"steps": 1, "tokens": 2**53, "local_step": 4}, "unearned"),
    ({"steps": 4, "tokens": 4 * TOKENS_PER_STEP + 1}, "unearned"),
    ({"steps": 40, "tokens": 40 * TOKENS_PER_STEP, "local_step": 4}, "unearned"),
    ({"learner": 4}, "learner_out_of_range"),
    ({"learner": 10**6}, "learner_out_of_range"),
])
def test_a_delivery_cannot_claim_weight_its_counters_did_not_earn(fields, reason):
  s, records = _syncer()
  s.tick(0.0, [_beat(0.0, m) for m in range(4)] + [_beat(0.0, 10**6)], ())
  before = s.global_params()
  merged, _ = s.tick(1.0, [_beat(1.0)], [_delivery(**fields)])
  assert merged == [] and s.rejections[reason] == 1 and _unchanged(s, before)
  merged, _ = s.tick(2.0, [_beat(2.0)], [_delivery(step=8)])
  assert [m.version for m in merged] == [1] and reason in _reasons(records)


def test_an_honest_delivery_at_the_limit_merges_with_its_token_weight():
  """tokens == steps x tokens_per_step is what an honest learner sends: it merges with its
  weight tokens^2/steps (40000 against 20000 for a delivery of half the steps)."""
  s, records = _syncer(quorum=2)
  s.tick(0.0, [_beat(0.0, 0), _beat(0.0, 1)], ())
  merged, _ = s.tick(1.0, [_beat(1.0, 0), _beat(1.0, 1)], [
      _delivery(0, steps=4, tokens=400), _delivery(1, steps=2, tokens=200)])
  assert [m.version for m in merged] == [1]
  weights = [a["weight"] for a in records[0]["admitted"]]
  assert weights == pytest.approx([400**2 / 4 / (400**2 / 4 + 200**2 / 2),
                                   200**2 / 2 / (400**2 / 4 + 200**2 / 2)])


def test_heartbeats_of_learners_or_incarnations_out_of_range_are_never_registered():
  s, _ = _syncer()
  s.tick(0.0, [_beat(0.0, learner=4), _beat(0.0, incarnation=2**31)], ())
  assert s.registry == {} and s.rejections["bad_heartbeat"] == 2


def test_an_incarnation_jump_does_not_lock_out_the_live_learner():
  """A crafted heartbeat far ahead is refused; one a little ahead takes the registry, but
  only until it falls silent: then the live incarnation is taken back and merges again."""
  s, _ = _syncer(timeout=5.0)
  s.tick(0.0, [_beat(0.0)], ())
  s.tick(0.5, [_beat(0.5, incarnation=2**30)], ())  # far ahead: refused
  assert s.registry[0].incarnation == 0 and s.rejections["bad_heartbeat"] == 1
  merged, _ = s.tick(1.0, [_beat(1.0)], [_delivery(step=4)])
  assert [m.version for m in merged] == [1]
  s.tick(2.0, [_beat(2.0, incarnation=3)], ())  # a forged restart
  merged, _ = s.tick(3.0, [_beat(3.0)], [_delivery(step=8, base_version=1)])
  assert merged == [] and s.rejections["wrong_incarnation"] == 1
  # The forger is silent for longer than the timeout; the live learner goes on beating.
  for t in (4.0, 6.0, 8.0):
    s.tick(t, [_beat(t)], ())
  assert s.registry[0].incarnation == 0
  merged, _ = s.tick(9.0, [_beat(9.0)], [_delivery(step=12, base_version=1)])
  assert [m.version for m in merged] == [2]


# 2. Exactly once, durably.
def test_the_same_delivery_in_a_later_round_is_rejected_as_replayed():
  s, records = _syncer()
  s.tick(0.0, [_beat(0.0)], ())
  merged, _ = s.tick(1.0, [_beat(1.0)], [_delivery(step=8)])
  assert [m.version for m in merged] == [1]
  before = s.global_params()
  for t, step in ((2.0, 8), (3.0, 4)):  # the same identity again, then an older one
    merged, _ = s.tick(t, [_beat(t)], [_delivery(step=step, base_version=1)])
    assert merged == [] and _unchanged(s, before)
  assert s.rejections["replayed"] == 2
  merged, _ = s.tick(4.0, [_beat(4.0)], [_delivery(step=12, base_version=1)])
  assert [m.version for m in merged] == [2] and "replayed" in _reasons(records)


@pytest.mark.parametrize("state", ["alive", "dead", "restarted", "stale_base"])
def test_a_replay_is_refused_as_replayed_whatever_its_learner_is_doing_now(state):
  """The ledger is asked before the liveness and staleness checks: a merged identity written
  again is `replayed` whether its learner is alive, dead (no heartbeat for a timeout),
  restarted (a newer incarnation registered, none of it merged yet) or moved on so far that
  the replay's base is stale. (A live multi-process run met the dead case: the replay of a
  killed learner was refused as `learner_dead`, and nothing said it was a replay.)"""
  s, _ = _syncer(timeout=5.0, max_staleness=0 if state == "stale_base" else 8)
  s.tick(0.0, [_beat(0.0)], ())
  merged, _ = s.tick(1.0, [_beat(1.0)], [_delivery(step=8)])
  assert [m.version for m in merged] == [1]
  before = s.global_params()
  now, beats = {"alive": (2.0, [_beat(2.0)]), "dead": (9.0, []),
                "restarted": (2.0, [_beat(2.0, incarnation=1)]),
                "stale_base": (2.0, [_beat(2.0)])}[state]
  merged, _ = s.tick(now, beats, [_delivery(step=8)])  # base 0, as when it first merged
  assert merged == [] and _unchanged(s, before) and s.versions == [1]
  assert dict(s.rejections) == {"replayed": 1}


def test_an_older_delivery_never_replaces_a_newer_one_waiting_in_its_round():
  s, records = _syncer(quorum=2)
  s.tick(0.0, [_beat(0.0, 0), _beat(0.0, 1)], ())
  s.tick(1.0, [], [_delivery(0, step=8)])
  s.tick(1.5, [], [_delivery(0, step=4)])
  assert s.rejections["replayed"] == 1
  s.tick(2.0, [], [_delivery(1, step=8)])
  assert [(a["learner"], a["local_step"]) for a in records[0]["admitted"]] == [(0, 8), (1, 8)]


def test_a_learner_that_left_stays_out():
  s, _ = _syncer()
  s.tick(0.0, [_beat(0.0)], ())
  merged, _ = s.tick(1.0, [_beat(1.0)], [_delivery(step=4)], left=[(0, 0)])
  assert [m.version for m in merged] == [1]  # its flushed delivery still merges
  merged, _ = s.tick(2.0, [_beat(2.0)], [_delivery(step=8, base_version=1)])
  assert merged == [] and 0 not in s.registry
  assert s.rejections["departed"] == 1 and s.ignored["departed"] == 1
  merged, _ = s.tick(3.0, [_beat(3.0, incarnation=1)], [_delivery(step=8, incarnation=1,
                                                                   base_version=1)])
  assert [m.version for m in merged] == [2]  # a new incarnation is welcome


def test_a_crafted_leave_far_ahead_does_not_shut_out_later_incarnations():
  s, _ = _syncer()
  s.tick(0.0, [_beat(0.0)], ())
  s.tick(1.0, (), (), left=[(0, 10**15)])
  assert s.ledger.floor(0) <= intake.MAX_INCARNATION_JUMP + 1


def test_the_ledger_survives_a_restart_of_the_single_controller_syncer():
  s, _ = _syncer()
  s.tick(0.0, [_beat(0.0)], ())
  s.tick(1.0, [_beat(1.0)], [_delivery(step=8)], left=[])
  state = json.loads(json.dumps(s.export_state()))
  again, _ = _syncer()
  fragments_now = {0: (s.versions[0], s.fragment_values(0), dict(s.momentum))}
  again.restore_state(state, fragments_now, {}, s.rounds)
  merged, _ = again.tick(2.0, [_beat(2.0)], [_delivery(step=8, base_version=1)])
  assert merged == [] and again.rejections["replayed"] == 1


def _store_syncer(tmp_path, **kw):
  store = Store(tmp_path)
  s, records = _syncer(**kw)
  for merged in s.initial(0.0):
    store.merged.put(merged, s.momentum, {"round": None, "state": s.export_state()})
  link = SyncerStoreLink(store, EXPECTED)
  link.poll(0.0)
  return store, s, records, link


def _beat_record(store, seq, incarnation=0, learner=0, **fields):
  store.learners.put_heartbeat(learner, dict({"incarnation": incarnation, "seq": seq,
                                              "local_step": 4, "step_time": 0.1}, **fields))


def test_a_delivery_rewritten_after_a_syncer_restart_is_rejected_as_replayed(tmp_path):
  """Merged, deleted, the syncer restarts (and every marker naming it in its tape is gone),
  then the same entry is written again: the durable ledger refuses it."""
  store, s, records, link = _store_syncer(tmp_path)
  _beat_record(store, 1)
  store.payloads.put(_delivery(step=8))
  syncer_process.sync_once(store, s, link, records, io.StringIO(), keep=3, now=1.0)
  link.close()
  assert s.versions == [1] and store.payloads.committed() == []
  for seq, t in ((2, 2.0), (3, 3.0)):  # two more rounds push the version out of the tapes
    _beat_record(store, seq)
    store.payloads.put(_delivery(step=8 + 4 * seq, base_version=s.versions[0]))
    link = SyncerStoreLink(store, EXPECTED, fresh_s=60)
    link.poll(t)
    syncer_process.sync_once(store, s, link, records, io.StringIO(), keep=1, now=t + 0.5)
    link.close()
  again, records2 = _syncer()
  ok, merged_keys, _ = syncer_process.recover(store, again, 1, 8)
  assert ok and again.versions == [3] and (0, 0, 0, 8) not in merged_keys
  before = again.global_params()
  store.payloads.put(_delivery(step=8, base_version=3))
  _beat_record(store, 9)
  link = SyncerStoreLink(store, EXPECTED, merged_keys, fresh_s=60)
  link.poll(5.0)
  syncer_process.sync_once(store, again, link, records2, io.StringIO(), keep=3, now=5.5)
  link.close()
  assert again.versions == [3] and again.rejections["replayed"] == 1
  assert _unchanged(again, before)


def test_an_entry_left_behind_by_a_syncer_crash_is_counted_as_replayed_and_deleted(tmp_path):
  """The syncer died after committing a round and before deleting its entries: the restarted
  syncer finds the entry, which a kept marker names, and refuses it unread. It is counted as
  `replayed` (as the ledger counts the same identity when read) and deleted, not quarantined:
  nothing is wrong with it, G already holds it."""
  store, s, records, link = _store_syncer(tmp_path)
  _beat_record(store, 1)
  store.payloads.put(_delivery(step=8))
  syncer_process.sync_once(store, s, link, records, io.StringIO(), keep=3, now=1.0)
  link.close()
  assert s.versions == [1]
  store.payloads.put(_delivery(step=8))  # as if the delete never happened
  again, records2 = _syncer()
  ok, merged_keys, _ = syncer_process.recover(store, again, 1, 8)
  assert ok and (0, 0, 0, 8) in merged_keys
  before = again.global_params()
  link = SyncerStoreLink(store, EXPECTED, merged_keys, fresh_s=60)
  try:
    _beat_record(store, 2)
    link.poll(2.0)
    syncer_process.sync_once(store, again, link, records2, io.StringIO(), keep=3, now=2.5)
    link.flush()
    assert dict(again.rejections) == {"replayed": 1} and again.versions == [1]
    assert store.payloads.committed() == [] and store.payloads.quarantined() == {}
    assert _unchanged(again, before)
  finally:
    link.close()


# 3. Every record is typed before it is used.
@pytest.mark.parametrize("beat", [
    Heartbeat(0, 0, 1, 1.0, "soon"), Heartbeat(0, 0, 1, 1.0, float("nan")),
    Heartbeat(0, 0, 1, 1.0, float("inf")), Heartbeat(0, 0, 1, 10**400, 1.0),
    Heartbeat(0, 0, 1, -(10**400), 1.0), Heartbeat(0, 0, 1, "slow", 1.0),
    Heartbeat(0, 0, 1, 1.0, 10**400),
])
def test_a_heartbeat_of_wrong_types_never_raises_out_of_tick(beat):
  s, _ = _syncer()
  for t in (1.0, 2.0):  # and every later tick goes on
    s.tick(t, [beat], ())
  assert all(math.isfinite(r.last_heartbeat) for r in s.registry.values())
  merged, _ = s.tick(3.0, [_beat(3.0)], [_delivery(step=4)])
  assert [m.version for m in merged] == [1]


def test_a_heartbeat_from_the_future_keeps_its_learner_alive_no_longer_than_the_timeout():
  s, _ = _syncer(timeout=5.0)
  s.tick(1.0, [_beat(1.0, time=1e15)], ())
  assert s.registry[0].last_heartbeat == 1.0 and s.alive(5.0) == [0] and s.alive(7.0) == []


def test_one_learners_claimed_step_time_cannot_stretch_the_grace_window():
  """Learner 1 claims a step time of a week and never delivers; the round of learner 0
  (step time 1 s) waits at most tau of learner 0's steps, not a week."""
  cfg = SyncConfig(quorum=1, gamma=0.8, tau=2, heartbeat_timeout_s=1e9)
  s = syncer_lib.Syncer(_params(0), PLAN, cfg, OuterConfig(), sync_delay_s=0.0, limits=LIMITS)
  s.tick(0.0, [_beat(0.0, 0, step_time=1.0), _beat(0.0, 1, step_time=7 * 24 * 3600.0)], ())
  _, deadline = s.tick(1.0, (), [_delivery(step=4)])
  assert deadline is not None and deadline - 1.0 <= 2 * 1.0
  assert policy.grace_step_time([1.0, 604800.0], [1.0], 2) == 2.0


def test_the_registry_forgets_learners_long_gone():
  s, _ = _syncer(timeout=1.0)
  s.tick(0.0, [_beat(0.0, m) for m in range(4)], ())
  s.tick(20.0, [_beat(20.0, 0)], ())
  assert sorted(s.registry) == [0] and len(s.export_state()["registry"]) == 1


@pytest.mark.parametrize("state", [
    None, [], {"registry": "x"}, {"registry": [{"learner_id": "0"}]},
    {"registry": [{"learner_id": 0, "incarnation": 0, "last_heartbeat": "now"}]},
    {"step_ema": {"0": "fast", "x": 1.0}}, {"quorum_ema": float("nan")},
    {"rejections": {"a": 1e400}}, {"last_quorum": -1, "last_grace": "x"},
    {"ledger": {"merged": [[0, 0, 0, "8"], "x"], "floor": [[0, 10**400]]}},
])
def test_a_corrupt_restored_state_is_typed_and_never_raises(state):
  s, _ = _syncer()
  s.restore_state(state, {}, {}, 0)
  merged, _ = s.tick(1.0, [_beat(1.0)], [_delivery(step=4)])
  assert [m.version for m in merged] == [1]


@pytest.mark.parametrize("record", [
    {"incarnation": 4.7, "seq": 1, "local_step": 1, "step_time": 0.1},
    {"incarnation": 0, "seq": "1", "local_step": 1, "step_time": 0.1},
    {"incarnation": 0, "seq": 1, "local_step": 1, "step_time": 0.1, "state": ["up"]},
    {"incarnation": 0, "seq": 1, "local_step": 1, "step_time": 0.1, "state": "gone"},
])
def test_heartbeat_records_of_wrong_types_are_skipped_by_the_link(tmp_path, record):
  store = Store(tmp_path)
  link = SyncerStoreLink(store, EXPECTED)
  link.poll(0.0)
  store.learners.put_heartbeat(0, record)
  assert link.poll(1.0) == ([], [], [], [])
  link.close()


@pytest.mark.parametrize("index", ['[1, 2]', '{"0": "x"}', '{"00": 1}', '{"0": 1e400}', '7'])
def test_a_corrupt_index_never_stops_a_commit_or_a_learners_poll_thread(tmp_path, index):
  store, s, records, link = _store_syncer(tmp_path)
  (tmp_path / "merged" / "index.json").write_text(index)
  learner = LearnerStoreLink(store, 0, 0, poll_s=0.01, shapes=None)
  _beat_record(store, 1)
  store.payloads.put(_delivery(step=4))
  syncer_process.sync_once(store, s, link, records, io.StringIO(), keep=3, now=1.0)
  link.close()
  assert s.versions == [1] and store.merged.index() == {0: 1}
  learner.wait_initial(1, timeout=20, min_versions={0: 1})
  learner.close()


# 4. Files are what they claim to be.
def test_a_commit_marker_that_is_a_directory_is_set_aside_and_the_round_commits(tmp_path):
  store, s, records, link = _store_syncer(tmp_path)
  os.mkdir(tmp_path / "merged" / "f0_v1.json")
  _beat_record(store, 1)
  store.payloads.put(_delivery(step=4))
  syncer_process.sync_once(store, s, link, records, io.StringIO(), keep=3, now=1.0)
  link.close()
  assert s.versions == [1] and store.merged.index() == {0: 1}
  assert store.merged.read(0, 1)[0].version == 1


def test_a_heartbeat_that_is_a_fifo_never_blocks_the_poll(tmp_path):
  store = Store(tmp_path)
  os.mkfifo(tmp_path / "heartbeats" / "l0.json")
  link = SyncerStoreLink(store, EXPECTED)
  out = []
  thread = threading.Thread(target=lambda: out.append(link.poll(0.0)), daemon=True)
  thread.start()
  thread.join(timeout=10)
  assert not thread.is_alive() and out == [([], [], [], [])]
  link.close()


def test_a_payload_entry_that_is_a_symlink_to_a_folder_outside_is_refused(tmp_path):
  store, s, records, link = _store_syncer(tmp_path / "store")
  outside = Store(tmp_path / "outside")
  outside.payloads.put(_delivery(step=4))  # a well-formed entry, outside the store
  os.symlink(tmp_path / "outside" / "payloads" / "f0_l0_i0_s4",
             tmp_path / "store" / "payloads" / "f0_l0_i0_s4")
  os.link(tmp_path / "outside" / "payloads" / "f0_l0_i0_s4.json",
          tmp_path / "store" / "payloads" / "f0_l0_i0_s4.json")
  _beat_record(store, 1)
  syncer_process.sync_once(store, s, link, records, io.StringIO(), keep=3, now=1.0)
  link.close()
  assert s.versions == [0] and s.rejections["bad_metadata"] == 1
  assert os.path.isdir(tmp_path / "outside" / "payloads" / "f0_l0_i0_s4")  # never followed


def test_a_payloads_folder_that_is_a_symlink_is_never_read(tmp_path):
  """The whole `payloads/` folder replaced by a link to well-formed deliveries elsewhere: none
  is merged or collected (found by scripts/mutation_check.py: nothing caught its removal)."""
  store, s, records, link = _store_syncer(tmp_path / "store")
  outside = Store(tmp_path / "outside")
  outside.payloads.put(_delivery(step=4))
  shutil.rmtree(tmp_path / "store" / "payloads")
  os.symlink(tmp_path / "outside" / "payloads", tmp_path / "store" / "payloads")
  _beat_record(store, 1)
  syncer_process.sync_once(store, s, link, records, io.StringIO(), keep=3, now=1.0)
  link.close()
  assert s.versions == [0] and s.rounds == 0
  assert sorted(os.listdir(tmp_path / "outside" / "payloads")) == [
      "f0_l0_i0_s4", "f0_l0_i0_s4.json"]  # never followed, never deleted


@pytest.mark.parametrize("name", ["f00_l0_i0_s4", "f0_l0_i0_s04", "f0_l0_i0_s4\n",
                                  "f0_l0_i0_s\u0664"])
def test_entry_names_must_be_canonical(tmp_path, name):
  store = Store(tmp_path)
  store.payloads.put(_delivery(step=4))
  for suffix in ("", ".json"):
    os.rename(tmp_path / "payloads" / f"f0_l0_i0_s4{suffix}",
              tmp_path / "payloads" / f"{name}{suffix}")
  assert store.payloads.committed() == []


def _plant_non_finite(store, s, version):
  bad = Merged(0, version, {k: np.full(v, np.nan, np.float32) for k, v in SHAPES.items()}, 1.0)
  store.merged.put(bad, s.momentum, {"round": None, "state": s.export_state()})


def test_recover_refuses_a_non_finite_version_and_falls_back_to_the_newest_good_one(tmp_path):
  store, s, records, link = _store_syncer(tmp_path)
  _beat_record(store, 1)
  store.payloads.put(_delivery(step=4))
  syncer_process.sync_once(store, s, link, records, io.StringIO(), keep=5, now=1.0)
  link.close()
  good = s.global_params()
  _plant_non_finite(store, s, 2)
  again, _ = _syncer()
  ok, _, _ = syncer_process.recover(store, again, 1, 8)
  assert ok and again.versions == [1] and _unchanged(again, good)
  assert store.merged.versions(0) == [0, 1] and store.merged.index() == {0: 1}
  with pytest.raises(StoreError) as e:  # and learners never apply one
    _plant_non_finite(store, s, 2)
    store.merged.read(0, 2)
  assert e.value.reason == NON_FINITE


def test_a_learner_skips_a_non_finite_version_and_takes_the_next(tmp_path):
  store, s, _, link = _store_syncer(tmp_path)
  link.close()
  _plant_non_finite(store, s, 1)
  learner = LearnerStoreLink(store, 0, 0, poll_s=0.01, shapes=None)
  time.sleep(0.5)  # dozens of polls of the index naming the planted version
  assert learner.latest(0).version == 0  # never applied: the newest usable one instead
  good = Merged(0, 2, _params(5), 2.0)
  store.merged.put(good, s.momentum, {"round": None, "state": {}})
  learner.wait_initial(1, timeout=20, min_versions={0: 2})
  assert learner.latest(0).version == 2
  learner.close()


def test_a_joining_learner_does_not_wait_on_a_version_nobody_can_use(tmp_path):
  """The index names version 9, which has no commit marker (a phantom), and version 2 is
  non-finite: the learner joins at once on version 1, the newest usable one, with its values
  (its floor used to be the index's 9, so the join waited until it timed out)."""
  store, s, _, link = _store_syncer(tmp_path)
  link.close()
  store.merged.put(Merged(0, 1, _params(7), 1.0), s.momentum, {"round": None, "state": {}})
  _plant_non_finite(store, s, 2)
  store.blobs.write_json("merged/index.json", {"0": 9})
  assert global_view.join_floor([store], (0,), [dict(SHAPES)], {0: 0}) == {0: 1}
  started = time.monotonic()
  agreed = hosts_lib.AgreedLink(store, 0, 0, hosts_lib.HostGroup(), poll_s=0.01,
                                shapes=[dict(SHAPES)])
  agreed.agree_initial(1, timeout=30)
  floor = global_view.join_floor([store], (0,), [dict(SHAPES)], {0: agreed.latest_version(0)})
  agreed.agree_initial(1, timeout=30, min_versions=floor)
  assert time.monotonic() - started < 10 and floor == {0: 1}
  held = agreed.latest(0)
  assert held.version == 1
  assert all(np.array_equal(held.tensors[k], v) for k, v in _params(7).items())
  agreed.close()


def test_a_flood_of_rejections_in_one_round_keeps_its_marker_under_the_record_limit(tmp_path):
  """40,000 rejected deliveries before one round closes (listed in full, the marker would be
  about 6 MiB): the tape record lists the first few and counts all of them by reason, the
  commit marker stays under the store's record limit, and a restarted syncer resumes from it."""
  store, s, records, link = _store_syncer(tmp_path)
  for i in range(40_000):
    s.reject(0, i % 4, 0, "stale" if i % 2 else "replayed", 10**6, 0.5, local_step=4, steps=4)
  _beat_record(store, 1)
  store.payloads.put(_delivery(step=4))
  tape = io.StringIO()
  syncer_process.sync_once(store, s, link, records, tape, keep=5, now=1.0)
  link.close()
  assert s.versions == [1]
  record = json.loads(tape.getvalue())
  assert len(record["rejected"]) == rejections.EXAMPLES
  assert record["rejected_by_reason"] == {"replayed": 20_000, "stale": 20_000}
  assert record["rejected_bytes"] == 40_000 * 10**6
  assert os.path.getsize(tmp_path / "merged" / "f0_v1.json") < blob_io._MAX_JSON_BYTES // 16
  good = s.global_params()
  again, _ = _syncer()
  ok, _, committed = syncer_process.recover(store, again, 1, 8)
  assert ok and again.versions == [1] and _unchanged(again, good)
  assert committed[0]["rejected_by_reason"] == record["rejected_by_reason"]
  assert fidelity.round_stats(committed)["rejected"] == 40_000


def test_when_quarantine_cannot_be_written_the_bad_entry_is_never_read_again(tmp_path):
  store, s, records, link = _store_syncer(tmp_path)
  (tmp_path / "quarantine").write_text("not a folder")
  store.payloads.put(_delivery(step=4))
  marker = tmp_path / "payloads" / "f0_l0_i0_s4.json"
  marker.write_text(marker.read_text().replace('"steps": 4', '"steps": 4.5'))
  _beat_record(store, 1)
  syncer_process.sync_once(store, s, link, records, io.StringIO(), keep=3, now=1.0)
  link.close()
  assert s.rejections["bad_counters"] == 1 and store.payloads.committed() == []
  again = SyncerStoreLink(store, EXPECTED)
  again.poll(2.0)
  assert again.poll(3.0)[1:3] == ([], [])
  again.close()


# 5. The lease cannot be wedged.
def _planted(tmp_path, generation, record):
  (tmp_path / "lease").mkdir(parents=True, exist_ok=True)
  (tmp_path / "lease" / f"g{generation}.json").write_text(json.dumps(record))


@pytest.mark.parametrize("expires", [float("nan"), float("inf"), 1e308, "soon", None])
def test_a_lease_record_with_an_unusable_expiry_protects_nothing(tmp_path, expires):
  store = Store(tmp_path)
  _planted(tmp_path, 3, {"holder": "x", "expires": expires, "host": "elsewhere"})
  lease = Lease(store, duration_s=4.0, same_host=False)
  assert lease.acquire(timeout_s=5.0) == 4


@pytest.mark.parametrize("generation", [10**12, 10**30 + 7])
def test_lease_generations_of_any_length_are_counted(tmp_path, generation):
  store = Store(tmp_path)
  _planted(tmp_path, generation, {"holder": "x", "expires": 0.0, "host": "elsewhere"})
  lease = Lease(store, duration_s=4.0, same_host=False)
  assert lease.acquire(timeout_s=5.0) == generation + 1
  second = Lease(store, duration_s=4.0, same_host=False)
  with pytest.raises(LeaseHeld):
    second.acquire(timeout_s=0.5)


def test_a_contender_whose_create_fails_backs_off_and_respects_its_deadline(tmp_path,
                                                                             monkeypatch):
  store = Store(tmp_path)
  calls = []

  def failing(rel, record):
    calls.append(rel)
    raise StoreError("write_failed", "disk full")

  monkeypatch.setattr(store.blobs, "create_json", failing)
  lease = Lease(store, duration_s=4.0, poll_s=0.05)
  with pytest.raises(LeaseHeld):
    lease.acquire(timeout_s=1.0)
  assert 2 <= len(calls) <= 12  # backed off: 0.05, 0.1, 0.2, 0.4 ... within one second


def test_a_name_that_keeps_existing_cannot_spin_the_contender(tmp_path, monkeypatch):
  store = Store(tmp_path)
  calls = []
  monkeypatch.setattr(store.blobs, "create_json", lambda rel, record: calls.append(rel) or False)
  lease = Lease(store, duration_s=4.0, poll_s=0.2)
  with pytest.raises(LeaseHeld):
    lease.acquire(timeout_s=0.5)
  assert len(calls) <= 12
