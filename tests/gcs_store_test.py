"""The store against a local GCS emulator speaking the real HTTP API (`tests/gcs_emulator.py`).

`tests/store_test.py` and `tests/lease_test.py` run their tests on it too (the "gcs" store
kind); this module holds what only a real client shows: what the emulator does and does not
honour, and objects written or deleted by *another* client (another process), which gcsfs's
listings cache used to hide.
"""

import json
import urllib.parse
import urllib.request

import numpy as np
import pytest
from gcs_emulator import BUCKET

from diloco.delivery import Delivery
from diloco.distributed.store import Store
from diloco.distributed.store.lease import Lease, LeaseLost


def _other_client():
  """A gcsfs client of its own, as another process has (no shared instance, no shared cache)."""
  from gcsfs import core  # pylint: disable=import-outside-toplevel
  return core.GCSFileSystem(token="anon", skip_instance_cache=True)


def _key(root: str, rel: str) -> str:
  return f"{root.removeprefix('gs://')}/{rel}"


def _payload(learner: int, step: int) -> Delivery:
  tensors = {"w": np.arange(6, dtype=np.float32).reshape(2, 3) + step}
  return Delivery(learner=learner, incarnation=0, fragment=0, local_step=step, steps=step,
                  tokens=10 * step, base_version=0, kind="values", tensors=tensors)


def test_emulator_ignores_generation_preconditions(gcs_emulator):
  """The emulator (gcp-storage-emulator) accepts `ifGenerationMatch=0` on an object that
  exists and overwrites it, where Cloud Storage answers 412. So the lease's create-only write
  (`Blobs.create_json`) cannot be tested here: `lease_test.py` tests it on a local disk and
  on the in-memory emulation (`tests/object_store.py`). If this fails, the emulator learned
  preconditions: move `test_only_one_contender_takes_a_generation` onto it."""
  url = (f"{gcs_emulator.host}/upload/storage/v1/b/{BUCKET}/o?uploadType=media&"
         f"ifGenerationMatch=0&name=precondition/x")
  statuses = []
  for body in (b"first", b"second"):
    with urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST")) as r:
      statuses.append(r.status)
  quoted = urllib.parse.quote("precondition/x", safe="")
  with urllib.request.urlopen(
      f"{gcs_emulator.host}/download/storage/v1/b/{BUCKET}/o/{quoted}?alt=media") as r:
    content = r.read()
  assert statuses == [200, 200] and content == b"second"


def test_what_the_store_writes_is_on_the_emulator(gcs_root, gcs_emulator):
  """The store's objects are real objects on the emulator, read back over plain HTTP."""
  store = Store(gcs_root)
  store.blobs.write_json("run.json", {"start": 12.5})
  store.payloads.put(_payload(0, 4))
  prefix = gcs_root.removeprefix(f"gs://{BUCKET}/")
  query = urllib.parse.urlencode({"prefix": f"{prefix}/"})
  with urllib.request.urlopen(f"{gcs_emulator.host}/storage/v1/b/{BUCKET}/o?{query}") as r:
    names = sorted(item["name"].removeprefix(f"{prefix}/") for item in json.load(r)["items"])
  assert "run.json" in names and "payloads/f0_l0_i0_s4.json" in names
  assert "payloads/f0_l0_i0_s4/_METADATA" in names and "payloads/f0_l0_i0_s4/t0000.npy" in names
  assert not any(n.endswith(".tmp") for n in names)  # no temporary names on an object store


def test_objects_another_client_writes_or_deletes_are_seen(gcs_root):
  """Before the store turned gcsfs's listings cache off, a listing was kept for ever: the
  second delivery, written by another client after the first listing, was never listed, and a
  deleted one stayed listed (and `exists`): a syncer would have waited for ever."""
  store, other = Store(gcs_root), _other_client()
  store.payloads.put(_payload(0, 4))
  scratch = f"{gcs_root}-scratch"  # the second delivery's objects, copied in by `other`
  Store(scratch).payloads.put(_payload(1, 8))
  Store(scratch).learners.put_heartbeat(1, {"seq": 1})
  assert store.payloads.committed() == ["f0_l0_i0_s4"]
  assert store.learners.heartbeats() == {} and store.blobs.exists("payloads/f0_l0_i0_s4.json")
  for source in other.find(scratch.removeprefix("gs://")):
    rel = source.removeprefix(scratch.removeprefix("gs://") + "/")
    other.pipe_file(_key(gcs_root, rel), other.cat_file(source))
  other.rm(_key(gcs_root, "payloads/f0_l0_i0_s4.json"))
  assert store.payloads.committed() == ["f0_l1_i0_s8"]
  assert not store.blobs.exists("payloads/f0_l0_i0_s4.json")
  assert store.learners.heartbeats() == {1: {"seq": 1}}
  got = store.payloads.read("f0_l1_i0_s8", {0: {"w": (2, 3)}})
  np.testing.assert_array_equal(got.tensors["w"], _payload(1, 8).tensors["w"])


def test_a_holder_sees_the_generation_another_process_created(gcs_root):
  """The lease's `check` asks whether generation n+1 exists after listing `lease/`: with the
  listing cached, a holder whose lease was taken by another host never noticed it."""
  store = Store(gcs_root)
  lease = Lease(store, duration_s=60.0, holder="a")
  assert lease.acquire(timeout_s=0) == 0
  lease.check()
  _other_client().pipe_file(_key(gcs_root, "lease/g1.json"),
                            json.dumps({"holder": "b", "expires": 1e12}).encode())
  with pytest.raises(LeaseLost, match="generation 1 was taken"):
    lease.check()
  assert not lease.renew()
