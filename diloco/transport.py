"""Messages between learners and the syncer, the learner's side of a transport as a Protocol,
and the in-memory transport that carries them.

Learners and the syncer never import each other: they meet only here. A learner depends on
`LearnerTransport` alone; three classes implement it: `InMemoryTransport` (the single-controller
runtime: one process, threads or a virtual clock), `distributed.learner_link.LearnerStoreLink`
(a learner process over the store's files) and `distributed.hosts.AgreedLink` (a learner
spanning several hosts). The syncer depends only on the messages: its runtime takes them from a
transport and hands them to `Syncer.tick`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Protocol

import numpy as np

from diloco.delivery import Delivery


@dataclasses.dataclass(frozen=True)
class Heartbeat:
  learner: int
  incarnation: int
  local_step: int
  step_time: float
  time: float


@dataclasses.dataclass(frozen=True)
class Merged:
  """Version `version` of fragment `fragment` of the global parameters."""
  fragment: int
  version: int
  tensors: dict[str, np.ndarray]
  published_at: float

  @property
  def nbytes(self) -> int:
    return int(sum(t.nbytes for t in self.tensors.values()))


class LearnerTransport(Protocol):
  """What a learner needs from a transport: send heartbeats and deliveries up, read the latest
  merged fragments down. Sends never wait on the syncer; `wait_for` is the only call that
  blocks, and only a learner at its sync point (`t + tau`) calls it."""

  def heartbeat(self, beat: Heartbeat) -> None:
    """Says this learner is alive, at what step and how fast."""

  def deliver(self, payload: Delivery) -> None:
    """Hands a fragment's delivery to the transport (queued; returns at once)."""

  def latest(self, fragment: int) -> Merged | None:
    """The newest merged version of `fragment` this learner can see, or None."""

  def latest_version(self, fragment: int) -> int:
    """The version of `latest(fragment)`; -1 when none was published."""

  def wait_for(self, fragment: int, min_version: int, timeout: float) -> Merged | None:
    """Blocks until `fragment` reaches `min_version` or `timeout` passes; the latest."""

  def count_download(self, nbytes: int) -> None:
    """Adds `nbytes` to the downloaded bytes (the bandwidth ledger)."""


class InMemoryTransport:
  """Thread-safe mailboxes: heartbeats and payloads up, the latest merged fragments down."""

  def __init__(self):
    self._lock = threading.Condition()
    self._heartbeats: list[Heartbeat] = []
    self._payloads: list[Delivery] = []
    self._left: list[tuple[int, int]] = []
    self._merged: dict[int, Merged] = {}
    self.bytes_up = 0
    self.bytes_down = 0

  # Learner side.
  def heartbeat(self, beat: Heartbeat) -> None:
    with self._lock:
      self._heartbeats.append(beat)
      self._lock.notify_all()

  def deliver(self, payload: Delivery) -> None:
    with self._lock:
      self._payloads.append(payload)
      self.bytes_up += payload.nbytes
      self._lock.notify_all()

  def leave(self, learner: int, incarnation: int) -> None:
    """This incarnation left for good (retired or finished); sent after its last delivery."""
    with self._lock:
      self._left.append((learner, incarnation))
      self._lock.notify_all()

  def latest(self, fragment: int) -> Merged | None:
    with self._lock:
      return self._merged.get(fragment)

  def latest_version(self, fragment: int) -> int:
    merged = self.latest(fragment)
    return -1 if merged is None else merged.version

  def wait_for(self, fragment: int, min_version: int, timeout: float) -> Merged | None:
    """Blocks until fragment's version >= min_version (or timeout); returns the latest."""
    with self._lock:
      self._lock.wait_for(lambda: self._merged.get(fragment) is not None
                          and self._merged[fragment].version >= min_version, timeout)
      return self._merged.get(fragment)

  def count_download(self, nbytes: int) -> None:
    with self._lock:
      self.bytes_down += nbytes

  # Syncer side.
  def take(self) -> tuple[list[Heartbeat], list[Delivery], list[tuple[int, int]]]:
    """(heartbeats, payloads, (learner, incarnation) that left) since the last call."""
    with self._lock:
      taken = self._heartbeats, self._payloads, self._left
      self._heartbeats, self._payloads, self._left = [], [], []
      return taken

  def publish(self, merged: Merged) -> None:
    with self._lock:
      current = self._merged.get(merged.fragment)
      if current is not None and current.version >= merged.version:
        raise ValueError(f"fragment {merged.fragment}: version {merged.version} is not newer "
                         f"than the published {current.version}")
      self._merged[merged.fragment] = merged
      self._lock.notify_all()

  def wait_for_messages(self, timeout: float) -> None:
    with self._lock:
      self._lock.wait_for(lambda: bool(self._heartbeats or self._payloads or self._left), timeout)
