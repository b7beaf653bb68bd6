"""The result of one simulated run: accounting, a readable summary and one JSON line."""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimResult:
  """Accounting of one run (docs/design.md 3.2).

  Attributes:
    goodput: useful chip-seconds (stepping, not waiting, not rejected) over allocated ones.
    uptime: fraction of wall time in which the global model advances (dp and elastic: the job
      runs; decoupled: at least `required_quorum` learners step, so rounds close).
    merged_token_fraction: per-fragment step counts that reached a merge over those produced
      (decoupled; at most 1 - tau / H, see `diloco.sim.rounds`); 1 for dp and elastic.
    staleness_mean, staleness_max, staleness_hist: staleness at admission of merged deliveries,
      weighted by time (fraction of admissions per staleness value).
    learners_per_round: mean deliveries merged per round.
    grace_mean_s: mean grace window of the closed rounds.
    failures: slice failures simulated; events: events processed; windows: round windows sampled.
    wall_s: wall-clock seconds of the simulation.
  """
  mode: str
  chips: int
  learners: int
  quorum: int
  grace: bool
  days: float
  seed: int
  goodput: float
  uptime: float
  merged_token_fraction: float
  staleness_mean: float
  staleness_max: int
  staleness_hist: dict[int, float]
  learners_per_round: float
  grace_mean_s: float
  failures: int
  events: int
  windows: int
  wall_s: float

  def to_json(self) -> str:
    """One JSON line with every field (histogram keys as strings)."""
    record = dataclasses.asdict(self)
    record["staleness_hist"] = {str(k): round(v, 6) for k, v in self.staleness_hist.items()}
    return json.dumps(record, sort_keys=True)

  def summary(self) -> str:
    """A few readable lines."""
    head = f"{self.mode}: {self.chips:,} chips, {self.days:g} days, seed {self.seed}"
    if self.mode == "decoupled":
      head += f", M={self.learners}, K={self.quorum or 'M'}, grace={'on' if self.grace else 'off'}"
    lines = [head,
             f"  goodput                {self.goodput:7.2%}",
             f"  uptime                 {self.uptime:7.2%}",
             f"  failures               {self.failures:,}"]
    if self.mode == "decoupled":
      lines += [f"  merged-token fraction  {self.merged_token_fraction:7.2%}",
                f"  learners per round     {self.learners_per_round:7.2f}",
                f"  mean grace window      {self.grace_mean_s:7.3f} s",
                f"  staleness mean / max   {self.staleness_mean:.2f} / {self.staleness_max}"]
    lines.append(f"  simulated in {self.wall_s:.2f} s ({self.events:,} events, "
                 f"{self.windows} round windows)")
    return "\n".join(lines)
