"""One syncer per store: a lease with an expiry, taken by compare-and-swap, renewed in the
background, and checked before every commit.

Two syncers writing rounds to one store would fork the global model (each publishing its own
version v of a fragment). A restarted syncer and a stale one (paused, partitioned, or
started by mistake) are the realistic pair. The lease is a series of records
`lease/g{n}.json`, one per *generation* n, each holding its holder's id, process, host and
the wall time it expires. The lease belongs to the newest generation until that expires.

- **Taking it** is creating generation n+1, which succeeds for exactly one contender:
  `Blobs.create_json` is a create-only write (a hard link on a local disk, a create-only
  object write on an object store, which has no rename). The winner reads the record back
  as a second check (a backend whose create were not atomic would show the other id).
- **Holding it**: a background thread rewrites the holder's own record with a later expiry
  every `duration_s / 4`; the merge path never waits on it. The holder trusts its lease for
  `duration_s` after the *start* of its last successful renewal, on its monotonic clock
  (which keeps running while the process is stopped), and never renews one that ran out:
  an expired lease is lost for good.
- **Checking it** (`check`, before every commit marker and index write): the lease must be
  valid on the holder's clock for at least `margin_s` more, and generation n+1 must not
  exist. A syncer that fails the check raises `LeaseLost` and must stop; it never writes
  again. A paused holder that is resumed fails the first condition.
- **Waiting for it**: a contender takes the lease once the newest record's expiry plus
  `skew_s` (the clock difference allowed between hosts) has passed on its own wall clock,
  or at once when the record was released by a clean exit, or, with `same_host=True`, when
  the holder's process is gone on this very host (a syncer restarted after SIGKILL does not
  wait out the lease). Until then it waits (`acquire(timeout_s=None)`) or fails with a
  message naming the holder (`LeaseHeld`).

The remaining risk is the one every lease without storage-side fencing has: a holder
paused between a passing check and the single object write that follows it, for longer
than `margin_s + skew_s`, could still land that one write. The check sits immediately
before each write to keep that window to a few instructions.
"""

from __future__ import annotations

import math
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable

from absl import logging

from diloco.distributed.store import Store
from diloco.distributed.store.entry_check import StoreError
from diloco.sync import intake

# A generation of any length (canonical ASCII digits, matched whole); 240 digits keep a
# record's name within a file system's 255 bytes.
_GENERATION = re.compile(r"g(0|[1-9][0-9]{0,239})\.json")
# An expiry further ahead than this many lease durations (plus the skew) cannot have been
# written by a holder of this store's lease: it is unusable and protects nothing.
_MAX_EXPIRY_AHEAD = 4


class LeaseLost(RuntimeError):
  """This process's lease expired or was taken: it must not write to the store again."""


class LeaseHeld(RuntimeError):
  """Another live syncer holds the lease (raised by `acquire` when its timeout passes)."""


def _boot_id() -> str:
  try:
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
      return f.read().strip()
  except OSError:
    return ""


def _process_gone(record: dict) -> bool:
  """Whether the record's holder process no longer exists on this host (same boot)."""
  if record.get("host") != socket.gethostname() or record.get("boot") != _boot_id():
    return False
  pid = record.get("pid")
  if not intake.is_count(pid, 1) or pid > 2**22:  # never 0 or -1 (a process group, everyone)
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  except (PermissionError, KeyError, TypeError, ValueError, OverflowError):
    return False
  try:  # a killed child its parent has not reaped yet is gone too
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
      return f.read().rsplit(")", 1)[-1].split()[0] == "Z"
  except (OSError, IndexError):
    return False


class Lease:
  """The store's syncer lease, held by this process (see the module docstring)."""

  def __init__(self, store: Store, *, duration_s: float, holder: str | None = None,
               skew_s: float | None = None, margin_s: float | None = None,
               same_host: bool = True, poll_s: float | None = None,
               wall: Callable[[], float] = time.time,
               monotonic: Callable[[], float] = time.monotonic):
    if not duration_s > 0:
      raise ValueError(f"lease: duration_s must be positive, got {duration_s!r}")
    self.store, self.duration_s = store, float(duration_s)
    self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    self.skew_s = self.duration_s / 4 if skew_s is None else float(skew_s)
    self.margin_s = self.duration_s / 4 if margin_s is None else float(margin_s)
    self.same_host = same_host
    self._poll_s = min(1.0, self.duration_s / 8) if poll_s is None else poll_s
    self._wall, self._monotonic = wall, monotonic
    self.generation: int | None = None
    self._taken_how: dict = {}  # when the lease was taken, and from whom
    self._valid_until = -float("inf")  # on the monotonic clock
    self._lost: str | None = None
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  # Records.
  def _rel(self, generation: int) -> str:
    return f"lease/g{generation}.json"

  def _newest(self) -> tuple[int, dict | None]:
    """(newest generation, its record) or (-1, None) when the store never had a lease."""
    generations = []
    try:
      for path in (self.store.root / "lease").iterdir():
        m = _GENERATION.fullmatch(path.name)
        if m is not None:
          generations.append(int(m[1]))
    except FileNotFoundError:
      pass
    for generation in sorted(generations, reverse=True):
      try:
        record = self.store.blobs.read_json(self._rel(generation))
      except StoreError:  # writes are atomic, so only a foreign hand makes one unreadable;
        record = {"holder": "unreadable"}  # it names no expiry and protects nothing
      if record is not None and not isinstance(record, dict):
        record = {"holder": "unreadable"}
      if record is not None:
        return generation, record
    return -1, None

  def _record(self, generation: int, started: float, **extra) -> dict:
    """The record of `generation`; renewals and the release keep how it was taken."""
    return dict(self._taken_how, holder=self.holder, generation=generation, pid=os.getpid(),
                host=socket.gethostname(), boot=_boot_id(),
                expires=started + self.duration_s, **extra)

  def _free(self, record: dict) -> bool:
    if record.get("released") is True:
      return True
    expires = intake.as_float(record.get("expires"))
    now = self._wall()
    if (expires is None or not math.isfinite(expires)
        or expires > now + _MAX_EXPIRY_AHEAD * self.duration_s + self.skew_s):
      return True  # a record that names no usable expiry protects nothing
    return now > expires + self.skew_s or (self.same_host and _process_gone(record))

  # Taking and giving back.
  def acquire(self, timeout_s: float | None = None) -> int:
    """Takes the lease, waiting while a live holder has it; returns the generation taken.

    LeaseHeld if `timeout_s` passes first (None: wait as long as it takes)."""
    deadline = None if timeout_s is None else self._monotonic() + timeout_s
    told = None
    backoff = self._poll_s
    while True:
      newest, record = self._newest()
      if record is None or self._free(record):
        started_wall, started = self._wall(), self._monotonic()
        generation = newest + 1
        self._taken_how = {"taken_at": started_wall}
        if record is not None:
          self._taken_how["after"] = {
              "generation": newest, "holder": record.get("holder"),
              "expires": record.get("expires"), "released": bool(record.get("released"))}
        try:
          created = self.store.blobs.create_json(self._rel(generation),
                                                 self._record(generation, started_wall))
        except StoreError as e:  # a full disk: nobody can write; try again later, backing off
          logging.warning("lease: cannot take generation %d: %s", generation, e)
          self._wait_or_give_up(deadline, backoff, f"could not create generation {generation}: "
                                f"{e}")
          backoff = min(2 * backoff, 8 * self._poll_s + 1.0)
          continue
        if created:
          mine = self.store.blobs.read_json(self._rel(generation))
          if isinstance(mine, dict) and mine.get("holder") == self.holder:
            with self._lock:
              self.generation, self._lost = generation, None
              self._valid_until = started + self.duration_s
            self._collect_old(generation)
            logging.info("lease: %s holds generation %d of %s", self.holder, generation,
                         self.store.root)
            return generation
        # Another contender took this generation first: look again (after a pause, so a
        # name that keeps existing without being a lease record cannot spin this loop).
        self._wait_or_give_up(deadline, self._poll_s / 4,
                              f"generation {generation} exists but is not this holder's")
        continue
      if deadline is not None and self._monotonic() >= deadline:
        raise LeaseHeld(
            f"store {self.store.root}: syncer {record.get('holder')!r} (pid {record.get('pid')} "
            f"on {record.get('host')}) holds the lease until {record.get('expires')} (wall "
            f"time); only one syncer may write to a store. Stop it, or wait for its lease "
            f"to expire ({self.duration_s:.0f} s after its last renewal).")
      if told != newest:
        told = newest
        logging.warning("lease: store %s is held by %r (pid %s on %s); waiting for it to "
                        "expire", self.store.root, record.get("holder"), record.get("pid"),
                        record.get("host"))
      time.sleep(self._poll_s)

  def _wait_or_give_up(self, deadline: float | None, wait_s: float, why: str) -> None:
    """Sleeps `wait_s`, or raises LeaseHeld if that would pass the caller's deadline."""
    if deadline is not None and self._monotonic() + wait_s >= deadline:
      raise LeaseHeld(f"store {self.store.root}: lease not taken before the deadline: {why}")
    time.sleep(wait_s)

  def _collect_old(self, generation: int) -> None:
    """Deletes generations older than the previous one (the history a reader needs)."""
    try:
      for path in (self.store.root / "lease").iterdir():
        m = _GENERATION.fullmatch(path.name)
        if m is not None and int(m[1]) < generation - 1:
          self.store.blobs.remove(f"lease/{path.name}")
    except OSError as e:
      logging.warning("lease: could not delete old generations: %r", e)

  def start(self) -> None:
    """Renews the lease on a background thread until `release` or until it is lost."""
    self._thread = threading.Thread(target=self._renew_loop, daemon=True, name="lease")
    self._thread.start()

  def release(self) -> None:
    """Stops renewing and marks the lease released, so a successor need not wait."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=30)
    with self._lock:
      generation, lost = self.generation, self._lost
      self._lost = self._lost or "released"
    if generation is None or lost is not None or self._taken():
      return
    try:
      self.store.blobs.write_json(self._rel(generation),
                                  self._record(generation, self._wall(), released=True),
                                  durable=True)
    except StoreError as e:
      logging.warning("lease: could not mark generation %d released: %s", generation, e)

  # Holding.
  def _taken(self) -> bool:
    return self.store.blobs.exists(self._rel(self.generation + 1))

  def _lose(self, why: str) -> None:
    with self._lock:
      if self._lost is None:
        self._lost = why
        logging.error("lease: %s lost generation %d of %s: %s", self.holder,
                      self.generation, self.store.root, why)

  def renew(self) -> bool:
    """Extends the lease once (the background thread calls it); False once it is lost."""
    with self._lock:
      if self._lost is not None or self.generation is None:
        return False
      generation = self.generation
    started_wall, started = self._wall(), self._monotonic()
    if started >= self._valid_until:  # ran out (e.g. the process was stopped): never revive
      self._lose(f"not renewed for {self.duration_s:.1f} s")
      return False
    try:
      if self._taken():
        self._lose(f"generation {generation + 1} was taken by another syncer")
        return False
      self.store.blobs.write_json(self._rel(generation),
                                  self._record(generation, started_wall, renewed_at=started_wall),
                                  durable=True)
    except (StoreError, OSError) as e:  # a store hiccup: the lease runs out unless a later
      logging.warning("lease: renewal failed: %r", e)  # renewal works
      return True
    with self._lock:
      if self._lost is None:
        self._valid_until = max(self._valid_until, started + self.duration_s)
    return True

  def _renew_loop(self) -> None:
    while not self._stop.wait(self.duration_s / 4):
      if not self.renew():
        return

  @property
  def held(self) -> bool:
    """A memory read, for the syncer's loop: held and valid for `margin_s` more."""
    with self._lock:
      return (self._lost is None and self.generation is not None
              and self._monotonic() + self.margin_s < self._valid_until)

  def check(self) -> None:
    """Raises LeaseLost unless this process may write now: call it right before a commit."""
    with self._lock:
      lost, generation = self._lost, self.generation
    if generation is None:
      raise LeaseLost(f"store {self.store.root}: this syncer never took the lease")
    if lost is None and self._monotonic() + self.margin_s >= self._valid_until:
      self._lose(f"its validity ran out (not renewed within {self.duration_s:.1f} s)")
    elif lost is None and self._taken():
      self._lose(f"generation {generation + 1} was taken by another syncer")
    with self._lock:
      lost = self._lost
    if lost is not None:
      raise LeaseLost(f"store {self.store.root}: syncer {self.holder} lost the lease "
                      f"(generation {generation}): {lost}; it must not write again")
