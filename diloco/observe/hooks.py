"""A researcher's own code in a run: `Hook(fn, every=N, on="learner" | "syncer")`.

`fn(view)` runs every N learner steps (each learner's own count) or every N syncer rounds with a
read-only `HookView`: the step or round, the metrics of that step (the learner's train/*,
or the round's tape record), and, when the hook asks for them (`params=True`), the learner's
parameters or the global parameters G, as host NumPy arrays that cannot be written.

Nothing on a learner's hot path waits for a hook. Each hook has its own worker thread and a
mailbox that holds one waiting call per learner (and one for the syncer): a call whose
learner's previous call has not started yet is skipped (counted, and printed at the end of
the run), so a slow hook delays only itself. The learner only hands
over references: its step's metrics as they come off the device, and for `params=True` a copy
of its parameters that the device makes in the background (one more copy of them in device
memory while the hook reads it); the worker thread reads them to the host. G is read by the
worker thread too, at the round it was called for or a later one.

A hook that raises is reported in one line naming it (`hook NAME at step S: Error: ...`); with
`on_error="continue"` (the default) it is called again at its next step, with "stop" the run
ends as if it had reached its last step (final evaluation, export, report), and a hook may end
it on purpose by returning `STOP` (early stopping).

Hooks reach a run two ways: `diloco.run(cfg, workdir, hooks=[...])` in this process, and
`log.hooks=FILE.py` (or a module name), a module whose `HOOKS` list every process of the run
imports: `python -m diloco.main`, and in the multi-process runtime each learner process (its
own learner's hooks, on host 0) and the syncer process (syncer hooks, rounds of the fragments
it owns). There a hook's stop ends the whole run through the store (`RunLifecycle.request_end`):
every learner retires with its final deliveries, the syncer merges them, evaluates and exports.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from diloco import user_code
from diloco.errors import ConfigError

KINDS = ("learner", "syncer")
ON_ERROR = ("continue", "stop")
STOP = "stop"  # what a hook returns to end the run


@dataclasses.dataclass(frozen=True)
class HookView:
  """What a hook sees. `kind`: "learner" or "syncer"; `step`: the learner's local step or the
  syncer's round count after the round; `learner`: the learner's id (None for the syncer);
  `metrics`: read-only floats; `params`: read-only flat {path: array}, or None unless asked."""
  kind: str
  step: int
  learner: int | None
  metrics: Mapping[str, Any]
  params: Mapping[str, np.ndarray] | None


@dataclasses.dataclass(frozen=True)
class Hook:
  """`fn(HookView)` every `every` learner steps or syncer rounds (`on`), with the parameters
  when `params`; `name` (default: the function's) names it in reports."""
  fn: Callable[[HookView], Any]
  every: int
  on: str = "learner"
  params: bool = False
  name: str = ""
  on_error: str = "continue"

  def __post_init__(self):
    if not callable(self.fn):
      raise ConfigError(f"hook {self.name or self.fn!r}: fn must be callable")
    if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
      raise ConfigError(f"hook {self.label}: every must be an integer >= 1, got {self.every!r}")
    if self.on not in KINDS:
      raise ConfigError(f"hook {self.label}: on must be one of {KINDS}, got {self.on!r}")
    if self.on_error not in ON_ERROR:
      raise ConfigError(f"hook {self.label}: on_error must be one of {ON_ERROR}, got "
                        f"{self.on_error!r}")

  @property
  def label(self) -> str:
    return self.name or getattr(self.fn, "__name__", repr(self.fn))


def load(spec: str) -> list[Hook]:
  """The `HOOKS` of the module or .py file `spec` (`log.hooks`; empty: none)."""
  if not spec:
    return []
  found = getattr(user_code.load(spec, "log.hooks"), "HOOKS", None)
  if not isinstance(found, (list, tuple)) or not all(isinstance(h, Hook) for h in found):
    raise ConfigError(f"log.hooks: {spec!r} must define HOOKS, a list of diloco.Hook, got "
                      f"{type(found).__name__}")
  return list(found)


def for_process(spec: str, hooks=(), on: tuple[str, ...] = KINDS) -> HookRunner:
  """The hooks this process runs: `hooks` and those of `log.hooks` (`spec`) that are `on`
  one of these kinds (a learner process leaves the syncer's to the syncer process)."""
  return HookRunner([h for h in [*hooks, *load(spec)] if not isinstance(h, Hook) or h.on in on])


def read_only(flat: Mapping[str, Any]) -> Mapping[str, np.ndarray]:
  """Host copies of `flat`'s arrays that cannot be written, in a mapping that cannot be."""
  out = {}
  for k, v in flat.items():
    a = np.array(v)  # a host copy (device arrays are read here, off the hot path)
    a.flags.writeable = False
    out[k] = a
  return types.MappingProxyType(out)


def learner_view(step: int, learner: int | None, device_metrics: Mapping[str, Any],
                 device_params: Any | None) -> HookView:
  """A learner's view, read to the host on the hook's worker thread: its step's metrics (as
  floats) and, when given, the parameters' copy (flattened to "/"-joined paths)."""
  import jax  # pylint: disable=import-outside-toplevel

  from diloco import fragments  # pylint: disable=import-outside-toplevel
  metrics = {k: float(v) for k, v in jax.device_get(dict(device_metrics)).items()}
  params = None
  if device_params is not None:
    params = read_only(fragments.flatten_tree(jax.device_get(device_params)))
  return HookView("learner", step, learner, types.MappingProxyType(metrics), params)


def syncer_view(rounds: int, record: Mapping[str, Any],
                global_params: Callable[[], Mapping[str, np.ndarray]] | None) -> HookView:
  """The syncer's view after `rounds` rounds: the round's tape record and, when given, G as
  `global_params()` returns it (flat host arrays) when the worker reads it."""
  params = read_only(global_params()) if global_params is not None else None
  return HookView("syncer", rounds, None, types.MappingProxyType(dict(record)), params)


def offer_learner_step(runner: HookRunner, step: int, learner: int | None,
                       parts: Callable[[bool], tuple[int, Any, Any]]) -> None:
  """Hands a learner's step to the hooks due there, if any: `parts(with_params)` (called
  only then, on the learner's thread) gives its step, its metrics as they come off the device
  and, when asked, a device copy of its parameters, all read to the host by the hooks' own
  threads."""
  due = runner.due("learner", step)
  if due:
    at, metrics, params = parts(runner.wants_params(due))
    runner.offer(due, at, lambda with_params: learner_view(
        at, learner, metrics, params if with_params else None), source=learner)


def offer_round(runner: HookRunner, record: Mapping[str, Any],
                read_g: Callable[[], Mapping[str, np.ndarray]]) -> None:
  """Hands a committed round (its tape record) to the syncer hooks due after it, if any;
  `read_g()` gives G, flat, to those that ask, on the hook's own thread."""
  rounds = int(record.get("round", -1)) + 1
  due = runner.due("syncer", rounds)
  if due:
    runner.offer(due, rounds, lambda with_params: syncer_view(
        rounds, record, read_g if with_params else None))


def report(summary: Mapping[str, Mapping[str, int]]) -> None:
  """One line per hook at the end of a run: its calls, the calls it skipped while busy, and
  the errors it raised."""
  for name, c in summary.items():
    print(f"hook {name}: {c['calls']} calls, {c['skipped']} skipped while busy, "
          f"{c['errors']} errors", flush=True)


class _Worker:
  """One hook's thread and its mailbox: at most one waiting call per source (a learner, or
  the syncer), so learners calling at the same time are all served, and a hook busy for long
  skips a source's calls until that source's waiting one has started."""

  def __init__(self, hook: Hook, runner: HookRunner):
    self.hook, self.runner = hook, runner
    self._waiting: dict = {}  # source -> (step, make), oldest first
    self._cv = threading.Condition()
    self._closing = False
    self.calls = self.skipped = self.errors = 0
    self.thread = threading.Thread(target=self._loop, name=f"hook-{hook.label}", daemon=True)
    self.thread.start()

  def offer(self, source, step: int, make: Callable[[], HookView]) -> bool:
    with self._cv:
      if self._closing or source in self._waiting:
        self.skipped += 1
        return False
      self._waiting[source] = (step, make)
      self._cv.notify()
      return True

  def close(self) -> None:
    with self._cv:
      self._closing = True
      self._cv.notify()

  def _loop(self) -> None:
    while True:
      with self._cv:
        while not self._waiting and not self._closing:
          self._cv.wait()
        if not self._waiting:
          return  # closing, and every waiting call has run
        source = next(iter(self._waiting))
        step, make = self._waiting.pop(source)
      self.calls += 1
      try:
        if self.hook.fn(make()) == STOP:
          self.runner.request_stop(f"hook {self.hook.label} asked to stop at step {step}")
      except Exception as e:  # noqa: BLE001  (the researcher's code: reported, never fatal)
        self.errors += 1
        line = f"hook {self.hook.label} at step {step}: {type(e).__name__}: {e}"
        print(line.splitlines()[0], file=sys.stderr, flush=True)
        if self.hook.on_error == "stop":
          self.runner.request_stop(f"hook {self.hook.label} failed at step {step}")


class HookRunner:
  """The hooks of a run: `due` is the cheap test on the hot path, `offer` hands a call to the
  hook's worker, `stop` is set when a hook ends the run, `close` waits for the calls in
  flight and returns each hook's counts."""

  def __init__(self, hooks=()):
    hooks = list(hooks)
    for h in hooks:
      if not isinstance(h, Hook):
        raise ConfigError(f"hooks: expected diloco.Hook objects, got {h!r}")
    self.stop = threading.Event()
    self.reason = ""
    self._workers = [_Worker(h, self) for h in hooks]

  def __bool__(self) -> bool:
    return bool(self._workers)

  def due(self, kind: str, step: int) -> list[_Worker]:
    return [w for w in self._workers if w.hook.on == kind and step % w.hook.every == 0]

  def wants_params(self, workers: list[_Worker]) -> bool:
    return any(w.hook.params for w in workers)

  def offer(self, workers: list[_Worker], step: int, make: Callable[[bool], HookView],
            source=None) -> None:
    """Hands `make(with_params)` to each of `workers` that holds no waiting call of
    `source` (a learner's id, or None for the syncer)."""
    for w in workers:
      w.offer(source, step, (lambda p=w.hook.params: make(p)))

  def request_stop(self, reason: str) -> None:
    if not self.stop.is_set():
      self.reason = reason
      print(f"stopping the run: {reason}", file=sys.stderr, flush=True)
      self.stop.set()

  def close(self, timeout_s: float = 60.0) -> dict[str, dict[str, int]]:
    """Lets each hook finish the calls in its mailbox (at most `timeout_s` each: a hook still
    running then is left to its daemon thread); returns each hook's counts."""
    for w in self._workers:
      w.close()  # after the calls waiting in its mailbox
    for w in self._workers:
      w.thread.join(timeout_s)
    return {w.hook.label: {"calls": w.calls, "skipped": w.skipped, "errors": w.errors}
            for w in self._workers}
