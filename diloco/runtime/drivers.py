"""Drivers of the single-controller runtime: a virtual clock or threads on the wall clock.

  * `VirtualDriver`: one thread and an event heap on a virtual clock; step times come
    from the configured speeds and a seeded jitter, so the same seed gives bit-identical
    global parameters and event tapes (tests use it);
  * `ThreadedDriver`: one thread per learner and one for the syncer on the wall clock.
Both apply the cooperative fault schedule (`diloco.runtime.faults`).
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from typing import Any

from absl import logging

from diloco.learner import loop as learner_loop
from diloco.learner.learner import NonFiniteMetrics
from diloco.runtime import faults as faults_lib
from diloco.runtime.core import Runtime, Slot
from diloco.transport import Heartbeat


class VirtualDriver:
  """Deterministic discrete-event driver on a virtual clock (one thread)."""

  def __init__(self, runtime: Runtime, on_eval, on_step):
    self.rt, self.on_eval, self.on_step = runtime, on_eval, on_step
    self.cfg = runtime.cfg
    self.now = runtime.clock_start
    self._heap: list = []
    self._seq = itertools.count()
    self._waiting: dict[int, tuple[float, list[int]]] = {}
    self._tick_at: float | None = None
    self.faults_fired = self.faults_ignored = 0  # of `learners.faults`, for the run's report

  def _push(self, at: float, kind: str, data: Any = None) -> None:
    heapq.heappush(self._heap, (at, next(self._seq), kind, data))

  def _schedule_step(self, slot: Slot, start: float) -> None:
    duration = self.rt.step_duration(slot) * self.cfg.learners.virtual_step_s
    self._push(start + duration, "step", (slot.index, slot.incarnation, start))

  def _tick(self) -> None:
    for g in self._waiting:  # waiting learners are alive
      slot = self.rt.slots[g]
      self.rt.transport.heartbeat(Heartbeat(g, slot.incarnation, slot.learner.local_step, 0.0,
                                            self.now))
    merged, deadline = self.rt.syncer.tick(self.now, *self.rt.transport.take())
    for m in merged:
      self._push(m.published_at, "publish", m)
    if deadline is not None and (self._tick_at is None or deadline < self._tick_at
                                 or self._tick_at <= self.now):
      self._tick_at = deadline
      self._push(deadline, "tick")

  def _after_step(self, slot: Slot) -> None:
    learner = slot.learner
    blocked = learner.sync_point()
    if blocked:
      self._waiting[slot.index] = (self.now, blocked)
      self._push(self.now + self.cfg.sync.heartbeat_timeout_s, "give_up",
                 (slot.index, slot.incarnation, learner.local_step))
    elif learner_loop.finished(learner, self.cfg):
      self._leave(slot, "done")
    else:
      self._schedule_step(slot, self.now)

  def _leave(self, slot: Slot, status: str) -> None:
    """A learner that finished ("done") or retires on purpose ("retired") leaves
    (`learner_loop.leave`: its final deliveries, then a flush)."""
    learner_loop.leave(slot.learner, self.cfg, on_purpose=True)
    self.rt.stop_learner(slot, status)

  def _join(self, slot: Slot, joins_running: bool = True) -> None:
    self.rt.start_learner(slot, background_io=False, now=self.now, clock=lambda: self.now,
                          joins_running=joins_running)
    load = self.cfg.learners.virtual_step_s
    self.rt.recorder.span(slot, "load", self.now, self.now + load)
    self._schedule_step(slot, self.now + load)

  def run(self) -> None:
    cfg = self.cfg
    for m in self.rt.syncer.initial(0.0):
      self.rt.transport.publish(m)
    for slot in self.rt.initial_slots():
      self._join(slot, joins_running=False)
    for f in self.rt.faults:
      self._push(f.at, "fault", f)
    if cfg.train.eval_every:
      self._push(cfg.train.eval_every * cfg.learners.virtual_step_s, "eval")
    down_since: dict[int, float] = {}
    while self._heap:
      if all(s.status in ("idle", "retired", "done") for s in self.rt.slots):
        break
      self.now, _, kind, data = heapq.heappop(self._heap)
      if kind == "step":
        g, incarnation, start = data
        slot = self.rt.slots[g]
        if slot.status != "up" or slot.incarnation != incarnation:
          continue  # the learner failed during this step: its work is lost
        try:
          self.rt.align_schedule(slot)
          slot.learner.step(self.now, self.now - start)
        except NonFiniteMetrics as e:
          if self.rt.learner_failed(slot, e):
            down_since[slot.index] = self.now
            self._push(self.now, "down_end", slot.index)
          self._tick()
          continue
        self.rt.recorder.span(slot, "step", start, self.now, local_step=slot.learner.local_step,
                              tokens=slot.learner.tokens_per_step)
        self.on_step(slot)
        self._tick()
        self._after_step(slot)
      elif kind in ("publish", "tick"):
        if kind == "publish":
          self.rt.transport.publish(data)
        self._tick()
        self._wake_waiting()
      elif kind == "give_up":
        g, incarnation, step = data
        slot = self.rt.slots[g]
        if g in self._waiting and slot.incarnation == incarnation and \
            slot.learner.local_step == step:
          since, blocked = self._waiting.pop(g)
          logging.warning("learner %d gave up waiting for fragments %s", g, blocked)
          slot.learner.give_up_waiting(blocked)
          self.rt.recorder.span(slot, "wait", since, self.now)
          self._after_step(slot)
      elif kind == "fault":
        self._fault(data, down_since)
      elif kind == "down_end":
        slot = self.rt.slots[data]
        self.rt.recorder.span(slot, "down", down_since.pop(data), self.now)
        self._join(slot)
      elif kind == "eval":
        self.on_eval(self.now)
        if any(s.status == "up" for s in self.rt.slots):
          self._push(self.now + cfg.train.eval_every * cfg.learners.virtual_step_s, "eval")
    self._settle()

  def _settle(self) -> None:
    """With `sync.final_sync`, the rounds that hold the learners' final deliveries close
    after the last learner left: the syncer goes on ticking and publishing until it has
    settled, for at most `sync.heartbeat_timeout_s` more of the virtual clock."""
    if not self.cfg.sync.final_sync:
      return
    until = self.now + self.cfg.sync.heartbeat_timeout_s
    self._tick()
    while not self.rt.syncer.settled() and self._heap and self._heap[0][0] <= until:
      at, _, kind, data = heapq.heappop(self._heap)
      if kind not in ("publish", "tick"):
        continue  # nobody is left to step, evaluate or fail
      self.now = at
      if kind == "publish":
        self.rt.transport.publish(data)
      self._tick()
    if not self.rt.syncer.settled():
      logging.warning("the syncer has not merged every final delivery within "
                      "sync.heartbeat_timeout_s=%g s", self.cfg.sync.heartbeat_timeout_s)

  def _wake_waiting(self) -> None:
    for g in sorted(self._waiting):
      slot = self.rt.slots[g]
      blocked = slot.learner.sync_point()
      if not blocked:
        since, _ = self._waiting.pop(g)
        self.rt.recorder.span(slot, "wait", since, self.now)
        if learner_loop.finished(slot.learner, self.cfg):
          self._leave(slot, "done")
        else:
          self._schedule_step(slot, self.now)

  def _fault(self, fault: faults_lib.Fault, down_since: dict[int, float]) -> None:
    self.faults_fired += 1
    if fault.kind == "add":
      idle = [s for s in self.rt.slots if s.status == "idle"]
      if not idle:
        logging.warning("fault add@%s: no spare device group left; ignored", fault.at)
        self.faults_ignored += 1
        return
      self._join(idle[0])
      return
    slot = self.rt.slots[fault.learner]
    if slot.status != "up":
      logging.warning("fault %s: learner %d is %s; ignored", fault.kind, slot.index, slot.status)
      self.faults_ignored += 1
      return
    if fault.kind != "nan":
      self._waiting.pop(slot.index, None)
    if fault.kind == "retire":
      self._leave(slot, "retired")
      return
    if fault.kind == "nan":
      self.rt.poison(slot)
      return
    self.rt.stop_learner(slot, "down")
    down_since[slot.index] = self.now
    self._push(self.now + fault.duration, "down_end", slot.index)


class _ThreadHooks:
  """`learner_loop.LoopHooks` of a learner thread: the wall clock, its stop event (a fault or
  the end of the run) and the runtime's recorder; the run checkpoint
  (`diloco.runtime.run_checkpoint.Periodic`) covers its state, so it saves none of its own."""

  def __init__(self, driver: ThreadedDriver, slot: Slot, stop: threading.Event):
    self._driver, self._slot, self._stop = driver, slot, stop

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

  def span(self, kind: str, start: float, end: float, **extra) -> None:
    self._driver.rt.recorder.span(self._slot, kind, start, end, **extra)

  def after_step(self, final: bool) -> None:
    if not final:  # a finished learner's last metrics are written by `Runtime.on_done`
      self._driver.on_step(self._slot)

  def checkpoint(self) -> None:
    return None  # the run checkpoint covers this learner (see the class docstring)


class ThreadedDriver:
  """Wall-clock driver: a thread per learner, one for the syncer; faults from the main thread."""

  def __init__(self, runtime: Runtime, on_eval, on_step):
    self.rt, self.on_eval, self.on_step = runtime, on_eval, on_step
    self.cfg = runtime.cfg
    self._t0 = time.monotonic() - runtime.clock_start
    self.done = threading.Event()
    self._errors: list[BaseException] = []
    self._stops: dict[int, threading.Event] = {}
    self._threads: dict[int, threading.Thread] = {}
    self._failed: queue.SimpleQueue = queue.SimpleQueue()  # (slot, since) to restart
    self._cohort: set[int] = set()  # initial learners that have not reached the gang start
    self._gang_size = 0
    self._ready = 0  # initial learners that reached the gang start
    self._gang = threading.Condition()  # notified as each initial learner gets ready
    self._eval: threading.Thread | None = None
    self.evals_skipped = 0
    self._ticks = 0  # the syncer thread's ticks, under the runtime's lock
    self.faults_fired = self.faults_ignored = 0  # of `learners.faults`, for the run's report

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

  def _settle(self) -> None:
    """With `sync.final_sync`, waits (at most `sync.heartbeat_timeout_s`) until the syncer
    thread has merged the learners' final deliveries. Every learner has left, so its messages
    are all in the transport: once a tick that took them after this call began has run (two
    more ticks: the one under way may have taken before), a settled syncer has them all."""
    if not self.cfg.sync.final_sync or self.done.is_set():
      return  # (set: a runtime thread failed)
    with self.rt.lock:
      after = self._ticks + 2
    until = time.monotonic() + self.cfg.sync.heartbeat_timeout_s
    while time.monotonic() < until:
      with self.rt.lock:
        if self._ticks >= after and self.rt.syncer.settled():
          return
      if self.done.is_set():
        return
      time.sleep(0.01)
    logging.warning("the syncer has not merged every final delivery within "
                    "sync.heartbeat_timeout_s=%g s", self.cfg.sync.heartbeat_timeout_s)

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
    learner_loop.train(learner, self.cfg, _ThreadHooks(self, slot, stop))
    finished = learner_loop.finished(learner, self.cfg) and not stop.is_set()
    # `_stop` sets the status before it stops the thread: "retired" is a planned retirement.
    retired = stop.is_set() and slot.status == "retired"
    learner_loop.leave(learner, self.cfg, on_purpose=finished or retired)
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
    returns: list[tuple[float, Slot, float]] = []
    next_eval = cfg.train.eval_every
    while not self.done.is_set():
      now = self.now()
      while pending and pending[0].at <= now:
        self._fault(pending.pop(0), returns)
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

  def _fault(self, fault: faults_lib.Fault, returns) -> None:
    self.faults_fired += 1
    if fault.kind == "add":
      idle = [s for s in self.rt.slots if s.status == "idle"]
      if idle:
        self._start(idle[0])
      else:
        logging.warning("fault add@%s: no spare device group left; ignored", fault.at)
        self.faults_ignored += 1
      return
    slot = self.rt.slots[fault.learner]
    if slot.status != "up":
      logging.warning("fault %s: learner %d is %s; ignored", fault.kind, slot.index, slot.status)
      self.faults_ignored += 1
      return
    if fault.kind == "retire":
      self._stop(slot, "retired")
      return
    if fault.kind == "nan":
      self.rt.poison(slot)
      return
    self._stop(slot, "down")
    returns.append((self.now() + fault.duration, slot, self.now()))
