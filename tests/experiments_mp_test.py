"""The multi-process experiments (chaos, bandwidth): fault schedules, closed forms, smoke runs."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from diloco.distributed import chaos
from diloco.sim.params import FailureModel
from experiments.bandwidth import config as bandwidth_config
from experiments.chaos import config as chaos_config
from experiments.chaos import faults
from experiments.harness import REPO


def test_kill_schedule_is_seeded_and_parses_back():
  process = faults.compress(FailureModel(), learners=3, window_s=40.0, expected=4.0)
  a = faults.draw(process, start_s=5.0, end_s=45.0, seed=3, restart_s=4.0)
  assert a == faults.draw(process, start_s=5.0, end_s=45.0, seed=3, restart_s=4.0)
  assert a != faults.draw(process, start_s=5.0, end_s=45.0, seed=4)
  assert all(e.kind == "kill" and 0 <= e.learner < 3 and 5.0 <= e.at <= 45.0 for e in a)
  assert chaos.parse(faults.render(a)) == a
  for m in range(3):  # a learner is immune while down (the simulator's thinning)
    times = [e.at for e in a if e.learner == m]
    assert all(b - t >= process.downtime_s + 4.0 - 0.01 for t, b in zip(times, times[1:]))


def test_compression_keeps_the_failure_model_and_hits_the_mean():
  model = FailureModel()
  process = faults.compress(model, learners=3, window_s=60.0, expected=5.0, slices=2)
  assert process.rate == pytest.approx(5.0 / (3 * 60.0))
  # Every duration shrinks by the same factor: downtime / mean gap is the model's own ratio.
  ratio = (model.repair_s + model.reconfig_s) * 2 * model.slice_rate
  assert process.downtime_s * process.rate == pytest.approx(ratio)
  counts = [len(faults.draw(process, start_s=0.0, end_s=60.0, seed=s, restart_s=5.0))
            for s in range(3000)]
  mean = process.expected_kills(60.0, restart_s=5.0)
  assert mean < 5.0  # downtime absorbs some failures
  # The renewal-process mean is exact only asymptotically; a window of ~2 cycles per learner
  # is within a few percent of it.
  assert np.mean(counts) == pytest.approx(mean, rel=0.06)


def test_without_downtime_the_count_is_poisson():
  model = FailureModel(repair_s=0.0, reconfig_s=0.0)
  process = faults.compress(model, learners=4, window_s=30.0, expected=3.0)
  counts = [len(faults.draw(process, start_s=0.0, end_s=30.0, seed=s)) for s in range(4000)]
  assert process.expected_kills(30.0) == pytest.approx(3.0)
  assert np.mean(counts) == pytest.approx(3.0, rel=0.04)
  assert np.var(counts) == pytest.approx(3.0, rel=0.1)


def test_experiments_cover_their_methods():
  chaos_runs = chaos_config.runs("full", seeds=(0, 1))
  assert len({r.name for r in chaos_runs}) == 6
  for seed in (0, 1):  # the two faulted methods get the same kills; the baseline none
    faulted = [dict(r.overrides).get("launch.chaos") for r in chaos_runs if r.seed == seed]
    assert faulted[0] == faulted[2] and faulted[0] and faulted[1] is None
  assert all(r.args == ("--role=launch",) for r in chaos_runs)
  sync = dict(chaos_runs[2].overrides)
  assert sync["sync.num_fragments"] == 1 and sync["sync.quorum"] == 0
  # One fragment of 1000 float32 parameters in 8 fragments crossing in one 0.2 s step.
  mbps, latency = bandwidth_config.throttle(1000, 8, 0.2)
  assert mbps == pytest.approx(1000 * 32 / 8 / 0.2 / 1e6, rel=1e-3) and latency == 50.0
  methods = [r.method for r in bandwidth_config.runs(1000, 8, 0.2)]
  assert methods == ["decoupled", "sync DiLoCo", "decoupled, WAN", "sync DiLoCo, WAN"]


def _runner(tmp_path, module, *flags):
  env = dict(os.environ, PYTHONPATH=REPO)
  out = subprocess.run(
      [sys.executable, "-m", module, f"--outdir={tmp_path / 'runs'}",
       f"--results_dir={tmp_path / 'results'}", "--preset=smoke", *flags],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  results = json.load(open(tmp_path / "results" / "results.json"))
  readme = open(tmp_path / "results" / "README.md").read()
  return results, readme


def _check_rows(results, name, methods):
  assert results["experiment"] == name and len(results["commit"]) in (40, 7)
  assert [r["method"] for r in results["rows"]] == methods
  for row in results["rows"]:
    assert row["eval_loss"] < row["initial_loss"] and row["tokens"] > 0
    for key in ("goodput", "mean_learners_per_round", "bytes_up", "bytes_down", "wall_s"):
      assert row[key] > 0, key


@pytest.mark.slow
@pytest.mark.processes
def test_chaos_pipeline_end_to_end(tmp_path):
  # One faulted method: the synchronous one runs in the multi-process runtime in the bandwidth
  # pipeline below, and both get the same kills by construction (test_experiments_cover_...).
  methods = ["decoupled, faults"]
  results, readme = _runner(tmp_path, "experiments.chaos.run", "--seeds=1",
                            *[f"--only={m}" for m in methods])
  _check_rows(results, "chaos", methods)
  for row in results["rows"]:
    assert row["kills"] >= 1 and row["kills_applied"] <= row["kills"]
  for name in ("eval.png", "progress.png", "timeline_decoupled_faults.png"):
    assert os.path.getsize(tmp_path / "results" / name) > 10_000
    assert f"({name})" in readme
  assert "| decoupled, faults | 0 |" in readme and "## Fault schedules" in readme


@pytest.mark.slow
@pytest.mark.processes
def test_bandwidth_pipeline_end_to_end(tmp_path):
  methods = ["decoupled", "sync DiLoCo, WAN"]
  results, readme = _runner(tmp_path, "experiments.bandwidth.run",
                            *[f"--only={m}" for m in methods])
  _check_rows(results, "bandwidth", methods)
  plain, throttled = results["rows"]
  assert plain["wan_mbps"] == 0 and throttled["wan_mbps"] > 0
  assert plain["steps_per_s"] > 0 and throttled["steps_per_s"] > 0
  ledger = json.load(open(tmp_path / "results" / "ledger.json"))
  dp, closed, up = ledger["rows"][:3]
  assert "data-parallel" in dp["what"] and dp["gbps"] > up["gbps"] > 0
  assert closed["dp_over_this"] == pytest.approx(24 * 2 * 2 / 3, rel=1e-6)  # H * 2 (M - 1) / M
  for name in ("eval.png", "ledger.png", "rates.png"):
    assert os.path.getsize(tmp_path / "results" / name) > 10_000
    assert f"({name})" in readme
