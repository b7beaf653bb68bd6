"""The virtual-clock driver of the single-controller runtime: deterministic, one thread."""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from diloco.learner import loop as learner_loop
from diloco.learner.learner import NonFiniteMetrics
from diloco.learner.sender import Sender
from diloco.runtime.core import Runtime, Slot
from diloco.runtime.drivers import Driver, SlotHooks
from diloco.transport import Heartbeat


class _VirtualHooks(SlotHooks):
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


class VirtualDriver(Driver):
  """Deterministic discrete-event driver on a virtual clock (one thread).

  It executes each learner's `learner_loop.life` on its event heap: a `Step` ends an event
  a step duration (`Runtime.step_duration` x `learners.virtual_step_s`) after it begins, a
  `WaitForRound` parks the learner until a publish or tick (it is heard at every tick
  meanwhile) or its give-up time, a `SyncPoint` first lets the syncer take the steps' messages.
  A fault ends a learner at once: a step in flight is lost.

  Deliveries go through one background `Sender` shared by all learners (the threaded driver's
  send path: host copies and quantisation off this thread, bounded in bytes). It sends in the
  order they were made and is drained before the syncer takes messages and before the clock
  moves, so the syncer sees exactly what a synchronous send would have given it: the run stays
  bit-identical. The wait for a delivery's values is thus deferred from the delivery to the
  syncer's next take (its device-to-host copy starts at the delivery); its wall seconds are
  `sender.drain_s` and `sender.wait_s`, which take no time on the virtual clock.
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
    self.sender = Sender(self.cfg.sync.send_queue_bytes, self.cfg.sync.send_queue)

  def _push(self, at: float, kind: str, data: Any = None) -> None:
    heapq.heappush(self._heap, (at, next(self._seq), kind, data))

  def _tick(self) -> None:
    for g in self._waiting:  # waiting learners are alive
      slot = self.rt.slots[g]
      self.rt.transport.heartbeat(Heartbeat(g, slot.incarnation, slot.learner.local_step, 0.0,
                                            self.now))
    self._stepped = False
    self.sender.drain()  # every delivery made so far is in the transport, in order
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
                          joins_running=joins_running, sender=self.sender)
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
    try:
      self._run()
    finally:
      self.sender.close()

  def _run(self) -> None:
    cfg = self.cfg
    for m in self.rt.syncer.initial(0.0):
      self.rt.transport.publish(m)
    for slot in self.rt.initial_slots():
      self._join(slot, joins_running=False)
    for f in self.rt.faults:
      self._push(f.at, "fault", f)
    if cfg.train.eval_every:
      self._push(cfg.train.eval_every * cfg.learners.virtual_step_s, "eval")
    while self._heap and not self.rt.stop_requested.is_set():
      if all(s.status in ("idle", "retired", "done") for s in self.rt.slots):
        break
      self.sender.drain()  # a send reads the clock (its transit): none is left as it moves
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
      self.sender.drain()
      self.now = at
      if kind == "publish":
        self.rt.transport.publish(data)
      self._tick()
      return True
    return False
