"""The cooperative fault schedule of the single-controller runtime (`learners.faults`).

Grammar: events separated by ';', each one of
  down:M@T+D   learner M fails at time T and comes back (new incarnation) after D seconds;
  add@T        the next spare device group joins as a new learner at time T;
  retire:M@T   learner M retires for good at time T;
  nan:M@T      learner M's parameters turn NaN at time T (a numerical blow-up): its next
               metrics are non-finite, so it fails and rejoins from the global fragments.
Times are seconds on the run clock (virtual or wall).
"""

from __future__ import annotations

import dataclasses
import re

from diloco.config.run_config import parse_events

_PATTERNS = {
    "down": re.compile(r"^down:(\d+)@([0-9.]+)\+([0-9.]+)$"),
    "add": re.compile(r"^add@([0-9.]+)$"),
    "retire": re.compile(r"^retire:(\d+)@([0-9.]+)$"),
    "nan": re.compile(r"^nan:(\d+)@([0-9.]+)$"),
}


@dataclasses.dataclass(frozen=True, order=True)
class Fault:
  at: float
  kind: str
  learner: int = -1
  duration: float = 0.0


def parse(text: str) -> list[Fault]:
  """Faults sorted by time; ConfigError naming `learners.faults` on any malformed event."""
  faults = []
  for kind, m in parse_events(text, _PATTERNS, "learners.faults",
                              "down:M@T+D, add@T, retire:M@T or nan:M@T separated by ';'"):
    if kind == "down":
      faults.append(Fault(float(m[2]), kind, int(m[1]), float(m[3])))
    elif kind == "add":
      faults.append(Fault(float(m[1]), kind))
    else:
      faults.append(Fault(float(m[2]), kind, int(m[1])))
  return sorted(faults)
