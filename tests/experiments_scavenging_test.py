"""The scavenging experiment: its schedule, time to target loss, and a tiny pipeline."""

import json
import os

import pytest

from experiments import harness
from experiments.scavenging import config as scav_config
from experiments.scavenging import run as scav_run


def test_scavenging_schedule_adds_two_learners_and_retires_them():
  assert scav_config.faults(24, 88) == "add@24;add@24;retire:2@88;retire:3@88"
  runs = scav_config.runs(seeds=(0,))
  assert [r.method for r in runs] == ["fixed M=2", "scavenging", "fixed M=4",
                                      "scavenging, cohort schedule"]
  assert dict(runs[1].overrides)["learners.faults"] == scav_config.faults()
  cohort = dict(runs[3].overrides)
  assert cohort["learners.join_schedule"] == "cohort"
  assert cohort == dict(dict(runs[1].overrides), **{"learners.join_schedule": "cohort"})


def test_time_to_loss_interpolates_between_evaluations():
  curve = [{"time": 0.0, "eval_loss": 5.0}, {"time": 10.0, "eval_loss": 3.0},
           {"time": 20.0, "eval_loss": 2.0}]
  assert scav_run.time_to_loss(curve, 2.5) == pytest.approx(15.0)
  assert scav_run.time_to_loss(curve, 3.0) == pytest.approx(10.0)
  assert scav_run.time_to_loss(curve, 6.0) == 0.0
  assert scav_run.time_to_loss(curve, 1.0) is None


@pytest.mark.slow
def test_scavenging_pipeline_writes_results_readme_and_plot(tmp_path):
  runs = [r for r in scav_config.runs(seeds=(0,), steps=16)
          if r.method in ("fixed M=2", "scavenging")]
  outdir, folder = str(tmp_path / "runs"), str(tmp_path / "results")
  os.makedirs(folder)
  wall = harness.run_all(runs, outdir)
  results = harness.report("scavenging", runs, outdir, folder, columns=scav_config.COLUMNS,
                           wall_s=wall, derive=scav_run.with_time_to_target(outdir, runs),
                           about=scav_config.__doc__, command="python -m experiments.x",
                           plot=dict(time_key="time", time_label="virtual seconds"))
  assert json.load(open(os.path.join(folder, "results.json"))) == results
  fixed, scav = results["rows"]
  # The added learners' steps count: more tokens than two learners' 16 steps.
  assert fixed["tokens"] == 2 * 16 * 8 * 64 < scav["tokens"]
  assert fixed["speedup"] == 1.0 and fixed["time_to_target_s"] is not None
  curve = harness.eval_curve(os.path.join(outdir, runs[1].name))
  assert [p["tokens"] for p in curve] == sorted(p["tokens"] for p in curve)
  assert curve[-1]["tokens"] == scav["tokens"]
  assert "| scavenging | 0 |" in open(os.path.join(folder, "README.md")).read()
  assert os.path.getsize(os.path.join(folder, "eval.png")) > 10_000
