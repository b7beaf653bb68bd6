"""S syncer shards behind one syncer's interface: the single-controller runtime's sharded syncer.

With `sync.shards = S` (docs/design.md 3.1, "Sharded syncer") the single-controller runtime runs
S independent `Syncer` instances in its one process, shard s owning the fragments
`ownership.owned(assignment, s)`. Every shard sees every heartbeat and every departure (each
keeps its own registry, so each judges liveness and quorums alone); a delivery goes only to its
fragment's owner. Each shard has its own policy EMAs (quorum, sync and lead time), as the
paper's independent syncers do: with grace on (gamma > 0) a shard's windows follow its own
rounds, so G can differ from one syncer's; with gamma = 0 (or K = M) the windows are 0 and G is
bit-identical for every S (tests/group_test.py).

Round records reach `on_round` at the end of each `tick`, sorted by fragment (the order one
syncer closes them in), with `"shard"` (the owner), `"shard_round"` (its count of rounds) and
`"round"` renumbered run-wide (0, 1, ... over all shards), so the tape reads as one syncer's.
With S = 1 the group is the one `Syncer` with records tagged `"shard": 0`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from diloco import fragments as fragments_lib
from diloco.errors import ConfigError
from diloco.outer.merge import OuterConfig
from diloco.sync import intake, ownership
from diloco.sync.policy import SyncConfig
from diloco.sync.syncer import Syncer
from diloco.transport import Merged


class SyncerGroup:
  """S `Syncer` shards, each owning its fragments; the interface the runtime uses of one."""

  def __init__(self, global_params: dict[str, np.ndarray], plan: fragments_lib.FragmentPlan,
               sync: SyncConfig, outer_cfg: OuterConfig, *, sync_delay_s: float | None = None,
               on_round: Callable[[dict], None] | None = None,
               limits: intake.Limits | None = None):
    self.plan = plan
    self.assignment = ownership.assign(plan.num_elements, sync.shards)
    self._on_round = on_round
    self._records: list[tuple[int, dict]] = []
    self.shards = [
        Syncer(global_params, plan, sync, outer_cfg, sync_delay_s=sync_delay_s,
               on_round=self._collector(s), limits=limits,
               owned=ownership.owned(self.assignment, s))
        for s in range(sync.shards)]
    # A bad or ignored heartbeat reaches every shard: one of them counts it (and records it on
    # the tape), so the run's rejection counts do not grow with S.
    for shard in self.shards[1:]:
      shard.counts_heartbeats = False
    self.rounds_total = 0  # run-wide round numbers on the tape (== sum of the shards' rounds)
    self.last_quorum = 0
    self.last_grace = 0.0

  def _collector(self, s: int) -> Callable[[dict], None]:
    return lambda record: self._records.append((s, record))

  @property
  def num_shards(self) -> int:
    return len(self.shards)

  def owner(self, fragment: Any) -> int:
    """The shard that owns `fragment`; 0 (which rejects it) for a value that is not one."""
    if intake.is_count(fragment, 0) and fragment < self.plan.num_fragments:
      return self.assignment[fragment]
    return 0

  # What one syncer offers, assembled from the shards.
  @property
  def rounds(self) -> int:
    return sum(s.rounds for s in self.shards)

  @property
  def versions(self) -> list[int]:
    return [self.shards[self.assignment[p]].versions[p] for p in range(self.plan.num_fragments)]

  @property
  def params(self) -> dict[str, np.ndarray]:
    return {k: v for s in self.shards for k, v in s.params.items()}

  @property
  def momentum(self) -> dict[str, np.ndarray]:
    return {k: v for s in self.shards for k, v in s.momentum.items()}

  @property
  def rejections(self) -> collections.Counter:
    return sum((s.rejections for s in self.shards), collections.Counter())

  @property
  def ignored(self) -> collections.Counter:
    return sum((s.ignored for s in self.shards), collections.Counter())

  @property
  def registry(self):
    return self.shards[0].registry

  def global_params(self) -> dict[str, np.ndarray]:
    return {k: v for s in self.shards for k, v in s.global_params().items()}

  def fragment_values(self, p: int) -> dict[str, np.ndarray]:
    return self.shards[self.owner(p)].fragment_values(p)

  def initial(self, now: float) -> list[Merged]:
    return sorted((m for s in self.shards for m in s.initial(now)), key=lambda m: m.fragment)

  def alive(self, now: float) -> list[int]:
    return self.shards[0].alive(now)

  def settled(self) -> bool:
    return all(s.settled() for s in self.shards)

  def forget(self, learner: int, incarnation: int) -> None:
    for s in self.shards:
      s.forget(learner, incarnation)

  def pending_keys(self) -> set[tuple[int, int, int, int]]:
    return set().union(*(s.pending_keys() for s in self.shards))

  def take_faults(self) -> list[tuple]:
    return [f for s in self.shards for f in s.take_faults()]

  def tick(self, now: float, beats=(), payloads=(), left=()) -> tuple[list[Merged], float | None]:
    """Every shard ingests all beats and departures and its own fragments' deliveries, and
    closes its due rounds; (merged sorted by fragment, the earliest of the shards' deadlines)."""
    beats, left = list(beats), list(left)
    routed: dict[int, list] = collections.defaultdict(list)
    for payload in payloads:
      routed[self.owner(payload.fragment)].append(payload)
    published, deadlines = [], []
    try:
      for s, shard in enumerate(self.shards):
        merged, deadline = shard.tick(now, beats, routed.get(s, ()), left)
        published += merged
        if deadline is not None:
          deadlines.append(deadline)
    finally:
      self._flush_records()
    return sorted(published, key=lambda m: m.fragment), min(deadlines, default=None)

  def _flush_records(self) -> None:
    """Hands the tick's round records on in fragment order, numbered run-wide."""
    records, self._records = sorted(self._records, key=lambda sr: sr[1]["fragment"]), []
    for s, record in records:
      record["shard_round"] = record["round"]
      record.update(round=self.rounds_total, shard=s)
      self.rounds_total += 1
      self.last_quorum = self.shards[s].last_quorum
      self.last_grace = self.shards[s].last_grace
      if self._on_round is not None:
        self._on_round(record)

  # Durable state (run checkpoints): one exported state per shard.
  def export_states(self) -> list[dict[str, Any]]:
    return [s.export_state() for s in self.shards]

  def restore_states(self, states: Sequence[dict[str, Any]],
                     fragments: dict[int, tuple[int, dict, dict]],
                     history: dict[int, dict[int, dict[str, np.ndarray]]]) -> None:
    """Each shard from its own exported state (its fragments from `fragments` and `history`);
    a checkpoint of another shard count is refused (fragments would change owner)."""
    if len(states) != self.num_shards:
      raise ConfigError(f"sync.shards: the checkpoint holds {len(states)} syncer shard(s), this "
                        f"run asks for {self.num_shards}; resume with sync.shards="
                        f"{len(states)} or use a fresh --workdir")
    for shard, state in zip(self.shards, states):
      shard.restore_state(state, fragments, history, int(state["rounds"]))
    self.rounds_total = self.rounds
    last = self.shards[0]
    self.last_quorum, self.last_grace = last.last_quorum, last.last_grace

  def state_summary(self) -> dict[str, Any]:
    summaries = [s.state_summary() for s in self.shards]
    closed = sum(s.closed_here for s in self.shards)
    admitted = sum(s.admitted_here for s in self.shards)
    return {"rounds": self.rounds, "last_quorum": self.last_quorum,
            "learners_per_round": admitted / max(closed, 1), "last_grace_s": self.last_grace,
            "rejected": dict(self.rejections), "ignored": dict(self.ignored),
            "shards": summaries}
