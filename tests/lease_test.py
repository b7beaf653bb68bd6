"""One syncer per store: the lease, in process on virtual clocks and between real processes
stopped and killed with real signals, on a local directory and on the emulated object store;
the in-process tests also on a local GCS emulator (`tests/gcs_emulator.py`), except those
that need the create-only write, which that emulator does not honour."""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import object_store
import pytest

from diloco.distributed.store import Store
from diloco.distributed.store.entry_check import StoreError
from diloco.distributed.store.lease import Lease, LeaseHeld, LeaseLost
from diloco.distributed.store.names import CONFLICT
from diloco.transport import Merged

HOLDER = os.path.join(os.path.dirname(__file__), "lease_holder.py")


@pytest.fixture(params=["local", "object", "gcs"])
def where(request, tmp_path, monkeypatch):
  if request.param == "gcs":
    return request.getfixturevalue("gcs_root"), None
  root, files = object_store.location(request.param, tmp_path, monkeypatch)
  return root, files


@pytest.fixture(params=["local", "object"])
def create_only_where(request, tmp_path, monkeypatch):
  """Stores whose create-only write is atomic: a local disk and the in-memory emulation. Not
  the GCS emulator, which ignores `ifGenerationMatch=0` and overwrites
  (`gcs_store_test.test_emulator_ignores_generation_preconditions`)."""
  root, files = object_store.location(request.param, tmp_path, monkeypatch)
  return root, files


class Clock:
  """One virtual time for the wall and monotonic clocks of every lease in a test."""

  def __init__(self):
    self.t = 1000.0

  def wall(self):
    return self.t

  def monotonic(self):
    return self.t


def _lease(store, clock, name, **kw):
  return Lease(store, duration_s=10.0, holder=name, wall=clock.wall, monotonic=clock.monotonic,
               **kw)


def _merged(version, value=None):
  value = float(version) if value is None else value
  return Merged(0, version, {"w": np.full(3, value, np.float32)}, 0.0)


MOMENTUM = {"w": np.zeros(3, np.float32)}


def test_a_second_syncer_waits_for_expiry_then_the_first_can_never_write_again(where):
  root, _ = where
  store, clock = Store(root), Clock()
  a, b = _lease(store, clock, "a"), _lease(store, clock, "b")
  assert a.acquire() == 0
  with pytest.raises(LeaseHeld, match="'a'.*only one syncer"):
    b.acquire(timeout_s=0)
  clock.t += 5
  assert a.renew()  # expires at 1015 now
  store.merged.put(_merged(0), MOMENTUM, {"by": "a"}, fence=a.check)
  clock.t += 9  # the first record's expiry (1010) has passed, not the renewed one's
  with pytest.raises(LeaseHeld):
    b.acquire(timeout_s=0)
  clock.t += 3.6  # past the renewed expiry and the allowed clock skew (2.5 s)
  assert b.acquire(timeout_s=0) == 1
  record = store.blobs.read_json("lease/g1.json")
  assert record["holder"] == "b" and record["after"]["holder"] == "a"
  assert record["taken_at"] > record["after"]["expires"] + b.skew_s
  with pytest.raises(LeaseLost, match="a lost the lease"):
    a.check()
  assert not a.renew()  # lost for good
  with pytest.raises(LeaseLost):
    store.merged.put(_merged(1), MOMENTUM, {"by": "a"}, fence=a.check)
  store.merged.put(_merged(1), MOMENTUM, {"by": "b"}, fence=b.check)
  assert store.merged.marker(0, 1)["by"] == "b" and store.merged.index() == {0: 1}
  assert store.merged.collect_uncommitted() == 0  # a's refused write left nothing


def test_a_holder_stopped_past_its_lease_stops_even_if_nobody_took_it(where):
  root, _ = where
  store, clock = Store(root), Clock()
  a = _lease(store, clock, "a")
  a.acquire()
  clock.t += 8  # stopped (SIGSTOP) longer than duration - margin: its clock ran on
  assert not a.held
  with pytest.raises(LeaseLost, match="ran out"):
    a.check()
  assert not a.renew()  # never revived, although generation 1 does not exist
  assert not store.blobs.exists("lease/g1.json")


def test_a_released_lease_or_a_dead_holder_on_this_host_is_taken_at_once(where):
  root, _ = where
  store, clock = Store(root), Clock()
  a = _lease(store, clock, "a")
  a.acquire()
  a.release()
  assert store.blobs.read_json("lease/g0.json")["released"]
  b = _lease(store, clock, "b")
  assert b.acquire(timeout_s=0) == 1 and store.blobs.read_json("lease/g1.json")["after"]["released"]
  clock.t += 1
  assert b.renew() and store.blobs.read_json("lease/g1.json")["after"]["holder"] == "a"  # kept
  # b's process dies (its record names a pid that no longer exists on this host).
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  record = store.blobs.read_json("lease/g1.json")
  store.blobs.write_json("lease/g1.json", dict(record, pid=dead.pid))
  with pytest.raises(LeaseHeld):  # across hosts, only the expiry tells
    _lease(store, clock, "c", same_host=False).acquire(timeout_s=0)
  assert _lease(store, clock, "c").acquire(timeout_s=0) == 2
  assert sorted(os.path.basename(str(p)) for p in (store.root / "lease").iterdir()) == [
      "g1.json", "g2.json"]  # older generations are collected


def test_only_one_contender_takes_a_generation(create_only_where):
  """On the in-memory emulation and a local disk only (see `create_only_where`)."""
  root, _ = create_only_where
  store = Store(root)
  assert store.blobs.create_json("lease/g0.json", {"holder": "a"})
  assert not store.blobs.create_json("lease/g0.json", {"holder": "b"})
  assert store.blobs.read_json("lease/g0.json") == {"holder": "a"}


def test_a_version_is_committed_once_and_its_data_never_overwritten(where):
  root, _ = where
  store, other = Store(root), Store(root)  # two syncers' views of one store
  store.merged.put(_merged(0, 1.0), MOMENTUM, {"by": "a"})
  with pytest.raises(StoreError, match="already committed") as e:
    other.merged.put(_merged(0, 2.0), MOMENTUM, {"by": "b"})
  assert e.value.reason == CONFLICT
  store.merged.put(_merged(0, 1.0), MOMENTUM, {"by": "a"})  # its own retry: the index only
  assert store.merged.marker(0, 0)["by"] == "a"
  np.testing.assert_array_equal(store.merged.read(0, 0)[0].tensors["w"], np.full(3, 1.0))
  assert store.merged.collect_uncommitted() == 0  # the refused write removed its data


def _writers(store):
  """(version, holder) of every committed version of fragment 0, in version order."""
  return [(v, store.merged.marker(0, v)["holder"]) for v in store.merged.versions(0)]


def _wait(predicate, what, timeout=120.0):
  deadline = time.monotonic() + timeout
  while not predicate():
    if time.monotonic() > deadline:
      raise AssertionError(f"timed out waiting for {what}")
    time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.processes
def test_two_real_syncers_one_store_stop_kill_and_takeover(create_only_where, tmp_path):
  """a writes; b waits. a is SIGSTOPped: b takes over after the expiry; a, resumed, stops
  without writing. b is SIGKILLed: c (which may not use same-host liveness) takes over after
  b's expiry. The versions are written by a, then b, then c, never interleaved. Not on the
  GCS emulator: a stopped between its check and its marker write relies on the create-only
  write to be refused (see `create_only_where`)."""
  root, _ = create_only_where
  lease_s = 3.0
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [os.getcwd(), os.environ.get("PYTHONPATH", "")]))
  extra = ([] if "://" not in root else
           ["--object-dir", os.environ[object_store.ENV]])
  logs, procs = {}, {}

  def start(name, *flags):
    logs[name] = open(tmp_path / f"{name}.log", "w+")  # noqa: SIM115  (closed below)
    procs[name] = subprocess.Popen(
        [sys.executable, HOLDER, root, name, str(lease_s), *extra, *flags],
        stdout=logs[name], stderr=subprocess.STDOUT, env=env)

  def log(name):
    logs[name].flush()
    return (tmp_path / f"{name}.log").read_text()

  store = Store(root)

  def holders():
    return [h for _, h in _writers(store)]

  try:
    start("a")
    _wait(lambda: holders().count("a") >= 3, "a's writes")
    start("b")
    _wait(lambda: "b: waiting" in log("b"), "b to start")
    time.sleep(lease_s)  # a renews meanwhile: b must not get in
    assert set(holders()) == {"a"} and "holds" not in log("b")
    procs["a"].send_signal(signal.SIGSTOP)
    _wait(lambda: holders().count("b") >= 3, "b to take over after a's expiry")
    procs["a"].send_signal(signal.SIGCONT)
    # LeaseLost; or, if it was stopped between its last check and its marker write, the
    # create-only marker refused the version b had committed meanwhile. Never wrote again.
    assert procs["a"].wait(timeout=60) in (3, 4), log("a")
    assert re.search(r"a lost the lease|already committed by another writer", log("a"))
    procs["b"].send_signal(signal.SIGKILL)
    procs["b"].wait()
    start("c", "--no-same-host")
    _wait(lambda: holders().count("c") >= 3, "c to take over after b's expiry")
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.send_signal(signal.SIGCONT)
        p.kill()
        p.wait()
    for f in logs.values():
      f.close()
  order = holders()
  blocks = [h for i, h in enumerate(order) if i == 0 or order[i - 1] != h]
  assert blocks == ["a", "b", "c"], order  # exactly one writer at a time, in lease order
  versions = [v for v, _ in _writers(store)]
  assert versions == list(range(len(versions)))  # no version lost or written twice
  generations = {store.merged.marker(0, v)["holder"]: store.merged.marker(0, v)["generation"]
                 for v in versions}
  assert generations == {"a": 0, "b": 1, "c": 2}
  c_record = store.blobs.read_json("lease/g2.json")
  assert c_record["after"]["holder"] == "b" and not c_record["after"]["released"]
  assert c_record["taken_at"] > c_record["after"]["expires"]  # c waited out b's lease
  assert re.search(r"b: holds generation 1", (tmp_path / "b.log").read_text())
