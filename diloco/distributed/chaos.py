"""The real fault schedule of the multi-process launcher (`launch.chaos`, `launch.chaos_faults`).

The grammar is `diloco.config.fault_grammar`'s; this runtime takes
  kill:M@T       SIGKILL learner M at T seconds (the launcher restarts it after a backoff, so
                 no +D: the backoff is the return delay);
  stop:M@T+D     SIGSTOP learner M at T, SIGCONT D seconds later (a hang, then a straggler);
  kill_syncer@T  SIGKILL the syncer (restarted; it resumes from its last durable round);
  kill_syncer:S@T  SIGKILL syncer shard S (`sync.shards` > 1; kill_syncer@T is shard 0): only
                 its fragments' rounds pause, the other shards go on;
  add@T          start a new learner (scavenged capacity);
  retire:M@T     SIGTERM learner M: it flushes, checkpoints and leaves for good.
Times count from the moment every initial learner has taken a step (start-up and compilation
vary by machine). M is a learner id or '*', a live learner drawn then from the seeded generator.
`generate` draws N more events from the seed; the launcher applies them all in time order.
"""

from __future__ import annotations

import numpy as np

from diloco.config import fault_grammar
from diloco.config.run_config import ConfigError

RUNTIME = fault_grammar.Runtime(field="launch.chaos",
                                verbs=("kill", "stop", "kill_syncer", "add", "retire"),
                                any_target=True, return_delay=False)
# The launcher's names for one scheduled event and for its '*' learner.
Event = fault_grammar.Event
ANY = fault_grammar.ANY


def parse(text: str) -> list[Event]:
  """Events sorted by time; ConfigError naming `launch.chaos` on a malformed one."""
  return fault_grammar.parse(text, RUNTIME)


# Relative frequencies of drawn faults: mostly learner kills and hangs, a few syncer kills,
# growth and retirement only as often as capacity allows (see `generate`).
_WEIGHTS = {"kill": 4, "stop": 3, "kill_syncer": 1, "add": 1, "retire": 1}


def generate(num: int, *, seed: int, start: float, end: float, spare: int,
             max_stop_s: float = 8.0, shards: int = 1) -> list[Event]:
  """`num` events at seeded uniform times in [start, end] on random ('*') learners (a syncer
  kill on a shard drawn from the `shards` syncer shards).

  At most `spare` adds are drawn (capacity for new learners), and at most as many
  retirements as adds, so the run never shrinks below its initial size.
  """
  rng = np.random.default_rng([seed, 7919])
  times = np.sort(rng.uniform(start, end, num))
  events, adds, retires = [], 0, 0
  for at in times:
    kinds = [k for k in _WEIGHTS if (k != "add" or adds < spare) and
             (k != "retire" or retires < adds)]
    weights = np.array([_WEIGHTS[k] for k in kinds], float)
    kind = kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))]
    at = round(float(at), 2)
    if kind == "stop":
      events.append(Event(at, kind, ANY, round(float(rng.uniform(1.0, max_stop_s)), 2)))
    elif kind in ("kill", "retire"):
      events.append(Event(at, kind, ANY))
    elif kind == "kill_syncer" and shards > 1:  # one draw more only when there is a choice
      events.append(Event(at, kind, shard=int(rng.integers(shards))))
    else:
      events.append(Event(at, kind))
    adds += kind == "add"
    retires += kind == "retire"
  return events


def schedule(text: str, num_random: int, *, seed: int, start: float, end: float,
             count: int, max_learners: int, shards: int = 1) -> list[Event]:
  """The launcher's whole schedule; checks that adds fit in `max_learners` and that syncer
  kills name one of the `shards` syncer shards."""
  events = parse(text)
  adds = sum(e.kind == "add" for e in events)
  if count + adds > max_learners:
    raise ConfigError(f"launch.chaos adds {adds} learners to learners.count={count}, more than "
                      f"launch.max_learners={max_learners}; raise launch.max_learners")
  for e in events:
    if e.learner != ANY and e.learner >= max_learners:
      raise ConfigError(f"launch.chaos: {e} names learner {e.learner}, but learners are "
                        f"0..{max_learners - 1}")
    if e.kind == "kill_syncer" and e.shard >= shards:
      raise ConfigError(f"launch.chaos: {e} names syncer shard {e.shard}, but "
                        f"sync.shards={shards} has shards 0..{shards - 1}")
  events += generate(num_random, seed=seed, start=start, end=end,
                     spare=max_learners - count - adds, shards=shards)
  return sorted(events)


def max_learners(cfg) -> int:
  """Learner ids (and data shards) a multi-process run may use: explicit or count + adds."""
  if cfg.launch.max_learners:
    return cfg.launch.max_learners
  return cfg.learners.count + sum(e.kind == "add" for e in parse(cfg.launch.chaos))
