"""Whether a run's rounds merged like the paper's algorithm, from its event tape.

Pure functions over the syncer's round records (`tape.jsonl`, the schema is in
`diloco.observe.accounting`): learners merged per round, grace windows and their use,
staleness of admitted deliveries, how rounds closed, and with a sharded syncer (`sync.shards`
> 1, docs/design.md 3.1) each shard's figures. `fidelity_line` is the one-line report the
syncer status and every run's end print; `accounting.summary` flattens the same numbers.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Mapping, Sequence

CLOSE_REASONS = ("quorum_reached", "grace_expired", "all_delivered", "final_all_delivered",
                 "final_timeout")


def staleness_histogram(tape: Sequence[Mapping]) -> dict[int, int]:
  """Admitted deliveries per staleness value, keys ascending."""
  counts = collections.Counter(int(a["staleness"]) for r in tape for a in r["admitted"])
  return dict(sorted(counts.items()))


def could_merge(record: Mapping) -> int:
  """The learners a round could have merged: alive at its close (`receivers`) or admitted.

  A final round (docs/design.md 2.3, final sync) merges learners that have already finished
  and left, so counting only the alive ones would report more learners merged than
  available."""
  receivers = record.get("receivers")
  if not isinstance(receivers, list):  # a record written before receivers were recorded
    return max(int(record.get("num_alive", 0)), len(record["admitted"]))
  return len(set(receivers) | {a["learner"] for a in record["admitted"]})


def round_stats(tape: Sequence[Mapping]) -> dict:
  """Round counts and means: quorum, learners admitted, grace and sync time, rejections.

  Returns:
    A dict with `rounds`, `mean_quorum`, `last_quorum` (the `quorum` a round required),
    `mean_learners` (admitted deliveries per round), `median_learners`, `mean_alive`
    (the most a round could have merged: the learners alive when it closed, plus those that
    had finished and left but whose final deliveries it merged; `could_merge`),
    `max_learners`,
    `learners_hist` (rounds per number of admitted deliveries), `mean_grace_s` and
    `median_grace_s` (the window the policy computed), `mean_grace_used_s` (time a round
    stayed open after its quorum), `admitted_in_grace` (deliveries that arrived after their
    round's quorum), `mean_sync_s`, `rejected` (total), `rejected_by_reason` and
    `close_reasons` (rounds per `reason`: "quorum_reached" closed at quorum with no grace,
    "grace_expired" at the end of the window, "all_delivered" when every alive learner had).
  """
  n = len(tape)
  ordered = sorted(tape, key=lambda r: (r["published_at"], r["round"]))

  def mean(values: list[float]) -> float:
    return sum(values) / n if n else 0.0

  rejected = collections.Counter()
  for r in tape:  # all of a round's rejections are counted; only the first few are listed
    rejected.update(r.get("rejected_by_reason") or [x["reason"] for x in r["rejected"]])
  return {
      "rounds": n,
      "mean_quorum": mean([r["quorum"] for r in tape]),
      "last_quorum": ordered[-1]["quorum"] if n else 0,
      "mean_learners": mean([len(r["admitted"]) for r in tape]),
      "median_learners": statistics.median([len(r["admitted"]) for r in tape]) if n else 0,
      "mean_alive": mean([could_merge(r) for r in tape]),
      "max_learners": max((len(r["admitted"]) for r in tape), default=0),
      "learners_hist": dict(sorted(collections.Counter(len(r["admitted"]) for r in tape).items())),
      "mean_grace_s": mean([r["grace_s"] for r in tape]),
      "median_grace_s": statistics.median([r["grace_s"] for r in tape]) if n else 0.0,
      "mean_grace_used_s": mean([r.get("grace_used_s", 0.0) for r in tape]),
      "admitted_in_grace": sum(r.get("admitted_in_grace", 0) for r in tape),
      "mean_sync_s": mean([r["sync_s"] for r in tape]),
      "rejected": sum(rejected.values()),
      "rejected_by_reason": dict(sorted(rejected.items())),
      "close_reasons": dict(sorted(collections.Counter(r["reason"] for r in tape).items())),
  }



def by_shard(tape: Sequence[Mapping]) -> dict[int, list[Mapping]]:
  """Round records per syncer shard (`shard`, 0 where a record names none), keys ascending."""
  out = collections.defaultdict(list)
  for r in tape:
    out[int(r.get("shard", 0))].append(r)
  return dict(sorted(out.items()))


def shard_stats(tape: Sequence[Mapping]) -> dict[int, dict[str, float]]:
  """Per syncer shard: `rounds`, `mean_learners_per_round`, `mean_alive_per_round`,
  `median_grace_s`, `mean_grace_s`, `mean_grace_used_s`, `staleness_mean`, `staleness_max`."""
  out = {}
  for s, records in by_shard(tape).items():
    stats, hist = round_stats(records), staleness_histogram(records)
    admitted = sum(hist.values())
    out[s] = {"rounds": stats["rounds"], "mean_learners_per_round": stats["mean_learners"],
              "mean_alive_per_round": stats["mean_alive"],
              "median_grace_s": stats["median_grace_s"], "mean_grace_s": stats["mean_grace_s"],
              "mean_grace_used_s": stats["mean_grace_used_s"],
              "staleness_mean": (sum(k * v for k, v in hist.items()) / admitted
                                 if admitted else 0.0),
              "staleness_max": max(hist, default=0)}
  return out


def _shards_part(tape: Sequence[Mapping]) -> str:
  """The fidelity line's per-shard part ("" for one shard)."""
  stats = shard_stats(tape)
  if len(stats) < 2:
    return ""
  return "; per shard: " + " | ".join(
      f"s{s} {x['rounds']} rounds, {x['mean_learners_per_round']:.2f} learners/round, grace "
      f"median {x['median_grace_s']:.3f}s, staleness mean {x['staleness_mean']:.2f}"
      for s, x in stats.items())


def fidelity_line(tape: Sequence[Mapping]) -> str:
  """One line saying whether rounds merge like the paper's algorithm: learners per round
  (mean and histogram), grace window and time used, staleness of admitted deliveries, and
  how rounds closed. Printed live by the syncer status and at the end of every run."""
  stats = round_stats(tape)
  n = stats["rounds"]
  if not n:
    return "fidelity: no round merged yet"
  hist = staleness_histogram(tape)
  admitted = sum(hist.values())
  closed = ", ".join(f"{k} {100 * stats['close_reasons'].get(k, 0) / n:.0f}%"
                     for k in CLOSE_REASONS)
  learners = " ".join(f"{k}:{v}" for k, v in stats["learners_hist"].items())
  stale = " ".join(f"{k}:{v}" for k, v in hist.items())
  return (f"fidelity: {n} rounds, learners/round mean {stats['mean_learners']:.2f} "
          f"[{learners}] of {stats['mean_alive']:.2f} alive, "
          f"grace median {stats['median_grace_s']:.3f}s used "
          f"{stats['mean_grace_used_s']:.3f}s ({stats['admitted_in_grace']} admitted in grace), "
          f"staleness mean {sum(k * v for k, v in hist.items()) / admitted:.2f} [{stale}], "
          f"closed by {closed}{_shards_part(tape)}")
