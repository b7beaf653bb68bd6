"""Accounting of a run from its event tape and activity log (docs/design.md 3.2). Pure, no JAX.

Inputs are the records of two JSON-lines files in the run's workdir, read by `read_jsonl`:
`tape.jsonl` (one record per closed syncer round, with its `admitted` and `rejected` deliveries,
`published_at`, `published_bytes` and `receivers`) and `activity.jsonl` (one record per learner
activity span: `learner`, `incarnation`, `kind` in "step", "wait", "down", "load", `start`, `end`,
`devices`, `slowdown`, `local_step`, `tokens`); the runtime that writes them documents the schema.

Definitions (times in seconds on the run's clock):

- **Goodput** = useful device-seconds / allocated device-seconds. A delivery of fragment p made at
  local step t with `steps = s` covers the inner steps t-s+1 .. t of that learner-incarnation (a
  "step" span's `local_step` is the step it completes). Every admitted delivery makes the device-
  seconds of the step spans it covers useful for 1/P of their value (a fragment is 1/P of the
  work); a step is counted at most once per fragment, so a step whose progress reached all P
  merges counts fully. A learner is allocated from the start of its first record to the end of
  its last record, with the devices of the record in force (a gap counts with the devices of the
  record before it): waiting, down and loading time is allocated but never useful.
- **Uptime** = 1 - stalled time / (horizon - start). With the distinct publish times
  t_1 < ... < t_n inside [start, horizon] and t_0 = start, t_{n+1} = horizon, every gap between
  consecutive times is allowed `stall_s` seconds of normal latency and the excess
  `max(0, gap - stall_s)` counts as time in which the global model stood still. `stall_s`
  defaults to `stall_factor` (3) times the median gap between consecutive publish events (of
  any fragment), where rounds published within a tenth of the mean gap of each other are one
  event (a syncer tick that closes several rounds, milliseconds apart on the wall clock).
  Regular merges give exactly 1.
- **Compute goodput** (the paper's goodput) = step device-seconds / allocated device-seconds:
  time spent computing, whether or not its progress reached G. The step device-seconds that
  did not reach G are split into those carried only by rejected deliveries and those dropped
  (never delivered: overwritten on receipt, or made after a learner's last delivery).
- **Merged tokens** = sum of the admitted deliveries' `tokens` / P (each delivery carries the
  tokens behind 1/P of the model); merged tokens/s divides by the horizon.
- **Staleness** is the `staleness` the syncer recorded for each admitted delivery.
- **Per shard**: with a sharded syncer (`sync.shards` > 1, docs/design.md 3.1) each round record
  names its `shard`; rounds, learners per round, grace and staleness are also given per shard
  (`fidelity.shard_stats`), and the overall figures are over every shard's rounds.
- **Bandwidth**: learner->syncer bytes are the `payload_bytes` of every delivery that reached
  the syncer (admitted and rejected); syncer->learner bytes are `published_bytes` times the
  number of receivers. The compression ratio is float32 bytes of the same fragments over the
  payload bytes. Data-parallel reference: the same model trained by D = number of learners device
  groups with one ring all-reduce of the gradient per step, in which every group sends (and
  receives) `2 (D - 1) / D * num_params * bytes_per_param_dp` bytes per step (as
  `diloco.sim.bandwidth`); `dp_bytes` is the total sent by all groups, `2 (D - 1) * N * b * steps`.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import json
import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence

from diloco.observe import fidelity

TAPE_FILE = "tape.jsonl"
ACTIVITY_FILE = "activity.jsonl"
KINDS = ("step", "wait", "down", "load")


def span_record(learner: int, incarnation: int, kind: str, start: float, end: float, *,
                devices: int, slowdown: float = 1.0, local_step: int = 0, tokens: int = 0) -> dict:
  """One activity span in the schema `diloco.observe.accounting` reads."""
  return {"learner": learner, "incarnation": incarnation, "kind": kind, "start": start,
          "end": end, "devices": devices, "slowdown": slowdown, "local_step": local_step,
          "tokens": tokens}


def read_jsonl(path: str) -> list[dict]:
  """Records of a JSON-lines file; a missing file gives [], a torn or blank line is skipped."""
  if not os.path.exists(path):
    return []
  records = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue  # A writer killed mid-line leaves a torn last record.
      if isinstance(record, dict):
        records.append(record)
  return records



def allocated_device_seconds(activity: Sequence[Mapping]) -> float:
  """Device-seconds allocated to all learners (first record's start to last record's end)."""
  by_learner = collections.defaultdict(list)
  for r in activity:
    by_learner[r["learner"]].append(r)
  total = 0.0
  for spans in by_learner.values():
    spans = sorted(spans, key=lambda r: (r["start"], r["end"]))
    end_all = max(r["end"] for r in spans)
    for i, r in enumerate(spans):
      until = spans[i + 1]["start"] if i + 1 < len(spans) else end_all
      total += r["devices"] * max(0.0, until - r["start"])
  return total


def useful_device_seconds(tape: Sequence[Mapping], activity: Sequence[Mapping],
                          num_fragments: int) -> float:
  """Device-seconds of the step spans whose progress reached a merge (see module docstring)."""
  if num_fragments < 1:
    raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
  # Per learner-incarnation: sorted local steps and the prefix sums of their device-seconds.
  steps = collections.defaultdict(list)
  for r in activity:
    if r["kind"] == "step":
      steps[(r["learner"], r["incarnation"])].append(
          (r["local_step"], r["devices"] * max(0.0, r["end"] - r["start"])))
  index = {}
  for key, pairs in steps.items():
    pairs.sort()
    prefix = [0.0]
    for _, ds in pairs:
      prefix.append(prefix[-1] + ds)
    index[key] = ([s for s, _ in pairs], prefix)
  # Covered local-step intervals per (learner, incarnation, fragment), merged so that a step
  # counts once per fragment.
  covered = collections.defaultdict(list)
  for rnd in tape:
    for a in rnd["admitted"]:
      if a["steps"] >= 1:
        covered[(a["learner"], a["incarnation"], rnd["fragment"])].append(
            (a["local_step"] - a["steps"] + 1, a["local_step"]))
  total = 0.0
  for (learner, incarnation, _), intervals in covered.items():
    if (learner, incarnation) not in index:
      continue
    local_steps, prefix = index[(learner, incarnation)]
    for lo, hi in _union(intervals):
      i, j = bisect.bisect_left(local_steps, lo), bisect.bisect_right(local_steps, hi)
      total += prefix[j] - prefix[i]
  return total / num_fragments


def where_steps_went(tape: Sequence[Mapping], activity: Sequence[Mapping],
                     num_fragments: int) -> dict[str, float]:
  """Step device-seconds split by what became of their progress (each fragment 1/P of it).

  "merged": reached G (the goodput's numerator); "rejected": carried only by deliveries the
  syncer rejected (stale, replayed, ...; their tape records name `local_step` and `steps`);
  "dropped": never carried by any delivery (overwritten on receipt, or made after the learner's
  last delivery). The three sum to all step device-seconds.
  """
  total = sum(r["devices"] * max(0.0, r["end"] - r["start"]) for r in activity
              if r["kind"] == "step")
  merged = useful_device_seconds(tape, activity, num_fragments)
  # Deliveries merged or rejected, as admitted-like records, give "merged or rejected".
  carried = [{"fragment": rnd["fragment"], "admitted": list(rnd["admitted"]) + [
      r for r in rnd.get("rejected", ()) if "local_step" in r and "steps" in r]}
             for rnd in tape]
  delivered = useful_device_seconds(carried, activity, num_fragments)
  return {"merged": merged, "rejected": max(delivered - merged, 0.0),
          "dropped": max(total - delivered, 0.0)}


def goodput(tape: Sequence[Mapping], activity: Sequence[Mapping], num_fragments: int) -> float:
  """Useful device-seconds over allocated device-seconds (0 when nothing was allocated)."""
  allocated = allocated_device_seconds(activity)
  if allocated <= 0.0:
    return 0.0
  return useful_device_seconds(tape, activity, num_fragments) / allocated


def activity_breakdown(activity: Sequence[Mapping]) -> dict[str, float]:
  """Device-seconds per kind ("step", "slowed_step", "wait", "down", "load").

  "step" counts every step span, "slowed_step" those of them with `slowdown > 1`.
  """
  out = dict.fromkeys(("step", "slowed_step", "wait", "down", "load"), 0.0)
  for r in activity:
    ds = r["devices"] * max(0.0, r["end"] - r["start"])
    out[r["kind"]] = out.get(r["kind"], 0.0) + ds
    if r["kind"] == "step" and r.get("slowdown", 1.0) > 1.0:
      out["slowed_step"] += ds
  return out



def uptime(tape: Sequence[Mapping], horizon: float, *, start: float = 0.0,
           stall_s: float | None = None, stall_factor: float = 3.0) -> float:
  """Fraction of [start, horizon] in which the global model advances (module docstring).

  Args:
    tape: round records.
    horizon: end of the run on its clock.
    start: beginning of the run on its clock.
    stall_s: normal latency allowed between two publishes; default `stall_factor` times the
      median gap between distinct consecutive publish times (0 with fewer than two).
    stall_factor: see `stall_s`.

  Returns:
    Uptime in [0, 1]; 0 when nothing was published or the horizon is empty.
  """
  length = horizon - start
  times = sorted({r["published_at"] for r in tape if start <= r["published_at"] <= horizon})
  if length <= 0.0 or not times:
    return 0.0
  if stall_s is None:
    burst_s = 0.1 * length / len(times)
    events = [t for t, prev in zip(times, [-math.inf, *times]) if t - prev > burst_s]
    gaps = [b - a for a, b in itertools.pairwise(events)]
    stall_s = stall_factor * statistics.median(gaps) if gaps else 0.0
  points = [start, *times, horizon]
  stalled = sum(max(0.0, (b - a) - stall_s) for a, b in itertools.pairwise(points))
  return max(0.0, 1.0 - stalled / length)


def merged_tokens(tape: Sequence[Mapping], num_fragments: int) -> float:
  """Tokens whose progress reached a merge: admitted tokens summed over rounds, divided by P."""
  if num_fragments < 1:
    raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
  return sum(a["tokens"] for r in tape for a in r["admitted"]) / num_fragments


def merged_tokens_per_s(tape: Sequence[Mapping], num_fragments: int, horizon: float,
                        start: float = 0.0) -> float:
  """`merged_tokens` per second of [start, horizon] (0 for an empty horizon)."""
  length = horizon - start
  return merged_tokens(tape, num_fragments) / length if length > 0.0 else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class BandwidthLedger:
  """Bytes moved by a run, and what data-parallel would move (module docstring).

  Attributes:
    bytes_up: learner->syncer payload bytes (admitted and rejected deliveries).
    bytes_down: syncer->learner bytes (`published_bytes` times receivers).
    bytes_rejected: the part of `bytes_up` that was rejected.
    up_by_learner, down_by_learner: the same per learner id.
    up_by_fragment, down_by_fragment: the same per fragment.
    round_up_peak, round_up_mean, round_down_peak, round_down_mean: per round.
    bytes_per_token: (bytes_up + bytes_down) / merged tokens (0 if none merged).
    compression_ratio: float32 bytes of the delivered fragments / their payload bytes (None
      without fragment sizes).
    dp_groups: D, the data-parallel device groups compared against.
    dp_steps: data-parallel steps compared against.
    dp_bytes_per_group: bytes each group sends in the ring all-reduces of `dp_steps` steps.
    dp_bytes: bytes all groups send, `dp_groups * dp_bytes_per_group`.
    dp_ratio: dp_bytes / (bytes_up + bytes_down) (None when nothing was sent).
  """
  bytes_up: int
  bytes_down: int
  bytes_rejected: int
  up_by_learner: dict[int, int]
  down_by_learner: dict[int, int]
  up_by_fragment: dict[int, int]
  down_by_fragment: dict[int, int]
  round_up_peak: int
  round_up_mean: float
  round_down_peak: int
  round_down_mean: float
  bytes_per_token: float
  compression_ratio: float | None
  dp_groups: int
  dp_steps: float
  dp_bytes_per_group: float
  dp_bytes: float
  dp_ratio: float | None


def dp_bytes_per_group(num_params: int, groups: int, steps: float,
                       bytes_per_param: float = 2) -> float:
  """Bytes one of `groups` device groups sends in `steps` ring all-reduces of the gradient."""
  if groups <= 1:
    return 0.0
  return 2.0 * (groups - 1) / groups * num_params * bytes_per_param * steps


def bandwidth_ledger(tape: Sequence[Mapping], *, num_params: int, steps: float,
                     num_fragments: int, fragment_sizes: Sequence[int] | None = None,
                     bytes_per_param_dp: float = 2, dp_groups: int | None = None
                     ) -> BandwidthLedger:
  """Bytes each way per learner, fragment and round, and the data-parallel comparison.

  Args:
    tape: round records.
    num_params: N, parameters of the model.
    steps: data-parallel steps to compare with (e.g. the learners' inner steps / D, the same
      tokens with a D times larger batch).
    num_fragments: P (for bytes per merged token).
    fragment_sizes: element count of each fragment, for the compression ratio.
    bytes_per_param_dp: bytes per gradient value of the all-reduce (2: bf16).
    dp_groups: D; default the number of distinct learners in the tape.

  Returns:
    The ledger.
  """
  up_l, down_l = collections.Counter(), collections.Counter()
  up_p, down_p = collections.Counter(), collections.Counter()
  round_up, round_down, rejected, fp32 = [], [], 0, 0
  learners = set()
  for r in tape:
    p = r["fragment"]
    up = 0
    for d in (*r["admitted"], *r["rejected"]):
      up_l[d["learner"]] += d["payload_bytes"]
      up += d["payload_bytes"]
      learners.add(d["learner"])
      if fragment_sizes is not None:
        fp32 += 4 * fragment_sizes[p]
    rejected += r.get("rejected_bytes", sum(d["payload_bytes"] for d in r["rejected"]))
    down = r["published_bytes"] * len(r["receivers"])
    for m in r["receivers"]:
      down_l[m] += r["published_bytes"]
      learners.add(m)
    up_p[p] += up
    down_p[p] += down
    round_up.append(up)
    round_down.append(down)
  bytes_up, bytes_down = sum(round_up), sum(round_down)
  tokens = merged_tokens(tape, num_fragments)
  groups = dp_groups if dp_groups is not None else len(learners)
  per_group = dp_bytes_per_group(num_params, groups, steps, bytes_per_param_dp)
  dp_total = groups * per_group
  n = len(tape)
  return BandwidthLedger(
      bytes_up=bytes_up, bytes_down=bytes_down, bytes_rejected=rejected,
      up_by_learner=dict(sorted(up_l.items())), down_by_learner=dict(sorted(down_l.items())),
      up_by_fragment=dict(sorted(up_p.items())), down_by_fragment=dict(sorted(down_p.items())),
      round_up_peak=max(round_up, default=0), round_up_mean=bytes_up / n if n else 0.0,
      round_down_peak=max(round_down, default=0), round_down_mean=bytes_down / n if n else 0.0,
      bytes_per_token=(bytes_up + bytes_down) / tokens if tokens else 0.0,
      compression_ratio=fp32 / bytes_up if fragment_sizes is not None and bytes_up else None,
      dp_groups=groups, dp_steps=float(steps), dp_bytes_per_group=per_group, dp_bytes=dp_total,
      dp_ratio=dp_total / (bytes_up + bytes_down) if bytes_up + bytes_down else None)



def _breakdowns(tape: Sequence[Mapping], stats: Mapping, hist: Mapping[int, int],
                kinds: Mapping[str, float], allocated: float) -> dict[str, float]:
  """The summary's keyed breakdowns: time by activity kind, rejections by reason, and the
  fidelity report (docs/design.md 2.3-2.4): how rounds closed, how many learners they merged,
  how stale the admitted deliveries were, and with a sharded syncer each shard's figures."""
  out: dict[str, float] = {}
  for kind in ("wait", "down", "load", "slowed_step"):
    out[f"{kind}_fraction"] = kinds[kind] / allocated if allocated > 0.0 else 0.0
  for reason, count in stats["rejected_by_reason"].items():
    out[f"rejected/{reason}"] = count
  for reason in fidelity.CLOSE_REASONS:
    out[f"closed_by/{reason}"] = (stats["close_reasons"].get(reason, 0) / stats["rounds"]
                                  if stats["rounds"] else 0.0)
  for learners, count in stats["learners_hist"].items():
    out[f"learners_per_round/{learners}"] = count
  for age, count in hist.items():
    out[f"staleness/{age}"] = count
  per_shard = fidelity.shard_stats(tape)
  if len(per_shard) > 1:  # a sharded syncer: its shards' figures beside the overall ones
    out["shards"] = len(per_shard)
    for s, figures in per_shard.items():
      out.update({f"shard{s}/{k}": v for k, v in figures.items()})
  return out


def summary(workdir: str, num_fragments: int, num_params: int, *,
            fragment_sizes: Sequence[int] | None = None, bytes_per_param_dp: float = 2,
            horizon: float | None = None, stall_s: float | None = None,
            prefix: str = "accounting/") -> dict[str, float]:
  """Headline numbers of a run from `workdir/tape.jsonl` and `workdir/activity.jsonl`.

  Args:
    workdir: the run's directory.
    num_fragments: P.
    num_params: N, parameters of the model.
    fragment_sizes: element count per fragment (adds the compression ratio).
    bytes_per_param_dp: gradient bytes per value of the data-parallel reference (2: bf16).
    horizon: end of the run on its clock; default the last activity end or publish time.
    stall_s: see `uptime`.
    prefix: prepended to every key.

  Returns:
    A flat dict of floats (JSON-ready; keys with no defined value are left out). The data-
    parallel reference takes D = number of learners and steps = all step spans / D.
  """
  tape = read_jsonl(os.path.join(workdir, TAPE_FILE))
  activity = read_jsonl(os.path.join(workdir, ACTIVITY_FILE))
  if horizon is None:
    horizon = max([r["end"] for r in activity] + [r["published_at"] for r in tape], default=0.0)
  # Uptime counts from the first learner activity: process start-up is not a stall.
  start = min([r["start"] for r in activity], default=0.0)
  allocated = allocated_device_seconds(activity)
  useful = useful_device_seconds(tape, activity, num_fragments)
  kinds = activity_breakdown(activity)
  stats = fidelity.round_stats(tape)
  hist = fidelity.staleness_histogram(tape)
  admitted = sum(hist.values())
  learners = {r["learner"] for r in activity}
  step_spans = sum(1 for r in activity if r["kind"] == "step")
  ledger = bandwidth_ledger(
      tape, num_params=num_params, num_fragments=num_fragments, fragment_sizes=fragment_sizes,
      bytes_per_param_dp=bytes_per_param_dp, steps=step_spans / max(len(learners), 1),
      dp_groups=len(learners) or None)
  went = where_steps_went(tape, activity, num_fragments)
  out = {
      "goodput": useful / allocated if allocated > 0.0 else 0.0, "useful_device_s": useful,
      "allocated_device_s": allocated,
      # The paper's goodput: the fraction of allocated time spent computing steps, whether
      # or not their progress reached G.
      "compute_goodput": kinds["step"] / allocated if allocated > 0.0 else 0.0,
      "step_device_s": kinds["step"], "rejected_step_device_s": went["rejected"],
      "dropped_step_device_s": went["dropped"],
      "uptime": uptime(tape, horizon, start=start, stall_s=stall_s),
      "horizon_s": horizon, "merged_tokens": merged_tokens(tape, num_fragments),
      "merged_tokens_per_s": merged_tokens_per_s(tape, num_fragments, horizon),
      "rounds": stats["rounds"], "mean_quorum": stats["mean_quorum"],
      "last_quorum": stats["last_quorum"], "mean_learners_per_round": stats["mean_learners"],
      "median_learners_per_round": stats["median_learners"],
      "mean_alive_per_round": stats["mean_alive"],
      "mean_grace_s": stats["mean_grace_s"], "median_grace_s": stats["median_grace_s"],
      "mean_grace_used_s": stats["mean_grace_used_s"],
      "admitted_in_grace": stats["admitted_in_grace"], "mean_sync_s": stats["mean_sync_s"],
      "rejected": stats["rejected"],
      "staleness_mean": sum(k * v for k, v in hist.items()) / admitted if admitted else 0.0,
      "staleness_max": max(hist, default=0),
      "bytes_up": ledger.bytes_up, "bytes_down": ledger.bytes_down,
      "bytes_rejected": ledger.bytes_rejected,
      "round_bytes_up_peak": ledger.round_up_peak, "round_bytes_up_mean": ledger.round_up_mean,
      "round_bytes_down_peak": ledger.round_down_peak,
      "round_bytes_down_mean": ledger.round_down_mean,
      "bytes_per_token": ledger.bytes_per_token, "dp_bytes": ledger.dp_bytes,
  }
  out.update(_breakdowns(tape, stats, hist, kinds, allocated))
  if ledger.compression_ratio is not None:
    out["compression_ratio"] = ledger.compression_ratio
  if ledger.dp_ratio is not None:
    out["dp_ratio"] = ledger.dp_ratio
  return {prefix + k: float(v) for k, v in out.items()}



def _union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
  """Disjoint integer intervals covering the same integers as the closed `intervals`."""
  out = []
  for lo, hi in sorted(intervals):
    if out and lo <= out[-1][1] + 1:
      out[-1] = (out[-1][0], max(out[-1][1], hi))
    else:
      out.append((lo, hi))
  return out
