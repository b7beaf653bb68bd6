"""The end-of-run report (`diloco.observe.report`): one for both runtimes.

A tiny virtual-clock run of the single-controller runtime leaves its records; the launcher's
`finish` then reports the same records as a launched run would. Both must write the same
accounting.json keys with the same figures, and print the same short table.
"""

import collections
import json
import math
import os
import shutil

import pytest
import runtime_configs

from diloco.distributed.launcher import Launcher
from diloco.observe import metrics as metrics_lib
from diloco.observe import report
from diloco.runtime import decoupled

STEPS = 8


def _jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _evals(workdir):
  return [r for r in _jsonl(os.path.join(workdir, "metrics.jsonl")) if "eval/loss" in r]


@pytest.fixture(scope="module")
def decoupled_run(tmp_path_factory):
  """A 2-learner virtual-clock run whose fast learner finishes first: the periodic evals due
  after that are at its last step, like the final one. The slow learner goes down once and
  rejoins; the second fault finds it down already. Its config, workdir, summary, stdout."""
  workdir = str(tmp_path_factory.mktemp("decoupled"))
  cfg = runtime_configs.load(learners__count=2, learners__virtual_clock=True, train__steps=STEPS,
                        train__eval_every=STEPS // 4, sync__num_fragments=2, sync__period=4,
                        learners__speeds="1,2", learners__faults="kill:1@3+2;kill:1@4+1")
  capture = pytest.MonkeyPatch()
  lines = []
  capture.setattr("builtins.print", lambda *a, **k: lines.append(" ".join(map(str, a))))
  try:
    summary = decoupled.run(cfg, workdir)
  finally:
    capture.undo()
  return cfg, workdir, summary, "\n".join(lines)


@pytest.mark.slow
def test_single_controller_run_writes_every_key_once(decoupled_run):
  _, workdir, summary, _ = decoupled_run
  with open(os.path.join(workdir, "accounting.json")) as f:
    written = json.load(f)
  assert written == summary
  assert set(report.RUN_KEYS) <= set(written)
  assert all(k.startswith("accounting/") for k in set(written) - set(report.RUN_KEYS))
  assert (written["chaos/events"], written["chaos/applied"]) == (2, 1)
  assert (written["restarts"], written["syncer_restarts"]) == (1, 0)
  assert 0 < written["accounting/goodput"] <= 1 and written["wall_s"] > 0
  for name in ("loss.png", "timeline.png"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0


@pytest.mark.slow
def test_one_eval_record_per_step_and_the_final_one_last(decoupled_run):
  _, workdir, summary, _ = decoupled_run
  evals = _evals(workdir)
  per_step = collections.Counter(r["step"] for r in evals)
  assert per_step and max(per_step.values()) == 1, per_step
  assert evals[0]["step"] == 0 and evals[-1]["step"] == STEPS
  assert evals[-1]["eval/loss"] == summary["eval/loss"] < summary["eval/initial_loss"]
  assert len(per_step) >= 3  # the start, at least one periodic eval mid-run, the end


@pytest.mark.slow
def test_console_shows_the_final_eval_once_in_a_short_table(decoupled_run):
  _, workdir, summary, out = decoupled_run
  final = f"{summary['eval/loss']:.4f}"
  assert [line for line in out.splitlines() if final in line] == [
      f"  eval loss       {final} at step {STEPS} (initial {summary['eval/initial_loss']:.4f})"]
  table = out[out.index("run summary"):].splitlines()
  assert len(table) == 10 and "{" not in out[out.index("run summary"):]  # no dict dump
  rows = {line[2:16].strip(): line[18:] for line in table[1:]}
  assert rows["goodput"].startswith(f"{summary['accounting/goodput']:.2f} ")
  assert rows["staleness"] == (f"mean {summary['accounting/staleness_mean']:.2f}, "
                               f"max {summary['accounting/staleness_max']:.0f}")
  assert rows["export"] == os.path.join(workdir, "export")
  assert os.path.join(workdir, "tensorboard") in rows["tensorboard"]
  assert rows["restarts"] == "1 (0 of them the syncer's); faults 1 of 2 applied"
  assert out.count("fidelity: ") == 1


@pytest.mark.slow
def test_launcher_reports_the_same_keys_and_figures(decoupled_run, tmp_path, capsys):
  cfg, source, summary, decoupled_out = decoupled_run
  workdir = tmp_path / "launched"
  launcher = Launcher(cfg, str(workdir), config_json="unused.json")
  launcher.shutdown()  # no process: the records are the single-controller run's
  for name in ("tape.jsonl", "metrics.jsonl"):
    shutil.copy(os.path.join(source, name), workdir / name)
  shutil.copy(os.path.join(source, "activity.jsonl"), workdir / "activity" / "learners.jsonl")
  launched = launcher.finish()
  assert set(launched) == set(summary)
  for key, value in summary.items():
    if key.startswith("accounting/") or key.startswith("eval/"):
      assert launched[key] == pytest.approx(value, rel=1e-12), key
  with open(workdir / "accounting.json") as f:
    assert set(json.load(f)) == set(summary)
  out = capsys.readouterr().out
  table = out[out.index("run summary"):].splitlines()
  theirs = decoupled_out[decoupled_out.index("run summary"):].splitlines()
  # The same rows; only the paths and the wall time differ.
  assert [line.split()[0] for line in table] == [line.split()[0] for line in theirs]
  assert table[1] == theirs[1]  # the eval loss row


def test_eval_follower_prints_new_complete_global_eval_records(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  with open(path, "w") as f:
    f.write(json.dumps({"role": "syncer", "step": 0, "eval/loss": 9.0, "time": 0.0}) + "\n")
  follower = metrics_lib.EvalFollower(path, last_step=10)  # an earlier run's record is old
  assert follower.new_lines() == []
  with open(path, "a") as f:
    f.write(json.dumps({"role": "learner", "learner": 0, "step": 3, "train/loss": 4.0}) + "\n")
    f.write(json.dumps({"role": "syncer", "step": 4, "eval/loss": 3.25, "time": 12.34,
                        "outer/rounds": 7.0}) + "\n")
    f.write('{"role": "syncer", "step": 8, "eval/lo')  # still being written
  assert follower.new_lines() == ["t=12.3s step 4: global eval/loss 3.2500 after 7 rounds"]
  with open(path, "a") as f:
    f.write('ss": 2.5, "time": 20.0, "outer/rounds": 9}\n')
    # The final eval, at the last step: the report's table shows it.
    f.write(json.dumps({"role": "syncer", "step": 10, "eval/loss": 2.0, "time": 25.0}) + "\n")
  assert follower.new_lines() == ["t=20.0s step 8: global eval/loss 2.5000 after 9 rounds"]
  assert follower.new_lines() == []


def test_table_says_off_for_a_run_without_evals(tmp_path):
  summary = dict(report.RunFigures(None, math.nan, 5, 1.0, 2, 1, 3, 2).as_summary(),
                 **{"accounting/goodput": 0.5})
  text = report.table(summary, str(tmp_path), eval_step=5)
  assert "eval loss       off at step 5 (initial off)" in text
  assert "2 (1 of them the syncer's); faults 2 of 3 applied" in text
  assert "tensorboard     off" in text and "export          none" in text


def test_table_has_a_row_per_sharded_syncer_and_none_for_one(tmp_path):
  base = dict(report.RunFigures(2.0, 3.0, 5, 1.0, 0, 0, 0, 0).as_summary(),
              **{"accounting/rounds": 5.0})
  assert "syncer shards" not in report.table(base, str(tmp_path), eval_step=5)
  sharded = dict(base, **{"accounting/shards": 2.0, "accounting/shard0/rounds": 3.0,
                          "accounting/shard0/mean_learners_per_round": 1.5,
                          "accounting/shard1/rounds": 2.0,
                          "accounting/shard1/mean_learners_per_round": 2.0})
  text = report.table(sharded, str(tmp_path), eval_step=5)
  assert ("syncer shards   s0 3 rounds 1.50 learners/round, s1 2 rounds 2.00 learners/round"
          in text)
