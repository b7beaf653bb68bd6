"""The experiment harness end to end at a tiny size: real runs, regenerated results and plots."""

import dataclasses
import importlib
import json
import os
import pathlib
import shutil
import sys

import pytest
from absl import flags

from diloco.outer.merge import STALE_RULES
from experiments import compare, harness, summary
from experiments.stale import config as stale_config


def test_stale_experiment_covers_every_rule_and_setting():
  runs = stale_config.runs("tiny", seeds=(0, 1))
  assert len(runs) == 12 and len({r.name for r in runs}) == 12
  rules = {dict(r.overrides)["outer.stale"] for r in runs}
  gammas = {dict(r.overrides)["sync.gamma"] for r in runs}
  assert rules == set(STALE_RULES) and gammas == {0.0, 0.8}
  assert all(r.config == "configs/decoupled.py:tiny" for r in runs)


def test_table_and_summary():
  rows = [{"method": "a", "seed": 0, "eval_loss": 2.0}, {"method": "a", "seed": 1,
                                                          "eval_loss": 2.5},
          {"method": "b", "seed": 0, "eval_loss": 3.0}]
  (a, b) = harness.summarise(rows)
  assert a == {"method": "a", "eval_loss_mean": 2.25, "eval_loss_spread": 0.5, "seeds": 2}
  assert b["eval_loss_spread"] == 0.0
  text = harness.table(rows, ("method", "eval_loss"))
  assert text.splitlines()[0] == "| method | eval_loss |" and "| a | 2.5 |" in text


RUNNERS = sorted(p.parent.name for p in pathlib.Path(harness.REPO, "experiments").glob("*/run.py"))


def test_the_runners_are_found():
  assert {"ablations", "parity", "sweep", "stale", "chaos"} <= set(RUNNERS)


@pytest.mark.parametrize("name", RUNNERS)
def test_every_runner_takes_the_common_flags_from_the_harness(name):
  """Importing a runner defines no flag; its define_flags() gives harness.define_flags' flags
  with the experiment's own defaults."""
  common = {"outdir", "results_dir", "report_only"}
  assert not common & set(flags.FLAGS)
  module = importlib.import_module(f"experiments.{name}.run")
  assert not common & set(flags.FLAGS), f"experiments/{name}/run.py defines flags at import"
  before = set(flags.FLAGS)
  try:
    module.define_flags()
    added = set(flags.FLAGS) - before
    assert common <= added
    assert flags.FLAGS["outdir"].default == f"runs/experiments/{name}"
    assert flags.FLAGS["results_dir"].default == os.path.join(harness.REPO, "experiments", name)
  finally:  # also after a failed define_flags: the next runner starts from a clean FLAGS
    for flag in set(flags.FLAGS) - before:
      delattr(flags.FLAGS, flag)


def test_experiments_have_one_runner_of_processes():
  """Runs are started only by harness.run_all: no experiment has a thread pool of its own."""
  for path in pathlib.Path(harness.REPO, "experiments").rglob("*.py"):
    if path.name != "harness.py":
      text = path.read_text()
      assert "threading" not in text and "concurrent.futures" not in text, path


@dataclasses.dataclass(frozen=True)
class _ScriptRun(harness.Run):
  """A run whose process is a short Python script instead of a training run."""
  script: str = ""

  def command(self, workdir: str) -> list[str]:
    return [sys.executable, "-c", self.script, workdir]


# Each run records when its process slept, so the test reads the overlap from the runs
# themselves rather than from a wall-clock bound a loaded machine could miss.
_FINISH = ("import json, os, sys, time; start = time.time(); time.sleep(1.0); "
           "json.dump({'start': start, 'end': time.time()}, "
           "open(os.path.join(sys.argv[1], 'final.json'), 'w'))")


def test_run_all_runs_jobs_at_a_time_and_reuses_finished_runs(tmp_path):
  runs = [_ScriptRun(f"r{i}", "unused", script=_FINISH) for i in range(2)]
  wall = harness.run_all(runs, str(tmp_path), jobs=2)
  assert wall >= 1.0
  slept = [json.load(open(tmp_path / run.name / "final.json")) for run in runs]
  assert max(s["start"] for s in slept) < min(s["end"] for s in slept)  # both slept at once
  for run in runs:
    assert harness.finished(str(tmp_path / run.name))
    assert json.load(open(tmp_path / run.name / harness.HARNESS_FILE))["wall_s"] >= 1.0
  harness.run_all(runs, str(tmp_path), jobs=2)  # nothing left to run: neither runs again
  assert [json.load(open(tmp_path / run.name / "final.json")) for run in runs] == slept


def test_run_all_names_the_failed_run_and_starts_no_later_one(tmp_path):
  runs = [_ScriptRun("bad", "unused", script="import sys; sys.exit(3)"),
          _ScriptRun("slow", "unused", script=_FINISH),
          _ScriptRun("late", "unused", script=_FINISH)]
  with pytest.raises(RuntimeError, match=r"run bad__s0 failed with exit code 3; see .*run.log"):
    harness.run_all(runs, str(tmp_path), jobs=2)
  assert harness.finished(str(tmp_path / "slow__s0"))  # already running: it is let finish
  assert not (tmp_path / "late__s0").exists()


@pytest.mark.slow
def test_runs_are_collected_into_results_table_and_plot(tmp_path):
  overrides = (("learners.virtual_clock", True), ("train.steps", 16),
               ("train.eval_every", 8), ("learners.count", 2))
  runs = [harness.Run("two learners", "configs/decoupled.py:tiny", 0, overrides)]
  outdir, folder = str(tmp_path / "runs"), str(tmp_path / "results")
  os.makedirs(folder)
  with open(os.path.join(folder, "analysis.md"), "w") as f:
    f.write("## What it means\n\nAuthored text.")
  wall = harness.run_all(runs, outdir)
  assert wall > 0 and harness.finished(os.path.join(outdir, runs[0].name))
  assert harness.run_all(runs, outdir) < wall  # finished runs are reused, not rerun
  results = harness.report("smoke", runs, outdir, folder, columns=("method", "eval_loss"),
                           command="python -m experiments.smoke", wall_s=wall)
  on_disk = json.load(open(os.path.join(folder, "results.json")))
  assert on_disk == results and on_disk["experiment"] == "smoke"
  assert len(on_disk["commit"]) == 40 or on_disk["commit"] == "unknown"
  (row,) = on_disk["rows"]
  assert row["method"] == "two learners" and row["seed"] == 0
  assert row["tokens"] == 2 * 16 * 8 * 64  # learners x steps x batch x sequence
  assert row["eval_loss"] < row["initial_loss"]
  for key in ("goodput", "mean_learners_per_round", "bytes_up", "bytes_down"):
    assert row[key] > 0
  curve = harness.eval_curve(os.path.join(outdir, runs[0].name))
  assert [p["step"] for p in curve][0] == 0 and curve[-1]["eval_loss"] == pytest.approx(
      row["eval_loss"])
  readme = open(os.path.join(folder, "README.md")).read()
  assert "| two learners |" in readme and "Authored text." in readme and "eval.png" in readme
  assert os.path.getsize(os.path.join(folder, "eval.png")) > 10_000
  # experiments.compare reads the same run back, side by side (here with itself).
  workdir = os.path.join(outdir, runs[0].name)
  text = compare.compare([workdir, workdir], str(tmp_path / "compare"))
  assert text.count(f"| {runs[0].name} | {row['eval_loss']:.4g} |") == 2
  assert "goodput" in text.splitlines()[0]
  assert json.load(open(tmp_path / "compare" / "compare.json"))["rows"][0]["tokens"] == row[
      "tokens"]
  assert os.path.getsize(tmp_path / "compare" / "eval.png") > 10_000
  with pytest.raises(ValueError, match="no config.json"):
    compare.compare([str(tmp_path)])
  # A run whose folder is gone (run in an earlier session) is carried from results.json, not
  # rerun, and the README says from which commit.
  shutil.move(workdir, str(tmp_path / "elsewhere"))
  assert harness.carried_rows(runs, outdir, folder) == {
      ("two learners", 0): dict(row, carried_from=on_disk["commit"])}
  again = harness.report("smoke", runs, outdir, folder, columns=("method", "eval_loss"),
                         command="python -m experiments.smoke", wall_s=0.0, carry=True)
  assert again["rows"] == [dict(row, carried_from=on_disk["commit"])]
  readme = open(os.path.join(folder, "README.md")).read()
  assert "1 rows are carried from the results measured at commit" in readme
  assert "| two learners |" in readme and "Not run yet" not in readme
  assert harness.report("smoke", runs, outdir, folder, columns=("method", "eval_loss"),
                        command="x", wall_s=0.0)["rows"] == []  # without carry: not run


def _fake_run(path, batch_size, eval_batches, losses):
  os.makedirs(path)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({"train": {"batch_size": batch_size, "eval_batches": eval_batches},
               "data": {"seq_len": 4}, "learners": {"count": 0}}, f)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for step, loss in enumerate(losses):
      f.write(json.dumps({"t": 100.0 + step, "role": "dp", "step": step,
                          "eval/loss": loss}) + "\n")


def test_compare_flags_runs_scored_on_different_held_out_windows(tmp_path):
  _fake_run(tmp_path / "dp", 32, 4, [5.0, 2.0])
  _fake_run(tmp_path / "learners", 8, 16, [5.0, 2.1])
  _fake_run(tmp_path / "other", 8, 4, [5.0, 2.2])
  same = compare.compare([str(tmp_path / "dp"), str(tmp_path / "learners")])
  assert "held-out windows" not in same and "| dp | 2 | 5 | 128 | 1 | 128 |" in same
  mixed = compare.compare([str(tmp_path / "dp"), str(tmp_path / "other")])
  assert "different held-out windows ([32, 128])" in mixed


def test_summary_table_is_generated_from_results_files(tmp_path):
  rows = [{"method": "data-parallel", "seed": s, "eval_loss": v} for s, v in ((0, 2.0), (1, 2.2))]
  rows += [{"method": "decoupled outer 1.0/0.0", "seed": 0, "eval_loss": 2.31}]
  # Longer runs: reported apart, never "best" against the presets' length.
  rows += [{"method": "data-parallel 480 steps", "seed": 0, "steps": 480, "eval_loss": 1.5},
           {"method": "decoupled outer 1.0/0.0 480 steps", "seed": 0, "steps": 480,
            "eval_loss": 1.56}]
  os.makedirs(tmp_path / "parity")
  with open(tmp_path / "parity" / "results.json", "w") as f:
    json.dump({"experiment": "parity", "commit": "ab" * 20, "rows": rows}, f)
  readme = f"intro\n{summary.BEGIN}\nold\n{summary.END}\nrest\n"
  new = summary.update(readme, str(tmp_path))
  assert new.startswith("intro\n") and new.endswith("rest\n") and "old" not in new
  assert ("| [`parity`](experiments/parity/README.md) | eval loss: data-parallel 2.100; best "
          "Decoupled from scratch (decoupled outer 1.0/0.0) 2.310, ratio 1.100; at 480 steps: "
          "data-parallel 1.500, Decoupled 1.560, ratio 1.040 (target <= 1.02) "
          "| 5 | `abababab` |") in new
  with pytest.raises(ValueError, match="markers"):
    summary.update("no markers", str(tmp_path))


def test_short_table_keeps_the_first_clauses_of_each_headline(tmp_path):
  rows = [{"method": m, "seed": 0, "eval_loss": v}
          for m, v in (("a", 2.0), ("b", 2.1), ("c", 2.2), ("d", 2.3))]
  os.makedirs(tmp_path / "toy")
  with open(tmp_path / "toy" / "results.json", "w") as f:
    json.dump({"experiment": "toy", "commit": "cd" * 20, "rows": rows}, f)
  short = summary.short_table(str(tmp_path))
  assert "| [`toy`](experiments/toy/README.md) |  | a 2.000; b 2.100; c 2.200; ... |" in short
  assert "d 2.300" in summary.table(str(tmp_path)) and "d 2.300" not in short
  assert "](../experiments/toy/README.md)" in summary.table(str(tmp_path), link_prefix="../")


def test_readme_results_table_is_up_to_date():
  assert summary.main(["--check"]) == 0, "run: python -m experiments.summary"


def test_a_warm_start_counts_the_tokens_of_its_checkpoint(tmp_path):
  source = tmp_path / "dp_run"
  os.makedirs(source / "checkpoints" / "40")
  with open(source / "config.json", "w") as f:
    json.dump({"train": {"batch_size": 32}, "data": {"seq_len": 128},
               "learners": {"count": 0}}, f)
  warm = {"train": {"init_from": str(source / "checkpoints" / "40")}}
  assert harness.init_tokens(warm) == 40 * 32 * 128
  assert harness.init_tokens({"train": {"init_from": ""}}) == 0
  assert harness.init_tokens({"train": {"init_from": str(tmp_path / "export")}}) == 0


def test_trained_tokens_falls_back_to_logged_steps_then_to_the_config(tmp_path):
  # A run copied back without activity.jsonl still counts every learner's tokens.
  cfg = {"train": {"steps": 3, "batch_size": 2}, "data": {"seq_len": 5}, "learners": {"count": 2}}
  with open(tmp_path / "metrics.jsonl", "w") as f:
    for step in (1, 2, 3):
      for learner in (0, 1):
        f.write(json.dumps({"step": step, "learner": learner, "train/tokens": 10.0}) + "\n")
    f.write(json.dumps({"step": 3, "eval/loss": 1.0}) + "\n")
  assert harness.trained_tokens(str(tmp_path), cfg) == 60
  os.remove(tmp_path / "metrics.jsonl")
  assert harness.trained_tokens(str(tmp_path), cfg) == 3 * 2 * 5 * 2
  with open(tmp_path / "activity.jsonl", "w") as f:
    f.write(json.dumps({"kind": "step", "tokens": 7}) + "\n")
  assert harness.trained_tokens(str(tmp_path), cfg) == 7
