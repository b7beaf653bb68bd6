"""The transport over a store: what learner and syncer processes use instead of memory.

`LearnerStoreLink` implements `transport.LearnerTransport` (as the in-memory transport does), so the
same `Learner` runs unchanged; nothing on its hot path touches the store: deliveries and
heartbeats are queued and written by background threads (through the emulated WAN link),
and a poller thread downloads each newly committed merged fragment once, so `latest()` is
a memory read. With a sharded syncer (`sync.shards` > 1) it writes each delivery into its
fragment's shard folder and polls every shard's index (`shards`, `owner`); nothing else
depends on the shard count. `SyncerStoreLink` turns the store into the syncer's messages: new
heartbeats, readable payloads and rejections of unreadable ones, and releases payload
entries once the syncer is done with them.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Callable

from absl import logging

from diloco.distributed import wan
from diloco.sync import intake
from diloco.delivery import Delivery
from diloco.distributed.store import (GONE, NON_FINITE, WRITE_FAILED, Store, StoreError,
                                      parse_payload_name)
from diloco.transport import Heartbeat, Merged

UP, RETIRED, DONE = "up", "retired", "done"
# An entry whose read raised something other than a StoreError (a poison pill): quarantined.
READ_ERROR = "read_error"
# A merged version the index still names but that cannot be read this many polls in a row is
# broken, not merely collected between the index read and the entry read: the learner skips it
# for good and waits for a newer one.
_MAX_READ_FAILURES = 20
# Backoff of a delivery whose write failed (write_failed): from this, doubling, up to the max.
_RETRY_FIRST_S, _RETRY_MAX_S = 0.1, 10.0


class LearnerStoreLink:
  """A learner process's transport: queued writes up, prefetched merged fragments down."""

  def __init__(self, store: Store, learner: int, incarnation: int, *, poll_s: float,
               up: wan.Link | None = None, down: wan.Link | None = None,
               heartbeat_every_s: float = 0.2, send_queue: int = 8,
               on_fetch: Callable[[Merged], None] | None = None,
               shards: list[Store] | None = None, owner: tuple[int, ...] | None = None):
    """`on_fetch` sees every merged version the poller downloads (on its thread). At most
    `send_queue` deliveries wait for upload; `deliver` blocks while it is full. `shards`: the
    syncer shards' stores (`store.shard_stores`; None: `store` alone), `owner[p]` the shard
    of fragment p (`syncer_shards.assign`)."""
    self.store, self.learner, self.incarnation = store, learner, incarnation
    self._shards = list(shards) if shards else [store]
    if len(self._shards) > 1 and owner is None:
      raise ValueError("LearnerStoreLink: several syncer shards need the fragments' owner")
    self._owner = owner
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
        self.bytes_up += self._shard_of(payload.fragment).put_payload(
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
    self.store.put_heartbeat(self.learner, {
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
      index = store.merged_index()
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
      try:
        merged, _ = store.read_merged(p, version)
      except Exception as e:  # collected under us (the syncer moved on): next poll's index
        n = failures[(p, version)] = failures.get((p, version), 0) + 1
        if n >= _MAX_READ_FAILURES or getattr(e, "reason", None) == NON_FINITE:
          failures[(p, version)] = _MAX_READ_FAILURES
          logging.error("learner %d: merged f%d_v%d cannot be used, skipped: %r",
                        self.learner, p, version, e)
          continue
        logging.info("learner %d: merged f%d_v%d not read (%r); retrying", self.learner, p,
                     version, e)
        continue
      failures.pop((p, version), None)
      self.wan_wait_s += self._down.transfer(merged.nbytes)
      self.bytes_down += merged.nbytes
      if self._on_fetch is not None:
        self._on_fetch(merged)
      with self._cond:
        self._merged[p] = merged
        self._cond.notify_all()


def _beat_fields(record: dict) -> tuple | None:
  """((incarnation, seq), state, local_step, step_time, sent_at) of a heartbeat record, typed:
  None if an id is not a counter or the state is unknown. A step time or send time that is
  not a number is passed on as NaN (the syncer ignores unusable measurements)."""
  ids = [record.get(k) for k in ("incarnation", "seq", "local_step")]
  state = record.get("state", UP)
  if not all(intake.is_count(x, 0) for x in ids) or state not in (UP, RETIRED, DONE):
    return None
  step_time = intake.as_float(record.get("step_time"))
  sent_at = intake.as_float(record.get("sent_at", 0.0))
  return ((int(ids[0]), int(ids[1])), state, int(ids[2]),
          float("nan") if step_time is None else step_time,
          0.0 if sent_at is None or sent_at != sent_at else sent_at)


@dataclasses.dataclass(frozen=True)
class Rejected:
  """A store entry the syncer could not read as a payload."""
  name: str
  fragment: int
  learner: int
  incarnation: int
  reason: str
  nbytes: int


class _Deleter:
  """Deletes store entries on one background thread, in order.

  Deleting an entry whose files were synced to disk takes tens of milliseconds on a local
  disk (one request per object on GCS); the syncer's loop should spend that time merging and
  publishing. A name already queued is not queued twice.
  """

  def __init__(self):
    self._queue: queue.Queue = queue.Queue()
    self._lock = threading.Lock()
    self._pending: set[str] = set()
    self._thread = threading.Thread(target=self._run, name="store-deleter", daemon=True)
    self._thread.start()

  def submit(self, name: str, delete) -> None:
    """Deletes entry `name` by calling `delete()` later; failures are logged, not raised."""
    with self._lock:
      if name in self._pending:
        return
      self._pending.add(name)
    self._queue.put((name, delete))

  def queued(self, name: str) -> bool:
    with self._lock:
      return name in self._pending

  def _run(self) -> None:
    while (item := self._queue.get()) is not None:
      name, delete = item
      try:
        delete()
      except Exception as e:  # a failed delete must not stop the syncer; polls resubmit it
        logging.warning("store: could not delete %s: %r", name, e)
      with self._lock:
        self._pending.discard(name)
      self._queue.task_done()
    self._queue.task_done()

  def flush(self) -> None:
    """Returns once everything submitted so far is deleted."""
    self._queue.join()

  def close(self) -> None:
    self.flush()
    self._queue.put(None)
    self._thread.join()


class SyncerStoreLink:
  """The syncer's view of the store: new heartbeats and payloads since the last poll.

  Entries it is done with (merged, replaced, rejected) and old merged versions are deleted
  by a background thread; call `close()` at the end to finish those deletes.
  """

  def __init__(self, store: Store, expected: dict[int, dict[str, tuple]],
               already_merged: set[tuple[int, int, int, int]] = frozenset(),
               fresh_s: float = 0.0):
    """`already_merged` holds (fragment, learner, incarnation, step) of committed deliveries;
    on the first poll, heartbeats written less than `fresh_s` ago (by the learner's wall
    clock) count as alive; older ones are only a baseline."""
    self.store, self.expected, self.fresh_s = store, expected, fresh_s
    self._beats: dict[int, tuple[int, int]] = {}  # learner -> (incarnation, seq) last seen
    self._left: set[tuple[int, int]] = set()
    self._held: dict[str, tuple[int, int, int, int]] = {}
    self._done = set(already_merged)
    self._first_poll = True
    self._released: set[str] = set()  # handed to the deleter; never read again
    self._quarantining: dict[str, tuple[str, str]] = {}  # name -> (reason, detail)
    self._deleter = _Deleter()

  def poll(self, now: float) -> tuple[list[Heartbeat], list[Delivery], list[Rejected],
                                      list[tuple[int, int]]]:
    """(heartbeats, payloads, rejected entries, learners that left) since the last poll.

    A heartbeat counts when its record changed: a restarted syncer takes the records it
    finds as a baseline, so a learner that died while it was down does not look alive.
    """
    beats, left = [], []
    for learner, record in sorted(self.store.heartbeats().items()):
      fields = _beat_fields(record)
      if fields is None:  # a crafted record is skipped
        continue
      key, state, local_step, step_time, sent_at = fields
      beat = Heartbeat(learner, key[0], local_step, step_time, now)
      if self._beats.get(learner) == key:
        continue
      self._beats[learner] = key
      if state in (RETIRED, DONE):
        if (learner, key[0]) not in self._left:
          self._left.add((learner, key[0]))
          left.append((learner, key[0]))
      elif not self._first_poll or abs(time.time() - sent_at) < self.fresh_s:
        beats.append(beat)
    if self._first_poll:  # payloads wait for the next poll, when live learners have beaten
      self._first_poll = False
      return beats, [], [], left
    payloads, rejected = [], []
    listed = self.store.committed_payloads()
    # A name released earlier may still be listed by a listing that began before its delete
    # finished; once a listing no longer holds it, no later one will (names are unique).
    self._released.intersection_update(listed)
    self._quarantining = {n: why for n, why in self._quarantining.items() if n in self._released}
    for name in listed:
      if name in self._released:
        if not self._deleter.queued(name):  # its delete failed, or raced this listing
          if name in self._quarantining:
            self._quarantine(name, *self._quarantining[name])
          else:
            self._remove_payload(name)
        continue
      if name in self._held:
        continue
      ids = parse_payload_name(name)
      if ids in self._done:  # merged by a round committed before a syncer restart
        self._remove_payload(name)
        continue
      try:
        started = time.monotonic()
        payload = self.store.read_payload(name, self.expected)
        # The syncer's read ends the transit (measured on the syncer's own clock).
        read_s = time.monotonic() - started
        payloads.append(dataclasses.replace(payload, transit_s=payload.transit_s + read_s))
        self._held[name] = ids
        continue
      except StoreError as e:
        if e.reason == GONE:
          continue
        reason, detail = e.reason, str(e)
      except Exception as e:  # noqa: BLE001  (a poison pill never takes the syncer down)
        logging.exception("syncer: reading store entry %s raised", name)
        reason, detail = READ_ERROR, f"{type(e).__name__}: {e}"
      logging.warning("syncer: rejected store entry %s: %s", name, detail)
      rejected.append(Rejected(name, ids[0], ids[1], ids[2], reason,
                               self.store.payload_bytes(name)))
      self._quarantine(name, reason, detail)
    return beats, payloads, rejected, left

  def quarantine(self, faults: list[tuple]) -> None:
    """Moves held deliveries that the syncer found malformed or whose ingestion or merge
    raised (`Syncer.take_faults`) to the store's quarantine, so no syncer reads them again."""
    for fragment, learner, incarnation, local_step, reason, detail in faults:
      key = (fragment, learner, incarnation, local_step)
      for name in [n for n, ids in self._held.items() if ids == key]:
        del self._held[name]
        self._quarantine(name, reason, detail)

  def _quarantine(self, name: str, reason: str, detail: str) -> None:
    self._released.add(name)
    self._quarantining[name] = (reason, detail)
    self._deleter.submit(name, lambda: self._quarantine_or_remove(name, reason, detail))

  def _quarantine_or_remove(self, name: str, reason: str, detail: str) -> None:
    """Quarantines the entry; if `quarantine/` cannot be written, deletes it instead, so
    that no syncer (this one or a restarted one) ever reads it again."""
    try:
      self.store.quarantine_payload(name, reason, detail)
    except (OSError, StoreError) as e:
      logging.error("store: could not quarantine %s (%r); deleting it", name, e)
      self.store.remove_payload(name)

  def release(self, pending: set[tuple[int, int, int, int]]) -> None:
    """Deletes held payload entries that are no longer pending (merged, replaced, rejected).

    Call it only after the rounds closed in the same tick are durable: a syncer that
    crashes before that finds the entries again on restart.
    """
    for name, ids in list(self._held.items()):
      if ids not in pending:
        self._remove_payload(name)
        del self._held[name]

  def collect_merged(self, fragment: int, keep: int) -> None:
    """`Store.collect_merged` in the background (after the deletes submitted before it)."""
    self._deleter.submit(f"merged/f{fragment}",
                         lambda: self.store.collect_merged(fragment, keep))

  def _remove_payload(self, name: str) -> None:
    self._released.add(name)
    self._deleter.submit(name, lambda: self.store.remove_payload(name))

  def flush(self) -> None:
    """Returns once every delete submitted so far is done."""
    self._deleter.flush()

  def close(self) -> None:
    self._deleter.close()
