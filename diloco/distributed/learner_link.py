"""The learner's side of the transport over a store: what a learner process uses instead of memory.

`LearnerStoreLink` implements `transport.LearnerTransport` (as the in-memory transport does), so the
same `Learner` runs unchanged; nothing on its hot path touches the store: deliveries and
heartbeats are queued and written by background threads (through the emulated WAN link),
and a poller thread downloads each newly committed merged fragment once, so `latest()` is
a memory read. With a sharded syncer (`sync.shards` > 1) it writes each delivery into its
fragment's shard folder and polls every shard's index (`shards`, `owner`); nothing else
depends on the shard count. The syncer's side is `syncer_link.SyncerStoreLink`.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Callable

from absl import logging

from diloco.delivery import Delivery
from diloco.distributed import wan
from diloco.distributed.store import Store, global_view
from diloco.distributed.store.entry_check import StoreError
from diloco.distributed.store.learner_registry import UP
from diloco.distributed.store.names import NON_FINITE, WRITE_FAILED
from diloco.transport import Heartbeat, Merged

# A merged version the index still names but that cannot be read this many polls in a row is
# broken, not merely collected between the index read and the entry read: the learner skips it
# for good and waits for a newer one.
_MAX_READ_FAILURES = 20
# Backoff of a delivery whose write failed (write_failed): from this, doubling, up to the max.
_RETRY_FIRST_S, _RETRY_MAX_S = 0.1, 10.0


class LearnerStoreLink:
  """A learner process's transport: queued writes up, prefetched merged fragments down."""

  def __init__(self, store: Store, learner: int, incarnation: int, *, poll_s: float,
               shapes: list[dict[str, tuple]] | None,
               up: wan.Link | None = None, down: wan.Link | None = None,
               heartbeat_every_s: float = 0.2, send_queue: int = 8,
               on_fetch: Callable[[Merged], None] | None = None,
               shards: list[Store] | None = None, owner: tuple[int, ...] | None = None):
    """`on_fetch` sees every merged version the poller downloads (on its thread). At most
    `send_queue` deliveries wait for upload; `deliver` blocks while it is full. `shards`: the
    syncer shards' stores (`store.shard_stores`; None: `store` alone), `owner[p]` the shard
    of fragment p (`ownership.assign`). `shapes[p]`: fragment p's {path: shape} under the
    plan; a version of other paths or shapes is never taken. Required: None (take the marker's
    own shapes) is for a store whose writer the caller trusts, and must be said."""
    self.store, self.learner, self.incarnation = store, learner, incarnation
    self._shards = list(shards) if shards else [store]
    if len(self._shards) > 1 and owner is None:
      raise ValueError("LearnerStoreLink: several syncer shards need the fragments' owner")
    self._owner = owner
    self._shapes = shapes
    self._on_fetch = on_fetch
    self._up, self._down = up or wan.Link(), down or wan.Link()
    self._poll_s, self._beat_every = poll_s, heartbeat_every_s
    self._cond = threading.Condition()
    self._merged: dict[int, Merged] = {}
    self._beat: Heartbeat | None = None
    self._beat_state = UP
    self._written: Heartbeat | None = None
    self._beat_lock = threading.Lock()
    self._seq = 0
    self._outbox: queue.Queue = queue.Queue(maxsize=send_queue)
    self._stop = threading.Event()
    self._error: BaseException | None = None
    self.bytes_up = self.bytes_down = self.bytes_applied = 0
    self.wan_wait_s = 0.0
    self.send_wait_s = 0.0  # seconds `deliver` waited for room in the full outbox
    self.write_failures = 0  # failed delivery writes, each retried
    self._threads = [threading.Thread(target=self._guard, args=(fn,), daemon=True,
                                      name=f"store-{name}-l{learner}")
                     for name, fn in (("send", self._send_loop), ("beat", self._beat_loop),
                                      ("poll", self._poll_loop))]
    for t in self._threads:
      t.start()

  def _guard(self, fn) -> None:
    try:
      fn()
    except BaseException as e:  # surfaced to the learner on its next call
      logging.exception("learner %d: store thread failed", self.learner)
      self._error = e
      with self._cond:
        self._cond.notify_all()

  def _check(self) -> None:
    if self._error is not None:
      raise RuntimeError(f"learner {self.learner}: store {self.store.root} failed: "
                         f"{self._error!r}") from self._error

  # Learner side of the transport interface.
  def heartbeat(self, beat: Heartbeat) -> None:
    self._check()
    with self._cond:
      self._beat = beat

  def deliver(self, payload: Delivery) -> None:
    """Queues the delivery for upload; waits (backpressure) while the outbox is full."""
    self._check()
    queued_at = time.monotonic()
    while True:
      try:
        self._outbox.put((payload, queued_at), timeout=0.1)
        break
      except queue.Full:
        self._check()  # a dead sender thread never makes room
    self.send_wait_s += time.monotonic() - queued_at

  def latest(self, fragment: int) -> Merged | None:
    self._check()
    with self._cond:
      return self._merged.get(fragment)

  def latest_version(self, fragment: int) -> int:
    merged = self.latest(fragment)
    return -1 if merged is None else merged.version

  def wait_for(self, fragment: int, min_version: int, timeout: float) -> Merged | None:
    with self._cond:
      self._cond.wait_for(lambda: self._error is not None or (
          fragment in self._merged and self._merged[fragment].version >= min_version), timeout)
    return self.latest(fragment)

  def count_download(self, nbytes: int) -> None:
    self.bytes_applied += nbytes

  # Process life cycle.
  def wait_initial(self, num_fragments: int, timeout: float,
                   min_versions: dict[int, int] | None = None) -> None:
    """Blocks until every fragment has a published version from its shard (the syncers are
    up), at least `min_versions[p]` where given."""
    floor = min_versions or {}
    with self._cond:
      ok = self._cond.wait_for(lambda: self._error is not None or all(
          p in self._merged and self._merged[p].version >= floor.get(p, 0)
          for p in range(num_fragments)), timeout)
    self._check()
    if not ok:
      with self._cond:
        missing = [p for p in range(num_fragments) if not (
            p in self._merged and self._merged[p].version >= floor.get(p, 0))]
      folders = sorted({str(self._shard_of(p).root) for p in missing})
      raise TimeoutError(f"learner {self.learner}: fragments {missing[:8]} (at versions "
                         f"{floor}) did not appear in {', '.join(f + '/merged' for f in folders)} "
                         f"within {timeout:.0f} s; is the syncer (shard) of that folder running "
                         "on this store?")

  def flush(self, timeout: float = 600.0) -> None:
    """Waits until every queued delivery is committed to the store."""
    deadline = time.monotonic() + timeout
    while self._outbox.unfinished_tasks and time.monotonic() < deadline:
      self._check()
      time.sleep(0.01)
    self._check()

  def leave(self, state: str) -> None:
    """Flushes, then tells the syncer that this incarnation is gone for good ("retired"/"done")."""
    self.flush()
    with self._cond:
      self._beat_state = state
    self._write_beat()

  def close(self) -> None:
    self._stop.set()
    for t in self._threads:
      t.join(timeout=30)

  # Background threads.
  def _send_loop(self) -> None:
    while not self._stop.is_set():
      try:
        payload, queued_at = self._outbox.get(timeout=0.1)
      except queue.Empty:
        continue
      try:
        self.wan_wait_s += self._up.transfer(payload.nbytes)
        self._put_until_written(payload, queued_at)
      finally:
        self._outbox.task_done()

  def _put_until_written(self, payload: Delivery, queued_at: float) -> None:
    """Writes the delivery, retrying a failed write (a full disk, an unreachable bucket) with
    backoff: the store removes what a failed write left, and the bounded outbox makes the
    learner wait (backpressure) instead of losing the delivery or dying."""
    backoff = _RETRY_FIRST_S
    while True:
      # Queueing, the emulated link and retries are transit (durations on this host's clock).
      waited = time.monotonic() - queued_at
      try:
        self._write_beat_if_new()  # the syncer must know this incarnation before its payload
        self.bytes_up += self._shard_of(payload.fragment).payloads.put(
            dataclasses.replace(payload, transit_s=payload.transit_s + waited))
        return
      except StoreError as e:
        if e.reason != WRITE_FAILED:
          raise
        self.write_failures += 1
        logging.error("learner %d: delivery not written, retrying in %.1f s: %s",
                      self.learner, backoff, e)
        if self._stop.wait(backoff):
          raise
        backoff = min(2 * backoff, _RETRY_MAX_S)

  def _shard_of(self, fragment: int) -> Store:
    """The store folder of the syncer shard that owns `fragment`."""
    return self._shards[0 if self._owner is None else self._owner[fragment]]

  def _write_beat_if_new(self) -> None:
    with self._cond:
      new = self._beat is not None and self._beat is not self._written
    if new:
      self._write_beat()

  def _write_beat(self) -> None:
    with self._beat_lock:  # one writer at a time, so records never go back in seq
      self._write_beat_locked()

  def _write_beat_locked(self) -> None:
    with self._cond:
      beat, state = self._beat, self._beat_state
      self._seq += 1
      seq = self._seq
      self._written = beat
    if beat is None:
      return
    self.store.learners.put_heartbeat(self.learner, {
        "learner": self.learner, "incarnation": self.incarnation, "seq": seq, "state": state,
        "local_step": beat.local_step, "step_time": beat.step_time, "sent_at": time.time(),
        "bytes_up": self.bytes_up, "bytes_down": self.bytes_down})

  def _beat_loop(self) -> None:
    while not self._stop.wait(self._beat_every):
      if self._beat_state == UP:
        try:
          self._write_beat_if_new()
        except StoreError as e:  # a full disk: the next beat tries again
          if e.reason != WRITE_FAILED:
            raise
          logging.warning("learner %d: heartbeat not written: %s", self.learner, e)

  def _poll_loop(self) -> None:
    failures: dict[tuple[int, int], int] = {}  # (fragment, version) -> failed reads in a row
    while not self._stop.is_set():
      for shard, store in enumerate(self._shards):
        self._poll_shard(shard, store, failures)
      self._stop.wait(self._poll_s)

  def _poll_shard(self, shard: int, store: Store, failures: dict) -> None:
    """Downloads the versions one shard's index names that are newer than those held."""
    try:
      index = store.merged.index()
    except StoreError as e:  # a torn index on a non-atomic store: read it again next poll
      logging.warning("learner %d: %s", self.learner, e)
      index = {}
    for p, version in sorted(index.items()):
      if self._owner is not None and (p >= len(self._owner) or self._owner[p] != shard):
        continue  # not this shard's fragment (planted): never read
      with self._cond:
        have = self._merged.get(p)
      if have is not None and have.version >= version:
        continue
      if failures.get((p, version), 0) >= _MAX_READ_FAILURES:
        continue  # broken (logged once): never applied, a newer version is
      shapes = None if self._shapes is None or p >= len(self._shapes) else self._shapes[p]
      try:
        merged, _ = store.merged.read(p, version, shapes=shapes)
      except Exception as e:  # collected under us (the syncer moved on): next poll's index
        n = failures[(p, version)] = failures.get((p, version), 0) + 1
        if n >= _MAX_READ_FAILURES or getattr(e, "reason", None) == NON_FINITE:
          failures[(p, version)] = _MAX_READ_FAILURES
          logging.error("learner %d: merged f%d_v%d cannot be used, skipped: %r",
                        self.learner, p, version, e)
          # The newest version that is usable, by the markers (a joining learner must not
          # wait for a version nobody can use): taken if newer than the one held.
          merged = global_view.newest_usable(store, p, shapes)
          if merged is None or (have is not None and merged.version <= have.version):
            continue
        else:
          logging.info("learner %d: merged f%d_v%d not read (%r); retrying", self.learner, p,
                       version, e)
          continue
      if merged.version == version:  # a fallback leaves the broken version marked
        failures.pop((p, version), None)
      self.wan_wait_s += self._down.transfer(merged.nbytes)
      self.bytes_down += merged.nbytes
      if self._on_fetch is not None:
        self._on_fetch(merged)
      with self._cond:
        self._merged[p] = merged
        self._cond.notify_all()
