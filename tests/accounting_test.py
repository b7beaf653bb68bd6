"""Accounting from hand-built tapes and activity logs with closed-form answers; the timeline PNG."""

import json
import math

import pytest

from diloco.observe import accounting, fidelity, timeline


def step(learner, local_step, start, end, *, incarnation=0, devices=1, slowdown=1.0, tokens=100):
  return {"learner": learner, "incarnation": incarnation, "kind": "step", "start": start,
          "end": end, "devices": devices, "slowdown": slowdown, "local_step": local_step,
          "tokens": tokens}


def span(learner, kind, start, end, *, incarnation=0, devices=1):
  return {"learner": learner, "incarnation": incarnation, "kind": kind, "start": start,
          "end": end, "devices": devices, "slowdown": 1.0, "local_step": 0, "tokens": 0}


def delivery(learner, local_step, steps, *, incarnation=0, staleness=0, payload_bytes=10,
             tokens=None):
  return {"learner": learner, "incarnation": incarnation, "local_step": local_step,
          "steps": steps, "tokens": 100 * steps if tokens is None else tokens,
          "base_version": 0, "staleness": staleness, "weight": 1.0, "delta_norm": 1.0,
          "payload_bytes": payload_bytes, "arrived_at": 0.0}


def round_(fragment, published_at, admitted, *, rejected=(), published_bytes=0, receivers=(),
           number=0, quorum=1, grace_s=0.0):
  return {"round": number, "fragment": fragment, "version": number + 1,
          "opened_at": published_at - 1.0, "closed_at": published_at,
          "published_at": published_at, "quorum": quorum, "num_alive": 2, "grace_s": grace_s,
          "reason": "quorum", "admitted": list(admitted), "rejected": list(rejected),
          "update_norm": 1.0, "sync_s": 0.1, "published_bytes": published_bytes,
          "receivers": list(receivers)}


def rejection(learner, reason, payload_bytes=10):
  return {"learner": learner, "incarnation": 0, "reason": reason, "payload_bytes": payload_bytes,
          "arrived_at": 0.0}


def two_learners_stepping_and_waiting():
  """Learner 0 (2 devices): 4 steps of 1 s with a 1 s wait after step 2; learner 1: 2 steps."""
  activity = [step(0, 1, 0, 1, devices=2), step(0, 2, 1, 2, devices=2),
              span(0, "wait", 2, 3, devices=2), step(0, 3, 3, 4, devices=2),
              step(0, 4, 4, 5, devices=2),
              step(1, 1, 0, 2), step(1, 2, 2, 4)]
  return activity


def test_every_step_merged_gives_stepping_fraction():
  activity = two_learners_stepping_and_waiting()
  tape = [round_(0, 2.5, [delivery(0, 2, 2), delivery(1, 1, 1)]),
          round_(0, 5.0, [delivery(0, 4, 2), delivery(1, 2, 1)])]
  # Allocated: learner 0 2 devices x 5 s, learner 1 1 device x 4 s; useful: all but the wait.
  assert accounting.allocated_device_seconds(activity) == 14.0
  assert accounting.goodput(tape, activity, num_fragments=1) == pytest.approx(12.0 / 14.0)


def test_never_admitted_learner_contributes_nothing():
  activity = two_learners_stepping_and_waiting()
  tape = [round_(0, 2.5, [delivery(1, 1, 1)], rejected=[rejection(0, "stale")]),
          round_(0, 5.0, [delivery(1, 2, 1)])]
  assert accounting.goodput(tape, activity, 1) == pytest.approx(4.0 / 14.0)


def test_deliveries_of_unknown_incarnation_or_zero_steps_are_not_useful():
  activity = two_learners_stepping_and_waiting()
  tape = [round_(0, 2.5, [delivery(1, 2, 2, incarnation=7), delivery(0, 4, 0)])]
  assert accounting.useful_device_seconds(tape, activity, 1) == 0.0


def test_one_of_two_fragments_merged_gives_half():
  activity = [step(0, t, t - 1, t) for t in range(1, 5)]
  only_p0 = [round_(0, 2.0, [delivery(0, 2, 2)]), round_(0, 4.0, [delivery(0, 4, 2)])]
  assert accounting.goodput(only_p0, activity, num_fragments=2) == pytest.approx(0.5)
  both = only_p0 + [round_(1, 4.0, [delivery(0, 4, 4)])]
  assert accounting.goodput(both, activity, num_fragments=2) == pytest.approx(1.0)


def test_a_step_counts_once_per_fragment():
  activity = [step(0, t, t - 1, t) for t in range(1, 5)]
  # Two overlapping deliveries of fragment 0 cover steps 1-4 and 3-4: still 4 steps, not 6.
  tape = [round_(0, 4.0, [delivery(0, 4, 4)]), round_(0, 4.5, [delivery(0, 4, 2)])]
  assert accounting.goodput(tape, activity, 1) == pytest.approx(1.0)


def test_down_and_load_are_allocated_not_useful_and_incarnations_are_separate():
  # Incarnation 0 steps 1-2, is down 2 s, loads 1 s; incarnation 1 restarts at local step 1.
  activity = [step(0, 1, 0, 1), step(0, 2, 1, 2), span(0, "down", 2, 4),
              span(0, "load", 4, 5, incarnation=1), step(0, 1, 5, 6, incarnation=1),
              step(0, 2, 6, 7, incarnation=1)]
  tape = [round_(0, 7.0, [delivery(0, 2, 2, incarnation=1)])]
  assert accounting.allocated_device_seconds(activity) == 7.0
  # Only incarnation 1's two steps were merged (incarnation 0's were lost with it).
  assert accounting.goodput(tape, activity, 1) == pytest.approx(2.0 / 7.0)
  kinds = accounting.activity_breakdown(activity)
  assert (kinds["step"], kinds["down"], kinds["load"], kinds["wait"]) == (4.0, 2.0, 1.0, 0.0)


def test_allocation_follows_each_learners_own_first_and_last_record():
  # Learner 1 is added at t = 6 and removed at t = 8; the gap 7-7.5 still counts as allocated.
  activity = [step(0, t, t - 1, t) for t in range(1, 11)]
  activity += [step(1, 1, 6, 7, devices=4), step(1, 2, 7.5, 8, devices=4)]
  assert accounting.allocated_device_seconds(activity) == 10.0 + 4 * 2.0
  assert accounting.goodput([], activity, 1) == 0.0
  assert accounting.goodput([], [], 1) == 0.0


def test_uptime_regular_merges_and_a_long_gap():
  regular = [round_(0, float(t), []) for t in range(1, 101)]
  assert accounting.uptime(regular, horizon=100.0) == pytest.approx(1.0)
  jittered = [round_(0, t + 0.3 * math.sin(t), []) for t in range(1, 100)]
  assert accounting.uptime(jittered, horizon=100.0) == pytest.approx(1.0)
  # Several rounds published at the same instant (virtual clock) do not shrink the allowance.
  bursts = [round_(p, float(t), []) for t in range(2, 101, 2) for p in range(4)]
  assert accounting.uptime(bursts, horizon=100.0) == pytest.approx(1.0)
  # The same on the wall clock: one syncer tick publishes 4 rounds a millisecond apart.
  ticks = [round_(p, t + 0.001 * p, []) for t in range(2, 101, 2) for p in range(4)]
  assert accounting.uptime(ticks, horizon=100.0) == pytest.approx(1.0)
  # Ticks every 2 s, none in (40, 80): 6 s allowed, so 34 s stalled.
  ticks_gap = [r for r in ticks if not 40 < r["published_at"] < 80]
  assert accounting.uptime(ticks_gap, horizon=100.0) == pytest.approx(1.0 - 34.0 / 100.0)
  # No merges for t in (40, 80): median gap 1 s, so 3 s allowed, 37 s stalled.
  gap = [r for r in regular if not 40 < r["published_at"] < 80]
  assert accounting.uptime(gap, horizon=100.0) == pytest.approx(1.0 - 37.0 / 100.0)
  # Merges stop at t = 50 of a 100 s run.
  stopped = [r for r in regular if r["published_at"] <= 50]
  assert accounting.uptime(stopped, horizon=100.0) == pytest.approx(1.0 - 47.0 / 100.0)
  assert accounting.uptime(gap, horizon=100.0, stall_s=50.0) == 1.0
  assert accounting.uptime([], horizon=100.0) == 0.0


def test_merged_tokens_staleness_and_round_stats():
  tape = [round_(0, 1.0, [delivery(0, 2, 2, staleness=0), delivery(1, 2, 2, staleness=1)],
                 rejected=[rejection(2, "stale"), rejection(2, "nan")], quorum=2, grace_s=0.5),
          round_(1, 2.0, [delivery(0, 4, 4, staleness=1)], number=1, quorum=1, grace_s=0.0),
          round_(0, 3.0, [delivery(1, 4, 2, staleness=3)],
                 rejected=[rejection(3, "stale")], number=2, quorum=1, grace_s=0.1)]
  # Tokens 200 + 200 + 400 + 200 over P = 2 fragments, in 10 s.
  assert accounting.merged_tokens(tape, 2) == 500.0
  assert accounting.merged_tokens_per_s(tape, 2, horizon=10.0) == 50.0
  assert fidelity.staleness_histogram(tape) == {0: 1, 1: 2, 3: 1}
  stats = fidelity.round_stats(tape)
  assert stats["rounds"] == 3 and stats["last_quorum"] == 1
  assert stats["mean_quorum"] == pytest.approx(4 / 3)
  assert stats["mean_learners"] == pytest.approx(4 / 3) and stats["max_learners"] == 2
  assert stats["mean_grace_s"] == pytest.approx(0.2)
  assert stats["rejected"] == 3 and stats["rejected_by_reason"] == {"nan": 1, "stale": 2}
  assert stats["close_reasons"] == {"quorum": 3}


def test_bandwidth_ledger_sums_peaks_and_dp_comparison():
  tape = [round_(0, 1.0, [delivery(0, 2, 2, payload_bytes=100),
                          delivery(1, 2, 2, payload_bytes=100)],
                 rejected=[rejection(1, "stale", payload_bytes=50)], published_bytes=200,
                 receivers=[0, 1]),
          round_(1, 2.0, [delivery(0, 4, 2, payload_bytes=30)], published_bytes=60,
                 receivers=[0, 1, 2], number=1)]
  ledger = accounting.bandwidth_ledger(tape, num_params=1000, steps=10, num_fragments=2,
                                       fragment_sizes=[100, 30])
  assert (ledger.bytes_up, ledger.bytes_down, ledger.bytes_rejected) == (280, 580, 50)
  assert ledger.up_by_learner == {0: 130, 1: 150}
  assert ledger.down_by_learner == {0: 260, 1: 260, 2: 60}
  assert ledger.up_by_fragment == {0: 250, 1: 30}
  assert ledger.down_by_fragment == {0: 400, 1: 180}
  assert (ledger.round_up_peak, ledger.round_up_mean) == (250, 140.0)
  assert (ledger.round_down_peak, ledger.round_down_mean) == (400, 290.0)
  # Merged tokens (200 + 200 + 200) / 2 = 300.
  assert ledger.bytes_per_token == pytest.approx(860 / 300)
  # float32 bytes: 3 deliveries of fragment 0 (100 values), 1 of fragment 1 (30 values).
  assert ledger.compression_ratio == pytest.approx(4 * (3 * 100 + 30) / 280)
  # D = 3 learners seen: each sends 2 * 2/3 * 1000 * 2 bytes per step for 10 steps.
  assert ledger.dp_groups == 3
  assert ledger.dp_bytes_per_group == pytest.approx(2 * 2 / 3 * 1000 * 2 * 10)
  assert ledger.dp_bytes == pytest.approx(2 * 2 * 1000 * 2 * 10)
  assert ledger.dp_ratio == pytest.approx(80000 / 860)
  alone = accounting.bandwidth_ledger(tape, num_params=1000, steps=10, num_fragments=2,
                                      dp_groups=1)
  assert alone.dp_bytes == 0.0 and alone.compression_ratio is None


def write_jsonl(path, records, torn=""):
  path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn)


def test_read_jsonl_tolerates_torn_last_line_and_missing_file(tmp_path):
  path = tmp_path / "tape.jsonl"
  write_jsonl(path, [{"a": 1}, {"a": 2}], torn='{"a": 3, "b"')
  assert accounting.read_jsonl(str(path)) == [{"a": 1}, {"a": 2}]
  assert accounting.read_jsonl(str(tmp_path / "absent.jsonl")) == []


def test_summary_reads_the_workdir(tmp_path):
  activity = two_learners_stepping_and_waiting()
  tape = [round_(0, 2.5, [delivery(0, 2, 2, staleness=1), delivery(1, 1, 1)],
                 published_bytes=8, receivers=[0, 1]),
          round_(0, 5.0, [delivery(0, 4, 2, staleness=2), delivery(1, 2, 1)],
                 published_bytes=8, receivers=[0, 1], number=1)]
  write_jsonl(tmp_path / "tape.jsonl", tape, torn='{"round": 2, "frag')
  write_jsonl(tmp_path / "activity.jsonl", activity)
  out = accounting.summary(str(tmp_path), num_fragments=1, num_params=1000,
                           fragment_sizes=[5])
  assert out["accounting/goodput"] == pytest.approx(12.0 / 14.0)
  assert out["accounting/rounds"] == 2.0
  assert out["accounting/horizon_s"] == 5.0
  assert out["accounting/merged_tokens_per_s"] == pytest.approx(600 / 5.0)
  assert out["accounting/staleness_max"] == 2.0
  assert out["accounting/staleness_mean"] == pytest.approx(0.75)
  assert out["accounting/bytes_up"] == 40.0 and out["accounting/bytes_down"] == 32.0
  assert out["accounting/wait_fraction"] == pytest.approx(2.0 / 14.0)
  assert out["accounting/compression_ratio"] == pytest.approx(2.0)
  # D = 2 learners, 6 step spans / 2 = 3 steps, 2 * 1/2 * 1000 * 2 bytes per group and step.
  assert out["accounting/dp_bytes"] == pytest.approx(2 * 3 * 2000.0)
  assert all(isinstance(v, float) for v in out.values())
  json.dumps(out)


def test_merged_bars_merges_contiguous_spans_of_a_kind():
  spans = [step(0, 1, 0, 1), step(0, 2, 1, 2), step(0, 3, 2, 3, slowdown=2.0),
           step(0, 4, 3, 4, slowdown=2.0), span(0, "wait", 4, 5), step(0, 5, 5, 6),
           step(0, 6, 6, 7)]
  bars = timeline.merged_bars(spans, tolerance=1e-6)
  assert bars == {"step": [(0, 2), (5, 2)], "slowed": [(2, 2)], "wait": [(4, 1)]}


def test_timeline_png_with_many_spans(tmp_path):
  activity, tape = [], []
  for m in range(4):
    t, inc = 0.0, 0
    for s in range(1, 501):
      if m == 2 and s == 250:
        activity.append(span(m, "down", t, t + 20.0, incarnation=inc))
        inc += 1
        activity.append(span(m, "load", t + 20.0, t + 25.0, incarnation=inc))
        t += 25.0
      slow = 1.5 if m == 3 and s % 100 < 30 else 1.0
      activity.append(step(m, s, t, t + slow, incarnation=inc, slowdown=slow))
      t += slow
      if s % 50 == 0:
        activity.append(span(m, "wait", t, t + 0.5, incarnation=inc))
        t += 0.5
  for r in range(600):
    tape.append(round_(r % 24, 1.0 + r, [delivery(0, 1, 1)] * (1 + r % 4), number=r))
  path = tmp_path / "timeline.png"
  timeline.plot_timeline(tape, activity, str(path), title="test")
  data = path.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  assert len(data) > 10_000


def test_where_steps_went_splits_step_time_into_merged_rejected_and_dropped():
  # One learner, four 1-s steps on 2 devices, P = 2. Fragment 0: a merged delivery of steps
  # 1-2. Fragment 1: a rejected (stale) delivery of steps 1-4, plus a rejection with no
  # counters (a crafted one): it carries nothing.
  activity = [accounting.span_record(0, 0, "step", t, t + 1.0, devices=2, local_step=t + 1)
              for t in range(4)]
  tape = [
      {"fragment": 0, "admitted": [{"learner": 0, "incarnation": 0, "local_step": 2,
                                    "steps": 2}], "rejected": []},
      {"fragment": 1, "admitted": [], "rejected": [
          {"learner": 0, "incarnation": 0, "local_step": 4, "steps": 4, "reason": "stale"},
          {"learner": 0, "incarnation": 0, "reason": "unreadable"}]},
  ]
  went = accounting.where_steps_went(tape, activity, num_fragments=2)
  # Step device-seconds: 4 steps x 2 devices = 8, each fragment 4 of them.
  assert went == {"merged": pytest.approx(2.0), "rejected": pytest.approx(4.0),
                  "dropped": pytest.approx(2.0)}
  assert sum(went.values()) == pytest.approx(8.0)


def test_a_sharded_syncers_tape_gives_figures_per_shard_and_overall(tmp_path):
  """Rounds tagged with their syncer shard (docs/design.md 3.1): per-shard keys beside the
  overall ones, the shards' rounds summing to the run's."""
  shard0 = [dict(round_(0, 1.0, [delivery(0, 2, 2), delivery(1, 2, 2, staleness=1)],
                        grace_s=0.5), shard=0),
            dict(round_(0, 3.0, [delivery(0, 4, 2, staleness=2)], number=2), shard=0)]
  shard1 = [dict(round_(1, 2.0, [delivery(1, 4, 4)], number=1, grace_s=0.25), shard=1)]
  tape = shard0 + shard1
  write_jsonl(tmp_path / "tape.jsonl", tape)
  write_jsonl(tmp_path / "activity.jsonl", two_learners_stepping_and_waiting())
  out = accounting.summary(str(tmp_path), num_fragments=2, num_params=100)
  assert out["accounting/shards"] == 2.0 and out["accounting/rounds"] == 3.0
  assert out["accounting/shard0/rounds"] + out["accounting/shard1/rounds"] == 3.0
  assert out["accounting/shard0/mean_learners_per_round"] == pytest.approx(1.5)
  assert out["accounting/shard1/mean_learners_per_round"] == 1.0
  assert out["accounting/shard0/staleness_mean"] == pytest.approx(1.0)
  assert out["accounting/shard0/staleness_max"] == 2.0
  assert out["accounting/shard1/staleness_max"] == 0.0
  assert out["accounting/shard0/mean_grace_s"] == pytest.approx(0.25)
  assert out["accounting/shard1/median_grace_s"] == 0.25
  assert out["accounting/mean_learners_per_round"] == pytest.approx(4 / 3)  # overall meaning
  line = fidelity.fidelity_line(tape)
  assert line.startswith("fidelity: 3 rounds") and "per shard: s0 2 rounds" in line
  assert "s1 1 rounds, 1.00 learners/round" in line
  # One shard (or records written before shards): no per-shard keys, the line as before.
  assert "per shard" not in fidelity.fidelity_line(shard0)
  write_jsonl(tmp_path / "tape.jsonl", shard0)
  assert not any("shard" in k for k in accounting.summary(str(tmp_path), num_fragments=2,
                                                          num_params=100))


def test_a_final_round_counts_the_learners_that_left_after_their_final_delivery():
  """Learners that finished and left are not alive when their final round closes, yet the
  round merges them: the most it could merge counts them, so learners per round never exceeds
  the learners available (a fault-free run reads 2 of 2 to the end)."""
  final = [dict(delivery(0, 8, 2), final=True), dict(delivery(1, 8, 2), final=True)]
  tape = [round_(0, 1.0, [delivery(0, 4, 4), delivery(1, 4, 4)], receivers=[0, 1]),
          dict(round_(0, 2.0, final, receivers=[], number=1), num_alive=0),
          # One learner left; the one still alive has not delivered: 1 + 1 could merge.
          dict(round_(1, 3.0, [dict(delivery(0, 8, 2), final=True)], receivers=[1],
                      number=2), num_alive=1),
          # A record without `receivers` (older tapes): at least what it admitted.
          {k: v for k, v in round_(1, 4.0, final, number=3).items() if k != "receivers"}]
  assert [fidelity.could_merge(r) for r in tape] == [2, 2, 2, 2]
  stats = fidelity.round_stats(tape)
  assert stats["mean_alive"] == 2.0 and stats["mean_learners"] == pytest.approx(7 / 4)
  assert stats["mean_learners"] <= stats["mean_alive"]
