"""One learner's life around its steps, written once for every runtime (docs/architecture.md).

A learner (`diloco.learner.learner.Learner`) knows how to step, deliver and apply merged fragments;
this module decides when: step, pace to the configured speed, record step and wait spans,
apply what is due (`sync_point`), wait for a late round with heartbeats and give up on it
after `sync.heartbeat_timeout_s`, and, when the learner finishes or retires on purpose,
deliver every fragment one last time (`receipt.final_sync`) before flushing.

`life` is a generator: it yields what the learner does next (`Step`, `SyncPoint`,
`WaitForRound`, `Leave`) and receives the outcome. Each runtime executes the requests on its
own clock: the threaded driver's learner threads (`diloco.runtime.drivers`) and the learner
processes (`diloco.distributed.learner_process`) run them at once on the wall clock (`run`),
and the virtual-clock driver schedules them as events (a step ends a step duration later, a
wait ends on a publish). So a change to what a learner does between its steps is one edit
that every runtime picks up. The schedule alignment with live peers and the gang start are
shared here too. Nothing here knows the syncer: a learner only talks to its transport.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator
from typing import Any, Protocol

from absl import logging

from diloco import fragments as fragments_lib
from diloco.learner.island import pacing_wait
from diloco.learner.learner import Learner, LearnerConfig
from diloco.observe.accounting import span_record
from diloco.transport import Heartbeat

# How long one wait for a late round's publication lasts on the wall clock before the learner
# heartbeats again and asks whether to go on waiting.
_WAIT_SLICE_S = 0.2
# Shorter waits and stalls are not recorded as wait spans (timer noise).
_MIN_WAIT_S = 1e-3


@dataclasses.dataclass(frozen=True)
class Step:
  """One inner step (`Learner.step`), taking the learner's step duration on the executor's
  clock (on the wall clock: the step, then pacing to `hooks.slowdown()`). `step_time` is the
  previous step's duration, `previous` when it ended. The outcome is None."""
  step_time: float
  previous: float


@dataclasses.dataclass(frozen=True)
class SyncPoint:
  """Applies what is due (`Learner.sync_point`); the outcome is the fragments whose awaited
  round is not published yet. A virtual clock first lets its syncer take what the learner
  sent since it last ran."""


@dataclasses.dataclass(frozen=True)
class WaitForRound:
  """Waits a while for `fragment`'s round `version` to be published, heard by the syncer
  meanwhile (`heartbeat`); at the latest until `give_up_at`, when the loop gives it up. The
  outcome is whether the wait ran until `give_up_at` (an event clock wakes the learner exactly
  then; a wall-clock slice ends on its own and the loop reads the clock): the loop then asks
  the learner (`SyncPoint`) what it still waits for, or gives up."""
  fragment: int
  version: int
  heartbeat: Heartbeat
  give_up_at: float


@dataclasses.dataclass(frozen=True)
class Leave:
  """The learner ends its training (`leave`); `finished`: it took all its steps (otherwise
  the runtime stopped it: whether that was on purpose is the runtime's to say). The outcome is
  None, and the generator ends."""
  finished: bool


Request = Step | SyncPoint | WaitForRound | Leave


@dataclasses.dataclass(frozen=True)
class Agreement:
  """What the runtime decided at a point of the loop: leave it (`stop`: a retirement, a
  fault, the run's end) and stop waiting for the late round (`give_up`)."""
  stop: bool
  give_up: bool = False


class LoopHooks(Protocol):
  """What differs between the runtimes besides their clocks; `life` calls these at fixed
  points of its loop.

  A learner over several hosts must take the same decisions on every host: `agree` is then
  a collective call, made the same number of times at the same points on every host.
  """

  def now(self) -> float:
    """The run's clock (seconds)."""

  def stopped(self) -> bool:
    """A stop this process alone can see before the next step (never a collective)."""

  def agree(self, give_up: bool = False) -> Agreement:
    """Whether to stop (after every step and wait slice) and to give up a late round."""

  def span(self, kind: str, start: float, end: float, **extra) -> None:
    """Records an activity span (`SpanLog`)."""

  def after_step(self, final: bool) -> None:
    """After every step (`final`: after the last one, its metrics just read)."""

  def checkpoint(self) -> None:
    """Between steps, after the sync point: saves the learner's state when one is due."""


class WallClock(Protocol):
  """What the wall-clock executor (`run`) needs besides `LoopHooks`."""

  def slowdown(self) -> float:
    """This step's pacing factor (its speed, with jitter): see `island.pacing_wait`."""

  def pause(self, seconds: float) -> None:
    """Sleeps for pacing; may return early when the learner is asked to stop."""


Life = Generator[Request, Any, None]


def life(learner: Learner, cfg: LearnerConfig, hooks: LoopHooks) -> Life:
  """The learner's life: steps `learner` until `train.steps` local steps or a stop (by
  `hooks.stopped` or an agreed stop), then leaves (`Leave`)."""
  step_time, previous = 0.0, hooks.now()
  stop = False
  while learner.local_step < cfg.train.steps and not stop and not hooks.stopped():
    end, step_time = yield from _step(learner, hooks, previous, step_time)
    stop = hooks.agree().stop
    if cfg.receipt.final_sync and finished(learner, cfg):
      # The rounds received from here on keep its last steps, which the final sync delivers;
      # those of the deliveries it stepped past are due now and waited for (below).
      learner.keep_progress()
    blocked = yield SyncPoint()  # applies what is due (not a wait: the next step's time)
    waited_from = hooks.now()
    if blocked and not stop:
      stop = yield from _wait(learner, cfg, hooks, blocked, waited_from, step_time)
    waited = hooks.now() - waited_from > _MIN_WAIT_S
    if waited:
      hooks.span("wait", waited_from, hooks.now(), local_step=learner.local_step)
    hooks.checkpoint()
    # Paced steps keep their schedule: host work between steps (metrics, status, a checkpoint
    # save) is absorbed by the next step's pacing, as an accelerator overlaps it with the step
    # in flight, so equal learners do not drift apart by their host jitter. A wait restarts it.
    previous = hooks.now() if waited else end
  learner.read_metrics()  # the last step's metrics, which no next step reads
  hooks.after_step(final=True)
  stop = stop or hooks.stopped()
  yield Leave(finished=finished(learner, cfg) and not stop)


def _step(learner: Learner, hooks: LoopHooks, previous: float, step_time: float):
  """One step and its spans; returns (its end, its duration)."""
  send_wait = learner.send_wait_s
  yield Step(step_time, previous)
  end = hooks.now()
  step_time = end - previous
  # Time the step waited for room to send (backpressure) is waiting, not training.
  stalled = min(learner.send_wait_s - send_wait, step_time)
  hooks.span("step", previous, end - stalled, local_step=learner.local_step,
             tokens=learner.tokens_per_step)
  if stalled > _MIN_WAIT_S:
    hooks.span("wait", end - stalled, end, local_step=learner.local_step)
  hooks.after_step(final=False)
  return end, step_time


def _wait(learner: Learner, cfg: LearnerConfig, hooks: LoopHooks, blocked: list[int],
          waited_from: float, step_time: float):
  """Waits for the late rounds of the `blocked` fragments (heartbeating, so the syncer keeps
  counting this learner) until they are published and applied, the runtime stops it, or it
  gives up after `sync.heartbeat_timeout_s`. Returns whether it was stopped meanwhile."""
  transport = learner.transport
  timeout = cfg.sync.heartbeat_timeout_s
  while blocked and not hooks.stopped():
    p = blocked[0]
    timed_out = yield WaitForRound(p, transport.latest_version(p) + 1,
                                   Heartbeat(learner.id, learner.incarnation, learner.local_step,
                                             step_time, hooks.now()), waited_from + timeout)
    agreed = hooks.agree(give_up=bool(timed_out) or hooks.now() - waited_from > timeout)
    if agreed.give_up:
      logging.warning("learner %d gave up waiting for fragments %s", learner.id, blocked)
      learner.give_up_waiting(blocked)
      return agreed.stop
    blocked = yield SyncPoint()
    if agreed.stop:
      return True
  return hooks.stopped()


def run(learner: Learner, cfg: LearnerConfig, hooks: LoopHooks, clock: WallClock,
        on_purpose: Callable[[bool], bool]) -> tuple[bool, list[int]]:
  """Lives `life` on the wall clock: each request is executed at once (a step, then its
  pacing; a wait slice of `_WAIT_SLICE_S`). At `Leave`, `on_purpose(finished)` says whether
  the learner leaves on purpose (`leave`). Returns whether it finished (took all its steps,
  not stopped) and the fragments of its final deliveries."""
  transport, done, final = learner.transport, False, []
  requests = life(learner, cfg, hooks)
  outcome = None
  while True:
    try:
      request = requests.send(outcome)
    except StopIteration:
      return done, final
    outcome = None
    if isinstance(request, Step):
      learner.step(hooks.now(), request.step_time)
      extra = pacing_wait(hooks.now() - request.previous, clock.slowdown(),
                          cfg.learners.min_step_s)
      if extra > 0:
        clock.pause(extra)
    elif isinstance(request, SyncPoint):
      outcome = learner.sync_point()
    elif isinstance(request, WaitForRound):
      transport.heartbeat(request.heartbeat)
      transport.wait_for(request.fragment, request.version, _WAIT_SLICE_S)
    else:
      done = request.finished
      final = leave(learner, cfg, on_purpose(done))


def finished(learner: Learner, cfg: LearnerConfig) -> bool:
  """Whether the learner has taken all its steps (it then leaves as "done")."""
  return learner.local_step >= cfg.train.steps


def leave(learner: Learner, cfg: LearnerConfig, on_purpose: bool) -> list[int]:
  """Ends the learner's training: a learner that finished or retires on purpose delivers
  every fragment with progress not yet delivered (`receipt.final_sync`), so its last local steps
  reach the global parameters, then every delivery is flushed to its transport. A failed
  learner only flushes (the syncer times it out, as it would a crashed island). Returns the
  fragments of the final deliveries.

  Before it, the rounds already published for its outstanding deliveries are taken in, keeping
  the steps since (`Learner.keep_progress`), so that no step is delivered twice: a finishing
  learner has waited for them at its last sync point (`life`), a retiring one does not wait.
  """
  final = []
  if on_purpose and cfg.receipt.final_sync:
    learner.keep_progress()
    learner.sync_point()
    final = learner.deliver_final()
  learner.flush()
  return final


def align_with_peers(learner: Learner, peers: list[int], cfg: LearnerConfig,
                     joins_running: bool = True) -> None:
  """Aligns the fragment schedule of a learner with its live peers' local steps `peers`.

  A learner that joins running peers with no progress of its own starts at their cohort's
  step (`learners.join_schedule=cohort`, `fragments.cohort_step`); every learner then shifts
  its schedule (`fragments.aligned_phase`) to deliver each slot in the same step as they do.
  Without it, a learner back from a failure that cost it a non-multiple of H steps delivers
  steps away from its peers, more than a grace window (at most one step) gathers, and its
  deliveries make rounds of their own.
  """
  if joins_running and not learner.local_step and cfg.learners.join_schedule == "cohort":
    step = fragments_lib.cohort_step(peers)
    if step:
      learner.start_at(step)
      logging.info("learner %d: starts at its peers' local step %d", learner.id, step)
  learner.phase = fragments_lib.aligned_phase(learner.local_step, peers, cfg.sync.period)
  if learner.phase:
    logging.info("learner %d: schedule phase %d to deliver with its peers", learner.id,
                 learner.phase)


def start_together(learner_id: int, ready: Callable[[], int], size: int, timeout_s: float,
                   wait: Callable[[float], object],
                   abandoned: Callable[[], bool] = lambda: False) -> bool:
  """The gang start: waits until `ready()` counts all `size` initial learners (up to
  `timeout_s`, or until `abandoned()`); returns whether they all came. `wait(s)` sleeps up
  to s seconds between checks (a poll of the store, or a condition a ready learner notifies,
  so that every thread starts at the same instant).

  The initial learners take their first step together. Each delivers fragment p at the same
  local steps; started seconds apart (load and compile times differ, threads contend for the
  host), paced learners would keep that offset for the whole run, more than a grace window
  (at most one step) can gather, and every round would merge one learner.
  """
  deadline = time.monotonic() + timeout_s
  while ready() < size:
    if abandoned():
      return False
    if time.monotonic() > deadline:
      logging.warning("learner %d: not every initial learner was ready within %.0f s; "
                      "starting", learner_id, timeout_s)
      return False
    wait(max(min(deadline - time.monotonic(), 1.0), 0.0))
  return True


class SpanLog:
  """Writes one learner incarnation's activity spans (`accounting.span_record`) to `sink`."""

  def __init__(self, sink: Callable[[dict], None], learner: int, incarnation: int,
               devices: int, slowdown: float):
    self._sink = sink
    self._identity = dict(learner=learner, incarnation=max(incarnation, 0))
    self._devices, self._slowdown = devices, slowdown

  def __call__(self, kind: str, start: float, end: float, **extra) -> None:
    self._sink(span_record(self._identity["learner"], self._identity["incarnation"], kind,
                           start, end, devices=self._devices, slowdown=self._slowdown, **extra))
