"""Bad input at the trust boundary (docs/design.md 2.5): crafted deliveries, heartbeats and
store entries.

Every case feeds the real Syncer (and, for files, a real Store on disk) a delivery of one bad
kind next to good ones, and checks that the syncer survives, counts the rejection under its
reason (and lists it in the next tape record), keeps G and the momentum finite, and merges a
later good round.
"""

import dataclasses
import io
import json
import math
import os

import numpy as np
import pytest

from diloco import fragments, outer
from diloco.delivery import Delivery
from diloco.distributed import syncer_process
from diloco.distributed.store import Store
from diloco.distributed.syncer_link import SyncerStoreLink
from diloco.outer.merge import OuterConfig
from diloco.sync import intake
from diloco.sync import syncer as syncer_lib
from diloco.sync.policy import SyncConfig
from diloco.transport import Heartbeat

SHAPES = {"embedder/embedding": (6, 4), "layers/0/w": (4, 4), "layers/1/w": (4, 3)}
PLAN = fragments.plan_fragments(SHAPES, num_fragments=1)
EXPECTED = {0: dict(SHAPES)}


def _params(seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def _syncer(params=None, quorum=1, **outer_cfg):
  records = []
  cfg = SyncConfig(quorum=quorum, gamma=0.0, heartbeat_timeout_s=30.0)
  s = syncer_lib.Syncer(params or _params(0), PLAN, cfg, OuterConfig(**outer_cfg),
                        sync_delay_s=0.0, on_round=records.append)
  return s, records


def _good(learner=0, step=4, **fields):
  base = {"learner": learner, "incarnation": 0, "fragment": 0, "local_step": step, "steps": 4,
          "tokens": 400, "base_version": 0, "kind": "values", "tensors": _params(10 + step),
          "transit_s": 0.01, "lead_s": 0.0}
  return Delivery(**dict(base, **fields))


def _beats(now, *learners):
  return [Heartbeat(m, 0, 1, 1.0, now) for m in learners]


def _finite(s):
  return all(np.isfinite(v).all() for d in (s.params, s.momentum) for v in d.values())


def _then_a_good_round_merges(s, records, now, reason):
  """The next good delivery merges; its tape record lists the earlier rejection."""
  version = s.versions[0]
  merged, _ = s.tick(now, _beats(now, 0, 1), [_good(step=100 + int(now))])
  assert [m.version for m in merged] == [version + 1]
  assert _finite(s)
  assert reason in [r["reason"] for rec in records for r in rec["rejected"]]


class _Exploding(dict):
  """Tensors whose `items()` raises from the `n`-th call on: a delivery that makes the
  syncer's own code raise (at ingestion for n=1, in the merge for n=2)."""

  def __init__(self, tensors, n):
    super().__init__(tensors)
    self.calls, self.n = 0, n

  def items(self):
    self.calls += 1
    if self.calls >= self.n:
      raise RuntimeError("crafted tensors")
    return super().items()


def _quantized(**fields):
  q = {k: outer.quantize(v, 8, 4) for k, v in _params(3).items()}
  return {k: dataclasses.replace(v, **fields) for k, v in q.items()}


@pytest.mark.parametrize("fields, reason", [
    ({"transit_s": "soon"}, "bad_time"),
    ({"lead_s": None}, "bad_time"),
    ({"tensors": {k: np.full(s, 3e38, np.float32) for k, s in SHAPES.items()}}, "too_large"),
    ({"tensors": {k: np.full(s, 1e18, np.float32) for k, s in SHAPES.items()}}, "too_large"),
    ({"tensors": None}, "bad_payload"),
    ({"tensors": {1: np.zeros(3, np.float32)}}, "bad_payload"),
    ({"kind": 5}, "bad_payload"),
    ({"kind": "delta"}, "bad_payload"),  # values sent as a delta
    ({"learner": -3}, "bad_counters"),
    ({"learner": "0"}, "bad_counters"),
    ({"incarnation": float("nan")}, "bad_counters"),
    ({"steps": np.float64(4)}, "bad_counters"),
    ({"tensors": _Exploding(_params(5), 1)}, "ingest_error"),
])
def test_bad_delivery_is_rejected_and_a_later_round_merges(fields, reason):
  s, records = _syncer()
  g0 = s.global_params()
  merged, _ = s.tick(1.0, _beats(1.0, 0, 1), [_good(**{"learner": 1, **fields})])
  assert merged == [] and s.rejections[reason] == 1 and s.versions == [0]
  for k in SHAPES:
    np.testing.assert_array_equal(s.params[k], g0[k])
  assert [f[4] for f in s.take_faults()] == [reason]  # for the runtime to quarantine
  _then_a_good_round_merges(s, records, 2.0, reason)


@pytest.mark.parametrize("fields, reason", [
    ({"scales": np.full(6, 3e38, np.float32)}, "non_finite"),  # dequantises to inf
    ({"scales": np.ones(2, np.float32)}, "bad_payload"),  # fewer scales than blocks
    ({"values": np.zeros(3, np.int8)}, "bad_payload"),  # fewer codes than elements
    ({"bits": 3}, "bad_payload"),
    ({"block": 0}, "bad_payload"),
    ({"shape": (99,)}, "bad_payload"),
])
def test_bad_quantised_delivery_is_rejected(fields, reason):
  s, records = _syncer(quantize_bits=8, quantize_block=4)
  tensors = {k: v for k, v in _quantized().items()}
  name = next(k for k in SHAPES if math.prod(SHAPES[k]) == 24)
  tensors[name] = dataclasses.replace(tensors[name], **fields)
  merged, _ = s.tick(1.0, _beats(1.0, 0, 1), [_good(learner=1, kind="delta", tensors=tensors)])
  assert merged == [] and s.rejections[reason] == 1
  _then_a_good_round_merges(s, records, 2.0, reason)


def test_one_bad_delivery_never_stops_a_round_of_good_ones():
  s, _ = _syncer(quorum=2)
  huge = {k: np.full(sh, 3e38, np.float32) for k, sh in SHAPES.items()}
  merged, _ = s.tick(1.0, _beats(1.0, 0, 1, 2), [
      _good(learner=0), _good(learner=1, tensors=huge), _good(learner=2)])
  assert len(merged) == 1 and s.last_quorum == 2 and s.rejections == {"too_large": 1}
  assert _finite(s)


def test_a_delivery_that_raises_in_the_merge_is_dropped_and_the_others_merge():
  s, records = _syncer(quorum=2)
  merged, _ = s.tick(1.0, _beats(1.0, 0, 1, 2), [
      _good(learner=0), _good(learner=1, tensors=_Exploding(_params(7), 2)), _good(learner=2)])
  assert len(merged) == 1 and s.last_quorum == 2 and s.rejections == {"merge_error": 1}
  assert [(f[1], f[4]) for f in s.take_faults()] == [(1, "merge_error")]
  assert [a["learner"] for a in records[0]["admitted"]] == [0, 2]
  assert _finite(s)


def test_round_that_could_overflow_g_is_rejected_whole_and_g_is_unchanged():
  """G near the bound (a run gone wild, or crafted): deliveries far from it could take G or the
  momentum past float32's range; the round is refused before anything is written."""
  big = _params(0, scale=1e17)
  s, records = _syncer(params=big)
  g0, b0 = s.global_params(), {k: v.copy() for k, v in s.momentum.items()}
  far = {k: -v for k, v in big.items()}  # each delivery alone is within MAX_NORM
  merged, _ = s.tick(1.0, _beats(1.0, 0, 1), [_good(0, tensors=far), _good(1, tensors=far)])
  assert merged == [] and s.versions == [0] and s.rejections == {"overflow": 2}
  for k in SHAPES:
    np.testing.assert_array_equal(s.params[k], g0[k])
    np.testing.assert_array_equal(s.momentum[k], b0[k])
  # A later delivery close to G merges, and the tape lists the refused ones.
  near = {k: v * np.float32(1 - 1e-6) for k, v in big.items()}
  merged, _ = s.tick(2.0, _beats(2.0, 0), [_good(0, step=8, tensors=near)])
  assert [m.version for m in merged] == [1] and _finite(s)
  assert [r["reason"] for r in records[0]["rejected"]] == ["overflow", "overflow"]


def test_merge_bound_holds_against_a_numpy_nesterov_step():
  """`intake.merge_bound` >= the norms a real merge produces (float64 oracle, RDA merge)."""
  rng = np.random.default_rng(0)
  for _ in range(20):
    g = rng.standard_normal(50) * rng.uniform(0.1, 10)
    b = rng.standard_normal(50) * rng.uniform(0.1, 10)
    deltas = [rng.standard_normal(50) * rng.uniform(0.1, 10) for _ in range(3)]
    w = rng.uniform(0.1, 1, 3)
    w /= w.sum()
    units = sum(wi * d / np.linalg.norm(d) for wi, d in zip(w, deltas))
    grad = sum(wi * np.linalg.norm(d) for wi, d in zip(w, deltas)) * units / np.linalg.norm(
        units)
    lr, mu = rng.uniform(0.1, 2), rng.uniform(0, 0.99)
    b_new = mu * b + grad
    g_new = g - lr * (grad + mu * b_new)
    bound = intake.merge_bound(np.linalg.norm(g), np.linalg.norm(b),
                               max(map(np.linalg.norm, deltas)), lr, mu)
    assert bound >= max(np.linalg.norm(g_new), np.linalg.norm(b_new), np.linalg.norm(grad))


@pytest.mark.parametrize("beat", [
    Heartbeat(-1, 0, 1, 1.0, 1.0), Heartbeat("7", 0, 1, 1.0, 1.0),
    Heartbeat(1, float("inf"), 1, 1.0, 1.0), Heartbeat(1, 0, None, 1.0, 1.0),
    Heartbeat(10**30, 0, 1, 1.0, 1.0),
])
def test_bad_heartbeat_is_counted_and_never_registered(beat):
  s, records = _syncer()
  s.tick(1.0, [beat], ())
  assert s.rejections == {"bad_heartbeat": 1} and set(s.registry) == set()
  _then_a_good_round_merges(s, records, 2.0, "bad_heartbeat")
  assert records[0]["rejected"][0]["learner"] in (-1, 1)  # never a crafted object on the tape
  json.dumps(records)


@pytest.mark.parametrize("times", [
    {"transit_s": float("nan")}, {"transit_s": float("inf")}, {"transit_s": -1.0},
    {"transit_s": 1e12}, {"lead_s": float("nan")}, {"lead_s": 1e300},
])
def test_unusable_times_are_ignored_and_counted_and_the_delivery_merges(times):
  """docs/design.md 2.4: non-finite or negative measurements are ignored (and so are absurd
  ones); the delivery's progress is not lost for a broken clock."""
  s, _ = _syncer()
  merged, _ = s.tick(1.0, _beats(1.0, 0), [_good(0, **times)])
  assert len(merged) == 1 and s.rejections == {}
  assert s.state_summary()["ignored"] == {"bad_time_ignored": 1}
  for ema in (s.timing.sync, s.timing.lead):
    assert ema.value is None or 0.0 <= ema.value < 1.0


def test_nan_or_absurd_times_never_reach_the_emas():
  """A NaN step time, NaN transit or absurd lead used to turn the EMAs (and the grace
  deadlines computed from them) NaN for good."""
  s, _ = _syncer(quorum=2)
  s.policy = dataclasses.replace(s.policy, gamma=0.8)
  beats = [Heartbeat(0, 0, 1, float("nan"), 1.0), Heartbeat(1, 0, 1, 1e300, 1.0),
           Heartbeat(2, 0, 1, 0.5, 1.0)]
  merged, deadline = s.tick(1.0, beats, [_good(0, transit_s=float("nan")),
                                         _good(1, lead_s=1e300)])
  assert s.rejections == {} and s.ignored == {"bad_time_ignored": 4}
  if not merged:  # the grace window is open: its deadline is a real time
    assert math.isfinite(deadline)
    merged, _ = s.tick(deadline, (), ())
  assert len(merged) == 1
  merged, deadline = s.tick(5.0, _beats(5.0, 0, 1, 2), [_good(0, step=8), _good(1, step=8)])
  if not merged:  # the grace window is open: its deadline is a real time
    assert math.isfinite(deadline)
    merged, _ = s.tick(deadline, (), ())
  assert len(merged) == 1
  for ema in (s.timing.sync, s.timing.lead, s.timing.quorum, *s._step_ema.values()):
    assert ema.value is None or math.isfinite(ema.value)
  merged, deadline = s.tick(9.0, _beats(9.0, 0, 1, 2), [_good(0, step=12), _good(1, step=12)])
  assert merged or math.isfinite(deadline)


# The store: crafted entries on a real disk, read through the syncer's link.
def _store_with_link(tmp_path):
  store = Store(tmp_path)
  link = SyncerStoreLink(store, EXPECTED)
  link.poll(0.0)  # the first poll only takes a baseline
  store.learners.put_heartbeat(0, {"incarnation": 0, "seq": 1, "local_step": 4, "step_time": 0.1})
  return store, link


def _put(store, tmp_path, step, tensors=None):
  store.payloads.put(_good(step=step, tensors=tensors or _params(step)))
  return tmp_path / "payloads" / f"f0_l0_i0_s{step}"


def _edit_marker(entry, **fields):
  marker = entry.parent / f"{entry.name}.json"
  record = json.loads(marker.read_text())
  record.update(fields)
  marker.write_text(json.dumps(record))  # json writes NaN and Infinity as JSON reads them


def _edit_metadata(entry, old, new):
  path = entry / "_METADATA"
  path.write_text(path.read_text().replace(old, new))


def _pad(entry):
  with open(entry / "t0000.npy", "r+b") as f:
    f.truncate(8 << 30)  # 8 GiB, sparse: reading it would take the test far past its time


_ENTRY_CASES = {
    "steps 1e400": (lambda e: _edit_marker(e, steps=float("inf")), "bad_counters"),
    "steps 4.5": (lambda e: _edit_marker(e, steps=4.5), "bad_counters"),
    "steps '4'": (lambda e: _edit_marker(e, steps="4"), "bad_counters"),
    "tokens true": (lambda e: _edit_marker(e, tokens=True), "bad_counters"),
    "base_version -7": (lambda e: _edit_marker(e, base_version=-7), "bad_counters"),
    "lead null": (lambda e: _edit_marker(e, lead_s=None), "bad_time"),
    "transit 'soon'": (lambda e: _edit_marker(e, transit_s="soon"), "bad_time"),
    "no kind": (lambda e: _edit_marker(e, kind=None), "unreadable"),
    "final 'yes'": (lambda e: _edit_marker(e, final="yes"), "unreadable"),
    "final 1": (lambda e: _edit_marker(e, final=1), "unreadable"),
    "paths not a list": (lambda e: _edit_marker(e, paths="layers/0/w"), "unreadable"),
    "quantization bits 3": (
        lambda e: _edit_marker(e, kind="delta", quantization={"bits": 3, "block": 4}),
        "unreadable"),
    "quantization bits true": (
        lambda e: _edit_marker(e, kind="delta", quantization={"bits": True, "block": 4}),
        "unreadable"),
    "_METADATA names ../../x": (lambda e: _edit_metadata(e, '"t0000"', '"../../x"'),
                                "bad_metadata"),
    "_METADATA names t0000/../../x": (lambda e: _edit_metadata(e, '"t0001"', '"t0000/../../x"'),
                                      "bad_metadata"),
    "_METADATA asks for OCDBT": (lambda e: _edit_metadata(e, '"use_ocdbt": false',
                                                          '"use_ocdbt": true'), "bad_metadata"),
    "_METADATA not JSON": (lambda e: (e / "_METADATA").write_text("{"), "bad_metadata"),
    "extra file": (lambda e: (e / "t0009.npy").write_bytes(b"x"), "bad_metadata"),
    "missing file": (lambda e: os.remove(e / "t0001.npy"), "bad_metadata"),
    "subdirectory": (lambda e: os.mkdir(e / "t0009.npy"), "bad_metadata"),
    "symlink out of the entry": (
        lambda e: (os.remove(e / "t0000.npy"),
                   os.symlink(e.parent.parent / "outside.npy", e / "t0000.npy")),
        "bad_metadata"),
    "8 GiB file": (_pad, "oversize"),
}


@pytest.mark.parametrize("case", sorted(_ENTRY_CASES))
def test_bad_store_entry_is_quarantined_with_its_reason_before_orbax_reads_it(tmp_path, case):
  edit, reason = _ENTRY_CASES[case]
  np.save(tmp_path / "outside.npy", np.zeros(16, np.float32))  # what an escape would read
  store, link = _store_with_link(tmp_path)
  s, records = _syncer()
  entry = _put(store, tmp_path, 4)
  edit(entry)
  good = _put(store, tmp_path, 8)
  store.learners.put_heartbeat(0, {"incarnation": 0, "seq": 2, "local_step": 8, "step_time": 0.1})
  tape = io.StringIO()
  syncer_process.sync_once(store, s, link, records, tape, keep=3, now=1.0)
  link.flush()
  assert s.rejections == {reason: 1} and s.versions == [1] and _finite(s)
  assert json.loads(tape.getvalue())["rejected"][0]["reason"] == reason
  assert store.payloads.quarantined()[entry.name]["reason"] == reason
  assert store.payloads.committed() == [] and not os.path.exists(good)
  assert os.path.isdir(tmp_path / "quarantine" / entry.name)
  # A restarted syncer never sees it again.
  link.close()
  again = SyncerStoreLink(store, EXPECTED)
  again.poll(2.0)
  assert again.poll(3.0)[1:3] == ([], [])
  again.close()


def test_a_delivery_the_syncer_refuses_is_quarantined_by_the_runtime(tmp_path):
  """Bad values pass the store's checks (they are well-formed files) and are refused by the
  syncer; `sync_once` moves them to quarantine instead of deleting them."""
  store, link = _store_with_link(tmp_path)
  s, records = _syncer()
  entry = _put(store, tmp_path, 4, tensors={k: np.full(sh, 3e38, np.float32)
                                            for k, sh in SHAPES.items()})
  store.learners.put_heartbeat(0, {"incarnation": 0, "seq": 2, "local_step": 4, "step_time": 0.1})
  syncer_process.sync_once(store, s, link, records, io.StringIO(), keep=3, now=1.0)
  link.close()
  assert s.rejections == {"too_large": 1} and s.versions == [0] and _finite(s)
  assert store.payloads.quarantined()[entry.name]["reason"] == "too_large"
  assert store.payloads.committed() == []


def test_an_entry_whose_read_raises_is_quarantined_and_the_link_survives(tmp_path, monkeypatch):
  """A read that raises something no check foresaw (here injected into the real read) is a
  poison pill: quarantined as `read_error`, and the next entry is still read."""
  store, link = _store_with_link(tmp_path)
  bad, good = _put(store, tmp_path, 4), _put(store, tmp_path, 8)
  real_read = store.payloads.read

  def read(name, expected):
    if name == bad.name:
      raise RecursionError("crafted nesting")
    return real_read(name, expected)

  monkeypatch.setattr(store.payloads, "read", read)
  store.learners.put_heartbeat(0, {"incarnation": 0, "seq": 2, "local_step": 8, "step_time": 0.1})
  _, payloads, rejected, _ = link.poll(1.0)
  link.close()
  assert [p.local_step for p in payloads] == [8] and os.path.exists(good)
  assert [(r.name, r.reason) for r in rejected] == [(bad.name, "read_error")]
  assert "RecursionError" in store.payloads.quarantined()[bad.name]["detail"]


def test_a_quarantine_cut_short_by_a_crash_is_finished_and_keeps_its_first_reason(tmp_path):
  """A syncer that died between moving the data and moving the marker leaves a listed marker
  without data: the next syncer quarantines it again, keeping the original reason."""
  store, link = _store_with_link(tmp_path)
  entry = _put(store, tmp_path, 4)
  # The first two steps of `Payloads.quarantine`, as the dead syncer left them.
  os.mkdir(tmp_path / "quarantine")
  store.blobs.write_json(f"quarantine/{entry.name}.reason.json",
                         {"reason": "too_large", "detail": "", "time": 0.0})
  os.rename(entry, tmp_path / "quarantine" / entry.name)
  _, payloads, rejected, _ = link.poll(1.0)
  link.close()
  assert payloads == [] and [r.reason for r in rejected] == ["unreadable"]
  assert store.payloads.quarantined()[entry.name]["reason"] == "too_large"
  assert store.payloads.committed() == []
  assert os.path.exists(tmp_path / "quarantine" / f"{entry.name}.json")
