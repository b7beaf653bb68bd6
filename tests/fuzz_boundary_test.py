"""Property-based tests of the trust boundary (`hypothesis`): deliveries, heartbeats and store
entries, valid ones mutated field by field and random files where entries belong.

Invariants: the syncer never raises or blocks; G and the momentum stay finite and are
unchanged by rejected input; a valid delivery still merges afterwards; nothing merges twice.

Runs are bounded (a fixed number of examples, derandomised so CI sees the same ones) and keep
no example database (`database=None`); set DILOCO_FUZZ_EXAMPLES for a longer local search.
"""

import io
import json
import os
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco import fragments
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
LIMITS = intake.Limits(tokens_per_step=100, max_learners=4)
_EXAMPLES = int(os.environ.get("DILOCO_FUZZ_EXAMPLES", "0"))


def _bounded(n):
  return settings(max_examples=_EXAMPLES or n, deadline=None, database=None,
                  derandomize=not _EXAMPLES, suppress_health_check=[HealthCheck.too_slow])


# Values a crafted field may hold: every JSON type, extremes of each, and NumPy scalars.
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**53 + 1, 10**400, -(10**400), 2**31, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                         max_size=2),
    st.sampled_from([np.float64("nan"), np.int64(-1), np.float32(1e38)]))


def _params(seed):
  rng = np.random.default_rng(seed)
  return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _syncer(records=None):
  cfg = SyncConfig(quorum=1, gamma=0.0, heartbeat_timeout_s=30.0)
  return syncer_lib.Syncer(_params(0), PLAN, cfg, OuterConfig(), sync_delay_s=0.0,
                           limits=LIMITS, on_round=None if records is None else records.append)


def _valid(step, learner=0, **fields):
  base = {"learner": learner, "incarnation": 0, "fragment": 0, "local_step": step,
          "steps": 4, "tokens": 400, "base_version": 0, "kind": "values",
          "tensors": _params(step), "transit_s": 0.01, "lead_s": 0.0}
  return Delivery(**dict(base, **fields))


def _state(s):
  return ({k: v.copy() for k, v in s.params.items()},
          {k: v.copy() for k, v in s.momentum.items()}, list(s.versions))


def _same(a, b):
  return a[2] == b[2] and all(np.array_equal(x[k], y[k]) for x, y in zip(a[:2], b[:2])
                              for k in x)


def _finite(s):
  return all(np.isfinite(v).all() for d in (s.params, s.momentum) for v in d.values())


_TENSORS = st.one_of(
    JUNK, st.builds(lambda v: {k: np.full(s, v, np.float32) for k, s in SHAPES.items()},
                    st.floats(width=32, allow_nan=True, allow_infinity=True)),
    st.builds(lambda k: {k: np.zeros(3, np.float32)}, st.text(max_size=4)),
    st.builds(lambda dt: {k: np.zeros(s, dt) for k, s in SHAPES.items()},
              st.sampled_from([np.float64, np.int32, np.float16])))
_FIELDS = ["learner", "incarnation", "fragment", "local_step", "steps", "tokens",
           "base_version", "kind", "transit_s", "lead_s"]


@_bounded(200)
@given(field=st.sampled_from(_FIELDS + ["tensors"]), data=st.data())
def test_a_mutated_delivery_never_raises_and_never_moves_g_unless_it_is_valid(field, data):
  s = _syncer()
  s.tick(0.0, [Heartbeat(m, 0, 1, 1.0, 0.0) for m in range(4)], ())
  value = data.draw(_TENSORS if field == "tensors" else JUNK, label=field)
  before = _state(s)
  merged, _ = s.tick(1.0, [Heartbeat(0, 0, 1, 1.0, 1.0)], [_valid(8, **{field: value})])
  assert _finite(s)
  if not merged:
    assert _same(_state(s), before)
  # A valid delivery of another learner still merges; the same delivery again never does.
  merged, _ = s.tick(2.0, [Heartbeat(1, 0, 1, 1.0, 2.0)], [_valid(12, learner=1,
                                                                  base_version=s.versions[0])])
  assert len(merged) == 1 and _finite(s)
  again = _state(s)
  merged, _ = s.tick(3.0, [Heartbeat(1, 0, 1, 1.0, 3.0)], [_valid(12, learner=1,
                                                                  base_version=s.versions[0])])
  assert merged == [] and _same(_state(s), again)


@_bounded(200)
@given(fields=st.fixed_dictionaries({}, optional={
    k: JUNK for k in ("learner", "incarnation", "local_step", "step_time", "time")}))
def test_a_mutated_heartbeat_never_raises_and_leaves_the_registry_typed(fields):
  s = _syncer()
  beat = dict({"learner": 0, "incarnation": 0, "local_step": 1, "step_time": 1.0,
               "time": 1.0}, **fields)
  if beat["learner"] == 1:
    beat["learner"] = 0
  for t in (1.0, 2.0):
    s.tick(t, [Heartbeat(**beat), Heartbeat(1, 0, 1, 1.0, t)], ())
  for status in s.registry.values():
    assert intake.is_count(status.incarnation, 0) and np.isfinite(status.last_heartbeat)
    assert status.step_time is None or intake.is_duration(status.step_time)
  merged, _ = s.tick(3.0, [Heartbeat(1, 0, 1, 1.0, 3.0)], [_valid(8, learner=1)])
  assert len(merged) == 1 and _finite(s)


# Store entries: a delivery's marker mutated, random bytes where files belong, or a file
# of another kind where an entry belongs.
_MARKER_FIELDS = _FIELDS + ["paths", "quantization", "nbytes"]
_PLANTS = st.one_of(
    st.tuples(st.just("marker"), st.sampled_from(_MARKER_FIELDS), JUNK),
    st.tuples(st.just("marker_bytes"), st.just(""), st.binary(max_size=64)),
    st.tuples(st.just("metadata_bytes"), st.just(""), st.binary(max_size=64)),
    st.tuples(st.just("tensor_bytes"), st.just(""), st.binary(max_size=64)),
    st.tuples(st.just("entry_kind"), st.sampled_from(["file", "fifo", "symlink", "gone"]),
              st.none()),
    st.tuples(st.just("heartbeat"), st.sampled_from(["incarnation", "seq", "local_step",
                                                     "step_time", "state", "sent_at"]), JUNK),
    st.tuples(st.just("heartbeat_bytes"), st.just(""), st.binary(max_size=32)),
    st.tuples(st.just("index_bytes"), st.just(""), st.binary(max_size=32)),
)


def _plant(root, store, kind, field, value):
  entry = os.path.join(root, "payloads", "f0_l0_i0_s8")
  if kind == "marker":
    with open(entry + ".json", encoding="utf-8") as f:
      record = json.load(f)
    record[field] = value.tolist() if isinstance(value, np.generic) else value
    with open(entry + ".json", "w", encoding="utf-8") as f:
      f.write(json.dumps(record))
  elif kind in ("marker_bytes", "metadata_bytes", "tensor_bytes", "heartbeat_bytes",
                "index_bytes"):
    path = {"marker_bytes": entry + ".json", "metadata_bytes": os.path.join(entry, "_METADATA"),
            "tensor_bytes": os.path.join(entry, "t0000.npy"),
            "heartbeat_bytes": os.path.join(root, "heartbeats", "l0.json"),
            "index_bytes": os.path.join(root, "merged", "index.json")}[kind]
    with open(path, "wb") as f:
      f.write(value)
  elif kind == "entry_kind":
    store.blobs.remove("payloads/f0_l0_i0_s8")
    if field == "file":
      open(entry, "wb").close()
    elif field == "fifo":
      os.mkfifo(entry)
    elif field == "symlink":
      os.symlink(os.path.join(root, "merged"), entry)
  else:  # a heartbeat record with one field of another type
    store.learners.put_heartbeat(0, dict({"incarnation": 0, "seq": 2, "local_step": 8,
                                          "step_time": 0.1, "state": "up", "sent_at": 0.0},
                                         **{field: value.tolist() if isinstance(value, np.generic)
                                   else value}))


@_bounded(20)
@given(plant=_PLANTS)
def test_a_planted_store_entry_never_raises_out_of_sync_once(plant):
  with tempfile.TemporaryDirectory() as root:
    store = Store(root)
    records = []
    s = _syncer(records)
    for merged in s.initial(0.0):
      store.merged.put(merged, s.momentum, {"round": None, "state": s.export_state()})
    link = SyncerStoreLink(store, EXPECTED)
    link.poll(0.0)
    store.learners.put_heartbeat(0, {"incarnation": 0, "seq": 1, "local_step": 8, "step_time": 0.1})
    store.payloads.put(_valid(8))
    _plant(root, store, *plant)
    before = _state(s)
    syncer_process.sync_once(store, s, link, records, io.StringIO(), keep=3, now=1.0)
    assert _finite(s)
    if s.versions == [0]:
      assert _same(_state(s), before)
    # A valid delivery of learner 1 still merges, exactly once.
    store.learners.put_heartbeat(1, {"incarnation": 0, "seq": 1, "local_step": 12,
                                     "step_time": 0.1})
    syncer_process.sync_once(store, s, link, records, io.StringIO(), keep=3, now=2.0)
    version = s.versions[0]
    store.payloads.put(_valid(12, learner=1, base_version=version))
    store.learners.put_heartbeat(1, {"incarnation": 0, "seq": 2, "local_step": 12,
                                     "step_time": 0.1})
    syncer_process.sync_once(store, s, link, records, io.StringIO(), keep=3, now=3.0)
    link.flush()
    assert s.versions == [version + 1] and _finite(s)
    store.payloads.put(_valid(12, learner=1, base_version=version))
    syncer_process.sync_once(store, s, link, records, io.StringIO(), keep=3, now=4.0)
    link.close()
    assert s.versions == [version + 1]
