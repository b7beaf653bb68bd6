"""Where the global model is evaluated (`train.eval_mode`): never on the merge path.

The evaluator process is a real process launched beside the syncer and the learners; it
reads the published versions from the store and writes the global eval records itself.
"""

import json
import os
import subprocess
import sys

import pytest
import runtime_configs

from diloco.config import run_config
from diloco.runtime import data_parallel, decoupled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_eval_mode_is_validated():
  with pytest.raises(run_config.ConfigError, match="train.eval_mode"):
    runtime_configs.load(train__eval_mode="sometimes")


@pytest.mark.parametrize("runtime", ["decoupled", "dp"])
def test_process_eval_needs_the_multi_process_runtime(tmp_path, runtime):
  if runtime == "dp":
    cfg = runtime_configs.load("dp.py:tiny", train__eval_mode="process")
    run = data_parallel.run
  else:
    cfg = runtime_configs.load(train__eval_mode="process")
    run = decoupled.run
  with pytest.raises(run_config.ConfigError, match="train.eval_mode.*--role=launch"):
    run(cfg, str(tmp_path))


@pytest.mark.slow
def test_eval_off_trains_without_any_global_evaluation(tmp_path):
  cfg = runtime_configs.load(learners__virtual_clock=True, train__steps=16, train__eval_every=4,
                        train__eval_mode="off")
  summary = decoupled.run(cfg, str(tmp_path))
  assert summary["eval/loss"] is None and summary["eval/initial_loss"] is None
  records = _jsonl(os.path.join(tmp_path, "metrics.jsonl"))
  assert not [r for r in records if "eval/loss" in r]
  assert summary["accounting/rounds"] > 0  # it trained and merged


@pytest.mark.slow
@pytest.mark.processes
def test_evaluator_process_evaluates_the_published_versions(tmp_path):
  workdir = str(tmp_path)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
      [sys.executable, "-m", "diloco.main", "--config=configs/multiprocess.py:tiny",
       f"--workdir={workdir}", "--role=launch", "--config.learners.count=2",
       "--config.train.steps=48", "--config.train.eval_every=16",
       "--config.train.eval_mode=process", "--config.launch.chaos_faults=0",
       "--config.launch.timeout_s=600"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=700, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  evaluator_log = open(os.path.join(workdir, "logs", "evaluator.log")).read()
  syncer_log = open(os.path.join(workdir, "logs", "syncer.log")).read()
  assert "evaluator: stopped, eval/loss" in evaluator_log
  assert "global eval/loss" in evaluator_log and "global eval/loss" not in syncer_log
  evals = [r for r in _jsonl(os.path.join(workdir, "metrics.jsonl")) if "eval/loss" in r]
  assert evals[0]["step"] == 0 and evals[0]["outer/rounds"] == 0  # the start, version 0
  assert len(evals) >= 3  # the start, at least one on schedule, the final versions
  with open(os.path.join(workdir, "store", "registry.json")) as f:
    registry = json.load(f)
  assert evals[-1]["outer/rounds"] == registry["rounds"] and registry["stopped"]
  with open(os.path.join(workdir, "accounting.json")) as f:
    acc = json.load(f)
  assert acc["eval/loss"] == evals[-1]["eval/loss"] < acc["eval/initial_loss"]
  steps = [r["step"] for r in evals]
  assert len(steps) == len(set(steps)) and steps[-1] == 48, steps  # one record per step
  # The launcher's console shows the evaluator's evals as it records them.
  assert "global eval/loss" in proc.stdout, proc.stdout[-3000:]
