"""The cooperative fault schedule of the single-controller runtime (`learners.faults`).

The grammar is `diloco.config.fault_grammar`'s; this runtime takes
  kill:M@T+D   learner M fails at time T and comes back (new incarnation) after D seconds;
               without +D it comes back at once (D = 0);
  add@T        the next spare device group joins as a new learner at time T;
  retire:M@T   learner M retires for good at time T;
  nan:M@T      learner M's parameters turn NaN at time T (a numerical blow-up): its next
               metrics are non-finite, so it fails and rejoins from the global fragments.
M is a learner id. Times are seconds on the run clock (virtual or wall).
"""

from __future__ import annotations

from diloco.config import fault_grammar

RUNTIME = fault_grammar.Runtime(field="learners.faults", verbs=("kill", "add", "retire", "nan"),
                                any_target=False, return_delay=True)
# The drivers' name for one scheduled event.
Fault = fault_grammar.Event


def parse(text: str) -> list[Fault]:
  """Faults sorted by time; ConfigError naming `learners.faults` on any malformed event."""
  return fault_grammar.parse(text, RUNTIME)
