"""`Delivery`: one learner's delivery of one fragment, the one message both the transports and
the syncer's pure policy speak of (docs/design.md 2.3).

No NumPy or JAX here: `diloco.sync.policy` is pure and the goodput simulator (`diloco.sim`) builds
deliveries without tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class Delivery:
  """One delivery of fragment `fragment` by a learner (docs/design.md 2.3).

  The counters (`incarnation`, `local_step`, `steps`, `tokens`, `base_version`) are what the
  policy checks (`policy.check_delivery`, docs/design.md 2.4); the policy and the simulator
  need no tensors and leave `tensors` empty.
  `tensors` maps parameter paths to float32 values (`kind="values"`) or to quantised
  deltas `G_base - theta` (`kind="delta"`, `outer.QuantizedTensor`).
  `transit_s` is how long the delivery has been on its way since its values were on the
  learner's host (quantisation, queueing, upload, and the syncer's read): a sum of durations,
  each measured on the clock of the machine that spent it, so it means the same when
  learner and syncer clocks differ. It is the "pull" of the syncer's sync-time EMA.
  `lead_s` is the time from the delivery point (local step `local_step` dispatched) to its
  values being on the learner's host: the part of its tau steps of overlap the learner had
  already spent (about one step when steps are dispatched asynchronously).
  `final` marks a learner's final-sync delivery: its fragment's round waits for every live
  learner (`policy.decide_final_round`).
  """
  learner: int
  incarnation: int
  fragment: int
  local_step: int
  steps: int
  tokens: int
  base_version: int
  kind: str  # "values" | "delta"
  tensors: dict[str, Any] = dataclasses.field(default_factory=dict)
  transit_s: float = 0.0
  lead_s: float = 0.0
  final: bool = False  # the learner's last delivery of this fragment (docs/design.md 2.3)

  @property
  def nbytes(self) -> int:
    return int(sum(t.nbytes for t in self.tensors.values()))
