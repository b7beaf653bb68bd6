"""Goodput simulator against closed forms, within Monte Carlo error (docs/design.md 4)."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import integrate

from diloco.errors import ConfigError
from diloco.sim import analytic, bandwidth, engine, params
from diloco.sync.policy import SyncConfig

NO_FAILURES = params.FailureModel(mtbi_years=float("inf"))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(**kw):
  return engine.simulate(params.SimConfig(**kw))


@pytest.mark.parametrize("mode,learners", [("dp", 1), ("elastic", 1), ("decoupled", 4)])
def test_no_failures_gives_goodput_one(mode, learners):
  r = _run(mode=mode, chips=100_000, learners=learners, days=2, failures=NO_FAILURES)
  assert r.failures == 0
  assert r.goodput == pytest.approx(1.0, abs=1e-9)
  assert r.uptime == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("mode", ["dp", "elastic"])
def test_single_job_with_fixed_restart(mode):
  # Failure rate lambda = 1/120 s over 100 slices, restart (or reconfiguration) R = 60 s,
  # instant repair: failures during a stop are absorbed, so goodput = 1 / (1 + lambda R).
  lam, restart, slices, chips = 1 / 120, 60.0, 100, 256
  fm = params.FailureModel(mtbi_years=slices * chips / lam / params.YEAR_S, slice_chips=chips,
                           restart_s=restart, reconfig_s=restart, repair_s=0.0)
  r = _run(mode=mode, chips=slices * chips, learners=1, days=30, failures=fm)
  assert r.failures == pytest.approx(lam * 30 * 86400, rel=0.03)
  assert r.goodput == pytest.approx(1 / (1 + lam * restart), abs=0.004)  # MC std ~0.0007


def test_closed_form_of_calibrated_model_matches_simulation():
  for mode in ("dp", "elastic"):
    r = _run(mode=mode, chips=600_000, learners=1, days=20)
    assert r.goodput == pytest.approx(analytic.goodput(mode, 600_000, params.FailureModel()),
                                      abs=0.01)


def test_independent_learners_keep_the_global_model_up():
  single = _run(mode="dp", chips=1_200_000, learners=1, days=3)
  elastic = _run(mode="elastic", chips=1_200_000, learners=1, days=3)
  decoupled = _run(mode="decoupled", chips=1_200_000, learners=8, days=3,
                   sync=SyncConfig(quorum=1))
  assert single.uptime < 0.35 and elastic.uptime < 0.65
  assert decoupled.uptime > 0.999
  assert decoupled.goodput > elastic.goodput > single.goodput


def test_equal_speeds_without_failures_k1_equals_km():
  kw = {"mode": "decoupled", "chips": 80_000, "learners": 4, "days": 1, "failures": NO_FAILURES}
  k1, km = _run(sync=SyncConfig(quorum=1), **kw), _run(sync=SyncConfig(quorum=4), **kw)
  assert k1.goodput == pytest.approx(km.goodput, abs=1e-9)
  assert k1.goodput == pytest.approx(1.0, abs=1e-9)


def _expected_max_uniform(lows, highs):
  """E[max_i X_i], X_i ~ U(low_i, high_i) independent, by numeric integration of 1 - CDF."""
  def cdf(x):
    return np.prod([np.clip((x - lo) / (hi - lo), 0.0, 1.0) for lo, hi in zip(lows, highs)])
  top = max(highs)
  tail, _ = integrate.quad(lambda x: 1.0 - cdf(x), min(lows), top, limit=200)
  return min(lows) + tail


def test_heterogeneous_km_goodput_is_mean_over_expected_slowest():
  speeds, jitter = (1.0, 1.0, 1.18, 1.18), 0.1
  # tau = 0 and instant sync: with K = M every step waits for the slowest learner.
  r = _run(mode="decoupled", chips=80_000, learners=4, sync=SyncConfig(quorum=4, tau=0),
           grace=False, sync_s=0.0, speeds=speeds, step_jitter=jitter, window_steps=4000, days=1,
           failures=NO_FAILURES)
  lows = [s * (1 - jitter) for s in speeds]
  highs = [s * (1 + jitter) for s in speeds]
  expected = np.mean(speeds) / _expected_max_uniform(lows, highs)
  assert 0.85 < expected < 0.92
  assert r.goodput == pytest.approx(expected, abs=0.004)


def test_syncer_policy_drives_rounds():
  kw = {"mode": "decoupled", "chips": 80_000, "learners": 4, "days": 1, "failures": NO_FAILURES,
            "speeds": (1.0, 1.0, 1.18, 1.18), "step_jitter": 0.1}
  no_grace, grace = _run(grace=False, **kw), _run(grace=True, **kw)
  assert no_grace.learners_per_round == pytest.approx(1.0, abs=0.02)
  assert no_grace.grace_mean_s == 0.0
  # grace = clip(0.8 * (2 * step - 0 - 0.3), 0, step) = the slowest EMA step time (~1.2 s).
  assert 1.0 < grace.grace_mean_s < 1.3
  assert grace.learners_per_round > 1.5
  assert grace.merged_token_fraction > no_grace.merged_token_fraction
  # Neither makes anybody wait: equal goodput.
  assert grace.goodput == pytest.approx(no_grace.goodput, abs=1e-9)


def test_km_stalls_on_every_learner_pause():
  kw = {"mode": "decoupled", "chips": 600_000, "learners": 8, "days": 3}
  k8, k1 = _run(sync=SyncConfig(quorum=8), **kw), _run(sync=SyncConfig(quorum=1), **kw)
  assert k8.goodput < k1.goodput - 0.1


def test_schedule_adds_and_removes_learners():
  r = _run(mode="decoupled", chips=80_000, learners=4, days=3, failures=NO_FAILURES,
           schedule=((1.0, 4), (2.0, -6)))
  # Allocation follows the schedule, so goodput stays <= 1; only the joins' pauses are lost.
  assert 0.999 < r.goodput <= 1.0 + 1e-12


def test_config_validation_names_the_field():
  with pytest.raises(ValueError, match="learners"):
    params.SimConfig(mode="dp", learners=4)
  with pytest.raises(ValueError, match="step_jitter"):
    params.SimConfig(step_jitter=1.5)
  with pytest.raises(ConfigError, match="sync.quorum"):
    params.SimConfig(sync=SyncConfig(quorum=-1))
  # The group's rules across its fields apply too: a merge is applied tau steps after delivery.
  with pytest.raises(ConfigError, match="sync.period"):
    params.SimConfig(sync=SyncConfig(period=2, tau=2), window_steps=8)


def test_cli_names_the_flag_of_a_bad_sync_value():
  cmd = [sys.executable, "-m", "diloco.sim", "--mode=decoupled", "--inner_steps=2", "--tau=2"]
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
  assert out.returncode == 1
  assert out.stderr.strip() == ("diloco.sim: error: --inner_steps (sync.period): must be greater "
                                "than sync.tau=2 (docs/design.md 2.3), got 2")


def test_same_seed_same_result():
  a = _run(mode="decoupled", chips=300_000, learners=4, days=2, seed=3)
  b = _run(mode="decoupled", chips=300_000, learners=4, days=2, seed=3)
  assert dataclasses.replace(a, wall_s=0.0) == dataclasses.replace(b, wall_s=0.0)


def test_bandwidth_closed_form():
  bw = bandwidth.estimate(params=1e9, step_time=1.0, datacenters=8, fragments=24, H=24, tau=2,
                          bits=4, block=32)
  assert bw.dp_gbps == pytest.approx(2 * 7 / 8 * 1e9 * 16 / 1e9)
  assert bw.upload_mean_gbps == pytest.approx(1e9 * 4.5 / 24 / 1e9)
  assert bw.ratio == pytest.approx(28.0 / (4.5 / 24))


def test_cli_prints_json_last():
  cmd = [sys.executable, "-m", "diloco.sim", "--mode=decoupled", "--chips=150000",
         "--learners=4", "--quorum=1", "--days=2", "--speeds=1,1.18", "--step_jitter=0.1",
         "--grace=false", "--json"]
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                       check=True).stdout
  record = json.loads(out.strip().splitlines()[-1])
  assert record["mode"] == "decoupled" and record["chips"] == 150_000
  assert record["learners"] == 4 and record["grace"] is False
  assert 0.5 < record["goodput"] <= 1.0 and 0.0 <= record["uptime"] <= 1.0
  assert {"merged_token_fraction", "staleness_mean", "staleness_hist"} <= set(record)
