"""The learners' background sender: deliveries leave the devices off the stepping thread.

A delivery's fragment copy is held (on the device, then on the host) until its send is done, so
what is on its way is bounded in bytes, not only in count: a learner whose sends fall behind
waits (backpressure) instead of pinning unbounded memory. One worker thread sends in the order
the deliveries were queued, so a sender shared by several learners of one thread (the virtual
clock) hands them to the transport in exactly the order a synchronous send would.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class _Job:
  owner: Any
  nbytes: int
  future: concurrent.futures.Future


class Sender:
  """A worker thread fed by a queue bounded per owner (a learner) in bytes and in count.

  `submit` is called from one thread (a learner's, or the virtual clock's driver). An owner's
  next send waits while its sends on their way hold `limit_bytes` (with the new one) or number
  `limit_count`; one send is always let through, however large, so nothing deadlocks.
  """

  def __init__(self, limit_bytes: int, limit_count: int):
    self.limit_bytes, self.limit_count = limit_bytes, limit_count
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sender")
    self._jobs: list[_Job] = []  # oldest first
    self.wait_s = 0.0   # wall seconds submitters waited for room (backpressure)
    self.drain_s = 0.0  # wall seconds `drain` waited for sends to be handed over
    self.peak_bytes = 0  # the most bytes on their way at once

  def pending_bytes(self, owner: Any = None) -> int:
    return sum(j.nbytes for j in self._jobs if owner is None or j.owner is owner)

  def submit(self, owner: Any, nbytes: int, fn: Callable[..., None], *args) -> float:
    """Queues `fn(*args)` (the send of `nbytes` held for `owner`) once there is room; returns
    the wall seconds it waited. A failed earlier send of `owner` raises here."""
    self._collect(owner)
    waited = 0.0
    mine = [j for j in self._jobs if j.owner is owner]
    while mine and (len(mine) >= self.limit_count or
                    sum(j.nbytes for j in mine) + nbytes > self.limit_bytes):
      started = time.monotonic()
      concurrent.futures.wait([mine[0].future])
      waited += time.monotonic() - started
      self._collect(owner)
      mine = [j for j in self._jobs if j.owner is owner]
    self.wait_s += waited
    self._jobs.append(_Job(owner, nbytes, self._pool.submit(fn, *args)))
    self.peak_bytes = max(self.peak_bytes, self.pending_bytes())
    return waited

  def drain(self, owner: Any = None) -> None:
    """Waits until every queued send (of `owner`, or all) is handed over; raises the first
    that failed."""
    jobs = [j for j in self._jobs if owner is None or j.owner is owner]
    if not jobs:
      return
    started = time.monotonic()
    concurrent.futures.wait([j.future for j in jobs])
    self.drain_s += time.monotonic() - started
    self._collect(owner, every=True)

  def _collect(self, owner: Any, every: bool = False) -> None:
    """Forgets finished sends (of `owner`, or all with `every` and no owner), raising the
    first failure among them."""
    done = [j for j in self._jobs if j.future.done() and
            (j.owner is owner or (every and owner is None))]
    self._jobs = [j for j in self._jobs if all(j is not d for d in done)]
    for j in done:
      j.future.result()

  def close(self) -> None:
    """Hands over what is queued, then stops the worker."""
    try:
      self.drain()
    finally:
      self._pool.shutdown(wait=True)
