"""The one grammar of fault schedules, for both runtimes: verbs, parsing, text, help.

A schedule is events separated by ';' (spaces ignored), each one of
  kill:M@T[+D]      learner M dies at T and comes back as a new incarnation, D seconds later;
  stop:M@T+D        learner M hangs at T for D seconds, then goes on (a straggler);
  kill_syncer[:S]@T the syncer (shard S, default 0) dies at T and resumes from its last
                    durable round;
  add@T             a new learner joins at T (a spare device group, scavenged capacity);
  retire:M@T        learner M leaves for good at T, flushing its last progress;
  nan:M@T           learner M's parameters turn NaN at T (a numerical blow-up): it fails on its
                    next metrics and rejoins from the global fragments.
T and D are seconds; M is a learner id, or '*' for a live learner drawn when the event fires.

Each runtime declares a `Runtime`: its config field, the verbs it supports and which optional
forms it takes. The single-controller runtime (`diloco.runtime.faults`, `learners.faults`)
takes kill, add, retire and nan with learner ids; its kill's `+D` is how long the learner stays
down, and a missing `+D` means D = 0 (it comes back at once, like a NaN failure). The
multi-process runtime (`diloco.distributed.chaos`, `launch.chaos`) takes kill, stop,
kill_syncer, add and retire with '*' targets; a killed process comes back when its launcher
restarts it after the restart backoff, so its kill takes no `+D`. An event of a verb the
runtime does not support, or an old spelling (`down:M@T+D`, now `kill:M@T+D`), is a one-line
`ConfigError` naming the field and what to write instead.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from diloco.config.run_config import parse_events
from diloco.errors import ConfigError

ANY = -1  # the learner of a '*' event: a live one drawn when it fires

_NUM = r"(\d+(?:\.\d*)?|\.\d+)"
_TARGET = r"(\d+|\*)"
_PATTERNS = {
    "kill": re.compile(rf"^kill:{_TARGET}@{_NUM}(?:\+{_NUM})?$"),
    "stop": re.compile(rf"^stop:{_TARGET}@{_NUM}\+{_NUM}$"),
    "kill_syncer": re.compile(rf"^kill_syncer(?::(\d+))?@{_NUM}$"),
    "add": re.compile(rf"^add@{_NUM}$"),
    "retire": re.compile(rf"^retire:{_TARGET}@{_NUM}$"),
    "nan": re.compile(rf"^nan:{_TARGET}@{_NUM}$"),
}
VERBS = tuple(_PATTERNS)
# Old spellings, matched whatever follows, and the verb that replaced each.
_OLD = {"down": "kill"}
_OLD_PATTERNS = {old: re.compile(rf"^{old}(?::(.*))?$") for old in _OLD}
_TARGETED = ("kill", "stop", "retire", "nan")


@dataclasses.dataclass(frozen=True)
class Runtime:
  """A runtime's dialect of the grammar.

  Attributes:
    field: the config field its schedule is read from (named by every error).
    verbs: the verbs it supports, in the order its help line lists them.
    any_target: whether an event may target '*' (a learner drawn when it fires).
    return_delay: whether kill takes `+D` (the runtime times the return itself).
  """
  field: str
  verbs: tuple[str, ...]
  any_target: bool
  return_delay: bool


@dataclasses.dataclass(frozen=True, order=True)
class Event:
  """One scheduled fault; sorted by time. `str` gives its text back (`format_event`)."""
  at: float
  kind: str
  learner: int = ANY  # ANY: a live learner drawn when the event fires
  duration: float = 0.0  # kill: the return delay D; stop: how long the learner hangs
  shard: int = 0  # kill_syncer: the syncer shard it kills

  def __str__(self) -> str:
    return format_event(self)


def _number(x: float) -> str:
  """The shortest text that parses back to `x`, without an exponent (the grammar has none)."""
  return np.format_float_positional(float(x), trim="-")


def format_event(event: Event) -> str:
  """The event's text in the grammar; `parse` of it gives the event back."""
  at = _number(event.at)
  who = "*" if event.learner == ANY else str(event.learner)
  if event.kind == "add":
    return f"add@{at}"
  if event.kind == "kill_syncer":
    return f"kill_syncer:{event.shard}@{at}" if event.shard else f"kill_syncer@{at}"
  if event.kind == "stop" or (event.kind == "kill" and event.duration):
    return f"{event.kind}:{who}@{at}+{_number(event.duration)}"
  return f"{event.kind}:{who}@{at}"


def _usage(verb: str, runtime: Runtime) -> str:
  if verb == "kill":
    return "kill:M@T[+D]" if runtime.return_delay else "kill:M@T"
  return {"stop": "stop:M@T+D", "kill_syncer": "kill_syncer[:S]@T", "add": "add@T",
          "retire": "retire:M@T", "nan": "nan:M@T"}[verb]


def help_line(runtime: Runtime) -> str:
  """What the runtime's field accepts, for error messages and docs."""
  usages = [_usage(v, runtime) for v in runtime.verbs]
  notes = ["M a learner id or '*'" if runtime.any_target else "M a learner id"]
  if "kill_syncer" in runtime.verbs:
    notes.append("S a syncer shard")
  return (f"{', '.join(usages[:-1])} or {usages[-1]} ({', '.join(notes)}), "
          "separated by ';'")


def _event(kind: str, m: re.Match) -> Event:
  if kind == "add":
    return Event(float(m[1]), kind)
  if kind == "kill_syncer":
    return Event(float(m[2]), kind, shard=int(m[1] or 0))
  learner = ANY if m[1] == "*" else int(m[1])
  duration = float(m[3]) if kind in ("kill", "stop") and m[3] is not None else 0.0
  return Event(float(m[2]), kind, learner, duration)


def _check(kind: str, m: re.Match, runtime: Runtime) -> None:
  """ConfigError, one line, for an event of the grammar that `runtime` does not take."""
  item = m.string
  if kind in _OLD:
    new = f"{_OLD[kind]}:{m[1] or 'M@T'}"
    if not runtime.return_delay:
      new = new.split("+")[0]
    raise ConfigError(f"{runtime.field}: {item!r} uses the old verb {kind!r}; write {new!r}")
  if kind not in runtime.verbs:
    raise ConfigError(f"{runtime.field}: {item!r}: this runtime has no {kind!r} faults; use "
                      f"{', '.join(runtime.verbs)}")
  if kind in _TARGETED and m[1] == "*" and not runtime.any_target:
    raise ConfigError(f"{runtime.field}: {item!r} targets '*' (a learner the multi-process "
                      "launcher draws); name a learner id")
  if kind == "kill" and m[3] is not None and not runtime.return_delay:
    raise ConfigError(f"{runtime.field}: {item!r} gives a return delay, but a killed learner "
                      f"returns when the launcher restarts it; write {item.split('+')[0]!r}")


def parse(text: str, runtime: Runtime) -> list[Event]:
  """`runtime`'s events in `text`, sorted by time; a one-line ConfigError naming its field on
  a malformed event, a verb it does not support or an old spelling."""
  events = []
  for kind, m in parse_events(text, {**_PATTERNS, **_OLD_PATTERNS}, runtime.field,
                              help_line(runtime)):
    _check(kind, m, runtime)
    events.append(_event(kind, m))
  return sorted(events)
