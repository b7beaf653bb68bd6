"""The wall-clock driver of the single-controller runtime: a thread per learner."""

from __future__ import annotations

import queue
import threading
import time

from absl import logging

from diloco.learner import loop as learner_loop
from diloco.learner.learner import NonFiniteMetrics
from diloco.runtime.core import Runtime, Slot
from diloco.runtime.drivers import Driver, SlotHooks


class _ThreadHooks(SlotHooks):
  """`learner_loop.LoopHooks` (and `WallClock`) of a learner thread: the wall clock, its stop
  event (a fault or the end of the run)."""

  def __init__(self, driver: ThreadedDriver, slot: Slot, stop: threading.Event):
    super().__init__(driver, slot)
    self._stop = stop

  def now(self) -> float:
    return self._driver.now()

  def stopped(self) -> bool:
    return self._stop.is_set() or self._driver.done.is_set()

  def slowdown(self) -> float:
    return self._driver.rt.step_duration(self._slot)

  def pause(self, seconds: float) -> None:
    self._stop.wait(seconds)

  def agree(self, give_up: bool = False) -> learner_loop.Agreement:
    return learner_loop.Agreement(self.stopped(), give_up)


class ThreadedDriver(Driver):
  """Wall-clock driver: a thread per learner, one for the syncer; faults from the main thread.
  Each learner thread executes its `learner_loop.life` at once (`learner_loop.run`)."""

  def __init__(self, runtime: Runtime, on_eval, on_step):
    super().__init__(runtime, on_eval, on_step)
    self._t0 = time.monotonic() - runtime.clock_start
    self.done = threading.Event()
    self._errors: list[BaseException] = []
    self._stops: dict[int, threading.Event] = {}
    self._threads: dict[int, threading.Thread] = {}
    self._failed: queue.SimpleQueue = queue.SimpleQueue()  # (slot, since) to restart
    self._returns: list[tuple[float, Slot, float]] = []  # (at, slot, since) to restart
    self._cohort: set[int] = set()  # initial learners that have not reached the gang start
    self._gang_size = 0
    self._ready = 0  # initial learners that reached the gang start
    self._gang = threading.Condition()  # notified as each initial learner gets ready
    self._eval: threading.Thread | None = None
    self.evals_skipped = 0
    self._ticks = 0  # the syncer thread's ticks, under the runtime's lock

  def now(self) -> float:
    return time.monotonic() - self._t0

  def _guard(self, fn, *args) -> None:
    try:
      fn(*args)
    except BaseException as e:  # surfaced by the main thread
      logging.exception("runtime thread failed")
      self._errors.append(e)
      self.done.set()
      with self._gang:  # no learner waits at the gang start for a peer that will not come
        self._gang.notify_all()

  def _syncer_loop(self) -> None:
    deadline = None
    while not self.done.is_set():
      wait = 0.05 if deadline is None else min(0.05, max(deadline - self.now(), 0.0))
      self.rt.transport.wait_for_messages(wait)
      messages = self.rt.transport.take()
      with self.rt.lock:
        merged, deadline = self.rt.syncer.tick(self.now(), *messages)
        self._ticks += 1
      for m in merged:
        self.rt.transport.publish(m)

  def _aborted(self) -> bool:
    return self.done.is_set()

  def _clock(self) -> float:
    return self.now()

  def _settle_mark(self) -> int:
    """Every learner has left, so its messages are all in the transport: once a tick that
    took them after this call began has run (two more ticks: the one under way may have taken
    before), a settled syncer has them all."""
    with self.rt.lock:
      return self._ticks + 2

  def _settled(self, mark: int) -> bool:
    with self.rt.lock:
      return self._ticks >= mark and self.rt.syncer.settled()

  def _syncer_moves(self, until: float) -> bool:
    """Gives the syncer thread 10 ms."""
    if self.now() >= until or self.done.is_set():
      return False
    time.sleep(0.01)
    return True

  def _learner_loop(self, slot: Slot, stop: threading.Event) -> None:
    try:
      self._train(slot, stop)
    except NonFiniteMetrics as e:  # this learner failed; the others go on
      since = self.now()
      if self.rt.learner_failed(slot, e):
        self._failed.put((slot, since))

  def _train(self, slot: Slot, stop: threading.Event) -> None:
    start = self.now()
    initial = slot.index in self._cohort
    learner = self.rt.start_learner(slot, background_io=True, now=start, clock=time.monotonic,
                                    joins_running=not initial)
    self.rt.recorder.span(slot, "load", start, self.now())
    self._start_together(slot)
    self.rt.align_schedule(slot)
    hooks = _ThreadHooks(self, slot, stop)
    # `_stop` sets the status before it stops the thread: "retired" is a planned retirement.
    finished, _ = learner_loop.run(
        learner, self.cfg, hooks, hooks,
        on_purpose=lambda done: done or (stop.is_set() and slot.status == "retired"))
    self.rt.stop_learner(slot, "done" if finished else slot.status)

  def _start_together(self, slot: Slot) -> None:
    """The initial learners take their first step together (`learner_loop.start_together`,
    as the learner processes do). A rejoining learner does not wait."""
    if slot.index not in self._cohort:
      return
    with self._gang:
      self._cohort.discard(slot.index)
      self._ready += 1
      self._gang.notify_all()

    def wait(seconds: float) -> None:
      with self._gang:
        self._gang.wait_for(lambda: self._ready >= self._gang_size or self.done.is_set(),
                            seconds)

    learner_loop.start_together(slot.index, lambda: self._ready, self._gang_size,
                                self.cfg.store.join_timeout_s, wait, abandoned=self.done.is_set)

  def _start(self, slot: Slot) -> None:
    stop = threading.Event()
    self._stops[slot.index] = stop
    slot.status = "up"
    thread = threading.Thread(target=self._guard, args=(self._learner_loop, slot, stop),
                              name=f"learner-{slot.index}", daemon=True)
    self._threads[slot.index] = thread
    thread.start()

  def _stop(self, slot: Slot, status: str) -> None:
    slot.status = status  # read by the learner thread when it exits
    self._stops[slot.index].set()
    self._threads[slot.index].join()

  def run(self) -> None:
    cfg = self.cfg
    for m in self.rt.syncer.initial(0.0):
      self.rt.transport.publish(m)
    syncer = threading.Thread(target=self._guard, args=(self._syncer_loop,), name="syncer",
                              daemon=True)
    syncer.start()
    initial = self.rt.initial_slots()
    self._cohort = {slot.index for slot in initial}
    self._gang_size = len(initial)
    for slot in initial:
      self._start(slot)
    pending = list(self.rt.faults)
    returns = self._returns
    next_eval = cfg.train.eval_every
    while not self.done.is_set() and not self.rt.stop_requested.is_set():
      now = self.now()
      while pending and pending[0].at <= now:
        self._fault(pending.pop(0))
      while not self._failed.empty():  # rejoin at once from the global fragments
        slot, since = self._failed.get()
        self._threads[slot.index].join()
        returns.append((now, slot, since))
      for item in [r for r in returns if r[0] <= now]:
        returns.remove(item)
        _, slot, since = item
        self.rt.recorder.span(slot, "down", since, self.now())
        self._start(slot)
      progress = max((s.resume.local_step if s.learner is None else s.learner.local_step)
                     for s in self.rt.slots)
      if next_eval and progress >= next_eval:
        self._evaluate_in_background()
        next_eval += cfg.train.eval_every
      if all(s.status in ("idle", "retired", "done") for s in self.rt.slots) and not returns \
          and self._failed.empty():
        break
      time.sleep(0.05)
    self._settle()
    self.done.set()
    syncer.join()
    for thread in self._threads.values():
      thread.join()
    if self._eval is not None:
      self._eval.join()
    if self._errors:
      raise self._errors[0]

  def _evaluate_in_background(self) -> None:
    """The periodic global eval on a thread of its own (it copies G under the lock and
    evaluates without it): neither merges nor this loop's faults and restarts wait for it.
    One at a time: an eval due while the previous one runs is skipped (counted)."""
    if self._eval is not None and self._eval.is_alive():
      self.evals_skipped += 1
      logging.warning("the global eval is still running: the one due now is skipped")
      return
    self._eval = threading.Thread(target=self._guard, args=(self.on_eval, self.now()),
                                  daemon=True, name="eval")
    self._eval.start()
    messages = self.rt.transport.take()
    with self.rt.lock:
      self.rt.syncer.tick(self.now(), *messages)

  def _add(self, slot: Slot) -> None:
    self._start(slot)

  def _retire(self, slot: Slot) -> None:
    self._stop(slot, "retired")

  def _down(self, slot: Slot, duration: float) -> None:
    self._stop(slot, "down")
    self._returns.append((self.now() + duration, slot, self.now()))
