"""The store: real Orbax entries on disk, commit markers, bad entries, durable syncer recovery."""

import glob
import json
import os
import pathlib
import re
import time

import numpy as np
import object_store
import pytest
from etils import epath

from diloco import fragments, outer
from diloco.config.run_config import StoreConfig
from diloco.delivery import Delivery
from diloco.distributed import chaos, syncer_process, wan
from diloco.distributed import store as store_lib
from diloco.distributed.learner_link import LearnerStoreLink
from diloco.distributed.store import Store, global_view
from diloco.distributed.store import layout as store_layout
from diloco.distributed.store.names import parse_payload_name, payload_name
from diloco.distributed.syncer_link import SyncerStoreLink
from diloco.errors import ConfigError
from diloco.outer.merge import OuterConfig
from diloco.sync import ownership
from diloco.sync import syncer as syncer_lib
from diloco.sync.policy import SyncConfig
from diloco.transport import Heartbeat, Merged

SHAPES = {"embedder/embedding": (6, 4), "layers/0/w": (4, 4), "layers/1/w": (4, 3)}
PLAN = fragments.plan_fragments(SHAPES, num_fragments=2)
EXPECTED = {p: {k: SHAPES[k] for k in paths} for p, paths in enumerate(PLAN.fragments)}


@pytest.fixture(params=["local", "object", "gcs"])
def where(request, tmp_path, monkeypatch):
  """(root, files): a local-directory store, the same tests on an emulated object store
  (`tests/object_store.py`: no rename, no directories, no prefix times), and on a local GCS
  emulator through gcsfs's HTTP client (`tests/gcs_emulator.py`); `files` is the path the
  tests damage entries through (the local directory holding the files, or the `gs://` root)."""
  if request.param == "gcs":
    root = request.getfixturevalue("gcs_root")
    return root, epath.Path(root)
  root, files = object_store.location(request.param, tmp_path, monkeypatch)
  return root, pathlib.Path(files)


def _params(seed):
  rng = np.random.default_rng(seed)
  return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _payload(learner, p, values, *, step=4, base=0, incarnation=0, kind="values"):
  tensors = {k: values[k] for k in PLAN.fragments[p]}
  return Delivery(learner=learner, incarnation=incarnation, fragment=p, local_step=step, steps=step,
                  tokens=100 * step, base_version=base, kind=kind, tensors=tensors, transit_s=0.0)


def _syncer(on_round=None, **sync):
  cfg = SyncConfig(**{"quorum": 1, "gamma": 0.0, "heartbeat_timeout_s": 30.0, **sync})
  return syncer_lib.Syncer(_params(0), PLAN, cfg, OuterConfig(), sync_delay_s=0.0,
                           on_round=on_round)


def _beat(store, learner, incarnation=0, seq=1, state="up"):
  store.learners.put_heartbeat(learner, {"learner": learner, "incarnation": incarnation, "seq": seq,
                                         "state": state, "local_step": 4, "step_time": 0.1})


def test_names_are_built_only_from_validated_integers():
  assert payload_name(1, 2, 3, 40) == "f1_l2_i3_s40"
  assert parse_payload_name("f1_l2_i3_s40") == (1, 2, 3, 40)
  for bad in ("f1_l2_i3_s40/../x", "f1_l2_i3", "fx_l2_i3_s4", "../f1_l2_i3_s4"):
    assert parse_payload_name(bad) is None
  for bad in (-1, 1.5, "3", True):
    with pytest.raises(ValueError):
      payload_name(bad, 0, 0, 0)


def test_payload_round_trip_values_and_quantized(where):
  root, _ = where
  store = Store(root)
  values = _params(1)
  store.payloads.put(_payload(0, 0, values))
  q = {k: outer.quantize(values[k], 4, 8) for k in PLAN.fragments[1]}
  store.payloads.put(Delivery(learner=1, incarnation=0, fragment=1, local_step=5, steps=5,
                              tokens=500, base_version=0, kind="delta", tensors=q, transit_s=0.0))
  names = store.payloads.committed()
  assert names == ["f0_l0_i0_s4", "f1_l1_i0_s5"]
  got = store.payloads.read(names[0], EXPECTED)
  assert got.steps == 4 and got.tokens == 400 and got.kind == "values"
  for k in PLAN.fragments[0]:
    np.testing.assert_array_equal(got.tensors[k], values[k])
  got = store.payloads.read(names[1], EXPECTED)
  for k in PLAN.fragments[1]:
    np.testing.assert_array_equal(outer.dequantize(got.tensors[k]), outer.dequantize(q[k]))


@pytest.mark.parametrize("bits", [16, 8, 4, 2, 1])
def test_quantized_payloads_of_every_precision_round_trip(where, bits):
  root, _ = where
  store = Store(root)
  values = _params(bits)
  q = {k: outer.quantize(values[k], bits, 8) for k in PLAN.fragments[1]}
  written = store.payloads.put(Delivery(learner=1, incarnation=0, fragment=1, local_step=5, steps=5,
                                        tokens=500, base_version=0, kind="delta", tensors=q,
                                        transit_s=0.0))
  assert written == sum(t.nbytes for t in q.values())
  got = store.payloads.read(store.payloads.committed()[0], EXPECTED)
  for k in PLAN.fragments[1]:
    np.testing.assert_array_equal(outer.dequantize(got.tensors[k]), outer.dequantize(q[k]))


def test_json_records_are_replaced_atomically(where):
  root, files = where
  store = Store(root)
  store.blobs.write_json("registry.json", {"a": 1})
  store.blobs.write_json("registry.json", {"a": 2})
  assert store.blobs.read_json("registry.json") == {"a": 2}
  assert [p.name for p in files.iterdir() if p.name.endswith(".tmp")] == []
  assert store.blobs.read_json("missing.json") is None


def _names(folder):
  return [p.name for p in folder.iterdir()]


def _plant(store, files):
  """One entry of every bad kind, plus one good delivery; returns the expected reasons."""
  good = _params(1)
  p_of = PLAN.fragment_of("layers/0/w")
  store.payloads.put(_payload(0, p_of, good, step=1))  # the good one
  # Half-written: data but no commit marker -> never read.
  store.payloads.put(_payload(0, 1, good, step=2))
  (files / "payloads" / "f1_l0_i0_s2.json").unlink()
  # Truncated: every data file of the entry cut to a few bytes (an entry is flat).
  store.payloads.put(_payload(0, 0, good, step=3))
  for f in (files / "payloads" / "f0_l0_i0_s3").iterdir():
    if not f.name.startswith((".", "_", "zarr")):
      f.write_bytes(f.read_bytes()[:3])
  # Garbage: a commit marker that is not JSON.
  store.payloads.put(_payload(0, 1, good, step=4))
  (files / "payloads" / "f1_l0_i0_s4.json").write_bytes(b"\x00\xffnot json")
  # Wrong shape and wrong dtype written as if they were the right tensors.
  wrong = dict(good, **{"layers/0/w": np.zeros((2, 2), np.float32)})
  bad_dtype = {k: v.astype(np.float16) for k, v in good.items()}
  store.payloads.put(_payload(0, p_of, wrong, step=5))
  store.payloads.put(_payload(0, p_of, bad_dtype, step=6))
  nan = dict(good, **{"layers/0/w": np.full((4, 4), np.nan, np.float32)})
  store.payloads.put(_payload(0, p_of, nan, step=7))
  store.payloads.put(_payload(9, 0, good, step=8))                 # unknown learner
  store.payloads.put(_payload(1, 0, good, step=9, incarnation=0))  # stale incarnation (1 is at 2)
  store.payloads.put(_payload(0, 1 - p_of, good, step=10, base=0))  # too stale, see below
  # Crafted counters in otherwise valid markers: a number JSON reads as infinity (int() of it
  # raised OverflowError out of the store; now refused by the store), and zero tokens for four
  # steps (refused by the syncer).
  for step, field, value in ((11, "steps", "1e400"), (12, "tokens", "0")):
    store.payloads.put(_payload(0, p_of, good, step=step))
    marker = files / "payloads" / f"f{p_of}_l0_i0_s{step}.json"
    marker.write_text(re.sub(rf'"{field}": \d+', f'"{field}": {value}', marker.read_text()))
  return {"unreadable": 2, "wrong_shape": 1, "wrong_dtype": 1, "non_finite": 1,
          "unknown_learner": 1, "wrong_incarnation": 1, "stale": 1, "bad_counters": 2}


def test_merged_rounds_are_synced_to_disk_and_payloads_are_not(tmp_path, monkeypatch):
  """Merged rounds are the syncer's durable state: every file of the entry (tensors and
  Orbax's metadata) and the folders that name them are fsynced, then the commit marker; the
  index, which a restarted syncer rewrites from the markers, is not, nor are payloads
  (consumed within seconds) and heartbeats."""
  synced = []
  real_fsync = os.fsync

  def spy(fd):  # the name of what is synced, with the temporary folder's name undone
    name = os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), tmp_path)
    synced.append(re.sub(r"\.([^/]+)\.[0-9a-f]{32}\.tmp", r"\1", name))
    real_fsync(fd)

  monkeypatch.setattr(os, "fsync", spy)
  store = Store(tmp_path)
  store.payloads.put(_payload(0, 0, _params(1)))
  store.learners.put_heartbeat(0, {"seq": 1})
  assert synced == []
  s = _syncer()
  store.merged.put(s.initial(0.0)[0], s.momentum, {"round": None})
  data = store.merged.marker(0, 0)["data"]
  entry_files = [os.path.relpath(os.path.join(d, f), tmp_path)
                 for d, _, fs in os.walk(tmp_path / "merged" / data) for f in fs]
  assert len(entry_files) == 2 * (len(PLAN.fragments[0]) + 1)  # tensors + _METADATA, twice
  marker = synced.index("merged/f0_v0.json")
  assert set(entry_files) <= set(synced[:marker])
  assert {f"merged/{data}/params", f"merged/{data}/outer", f"merged/{data}", "merged"} <= set(
      synced[:marker])  # the entries' folders, the rename, and the new version's folder
  assert synced[marker + 1:] == ["merged"]  # the marker's name; nothing for the index
  assert store.merged.read(0, 0)[0].version == 0

def test_every_bad_entry_kind_is_rejected_with_its_reason(where):
  root, files = where
  store = Store(root)
  s = _syncer(max_staleness=0)
  s.versions[1 - PLAN.fragment_of("layers/0/w")] = 1  # version 0 is now too stale there
  g0 = s.global_params()
  expected = _plant(store, files)
  link = SyncerStoreLink(store, EXPECTED)
  _beat(store, 0)
  _beat(store, 1, incarnation=2)
  # Crafted heartbeats are skipped, not raised: a number JSON reads as infinity, a bad time.
  (files / "heartbeats").mkdir(exist_ok=True)
  (files / "heartbeats" / "l7.json").write_text(
      '{"incarnation": 0, "seq": 1e400, "local_step": 1, "step_time": 0.1}')
  (files / "heartbeats" / "l8.json").write_text(
      '{"incarnation": 0, "seq": 1, "local_step": 1, "step_time": 0.1, "sent_at": "soon"}')
  assert link.poll(1.0) == ([], [], [], [])  # the first poll only takes a baseline
  _beat(store, 0, seq=2)
  _beat(store, 1, incarnation=2, seq=2)
  beats, payloads, rejected, _ = link.poll(2.0)
  assert len(beats) == 2
  for r in rejected:
    s.reject(r.fragment, r.learner, r.incarnation, r.reason, r.nbytes, 2.0)
  merged, _ = s.tick(2.0, beats, payloads)
  assert dict(s.rejections) == expected
  p_of = PLAN.fragment_of("layers/0/w")
  assert [m.fragment for m in merged] == [p_of] and s.last_quorum == 1  # only the good one
  link.release(s.pending_keys())
  link.close()  # deletes run in the background; this waits for them
  assert store.payloads.committed() == []  # everything read was released
  # What the store could not use was moved aside with its reason, never deleted.
  assert sorted(r["reason"] for r in store.payloads.quarantined().values()) == sorted(
      r.reason for r in rejected)
  assert len(rejected) == 5 and (files / "quarantine" / rejected[0].name).is_dir()
  assert store.payloads.uncommitted() == ["f1_l0_i0_s2"]  # never trusted, never read
  assert store.payloads.collect_uncommitted(max_age_s=3600) == 0
  assert store.payloads.collect_uncommitted(max_age_s=-1) == 1
  assert store.payloads.uncommitted() == []
  for k in PLAN.fragments[1 - p_of]:
    np.testing.assert_array_equal(s.global_params()[k], g0[k])


def test_a_learner_that_left_while_no_syncer_ran_has_its_last_deliveries_merged(where):
  """A learner flushes its final deliveries, then says it left (RETIRED or DONE), while the
  syncer is down. The restarted syncer's link reports the departure with the deliveries, not on
  its first poll (which only takes a baseline), so the syncer, which forgets a learner after the
  tick, merges them instead of refusing them as a departed incarnation's."""
  root, _ = where
  store = Store(root)
  for state in ("retired", "done"):
    s = _syncer()  # as restored: learner 0 registered, its round not closed yet
    s.tick(0.5, [Heartbeat(0, 0, 3, 0.1, 0.5)], [])
    p = 1 if state == "done" else 0
    store.payloads.put(_payload(0, p, _params(1), step=4))
    _beat(store, 0, seq=5 if state == "done" else 4, state=state)
    link = SyncerStoreLink(store, EXPECTED)
    try:
      merged, left_seen = [], []
      for now in (1.0, 2.0):
        beats, payloads, rejected, left = link.poll(now)
        assert rejected == []
        merged += s.tick(now, beats, payloads)[0]
        for learner, incarnation in left:  # as `syncer_process.sync_once`: after the tick
          s.forget(learner, incarnation)
        left_seen += left
        link.release(s.pending_keys())
      assert left_seen == [(0, 0)] and [m.fragment for m in merged] == [p], state
      assert "departed" not in s.rejections
    finally:
      link.close()


def test_uncommitted_entries_are_collected_by_the_age_this_process_saw_them(where):
  """No modification time is read (an object store has none for a prefix, and a dead
  writer's clock is not ours): an entry is collected once this process has seen it
  uncommitted for longer than the limit, and never once it is committed."""
  root, files = where
  store = Store(root)
  for step in (1, 2):
    store.payloads.put(_payload(0, 0, _params(1), step=step))
    (files / "payloads" / f"f0_l0_i0_s{step}.json").unlink()  # the writer died before it
  old = files / "payloads" / "f0_l0_i0_s1"
  if isinstance(old, pathlib.Path):  # a local folder's time of 1970 means nothing
    os.utime(old, (0, 0))
  assert store.payloads.collect_uncommitted(max_age_s=0.3) == 0  # first seen now
  store.blobs.write_json("payloads/f0_l0_i0_s2.json", {"late": True})  # a slow writer committed
  time.sleep(0.4)
  assert store.payloads.collect_uncommitted(max_age_s=0.3) == 1
  assert store.payloads.uncommitted() == [] and store.payloads.committed() == ["f0_l0_i0_s2"]
  assert Store(root).payloads.collect_uncommitted(max_age_s=-1) == 0  # nothing else was left


def test_syncer_link_retries_a_failed_delete_and_never_rereads(where, monkeypatch):
  root, _ = where
  store = Store(root)
  s = _syncer()
  link = SyncerStoreLink(store, EXPECTED)
  try:
    link.poll(0.0)
    _beat(store, 0)
    store.payloads.put(_payload(0, 0, _params(1)))
    beats, payloads, rejected, _ = link.poll(1.0)
    assert len(payloads) == 1 and rejected == []
    s.tick(1.0, beats, payloads)
    real_remove, failures = store.payloads.remove, []

    def flaky_remove(name):
      if not failures:
        failures.append(name)
        raise OSError("transient")
      real_remove(name)

    monkeypatch.setattr(store.payloads, "remove", flaky_remove)
    link.release(s.pending_keys())
    link.flush()
    assert failures and store.payloads.committed() == failures  # the delete failed
    assert link.poll(2.0)[1:3] == ([], [])  # not read again: it was consumed
    link.flush()  # the poll resubmitted the delete
    assert store.payloads.committed() == []
  finally:
    link.close()


def test_learner_link_delivers_and_prefetches_merged(where):
  root, _ = where
  store = Store(root)
  s = _syncer()
  for m in s.initial(0.0):
    store.merged.put(m, s.momentum, {"round": None, "state": s.export_state()})
  link = LearnerStoreLink(store, 3, 0, poll_s=0.01, shapes=None, heartbeat_every_s=0.01)
  try:
    link.wait_initial(PLAN.num_fragments, timeout=30)
    assert link.latest_version(0) == 0 and link.latest_version(1) == 0
    link.heartbeat(Heartbeat(3, 0, 1, 0.1, 0.0))
    link.deliver(_payload(3, 0, _params(5)))
    link.flush()
    assert store.payloads.committed() == ["f0_l3_i0_s4"]
    assert store.learners.heartbeats()[3]["local_step"] == 1  # written before the payload
    link.leave("retired")
    assert store.learners.heartbeats()[3]["state"] == "retired"
  finally:
    link.close()


def test_learner_link_outbox_is_bounded_and_loses_nothing(tmp_path):
  """At `send_queue` deliveries waiting for a slow link, `deliver` waits (backpressure) instead
  of buffering without bound; every delivery still reaches the store."""
  store = Store(tmp_path)
  link = LearnerStoreLink(store, 0, 0, poll_s=0.01, shapes=None, up=wan.Link(latency_ms=300), send_queue=1)
  try:
    for step in (4, 8, 12):
      link.deliver(_payload(0, 0, _params(step), step=step))
      assert link._outbox.qsize() <= 1
    assert link.send_wait_s > 0.0  # the third waited for the first upload to finish
    link.flush()
    assert sorted(store.payloads.committed()) == ["f0_l0_i0_s12", "f0_l0_i0_s4", "f0_l0_i0_s8"]
  finally:
    link.close()


def test_learner_link_outlives_a_version_collected_before_it_read_it(where):
  """The index names a version that GC removed before the learner read it (a slow learner):
  the poller waits for the next index instead of failing the learner."""
  root, _ = where
  store = Store(root)
  s = _syncer()
  for m in s.initial(0.0):
    store.merged.put(m, s.momentum, {"round": None, "state": s.export_state()})
  store.blobs.write_json("merged/index.json", {"0": 7, "1": 0})  # f0_v7 is gone (never written)
  link = LearnerStoreLink(store, 0, 0, poll_s=0.01, shapes=None)
  try:
    link.wait_for(1, 0, timeout=30)
    assert link.latest_version(0) == -1 and link.latest_version(1) == 0  # still alive
    s.versions[0] = 8
    store.merged.put(Merged(0, 8, s.fragment_values(0), 1.0), s.momentum,
                     {"round": 0, "state": s.export_state()})
    assert link.wait_for(0, 8, timeout=30).version == 8
  finally:
    link.close()


def test_collect_merged_spares_a_version_being_written(where):
  root, files = where
  store = Store(root)
  s = _syncer()
  for v in range(4):
    s.versions[0] = v
    store.merged.put(Merged(0, v, s.fragment_values(0), float(v)), s.momentum, {"round": v})
  writing = files / "merged" / "f0_v4.0123456789ab" / "params"  # the syncer is writing v4
  writing.mkdir(parents=True)
  (writing / "t0000.npy").write_bytes(b"half")
  store.merged.collect(0, keep=2)
  assert store.merged.versions(0) == [2, 3]
  names = sorted(re.sub(r"\.[0-9a-f]{12}$", ".w", n) for n in _names(files / "merged"))
  assert names == ["f0_v2.json", "f0_v2.w", "f0_v3.json", "f0_v3.w", "f0_v4.w", "index.json"]
  assert store.merged.collect_uncommitted() == 1  # what a restarted syncer does first
  assert not (files / "merged" / "f0_v4.0123456789ab").exists()
  np.testing.assert_array_equal(store.merged.read(0, 3)[0].tensors["embedder/embedding"],
                                s.fragment_values(0)["embedder/embedding"])

def _five_committed_rounds(store, tmp_path, keep=None):
  """A syncer of two learners that publishes its initial versions, then commits five rounds
  (fragments 0, 1, 0, 1, 0) to `store` and to a tape; returns the syncer and the tape's path.
  `keep`: versions kept per fragment after each commit (None: all)."""
  records: list = []
  s = _syncer(on_round=records.append)
  for m in s.initial(0.0):
    store.merged.put(m, s.momentum, {"round": None, "state": s.export_state()})
  tape_path = str(tmp_path / "tape.jsonl")
  with open(tape_path, "a", encoding="utf-8") as tape:
    beats = [Heartbeat(m, 0, 1, 0.1, 0.0) for m in (0, 1)]
    for r in range(5):
      p = r % 2
      merged, _ = s.tick(float(r + 1), beats if r == 0 else (),
                         [_payload(r % 2, p, _params(10 + r), base=s.versions[p], step=r + 1)])
      syncer_process._commit(store, s, merged, records, tape)
      if keep is not None:
        store.merged.collect(p, keep=keep)
  return s, tape_path


def test_syncer_recovers_the_last_durable_round_exactly(where, tmp_path):
  """Kill-and-restart in process: same G, momentum, versions; tape without gap or duplicate."""
  store = Store(where[0])
  s, tape_path = _five_committed_rounds(store, tmp_path, keep=3)
  # A round that closed but died before its commit marker: never durable.
  s.tick(6.0, (), [_payload(0, 0, _params(99), base=s.versions[0], step=9)])
  with open(tape_path, "a") as f:
    f.write('{"round": 5, "torn')  # a torn line from the crash
  durable = _syncer()
  durable_params = {}
  for p in range(2):
    v = store.merged.versions(p)[-1]
    durable_params.update(store.merged.read(p, v)[0].tensors)

  fresh = _syncer()
  ok, merged_keys, committed = syncer_process.recover(store, fresh, 2, max_staleness=8)
  syncer_process.repair_tape(tape_path, fresh.rounds, committed, versions=None)
  assert ok and fresh.rounds == 5 and fresh.versions == [3, 2]
  for k, v in durable_params.items():
    np.testing.assert_array_equal(fresh.global_params()[k], v)
  assert set(fresh.registry) == {0, 1}
  assert (0, 0, 0, 5) in merged_keys  # round 4 merged learner 0's step-5 delivery
  rounds = [json.loads(line)["round"] for line in open(tape_path)]
  assert rounds == [0, 1, 2, 3, 4]
  assert store.merged.versions(0) == [1, 2, 3]  # keep=3: version 0 collected
  del durable


def test_repair_tape_drops_the_rounds_of_versions_recover_refused(tmp_path):
  """Fragment 1's newest version (round 3) is non-finite on disk: `recover` resumes it from
  version 1, so the tape must no longer list round 3 (G does not hold it; the next round of
  fragment 1 reuses version 2), while round 4 of fragment 0 stays."""
  store = Store(tmp_path / "store")
  _, tape_path = _five_committed_rounds(store, tmp_path)
  data = store.merged.marker(1, 2)["data"]
  for npy in (tmp_path / "store" / "merged" / data / "params").glob("*.npy"):
    np.save(npy, np.full(np.load(npy).shape, np.nan, np.float32))
  fresh = _syncer()
  ok, _, committed = syncer_process.recover(store, fresh, 2, max_staleness=8)
  assert ok and fresh.versions == [3, 1] and fresh.rounds == 5
  syncer_process.repair_tape(tape_path, fresh.rounds, committed,
                             versions={p: fresh.versions[p] for p in fresh.owned})
  with open(tape_path, encoding="utf-8") as f:
    listed = [json.loads(line) for line in f]
  assert [r["round"] for r in listed] == [0, 1, 2, 4]
  assert all(r["version"] <= fresh.versions[r["fragment"]] for r in listed)


def test_recover_refuses_a_store_of_another_layout_even_without_the_layout_check(tmp_path):
  """A library caller that skips `store_layout.claim`: a syncer whose plan has other shapes
  must not take the store for a fresh one (and publish version 0 over the run's rounds)."""
  store = Store(tmp_path / "store")
  _five_committed_rounds(store, tmp_path)
  before = {p: store.merged.versions(p) for p in range(2)}
  rng = np.random.default_rng(0)
  for transposed, message in ((("layers/1/w",), "have no usable committed version while others"),
                              (("layers/1/w", "embedder/embedding"), "hold committed versions, "
                               "none of which reads back")):
    shapes = {k: s[::-1] if k in transposed else s for k, s in SHAPES.items()}
    other = syncer_lib.Syncer({k: rng.standard_normal(v).astype(np.float32)
                               for k, v in shapes.items()},
                              fragments.plan_fragments(shapes, num_fragments=2),
                              SyncConfig(quorum=1, gamma=0.0), OuterConfig(), sync_delay_s=0.0)
    with pytest.raises(ConfigError, match=message):
      syncer_process.recover(store, other, 2, max_staleness=8)
  assert {p: store.merged.versions(p) for p in range(2)} == before  # nothing moved aside
  fresh = Store(tmp_path / "empty")
  assert syncer_process.recover(fresh, _syncer(), 2, max_staleness=8) == (False, set(), [])


def test_wan_link_serialises_transfers_and_adds_latency():
  now = [0.0]
  link = wan.Link(8.0, 50.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
  assert link.transfer(1_000_000) == pytest.approx(1.05)  # 8 Mbit at 8 Mbit/s + 50 ms
  assert link.arrival(500_000) == pytest.approx(1.05 + 0.5 + 0.05 - 0.05 + 0.0, abs=0.06)
  assert wan.Link().transfer(10**9) == 0.0
  up, down = wan.learner_links(StoreConfig(wan_mbps="100,10", wan_latency_ms="5"), 3)
  assert up.bytes_per_s == 10e6 / 8 and down.latency_s == 0.005
  with pytest.raises(ConfigError, match="store.wan_mbps: values must be >= 0"):
    StoreConfig(wan_mbps="-1").check()


def test_chaos_grammar_and_seeded_generation():
  events = chaos.parse("kill:1@20; stop:*@30+5;kill_syncer@40;add@50;retire:2@90")
  assert [str(e) for e in events] == ["kill:1@20", "stop:*@30+5", "kill_syncer@40", "add@50",
                                      "retire:2@90"]
  with pytest.raises(ConfigError, match="launch.chaos"):
    chaos.parse("explode:1@3")
  a = chaos.generate(12, seed=3, start=10, end=60, spare=1)
  assert a == chaos.generate(12, seed=3, start=10, end=60, spare=1)
  assert len(a) == 12 and all(10 <= e.at <= 60 for e in a)
  assert sum(e.kind == "add" for e in a) <= 1
  assert sum(e.kind == "retire" for e in a) <= sum(e.kind == "add" for e in a)
  with pytest.raises(ConfigError, match="launch.max_learners"):
    chaos.schedule("add@1;add@2", 0, seed=0, start=0, end=1, count=3, max_learners=4)


def test_chaos_targets_a_syncer_shard_and_refuses_a_bad_one():
  events = chaos.parse("kill_syncer@4;kill_syncer:1@5")
  assert [(e.kind, e.shard) for e in events] == [("kill_syncer", 0), ("kill_syncer", 1)]
  assert [str(e) for e in events] == ["kill_syncer@4", "kill_syncer:1@5"]
  with pytest.raises(ConfigError, match=r"^launch.chaos: kill_syncer:2@5 names syncer shard 2, "
                     r"but sync.shards=2"):
    chaos.schedule("kill_syncer:2@5", 0, seed=0, start=0, end=1, count=1, max_learners=1,
                   shards=2)
  with pytest.raises(ConfigError, match="launch.chaos"):
    chaos.parse("kill_syncer:-1@5")
  # Drawn syncer kills spread over the shards; one shard draws as before.
  drawn = chaos.generate(60, seed=3, start=0, end=60, spare=0, shards=3)
  assert {e.shard for e in drawn if e.kind == "kill_syncer"} == {0, 1, 2}
  assert chaos.generate(12, seed=3, start=10, end=60, spare=1, shards=1) == chaos.generate(
      12, seed=3, start=10, end=60, spare=1)


# The sharded syncer's layout (`sync.shards` > 1, docs/design.md 3.1).
OWNER = ownership.assign(PLAN.num_elements, 2)


def _merged(p, version, seed=0):
  return Merged(fragment=p, version=version, published_at=1.0,
                tensors={k: _params(seed)[k] for k in PLAN.fragments[p]})


def _delivery(learner, p, step):
  return Delivery(learner=learner, incarnation=0, fragment=p, local_step=step, steps=step,
                  tokens=100 * step, base_version=0, kind="values", transit_s=0.0,
                  tensors={k: _params(1)[k] for k in PLAN.fragments[p]})


def test_one_shard_keeps_the_unsharded_layout(where):
  root, files = where
  (store,) = store_lib.shard_stores(root, 1)
  assert store.shard is None and store.shared is store and store.root == store.base
  store.merged.put(_merged(0, 0), {k: np.zeros(SHAPES[k], np.float32)
                                   for k in PLAN.fragments[0]}, {"round": None})
  assert (files / "merged" / "index.json").exists() and not (files / "shards").exists()
  assert store_lib.global_index([store]) == {0: 0}


def test_each_shard_owns_its_folder_and_shares_the_run_records(where):
  root, files = where
  shards = store_lib.shard_stores(root, 2)
  assert sorted(set(OWNER)) == [0, 1]
  for p, s in enumerate(OWNER):
    shards[s].merged.put(_merged(p, 3), {k: np.zeros(SHAPES[k], np.float32)
                                         for k in PLAN.fragments[p]}, {"round": None})
    shards[s].blobs.write_json("registry.json", {"shard": s})
  for s in (0, 1):
    own = [p for p in range(PLAN.num_fragments) if OWNER[p] == s]
    assert json.loads((files / "shards" / f"s{s}" / "merged" / "index.json").read_text()) == {
        str(p): 3 for p in own}
    assert json.loads((files / "shards" / f"s{s}" / "registry.json").read_text()) == {"shard": s}
  assert not (files / "merged" / "index.json").exists()  # nothing merged at the root
  # Heartbeats, incarnations, the run start, learner checkpoints and stop.json are the run's.
  _beat(shards[1], 4)
  assert set(shards[0].learners.heartbeats()) == {4} and (files / "heartbeats" / "l4.json").exists()
  assert shards[1].learners.next_incarnation(4) == 0 and shards[0].learners.next_incarnation(4) == 1
  assert shards[0].run.start(create=True) == shards[1].run.start()
  assert shards[1].learners.learner_dir(4) == shards[0].learners.learner_dir(4) == store_lib.Store(
      root).learners.learner_dir(4)
  assert not shards[0].run.stop_requested()
  store_lib.shared_store(root, 2).run.request_stop({"at": 1.0})
  assert shards[0].run.stop_requested() and shards[1].run.stop_requested()
  assert store_lib.global_index(shards, OWNER) == {p: 3 for p in range(PLAN.num_fragments)}


def test_learner_link_routes_each_delivery_to_its_shard_and_polls_every_index(where):
  root, _ = where
  shards = store_lib.shard_stores(root, 2)
  zeros = lambda p: {k: np.zeros(SHAPES[k], np.float32) for k in PLAN.fragments[p]}  # noqa
  for p, s in enumerate(OWNER):
    shards[s].merged.put(_merged(p, 1 + p), zeros(p), {"round": None})
  # A version planted in the wrong shard's folder is never read (nor counted in the index).
  wrong = 1 - OWNER[0]
  shards[wrong].merged.put(_merged(0, 9, seed=5), zeros(0), {"round": None})
  assert store_lib.global_index(shards, OWNER)[0] == 1
  link = LearnerStoreLink(shards[0].shared, 0, 0, poll_s=0.01, shapes=None, shards=shards, owner=OWNER)
  try:
    link.wait_initial(PLAN.num_fragments, timeout=30)
    assert {p: link.latest_version(p) for p in range(PLAN.num_fragments)} == {
        p: 1 + p for p in range(PLAN.num_fragments)}
    for p in range(PLAN.num_fragments):
      link.heartbeat(Heartbeat(0, 0, 4, 0.1, 0.0))
      link.deliver(_delivery(0, p, 4))
    link.flush()
    for s in (0, 1):
      assert [parse_payload_name(n)[0] for n in shards[s].payloads.committed()] == [
          p for p in range(PLAN.num_fragments) if OWNER[p] == s]
    # A newer version in the owner's folder is fetched; the planted one never.
    shards[OWNER[0]].merged.put(_merged(0, 2, seed=2), zeros(0), {"round": None})
    got = link.wait_for(0, 2, timeout=30)
    assert got.version == 2
    for k in PLAN.fragments[0]:
      np.testing.assert_array_equal(got.tensors[k], _params(2)[k])
  finally:
    link.close()


def test_a_learner_link_waits_for_every_shard(where):
  root, _ = where
  shards = store_lib.shard_stores(root, 2)
  p = OWNER.index(0)
  shards[0].merged.put(_merged(p, 0), {k: np.zeros(SHAPES[k], np.float32)
                                       for k in PLAN.fragments[p]}, {"round": None})
  link = LearnerStoreLink(shards[0].shared, 0, 0, poll_s=0.01, shapes=None, shards=shards, owner=OWNER)
  try:
    with pytest.raises(TimeoutError, match=r"shards/s1/merged"):
      link.wait_initial(PLAN.num_fragments, timeout=0.5)
  finally:
    link.close()


def test_a_shard_recovers_only_its_own_fragments(tmp_path):
  """Shard 1 restarted over its folder resumes its fragments' versions and ledger; shard 0's
  folder and fragments are untouched by it."""
  shards = store_lib.shard_stores(str(tmp_path / "store"), 2)
  own = ownership.owned(OWNER, 1)
  records = []
  s1 = syncer_lib.Syncer(_params(0), PLAN, SyncConfig(quorum=1, gamma=0.0), OuterConfig(),
                         sync_delay_s=0.0, on_round=records.append, owned=own)
  for merged in s1.initial(0.0):
    shards[1].merged.put(merged, s1.momentum, {"round": None, "state": s1.export_state()})
  p = own[0]
  merged, _ = s1.tick(1.0, [Heartbeat(0, 0, 1, 0.1, 0.0)], [_delivery(0, p, 4)])
  syncer_process._commit(shards[1], s1, merged, records, open(os.devnull, "w"))
  assert s1.versions[p] == 1
  again = syncer_lib.Syncer(_params(7), PLAN, SyncConfig(quorum=1), OuterConfig(),
                            sync_delay_s=0.0, owned=own)
  ok, merged_keys, committed = syncer_process.recover(shards[1], again, PLAN.num_fragments, 8)
  assert ok and merged_keys == {(p, 0, 0, 4)} and [r["round"] for r in committed] == [0]
  assert [again.versions[q] for q in own] == [s1.versions[q] for q in own]
  assert shards[1].merged.index() == {q: s1.versions[q] for q in own}
  assert shards[0].merged.index() == {} and shards[0].merged.versions(p) == []


@pytest.mark.parametrize("num_shards", [1, 2])
def test_init_from_a_store_assembles_g_from_every_shards_newest_version(tmp_path, num_shards):
  """`train.init_from=STORE`: each fragment's newest committed version, from its own shard's
  folder (here fragment 0 at version 2, the others at 0), checked against the values written."""
  from diloco.artifacts import export  # pylint: disable=import-outside-toplevel
  root = str(tmp_path / "store")
  owner = ownership.assign(PLAN.num_elements, num_shards)
  stores = store_lib.shard_stores(root, num_shards)
  store_layout.claim(stores[0].shared, store_layout.layout_record(
      num_shards, PLAN, fragments.unflatten_tree({k: np.zeros(s, np.float32)
                                                  for k, s in SHAPES.items()})))
  momentum = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
  for p in range(PLAN.num_fragments):
    stores[owner[p]].merged.put(_merged(p, 0, seed=0), momentum, {"round": None})
  for version in (1, 2):
    stores[owner[0]].merged.put(_merged(0, version, seed=version), momentum, {"round": None})
  assert export.store_shards(root) == num_shards
  params, source = export.read_params(root, read_store=global_view.read_store)
  flat = fragments.flatten_tree(params)
  want = {k: _params(2 if k in PLAN.fragments[0] else 0)[k] for k in SHAPES}
  assert flat.keys() == want.keys() and all(np.array_equal(flat[k], want[k]) for k in want)
  assert f"{num_shards} syncer shard(s)" in source and "0:v2" in source
  assert export.store_shards(str(tmp_path)) == 0  # not a store
  with pytest.raises(ConfigError, match=r"^train.init_from: .* is a multi-process run's store"):
    export.read_params(root)  # without the runtime's reader: one line, nothing read
  # A lost or emptied index: still a store, and the markers give the same G.
  for folder in glob.glob(os.path.join(root, "**", "merged"), recursive=True):
    os.remove(os.path.join(folder, "index.json"))
  assert export.store_shards(root) == num_shards
  params, _ = export.read_params(root, read_store=global_view.read_store)
  flat = fragments.flatten_tree(params)
  assert all(np.array_equal(flat[k], want[k]) for k in want)


def test_a_learner_link_must_say_which_shapes_it_takes(tmp_path):
  """`shapes` has no default: a library caller that forgets it would take a version of any
  paths and shapes the store holds (the processes pass the plan's)."""
  with pytest.raises(TypeError, match="shapes"):
    LearnerStoreLink(Store(str(tmp_path)), 0, 0, poll_s=0.01)  # pylint: disable=missing-kwoa
