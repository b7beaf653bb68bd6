"""Receipt modes in whole runs of both runtimes, checked on the tape's counters.

On a fault-free run every fragment is delivered every H steps and its merge is applied tau
steps after each delivery. Overwriting drops those tau steps, so a delivery after the first
carries at most H - tau steps; keep_local keeps them and counts them, so it carries exactly H
(docs/design.md 2.3). The same learner code runs in both runtimes; these runs show each runtime
hands it what that needs.
"""

import json
import os
import subprocess
import sys

import pytest
import runtime_configs

from diloco.runtime import decoupled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _later_deliveries(workdir):
  """`steps` of every admitted delivery but each learner-fragment's first."""
  with open(os.path.join(workdir, "tape.jsonl")) as f:
    tape = [json.loads(line) for line in f if line.strip()]
  seen, later = set(), []
  for r in sorted(tape, key=lambda r: r["round"]):
    for a in sorted(r["admitted"], key=lambda a: a["local_step"]):
      key = (a["learner"], a["incarnation"], r["fragment"])
      if key in seen and not a.get("final"):
        later.append(a["steps"])
      seen.add(key)
  return later


def _check(receipt, steps, period, tau):
  assert len(steps) >= 8
  if receipt == "keep_local":
    assert set(steps) == {period}
  else:
    assert max(steps) <= period - tau and max(steps) == period - tau


@pytest.mark.parametrize("receipt", ["overwrite", "keep_local"])
def test_virtual_clock_run_counts_the_kept_steps(tmp_path, receipt):
  cfg = runtime_configs.load(learners__count=2, learners__devices="2,2",
                        learners__virtual_clock=True, train__steps=32, receipt__mode=receipt)
  decoupled.run(cfg, str(tmp_path))
  _check(receipt, _later_deliveries(tmp_path), cfg.sync.period, cfg.sync.tau)


@pytest.mark.slow
@pytest.mark.processes
def test_multi_process_run_counts_the_kept_steps(tmp_path):
  receipt = "keep_local"  # overwrite's counters are the virtual-clock test's contrast
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
      [sys.executable, "-m", "diloco.main", "--config=configs/multiprocess.py:tiny",
       f"--workdir={tmp_path}", "--role=launch", "--config.learners.count=2",
       "--config.train.steps=40", f"--config.receipt.mode={receipt}",
       "--config.launch.chaos_faults=0",  # fault-free: every learner delivers on schedule
       "--config.launch.timeout_s=600"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=700, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  cfg = runtime_configs.load("multiprocess.py:tiny")
  _check(receipt, _later_deliveries(tmp_path), cfg.sync.period, cfg.sync.tau)
