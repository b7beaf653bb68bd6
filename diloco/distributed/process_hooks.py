"""`log.hooks` in the multi-process runtime: which process runs which hooks, and a hook's stop
as the end of the whole run.

Each learner process runs its own learner's hooks (on host 0 of a learner over several
hosts), each syncer process the syncer's, after each round it commits. A hook that stops the
run writes the store's end marker (`RunLifecycle.request_end`); every learner process watches
it on a thread of its own, never on its steps, and retires on purpose (final deliveries); the
syncer settles once they have all left, then evaluates and exports as at the run's last step.
"""

from __future__ import annotations

import threading

from absl import logging

from diloco.distributed.store.run_lifecycle import RunLifecycle
from diloco.errors import ConfigError
from diloco.observe import hooks as hooks_lib


def learner_hooks(spec: str, leader: bool, hosts: int) -> hooks_lib.HookRunner:
  """A learner process's learner hooks of `spec`: run by host 0 alone (the other hosts train
  the same steps). A learner over several hosts cannot read its whole parameters on one of
  them, so a hook that asks for them is refused there."""
  if not leader:
    return hooks_lib.HookRunner()
  runner = hooks_lib.for_process(spec, on=("learner",))
  if hosts > 1 and runner.wants_params(runner.due("learner", 0)):
    runner.close()
    raise ConfigError(f"log.hooks: a learner over {hosts} hosts cannot hand its parameters "
                      "to a hook (params=True)")
  return runner


class SyncerHooks:
  """A syncer process's syncer hooks of `spec`: after each committed round, those due get its
  tape record and, when asked, a copy of the fragments this process owns, taken on the
  syncer's thread (between merges); a hook's stop writes the end marker."""

  def __init__(self, spec: str, run: RunLifecycle, syncer, who: str):
    self.runner = hooks_lib.for_process(spec, on=("syncer",))
    self._run, self._syncer, self._who, self._ended = run, syncer, who, False

  def after_round(self, record: dict) -> None:
    due = self.runner.due("syncer", int(record.get("round", -1)) + 1) if self.runner else []
    if due:
      g = self._syncer.global_params() if self.runner.wants_params(due) else None
      hooks_lib.offer_round(self.runner, record, lambda: g)

  def end_if_stopped(self, clock) -> None:
    if self.runner.stop.is_set() and not self._ended:
      self._ended = True
      self._run.request_end({"by": self._who, "reason": self.runner.reason, "at": clock()})


class EndWatch:
  """Whether the run is ending early, for a learner process: its own hooks stopped the run
  (it then writes the end marker) or another process's did (the marker, polled on a thread of
  its own, never on the learner's steps)."""

  def __init__(self, run: RunLifecycle, who: str, clock, poll_s: float):
    self._run, self._who, self._clock = run, who, clock
    self._poll_s = max(poll_s, 0.5)
    self._ended, self._closing = threading.Event(), threading.Event()
    self._thread: threading.Thread | None = None

  def is_set(self) -> bool:
    return self._ended.is_set()

  def watch(self, hooks) -> None:
    """Starts watching the store and `hooks` (a `HookRunner`: its `stop` and `reason`)."""
    if self._run.end_requested():  # a learner (re)started after the run was ended
      self._ended.set()
      return
    self._thread = threading.Thread(target=self._loop, args=(hooks,), daemon=True,
                                    name="run-end")
    self._thread.start()

  def _loop(self, hooks) -> None:
    while not self._closing.is_set():
      if hooks.stop.wait(self._poll_s):
        self._ended.set()  # this learner retires whatever the store says
        try:
          self._run.request_end({"by": self._who, "reason": hooks.reason, "at": self._clock()})
        except (OSError, RuntimeError) as e:  # StoreError: the others are not told
          logging.error("%s: could not write the run's end marker: %s", self._who, e)
        return
      try:
        ended = self._run.end_requested()
      except OSError as e:  # a store hiccup: asked again at the next poll
        logging.warning("%s: could not read the run's end marker: %s", self._who, e)
        continue
      if ended:
        print(f"{self._who}: the run was ended early (end.json); retiring", flush=True)
        self._ended.set()
        return

  def close(self) -> None:
    self._closing.set()
    if self._thread is not None:
      self._thread.join(self._poll_s + 10)
