"""One learner over several hosts (its own multi-host `jax.distributed` world, e.g. a TPU slice).

Every host runs the same learner program and its steps are collective, so every host must take
the same decisions at the same point of the program: which merged version of each fragment to
apply, whether to retire, whether to stop waiting for a late round. Host 0 (the leader) is the
only one that writes to the store (incarnation, deliveries, heartbeats). It decides, and the
other hosts read its decisions from JAX's coordination key-value store, host to host, with no
device synchronisation on the step path. Merged fragments are not forwarded between hosts:
each host's own poller downloads them from the store and the host reports the versions it
holds; the leader only picks versions that every host holds.

With one host (`jax.process_count() == 1`) the same code runs without the key-value store, so
single-host learners and the tests exercise it too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from typing import Any, Callable

import jax

from diloco.delivery import Delivery
from diloco.distributed.learner_link import LearnerStoreLink
from diloco.distributed.store import Store
from diloco.transport import Heartbeat, Merged


def _coordination_client():
  # JAX's coordination-service client; JAX has no public accessor for it (Orbax reads it the
  # same way for its multi-host barriers).
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("a learner over several hosts needs jax.distributed.initialize() "
                       "(--jax_distributed)")
  return client


class HostGroup:
  """This process's place among its learner's hosts, and the decisions they share."""

  def __init__(self, timeout_s: float = 600.0):
    self.index, self.count = jax.process_index(), jax.process_count()
    self.leader = self.index == 0
    self.timeout_s = timeout_s
    self._client = _coordination_client() if self.count > 1 else None

  def share(self, key: str, decide: Callable[[], Any]) -> Any:
    """The leader's `decide()` (JSON-able), on every host; only the leader calls `decide`."""
    if self._client is None:
      return decide()
    if self.leader:
      value = decide()
      self._client.key_value_set(f"diloco/{key}", json.dumps(value), allow_overwrite=True)
      return value
    try:
      raw = self._client.blocking_key_value_get(f"diloco/{key}", int(self.timeout_s * 1000))
    except Exception as e:  # the coordination service reports a timeout as a runtime error
      raise TimeoutError(f"host {self.index}: no decision {key!r} from the leader host within "
                         f"{self.timeout_s:.0f} s ({str(e).splitlines()[0]})") from None
    return json.loads(raw)

  def post(self, key: str, value: Any) -> None:
    """Publishes this host's own `value` under `key` (replacing its previous one)."""
    if self._client is not None:
      self._client.key_value_set(f"diloco/{key}/h{self.index}", json.dumps(value),
                                 allow_overwrite=True)

  def peek(self, key: str, host: int) -> Any | None:
    """What `host` last posted under `key`, or None (never blocks)."""
    if self._client is None:
      return None
    try:
      return json.loads(self._client.key_value_try_get(f"diloco/{key}/h{host}"))
    except Exception:  # NOT_FOUND: that host has posted nothing yet
      return None

  def forget(self, key: str) -> None:
    if self._client is not None and self.leader:
      self._client.key_value_delete(f"diloco/{key}")


@dataclasses.dataclass(frozen=True)
class Decision:
  retire: bool
  give_up: bool


class AgreedLink:
  """A learner transport that every host of one learner sees identically.

  It wraps this host's own `LearnerStoreLink`. `latest` answers from the view the hosts last
  agreed on (`agree`), not from whatever this host's poller fetched meanwhile; each host keeps
  the versions it fetched until the view passes them. Only the leader writes to the store.
  """

  def __init__(self, store: Store, learner: int, incarnation: int, hosts: HostGroup,
               **link_kwargs):
    self.hosts = hosts
    self._lock = threading.Lock()
    self._held: dict[int, dict[int, Merged]] = {}
    self._view: dict[int, Merged] = {}
    self._agreements = 0
    self._log = hashlib.sha256()  # every decision taken, in order: equal on all hosts
    self._kept_from = 0  # the leader deletes decisions every host has read
    self.inner = LearnerStoreLink(store, learner, incarnation, on_fetch=self._fetched,
                                  **link_kwargs)

  def _fetched(self, merged: Merged) -> None:
    with self._lock:
      self._held.setdefault(merged.fragment, {})[merged.version] = merged

  # Agreement.
  def agree(self, retire: bool = False, give_up: bool = False) -> Decision:
    """One shared decision; every host calls it at the same point of its loop."""
    with self._lock:
      holdings = {str(p): sorted(vs) for p, vs in self._held.items()}
    n = self._agreements
    self._agreements += 1
    if not self.hosts.leader:  # what it holds, and that it has read every decision before n
      self.hosts.post("held", {"next": n, "held": holdings})
    read_by_all = n

    def decide() -> dict:
      nonlocal read_by_all
      common = {p: set(vs) for p, vs in holdings.items()}
      for host in range(1, self.hosts.count):
        theirs = self.hosts.peek("held", host) or {"next": 0, "held": {}}
        read_by_all = min(read_by_all, theirs["next"])
        common = {p: vs & set(theirs["held"].get(p, ())) for p, vs in common.items()}
      view = {}
      for p, versions in common.items():
        current = self._view.get(int(p))
        newest = max(versions, default=-1)
        if current is None or newest > current.version:
          view[p] = newest
      return {"view": view, "retire": bool(retire), "give_up": bool(give_up)}

    decision = self.hosts.share(f"agree/{n}", decide)
    self._log.update(json.dumps(decision, sort_keys=True).encode())
    if self.hosts.leader:
      for old in range(self._kept_from, read_by_all):
        self.hosts.forget(f"agree/{old}")
      self._kept_from = max(self._kept_from, read_by_all)
    with self._lock:
      for p, version in decision["view"].items():
        if version < 0:
          continue
        p = int(p)
        self._view[p] = self._held[p][version]
        self._held[p] = {v: m for v, m in self._held[p].items() if v >= version}
    return Decision(decision["retire"], decision["give_up"])

  def agree_initial(self, num_fragments: int, timeout: float,
                    min_versions: dict[int, int] | None = None) -> None:
    """Waits until this host fetched every fragment (at least `min_versions[p]`), then agrees
    until the view has them all (the view is the same on every host, so every host leaves
    this loop at the same point)."""
    floor = min_versions or {}
    self.inner.wait_initial(num_fragments, timeout, floor)
    deadline = time.monotonic() + timeout
    while len(self._view) < num_fragments or any(
        self._view[p].version < floor.get(p, 0) for p in range(num_fragments)):
      if self.agree(give_up=time.monotonic() > deadline).give_up:
        raise TimeoutError(f"learner {self.inner.learner}: the hosts did not come to hold the "
                           f"same version of every fragment within {timeout:.0f} s")
      time.sleep(0.05)

  @property
  def agreements(self) -> dict:
    """How many decisions this host took and a digest of them (equal on every host)."""
    return {"count": self._agreements, "digest": self._log.hexdigest()[:16]}

  # Learner side of the transport interface.
  def heartbeat(self, beat: Heartbeat) -> None:
    if self.hosts.leader:
      self.inner.heartbeat(beat)

  def deliver(self, payload: Delivery) -> None:
    if self.hosts.leader:
      self.inner.deliver(payload)

  def latest(self, fragment: int) -> Merged | None:
    with self._lock:
      return self._view.get(fragment)

  def latest_version(self, fragment: int) -> int:
    merged = self.latest(fragment)
    return -1 if merged is None else merged.version

  def wait_for(self, fragment: int, min_version: int, timeout: float) -> Merged | None:
    """Waits (at most `timeout`) for this host to fetch `min_version`; the view changes only
    at the next `agree`."""
    self.inner.wait_for(fragment, min_version, timeout)
    return self.latest(fragment)

  def count_download(self, nbytes: int) -> None:
    self.inner.count_download(nbytes)

  # Process life cycle.
  def flush(self) -> None:
    self.inner.flush()

  def leave(self, state: str) -> None:
    if self.hosts.leader:
      self.inner.leave(state)

  def close(self) -> None:
    self.inner.close()

  @property
  def bytes_up(self) -> int:
    return self.inner.bytes_up

  @property
  def bytes_down(self) -> int:
    return self.inner.bytes_down

  @property
  def wan_wait_s(self) -> float:
    return self.inner.wan_wait_s
