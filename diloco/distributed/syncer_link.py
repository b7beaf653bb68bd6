"""The syncer's side of the store transport: the store turned into the syncer's messages.

`SyncerStoreLink` lists the store and returns new heartbeats, readable payloads and
rejections of unreadable ones (quarantined, never read again) and of ones a round committed
before a syncer restart already merged (`replayed`, deleted unread), and releases payload entries
and old merged versions once the syncer is done with them, on a background deleter thread.
The learner's side is `learner_link.LearnerStoreLink`.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

from absl import logging

from diloco.delivery import Delivery
from diloco.distributed.store import Store
from diloco.distributed.store.entry_check import StoreError
from diloco.distributed.store.learner_registry import DONE, RETIRED, beat_fields
from diloco.distributed.store.names import GONE, parse_payload_name
from diloco.sync.intake import REJECT_REPLAYED
from diloco.transport import Heartbeat

# An entry whose read raised something other than a StoreError (a poison pill): quarantined.
READ_ERROR = "read_error"

@dataclasses.dataclass(frozen=True)
class Rejected:
  """A store entry the syncer could not read as a payload, or refused unread (a replay)."""
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
    self._left_later: list[tuple[int, int]] = []  # departures seen by the first poll
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
    for learner, record in sorted(self.store.learners.heartbeats().items()):
      fields = beat_fields(record)
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
      # So do departures: a learner that flushed its last deliveries and left while no syncer
      # ran is forgotten only after those deliveries are taken (the syncer forgets after the
      # tick), else they would be refused as a departed incarnation's.
      self._left_later = left
      return beats, [], [], []
    left, self._left_later = self._left_later + left, []
    payloads, rejected = [], []
    listed = self.store.payloads.committed()
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
      if ids in self._done:  # merged by a round committed before a syncer restart: G holds it
        rejected.append(Rejected(name, ids[0], ids[1], ids[2], REJECT_REPLAYED,
                                 self.store.payloads.nbytes(name)))
        self._remove_payload(name)
        continue
      try:
        started = time.monotonic()
        payload = self.store.payloads.read(name, self.expected)
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
                               self.store.payloads.nbytes(name)))
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
      self.store.payloads.quarantine(name, reason, detail)
    except (OSError, StoreError) as e:
      logging.error("store: could not quarantine %s (%r); deleting it", name, e)
      self.store.payloads.remove(name)

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
    """`MergedVersions.collect` in the background (after the deletes submitted before it)."""
    self._deleter.submit(f"merged/f{fragment}",
                         lambda: self.store.merged.collect(fragment, keep))

  def _remove_payload(self, name: str) -> None:
    self._released.add(name)
    self._deleter.submit(name, lambda: self.store.payloads.remove(name))

  def flush(self) -> None:
    """Returns once every delete submitted so far is done."""
    self._deleter.flush()

  def close(self) -> None:
    self._deleter.close()
