"""Drivers of the single-controller runtime: what the virtual clock and the wall clock share.

  * `diloco.runtime.virtual_driver.VirtualDriver`: one thread and an event heap on a virtual
    clock; step times come from the configured speeds and a seeded jitter, so the same seed
    gives bit-identical global parameters and event tapes (tests use it);
  * `diloco.runtime.threaded_driver.ThreadedDriver`: one thread per learner and one for the
    syncer on the wall clock.
Both run each learner's life as `diloco.learner.loop.life` says (the threads execute its
requests at once, the virtual clock schedules them as events), and share, here, the cooperative
fault schedule (`diloco.runtime.faults`, `Driver._fault`), the final settling of the syncer
(`Driver._settle`) and the hooks every learner slot has (`SlotHooks`).
"""

from __future__ import annotations

from typing import Any

from absl import logging

from diloco.runtime import faults as faults_lib
from diloco.runtime.core import Runtime, Slot


class Driver:
  """What both drivers share: the fault schedule's dispatch and the final settling of the
  syncer. Each driver says how it starts, retires and takes down a learner, and how its
  syncer moves on."""

  def __init__(self, runtime: Runtime, on_eval, on_step):
    self.rt, self.on_eval, self.on_step = runtime, on_eval, on_step
    self.cfg = runtime.cfg
    self.faults_fired = self.faults_ignored = 0  # of `learners.faults`, for the run's report

  def _fault(self, fault: faults_lib.Fault) -> None:
    """Applies one event of `learners.faults`; an event that finds no spare device group or
    no running learner is ignored (counted)."""
    self.faults_fired += 1
    if fault.kind == "add":
      idle = [s for s in self.rt.slots if s.status == "idle"]
      if not idle:
        logging.warning("fault add@%s: no spare device group left; ignored", fault.at)
        self.faults_ignored += 1
        return
      self._add(idle[0])
      return
    slot = self.rt.slots[fault.learner]
    if slot.status != "up":
      logging.warning("fault %s: learner %d is %s; ignored", fault.kind, slot.index, slot.status)
      self.faults_ignored += 1
      return
    if fault.kind == "retire":
      self._retire(slot)
    elif fault.kind == "nan":
      self.rt.poison(slot)
    else:
      self._down(slot, fault.duration)

  def _add(self, slot: Slot) -> None:
    """Starts a learner on an idle device group."""
    raise NotImplementedError

  def _retire(self, slot: Slot) -> None:
    """Retires a running learner on purpose (it leaves with its final deliveries)."""
    raise NotImplementedError

  def _down(self, slot: Slot, duration: float) -> None:
    """Takes a running learner down; a new incarnation starts `duration` seconds later."""
    raise NotImplementedError

  def _settle(self) -> None:
    """With `receipt.final_sync`, the rounds that hold the learners' final deliveries close
    after the last learner left: the syncer goes on until it has merged them, for at most
    `sync.heartbeat_timeout_s` more of the run's clock."""
    if not self.cfg.receipt.final_sync or self._aborted():
      return
    until = self._clock() + self.cfg.sync.heartbeat_timeout_s
    mark = self._settle_mark()
    while not self._settled(mark):
      if not self._syncer_moves(until):
        if not self._aborted():
          logging.warning("the syncer has not merged every final delivery within "
                          "sync.heartbeat_timeout_s=%g s", self.cfg.sync.heartbeat_timeout_s)
        return

  def _aborted(self) -> bool:
    """Whether a runtime thread failed (the run ends with its error)."""
    return False

  def _clock(self) -> float:
    raise NotImplementedError

  def _settle_mark(self) -> Any:
    """Lets the syncer take every learner's last messages; what `_settled` needs to know it
    has."""
    raise NotImplementedError

  def _settled(self, mark: Any) -> bool:
    """Whether the syncer took the last messages (`mark`) and has merged everything."""
    raise NotImplementedError

  def _syncer_moves(self, until: float) -> bool:
    """Lets the syncer move on (not past `until`); False when it cannot any more."""
    raise NotImplementedError


class SlotHooks:
  """`diloco.learner.loop.LoopHooks` shared by both drivers: the runtime's recorder and the run's
  metrics; the run checkpoint (`diloco.runtime.run_checkpoint`) covers the learner's state, so
  it saves none of its own."""

  def __init__(self, driver: Driver, slot: Slot):
    self._driver, self._slot = driver, slot

  def span(self, kind: str, start: float, end: float, **extra) -> None:
    self._driver.rt.recorder.span(self._slot, kind, start, end, **extra)

  def after_step(self, final: bool) -> None:
    if not final:  # a finished learner's last metrics are written by `Runtime.on_done`
      self._driver.on_step(self._slot)

  def checkpoint(self) -> None:
    return None  # the run checkpoint covers this learner (see the class docstring)
