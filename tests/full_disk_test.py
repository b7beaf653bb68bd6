"""A full disk: every write of the store fails with ENOSPC at the Nth byte; the store raises
a clear StoreError naming the entry, readers never see a half entry, and the next write after
space is freed works. Learner side (payloads) and syncer side (merged data, marker, index),
on a local directory and on the emulated object store."""

import builtins
import errno
import gc
import os
import time

import numpy as np
import object_store
import pytest

from diloco import fragments
from diloco.delivery import Delivery
from diloco.distributed import syncer_process
from diloco.distributed.learner_link import LearnerStoreLink
from diloco.distributed.store import Store
from diloco.distributed.store.entry_check import StoreError
from diloco.distributed.store.names import WRITE_FAILED
from diloco.outer.merge import OuterConfig
from diloco.sync import syncer as syncer_lib
from diloco.sync.policy import SyncConfig
from diloco.transport import Heartbeat, Merged

SHAPES = {"a": (16, 8), "b": (8,)}
PLAN = fragments.plan_fragments(SHAPES, num_fragments=1)
EXPECTED = {0: dict(SHAPES)}


class Disk:
  """Every file written under `folder` through Python's `open` draws on one budget of bytes;
  the write that would pass it writes what fits and raises OSError(ENOSPC), as a full disk
  does. `left=None`: unlimited (space freed)."""

  def __init__(self, folder, monkeypatch):
    self.folder, self.left, self.written = str(folder), None, 0
    real_open = builtins.open

    def patched(file, mode="r", *args, **kwargs):
      f = real_open(file, mode, *args, **kwargs)
      if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax") and (
          os.path.abspath(os.fspath(file)).startswith(self.folder)):
        return _Metered(f, self)
      return f

    monkeypatch.setattr(builtins, "open", patched)

  def take(self, n: int) -> int:
    """How many bytes of an n-byte write fit (all of them while there is room)."""
    fits = n if self.left is None else min(n, self.left)
    if self.left is not None:
      self.left -= fits
    self.written += fits
    return fits


class _Metered:
  """A file whose writes draw on the disk's budget; a short write raises ENOSPC."""

  def __init__(self, f, disk):
    self._f, self._disk = f, disk

  def write(self, data):
    size = len(data.encode()) if isinstance(data, str) else memoryview(data).nbytes
    fits = self._disk.take(size)
    if fits < size:
      if isinstance(data, str):
        self._f.write(data[:fits])
      else:
        self._f.write(memoryview(data).cast("B")[:fits])
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._f.name)
    return self._f.write(data)

  def __getattr__(self, name):
    return getattr(self._f, name)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._f.close()
    return False


@pytest.fixture(params=["local", "object"])
def where(request, tmp_path, monkeypatch):
  root, _ = object_store.location(request.param, tmp_path, monkeypatch)
  return root, Disk(tmp_path, monkeypatch)


def _payload(step):
  rng = np.random.default_rng(step)
  tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
  return Delivery(learner=0, incarnation=0, fragment=0, local_step=step, steps=step,
                  tokens=10 * step, base_version=0, kind="values", tensors=tensors, transit_s=0.0)


def _budgets(total: int) -> list[int]:
  """Where the disk fills up: at once, early, midway, and at the very last byte (the commit
  marker, written last)."""
  return sorted({0, 100, total // 2, total - 1})


def test_a_full_disk_fails_a_delivery_cleanly_and_the_next_one_works(where):
  root, disk = where
  store = Store(root)
  before = disk.written
  store.payloads.put(_payload(1))
  total = disk.written - before
  store.payloads.remove("f0_l0_i0_s1")
  for i, budget in enumerate(_budgets(total)):
    disk.left = budget
    step = 10 + i
    with pytest.raises(StoreError, match=f"f0_l0_i0_s{step}.*the disk is full") as e:
      store.payloads.put(_payload(step))
    assert e.value.reason == WRITE_FAILED
    assert store.payloads.committed() == []  # no reader ever sees it
    assert store.payloads.uncommitted() == []  # and nothing is left for the GC
  disk.left = None  # space freed
  store.payloads.put(_payload(99))
  got = store.payloads.read("f0_l0_i0_s99", EXPECTED)
  for k, v in _payload(99).tensors.items():
    np.testing.assert_array_equal(got.tensors[k], v)


def _syncer(on_round=None):
  params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
  cfg = SyncConfig(quorum=1, gamma=0.0, heartbeat_timeout_s=30.0)
  return syncer_lib.Syncer(params, PLAN, cfg, OuterConfig(), sync_delay_s=0.0,
                           on_round=on_round)


def test_a_full_disk_fails_a_merged_round_cleanly_and_the_next_write_works(where):
  """The round's data, its commit marker, or the index: whichever write fills the disk, the
  index still names the previous version, which still reads whole, and nothing uncommitted
  is left; when only the index write failed, the version is committed but unpublished, and
  the syncer's retry publishes it."""
  root, disk = where
  s = _syncer()
  values = {k: np.full(shape, 7.0, np.float32) for k, shape in SHAPES.items()}
  probe = Store(f"{root}_probe")  # the same writes elsewhere, to measure them
  probe.merged.put(s.initial(0.0)[0], s.momentum, {"round": None})
  before = disk.written
  probe.merged.put(Merged(0, 1, values, 1.0), s.momentum, {"round": 0})
  total = disk.written - before
  store = Store(root)
  store.merged.put(s.initial(0.0)[0], s.momentum, {"round": None})
  for budget in _budgets(total):
    disk.left = budget
    with pytest.raises(StoreError, match=r"merged f0_v1\b.*the disk is full") as e:
      store.merged.put(Merged(0, 1, values, 1.0), s.momentum, {"round": 0})
    assert e.value.reason == WRITE_FAILED
    assert store.merged.index() == {0: 0}  # learners still see version 0, whole
    np.testing.assert_array_equal(store.merged.read(0, 0)[0].tensors["a"], np.zeros((16, 8)))
    if budget == total - 1:  # the last byte is the index's: committed, not yet published
      assert store.merged.versions(0) == [0, 1] and "index.json" in str(e.value)
    else:
      assert store.merged.versions(0) == [0]
      assert store.merged.collect_uncommitted() == 0  # the failed write removed its data
  disk.left = None
  store.merged.put(Merged(0, 1, values, 1.0), s.momentum, {"round": 0})
  assert store.merged.index() == {0: 1}
  np.testing.assert_array_equal(store.merged.read(0, 1)[0].tensors["a"], values["a"])


def test_the_syncer_retries_a_commit_until_space_is_freed(where, tmp_path):
  """`syncer_process._commit`: the round is not lost, nor published, while the disk is full;
  it lands (once, with its tape line) when space comes back."""
  root, disk = where
  records = []
  store, s = Store(root), _syncer(on_round=records.append)
  for m in s.initial(0.0):
    store.merged.put(m, s.momentum, {"round": None, "state": s.export_state()})
  merged, _ = s.tick(1.0, [Heartbeat(0, 0, 4, 0.1, 1.0)], [_payload(4)])
  assert [m.version for m in merged] == [1]
  disk.left = 0
  waits = []

  def sleep(seconds):  # the store stays full for three tries, then space is freed
    waits.append(seconds)
    assert store.merged.index() == {0: 0}  # nothing published meanwhile
    if len(waits) == 3:
      disk.left = None

  with open(tmp_path / "tape.jsonl", "w", encoding="utf-8") as tape:
    commit = syncer_process._commit  # pylint: disable=protected-access
    commit(store, s, merged, records, tape, sleep=sleep)
  assert waits == [0.1, 0.2, 0.4]
  assert store.merged.index() == {0: 1} and store.merged.versions(0) == [0, 1]
  assert len((tmp_path / "tape.jsonl").read_text().splitlines()) == 1


def test_a_learner_retries_its_delivery_until_space_is_freed(where):
  """`LearnerStoreLink`: a delivery whose write fails is retried with backoff (the learner is
  told nothing, loses nothing, and waits only through the bounded outbox); it lands once
  space comes back."""
  root, disk = where
  store = Store(root)
  disk.left = 0
  link = LearnerStoreLink(store, 0, 0, poll_s=0.01, shapes=None, send_queue=1)
  try:
    link.deliver(_payload(4))
    deadline = time.monotonic() + 60
    while link.write_failures < 2 and time.monotonic() < deadline:
      time.sleep(0.01)
    assert link.write_failures >= 2  # failed, and was tried again
    assert store.payloads.committed() == []  # nothing half-written is visible meanwhile
    disk.left = None  # space freed
    link.flush(timeout=60)
    assert store.payloads.committed() == ["f0_l0_i0_s4"]
    got = store.payloads.read("f0_l0_i0_s4", EXPECTED)
    for k, v in _payload(4).tensors.items():
      np.testing.assert_array_equal(got.tensors[k], v)
  finally:
    link.close()


@pytest.fixture(autouse=True)
def _collect_garbage_after_each_test():
  """Collects each test's garbage (failed Orbax writes: event loops, futures, files) before
  the next test patches `open` again. Left to pile up over the file, it crashed CPython
  3.12.1's collector (a segfault in `gc`) in about 4 runs of 10; never on 3.11, and never in
  10 runs with this (docs/decisions/store_and_trust.md, "Durability of store entries, and a full disk")."""
  yield
  gc.collect()
