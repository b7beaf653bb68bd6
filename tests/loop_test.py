"""The learner loop (`diloco.learner.loop.life`) is written once: driven here by a scripted
executor, its requests say what a learner does between its steps on every runtime, and the
drivers only execute them."""

import inspect
import types

from diloco.learner import loop as learner_loop
from diloco.runtime import drivers, threaded_driver, virtual_driver


class _Transport:
  def latest_version(self, p):
    return 4 + p


class _Learner:
  """What the loop reads of a learner; records what the loop asks of it directly."""

  def __init__(self):
    self.id, self.incarnation, self.local_step = 1, 0, 0
    self.send_wait_s, self.tokens_per_step = 0.0, 8
    self.transport = _Transport()
    self.calls = []

  def read_metrics(self):
    self.calls.append("read_metrics")

  def give_up_waiting(self, fragments):
    self.calls.append(("give_up_waiting", list(fragments)))

  def keep_progress(self):
    self.calls.append(("keep_progress", self.local_step))


class _Hooks:
  def __init__(self, stop_after=None):
    self.t, self.spans, self.after, self._stop_after = 0.0, [], [], stop_after

  def now(self):
    return self.t

  def stopped(self):
    return False

  def agree(self, give_up=False):
    return learner_loop.Agreement(self._stop_after is not None and self.t >= self._stop_after,
                                  give_up)

  def span(self, kind, start, end, **extra):
    self.spans.append((kind, start, end))

  def after_step(self, final):
    self.after.append(final)

  def checkpoint(self):
    pass


def _cfg(steps=3, timeout=30.0, final_sync=True):
  return types.SimpleNamespace(train=types.SimpleNamespace(steps=steps),
                               sync=types.SimpleNamespace(heartbeat_timeout_s=timeout),
                               receipt=types.SimpleNamespace(final_sync=final_sync))


def _drive(life, learner, hooks, blocked, wait_s=1.0, events=False):
  """Executes `life`'s requests: a step takes 1 s, a wait slice `wait_s`; the sync points
  answer the `blocked` lists in turn ([] when none is left). `events`: a wait says when it
  ran until its give-up time (as the virtual clock's timer does). Returns the request names."""
  names, outcome = [], None
  blocked = list(blocked)
  while True:
    try:
      request = life.send(outcome)
    except StopIteration:
      return names
    outcome = None
    names.append(type(request).__name__)
    if isinstance(request, learner_loop.Step):
      hooks.t += 1.0
      learner.local_step += 1
    elif isinstance(request, learner_loop.SyncPoint):
      outcome = blocked.pop(0) if blocked else []
    elif isinstance(request, learner_loop.WaitForRound):
      assert request.heartbeat.local_step == learner.local_step
      hooks.t += wait_s
      outcome = events and hooks.t >= request.give_up_at
    else:
      names[-1] += f"(finished={request.finished})"


def test_a_late_round_is_waited_for_with_heartbeats_then_the_learner_steps_on():
  learner, hooks = _Learner(), _Hooks()
  names = _drive(learner_loop.life(learner, _cfg(), hooks), learner, hooks,
                 blocked=[[], [2], [2], []])
  assert names == ["Step", "SyncPoint", "Step", "SyncPoint", "WaitForRound", "SyncPoint",
                   "WaitForRound", "SyncPoint", "Step", "SyncPoint", "Leave(finished=True)"]
  # The wait is a span of its own between steps 2 and 3, and the next step starts after it.
  assert hooks.spans == [("step", 0.0, 1.0), ("step", 1.0, 2.0), ("wait", 2.0, 4.0),
                         ("step", 4.0, 5.0)]
  assert hooks.after == [False, False, False, True]
  assert learner.calls == [("keep_progress", 3), "read_metrics"]


def test_a_round_late_past_the_heartbeat_timeout_is_given_up():
  learner, hooks = _Learner(), _Hooks()
  names = _drive(learner_loop.life(learner, _cfg(steps=2, timeout=3.0), hooks), learner, hooks,
                 blocked=[[0, 1]] * 10, wait_s=1.0)
  # Wall-clock slices of 1 s from t = 1: it gives up after the one that ends past t = 4.
  wait = ["WaitForRound", "SyncPoint"] * 3 + ["WaitForRound"]
  assert names == ["Step", "SyncPoint", *wait, "Step", "SyncPoint", *wait,
                   "Leave(finished=True)"]
  assert learner.calls == [("give_up_waiting", [0, 1]), ("keep_progress", 2),
                           ("give_up_waiting", [0, 1]), "read_metrics"]
  assert hooks.spans[1] == ("wait", 1.0, 5.0)


def test_an_event_clock_gives_up_at_the_give_up_time():
  """A wait that ran until its give-up time (a virtual clock's timer) is given up then."""
  learner, hooks = _Learner(), _Hooks()
  names = _drive(learner_loop.life(learner, _cfg(steps=1, timeout=3.0), hooks), learner, hooks,
                 blocked=[[1]] * 10, wait_s=1.0, events=True)
  assert names == ["Step", "SyncPoint", "WaitForRound", "SyncPoint", "WaitForRound",
                   "SyncPoint", "WaitForRound", "Leave(finished=True)"]
  assert hooks.spans[1] == ("wait", 1.0, 4.0)


def test_an_agreed_stop_leaves_before_the_last_step():
  learner, hooks = _Learner(), _Hooks(stop_after=2.0)
  names = _drive(learner_loop.life(learner, _cfg(steps=5), hooks), learner, hooks,
                 blocked=[[], [3]])
  # Stopped after its second step: it applies what is due, waits for nothing and leaves.
  assert names == ["Step", "SyncPoint", "Step", "SyncPoint", "Leave(finished=False)"]
  assert learner.local_step == 2


def test_the_last_sync_point_keeps_the_steps_the_final_sync_delivers():
  """Before the sync point after its last step (and the waits that follow it), the learner is
  told to keep its progress: a round received there must not overwrite the last tau steps,
  which the final sync delivers. Not before, not on a stop, not without the final sync."""
  for final_sync, stop_after, expected in ((True, None, [("keep_progress", 3)]),
                                           (False, None, []), (True, 2.0, [])):
    learner, hooks = _Learner(), _Hooks(stop_after=stop_after)
    names = _drive(learner_loop.life(learner, _cfg(final_sync=final_sync), hooks), learner,
                   hooks, blocked=[[], [], [1], []])
    assert [c for c in learner.calls if c != "read_metrics"] == expected, (final_sync, names)
  # It comes before the last sync point, so the late round waited for there is kept too.
  learner, hooks = _Learner(), _Hooks()
  order = []
  learner.keep_progress = lambda: order.append("keep_progress")
  life = learner_loop.life(learner, _cfg(steps=1), hooks)
  life.send(None)  # its step
  learner.local_step = 1
  order.append(type(life.send(None)).__name__)
  assert order == ["keep_progress", "SyncPoint"]


def test_the_wall_clock_executor_paces_steps():
  """`run` executes the same requests at once: a step, then its pacing."""

  class Learner(_Learner):
    def __init__(self, hooks):
      super().__init__()
      self._hooks = hooks

    def step(self, now, step_time):
      self.calls.append(("step", now, step_time))
      self._hooks.t += 0.5
      self.local_step += 1

    def sync_point(self):
      return []

    def keep_progress(self):
      self.calls.append("keep_progress")

    def deliver_final(self):
      return [0]

    def flush(self):
      self.calls.append("flush")

  class Clock:
    def slowdown(self):
      return 2.0

    def pause(self, seconds):
      hooks.t += seconds

  hooks = _Hooks()
  learner = Learner(hooks)
  cfg = types.SimpleNamespace(train=types.SimpleNamespace(steps=2),
                              learners=types.SimpleNamespace(min_step_s=0.0),
                              sync=types.SimpleNamespace(heartbeat_timeout_s=30.0),
                              receipt=types.SimpleNamespace(final_sync=True))
  finished, final = learner_loop.run(learner, cfg, hooks, Clock(), on_purpose=lambda done: done)
  assert (finished, final) == (True, [0])
  # Each step takes 0.5 s and is paced to 1 s (speed factor 2); the next reports its time.
  assert learner.calls[:2] == [("step", 0.0, 0.0), ("step", 1.0, 1.0)]
  assert hooks.spans == [("step", 0.0, 1.0), ("step", 1.0, 2.0)]


def test_the_drivers_only_execute_the_loop():
  """Both drivers of the single-controller runtime live the shared loop; what a learner does
  between its steps (waiting, giving up, pacing, leaving) is nowhere in the drivers."""
  assert "learner_loop.life(" in inspect.getsource(virtual_driver.VirtualDriver)
  assert "learner_loop.run(" in inspect.getsource(threaded_driver.ThreadedDriver)
  for module in (drivers, virtual_driver, threaded_driver):
    source = inspect.getsource(module)
    for decision in ("give_up_waiting", "deliver_final", "pacing_wait", "learner_loop.finished",
                     "gave up"):
      assert decision not in source, (module.__name__, decision)
  # One fault dispatch and one settling, shared by both drivers.
  for name in ("_fault", "_settle"):
    assert name in vars(drivers.Driver)
    for cls in (virtual_driver.VirtualDriver, threaded_driver.ThreadedDriver):
      assert issubclass(cls, drivers.Driver) and name not in vars(cls), (cls.__name__, name)
