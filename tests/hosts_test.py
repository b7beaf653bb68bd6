"""The hosts' agreement rule (`diloco.distributed.hosts`). JAX's key-value store is replaced by a
dict here so the steps can be interleaved by hand; `multihost_test.py` runs the real one across
processes."""

import numpy as np
import pytest

from diloco.distributed import hosts as hosts_lib
from diloco.distributed.store import Store
from diloco.transport import Merged


class _DictHosts(hosts_lib.HostGroup):
  """Host `index` of two, sharing `kv` (what the coordination service holds)."""

  def __init__(self, index: int, kv: dict):
    self.index, self.count, self.leader, self.timeout_s = index, 2, index == 0, 1.0
    self._kv = kv

  def share(self, key, decide):
    if self.leader:
      self._kv[key] = decide()
    if key not in self._kv:
      raise TimeoutError(f"no decision {key!r}")  # the real one blocks; here: called too early
    return self._kv[key]

  def post(self, key, value):
    self._kv[f"{key}/h{self.index}"] = value

  def peek(self, key, host):
    return self._kv.get(f"{key}/h{host}")

  def forget(self, key):
    self._kv.pop(key, None)


def _merged(fragment, version):
  return Merged(fragment, version, {"w": np.full(2, version, np.float32)}, 0.0)


@pytest.fixture
def pair(tmp_path):
  kv: dict = {}
  store = Store(tmp_path)
  links = [hosts_lib.AgreedLink(store, 0, 0, _DictHosts(h, kv), poll_s=60.0, shapes=None)
           for h in (0, 1)]
  yield links
  for link in links:
    link.close()


def _agree(pair, **leader_flags):
  """One agreement: host 0 decides, then host 1 follows (and posts what it holds)."""
  first = pair[0].agree(**leader_flags)
  second = pair[1].agree()
  assert first == second
  return first


def test_the_view_moves_only_to_versions_every_host_holds(pair):
  leader, follower = pair
  leader._fetched(_merged(0, 0))
  _agree(pair)  # host 1 has posted nothing yet: no view
  assert leader.latest(0) is None and follower.latest(0) is None
  follower._fetched(_merged(0, 0))
  _agree(pair)  # host 1 posts {0: [0]} during this agreement, after host 0 decided it
  assert leader.latest(0) is None
  _agree(pair)
  assert leader.latest_version(0) == follower.latest_version(0) == 0
  # Host 0 fetches versions 1 and 2; host 1's poller skipped 1.
  leader._fetched(_merged(0, 1))
  leader._fetched(_merged(0, 2))
  follower._fetched(_merged(0, 2))
  _agree(pair)  # host 1's newest post still says {0: [0]}
  assert leader.latest_version(0) == 0
  _agree(pair)
  assert leader.latest_version(0) == follower.latest_version(0) == 2  # never 1
  np.testing.assert_array_equal(follower.latest(0).tensors["w"], [2, 2])
  assert sorted(follower._held[0]) == [2] and sorted(leader._held[0]) == [2]  # older dropped


def test_host_0_decides_retiring_and_giving_up(pair):
  assert _agree(pair, retire=True) == hosts_lib.Decision(retire=True, give_up=False)
  assert _agree(pair, give_up=True) == hosts_lib.Decision(retire=False, give_up=True)
  assert _agree(pair) == hosts_lib.Decision(retire=False, give_up=False)
  assert pair[0].agreements == pair[1].agreements and pair[0].agreements["count"] == 3


def test_decisions_are_deleted_only_once_every_host_has_read_them(pair):
  leader, follower = pair
  kv = leader.hosts._kv
  for _ in range(5):  # host 1 starts late: host 0 must keep every decision for it
    leader.agree()
  assert [f"agree/{n}" in kv for n in range(5)] == [True] * 5
  for _ in range(5):
    follower.agree()  # reads decisions 0..4, posting its progress
  leader.agree()  # decision 5: host 1 said it has read everything before 4
  assert [f"agree/{n}" in kv for n in range(6)] == [False] * 4 + [True] * 2
  follower.agree()
  assert leader.agreements == follower.agreements


def test_only_host_0_writes_to_the_store(pair, tmp_path):
  from diloco.delivery import Delivery
  from diloco.transport import Heartbeat
  leader, follower = pair
  for link in pair:
    link.heartbeat(Heartbeat(0, 0, 1, 0.1, 0.0))
    link.deliver(Delivery(learner=0, incarnation=0, fragment=0, local_step=1, steps=1, tokens=10,
                          base_version=-1, kind="values", tensors={"w": np.zeros(2, np.float32)},
                          transit_s=0.0))
  leader.inner.flush(timeout=30)
  follower.inner.flush(timeout=30)
  assert Store(tmp_path).payloads.committed() == ["f0_l0_i0_s1"]
  assert leader.bytes_up > 0 and follower.bytes_up == 0


def test_one_host_agrees_with_itself(tmp_path):
  link = hosts_lib.AgreedLink(Store(tmp_path), 0, 0, hosts_lib.HostGroup(), poll_s=60.0,
                              shapes=None)
  try:
    link._fetched(_merged(1, 3))
    assert link.latest(1) is None  # nothing is visible before an agreement
    link.agree()
    assert link.latest_version(1) == 3
  finally:
    link.close()
