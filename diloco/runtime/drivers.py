"""Drivers of the single-controller runtime: a virtual clock or threads on the wall clock.

  * `VirtualDriver`: one thread and an event heap on a virtual clock; step times come
    from the configured speeds and a seeded jitter, so the same seed gives bit-identical
    global parameters and event tapes (tests use it);
  * `ThreadedDriver`: one thread per learner and one for the syncer on the wall clock.
Both run each learner's life as `diloco.learner.loop.life` says (the threads execute its
requests at once, the virtual clock schedules them as events), and share the cooperative
fault schedule (`diloco.runtime.faults`, `_Driver._fault`) and the final settling of the syncer
(`_Driver._settle`).
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


class _Driver:
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
    """With `sync.final_sync`, the rounds that hold the learners' final deliveries close
    after the last learner left: the syncer goes on until it has merged them, for at most
    `sync.heartbeat_timeout_s` more of the run's clock."""
    if not self.cfg.sync.final_sync or self._aborted():
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


class _SlotHooks:
  """`learner_loop.LoopHooks` shared by both drivers: the runtime's recorder and the run's
  metrics; the run checkpoint (`diloco.runtime.run_checkpoint`) covers the learner's state, so
  it saves none of its own."""

  def __init__(self, driver: _Driver, slot: Slot):
    self._driver, self._slot = driver, slot

  def span(self, kind: str, start: float, end: float, **extra) -> None:
    self._driver.rt.recorder.span(self._slot, kind, start, end, **extra)

  def after_step(self, final: bool) -> None:
    if not final:  # a finished learner's last metrics are written by `Runtime.on_done`
      self._driver.on_step(self._slot)

  def checkpoint(self) -> None:
    return None  # the run checkpoint covers this learner (see the class docstring)


class _VirtualHooks(_SlotHooks):
  """`learner_loop.LoopHooks` of a learner on the virtual clock. Its clock starts when it
  has loaded; the fault schedule stops learners as events of their own, so the loop never
  sees a stop."""

  def __init__(self, driver: VirtualDriver, slot: Slot, loaded_at: float):
    super().__init__(driver, slot)
    self._loaded_at = loaded_at

  def now(self) -> float:
    return max(self._driver.now, self._loaded_at)

  def stopped(self) -> bool:
    return False

  def agree(self, give_up: bool = False) -> learner_loop.Agreement:
    return learner_loop.Agreement(False, give_up)


class VirtualDriver(_Driver):
  """Deterministic discrete-event driver on a virtual clock (one thread).

  It executes each learner's `learner_loop.life` on its event heap: a `Step` ends an event
  a step duration (`Runtime.step_duration` x `learners.virtual_step_s`) after it begins, a
  `WaitForRound` parks the learner until a publish or tick (it is heard at every tick
  meanwhile) or its give-up time, a `SyncPoint` first lets the syncer take the steps' messages.
  A fault ends a learner at once: a step in flight is lost.
  """

  def __init__(self, runtime: Runtime, on_eval, on_step):
    super().__init__(runtime, on_eval, on_step)
    self.now = runtime.clock_start
    self._heap: list = []
    self._seq = itertools.count()
    self._lives: dict[int, learner_loop.Life] = {}
    self._waiting: dict[int, learner_loop.WaitForRound] = {}  # parked learners
    self._stepped = False  # a learner stepped since the syncer last ran
    self._tick_at: float | None = None
    self._down_since: dict[int, float] = {}

  def _push(self, at: float, kind: str, data: Any = None) -> None:
    heapq.heappush(self._heap, (at, next(self._seq), kind, data))

  def _tick(self) -> None:
    for g in self._waiting:  # waiting learners are alive
      slot = self.rt.slots[g]
      self.rt.transport.heartbeat(Heartbeat(g, slot.incarnation, slot.learner.local_step, 0.0,
                                            self.now))
    self._stepped = False
    merged, deadline = self.rt.syncer.tick(self.now, *self.rt.transport.take())
    for m in merged:
      self._push(m.published_at, "publish", m)
    if deadline is not None and (self._tick_at is None or deadline < self._tick_at
                                 or self._tick_at <= self.now):
      self._tick_at = deadline
      self._push(deadline, "tick")

  def _advance(self, slot: Slot, outcome: Any = None) -> None:
    """Runs the slot's learner loop (sending it `outcome` first) up to its next request that
    takes time, and schedules it (a `SyncPoint` takes none)."""
    g = slot.index
    life = self._lives[g]
    while True:
      try:
        request = life.send(outcome)
      except NonFiniteMetrics as e:  # its last step's metrics, read as it finished
        self._fail(slot, e)
        return
      outcome = None
      if isinstance(request, learner_loop.SyncPoint):
        if self._stepped:
          self._tick()
        outcome = slot.learner.sync_point()
        continue
      if isinstance(request, learner_loop.WaitForRound):
        parked = self._waiting.get(g)
        self._waiting[g] = request
        if parked is None or parked.give_up_at != request.give_up_at:
          self._push(request.give_up_at, "give_up", (g, slot.incarnation, request.give_up_at))
        return
      self._waiting.pop(g, None)
      if isinstance(request, learner_loop.Step):
        start = request.previous
        duration = self.rt.step_duration(slot) * self.cfg.learners.virtual_step_s
        self._push(start + duration, "step", (g, slot.incarnation, start))
        return
      self._end_life(slot)  # `Leave`: it finished (the loop never sees a stop here)
      learner_loop.leave(slot.learner, self.cfg, on_purpose=True)
      self.rt.stop_learner(slot, "done" if request.finished else "retired")
      return

  def _end_life(self, slot: Slot) -> None:
    self._waiting.pop(slot.index, None)
    life = self._lives.pop(slot.index, None)
    if life is not None:
      life.close()

  def _fail(self, slot: Slot, error: NonFiniteMetrics) -> None:
    """Its step went non-finite: the learner fails, and rejoins at once unless retired."""
    self._end_life(slot)
    if self.rt.learner_failed(slot, error):
      self._down_since[slot.index] = self.now
      self._push(self.now, "down_end", slot.index)
    self._tick()

  def _join(self, slot: Slot, joins_running: bool = True) -> None:
    self.rt.start_learner(slot, background_io=False, now=self.now, clock=lambda: self.now,
                          joins_running=joins_running)
    loaded = self.now + self.cfg.learners.virtual_step_s
    self.rt.recorder.span(slot, "load", self.now, loaded)
    self._lives[slot.index] = learner_loop.life(slot.learner, self.cfg,
                                                _VirtualHooks(self, slot, loaded))
    self._advance(slot)

  def _add(self, slot: Slot) -> None:
    self._join(slot)

  def _retire(self, slot: Slot) -> None:
    self._end_life(slot)
    learner_loop.leave(slot.learner, self.cfg, on_purpose=True)
    self.rt.stop_learner(slot, "retired")

  def _down(self, slot: Slot, duration: float) -> None:
    self._end_life(slot)
    self.rt.stop_learner(slot, "down")
    self._down_since[slot.index] = self.now
    self._push(self.now + duration, "down_end", slot.index)

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
          self._fail(slot, e)
          continue
        self._stepped = True
        self._advance(slot)
      elif kind in ("publish", "tick"):
        if kind == "publish":
          self.rt.transport.publish(data)
        self._tick()
        for g in sorted(self._waiting):  # each asks its learner what it still waits for
          self._advance(self.rt.slots[g])
      elif kind == "give_up":
        g, incarnation, give_up_at = data
        parked = self._waiting.get(g)
        if parked is not None and self.rt.slots[g].incarnation == incarnation and \
            parked.give_up_at == give_up_at:
          self._advance(self.rt.slots[g], outcome=True)  # the wait ran until its give-up time
      elif kind == "fault":
        self._fault(data)
      elif kind == "down_end":
        slot = self.rt.slots[data]
        self.rt.recorder.span(slot, "down", self._down_since.pop(data), self.now)
        self._join(slot)
      elif kind == "eval":
        self.on_eval(self.now)
        if any(s.status == "up" for s in self.rt.slots):
          self._push(self.now + cfg.train.eval_every * cfg.learners.virtual_step_s, "eval")
    self._settle()

  def _clock(self) -> float:
    return self.now

  def _settle_mark(self) -> None:
    self._tick()

  def _settled(self, mark: None) -> bool:
    return self.rt.syncer.settled()

  def _syncer_moves(self, until: float) -> bool:
    """The next publish or tick on the heap (nobody is left to step, evaluate or fail)."""
    while self._heap and self._heap[0][0] <= until:
      at, _, kind, data = heapq.heappop(self._heap)
      if kind not in ("publish", "tick"):
        continue
      self.now = at
      if kind == "publish":
        self.rt.transport.publish(data)
      self._tick()
      return True
    return False


class _ThreadHooks(_SlotHooks):
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


class ThreadedDriver(_Driver):
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
    while not self.done.is_set():
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
