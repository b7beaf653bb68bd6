"""`diloco compare`: one clock for every run (compilation in or out for all), a warning when
token counts differ, and the command from outside the checkout."""

import json
import os
import subprocess
import sys

import pytest
from matplotlib import image

from diloco.cli import compare
from diloco.observe import curves

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(path, *, batch_size=8, count=0, evals, train_t=None):
  """A finished run's files: evaluations `(step, t, loss)` and, if given, training-step records
  at the times `train_t` (a run whose metrics hold no training step has none)."""
  os.makedirs(path)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({"train": {"batch_size": batch_size, "eval_batches": 4},
               "data": {"seq_len": 4}, "learners": {"count": count}}, f)
  records = [{"t": evals[0][1], "role": "dp", "step": 0, "eval/loss": evals[0][2]}]
  records += [{"t": t, "role": "dp", "step": i + 1, "train/loss": 3.0}
              for i, t in enumerate(train_t or ())]
  records += [{"t": t, "role": "dp", "step": s, "eval/loss": loss} for s, t, loss in evals[1:]]
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in sorted(records, key=lambda r: r["t"])))
  return str(path)


def test_runs_share_the_clock_that_leaves_compilation_out(tmp_path):
  # Run a spent 30 s compiling its first step (it ended at t=131), run b 1 s.
  a = _run(tmp_path / "a", evals=[(0, 100.0, 5.0), (10, 141.0, 2.0)], train_t=[131.0, 132.0])
  b = _run(tmp_path / "b", evals=[(0, 200.0, 5.0), (10, 211.0, 2.1)], train_t=[201.0, 202.0])
  text = compare.compare([a, b], str(tmp_path / "out"))
  assert "| a | 2 | 5 | 320 | 10 | 32 |" in text  # 141 - 131 s on the training clock
  assert "| b | 2.1 | 5 | 320 | 10 | 32 |" in text
  assert "time_s: seconds since each run's first training step (compilation excluded)." in text
  saved = json.load(open(tmp_path / "out" / "compare.json"))
  assert saved["clock"] == "train_s" and [r["time_s"] for r in saved["rows"]] == [10.0, 10.0]
  assert os.path.getsize(tmp_path / "out" / "eval.png") > 10_000
  assert "Warning" not in text  # same tokens, same held-out windows


def test_one_run_without_training_records_puts_every_run_on_the_wall_clock(tmp_path):
  a = _run(tmp_path / "a", evals=[(0, 100.0, 5.0), (10, 141.0, 2.0)], train_t=[131.0])
  b = _run(tmp_path / "b", evals=[(0, 200.0, 5.0), (10, 211.0, 2.1)])
  text = compare.compare([a, b])
  assert "| a | 2 | 5 | 320 | 41 | 32 |" in text and "| b | 2.1 | 5 | 320 | 11 | 32 |" in text
  assert "time_s: wall seconds since each run's first record (compilation included" in text


@pytest.mark.parametrize("steps_b, warned", [(10, False), (11, True), (20, True), (5, True)])
def test_different_token_counts_are_flagged(tmp_path, steps_b, warned):
  a = _run(tmp_path / "a", evals=[(0, 100.0, 5.0), (10, 110.0, 2.0)])
  b = _run(tmp_path / "b", evals=[(0, 100.0, 5.0), (steps_b, 110.0, 2.0)])
  text = compare.compare([a, b])
  assert ("trained on different numbers of tokens" in text) == warned
  if warned:
    assert f"(a 320, b {steps_b * 32:,})" in text  # 8 x 4 tokens a step


def test_compare_command_works_outside_the_checkout(tmp_path):
  a = _run(tmp_path / "a", evals=[(0, 100.0, 5.0), (10, 110.0, 2.0)])
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  for command in (["-m", "diloco", "compare"], ["-m", "diloco.cli.compare"]):
    proc = subprocess.run([sys.executable, *command, a, a, f"--report_dir={tmp_path}/r"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("| a | 2 | 5 | 320 |") == 2
    assert (tmp_path / "r" / "compare.md").exists()
  missing = subprocess.run([sys.executable, "-m", "diloco", "compare", str(tmp_path / "nope")],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
  assert missing.returncode != 0
  assert missing.stderr.strip().splitlines() == [
      f"diloco compare: error: {tmp_path / 'nope'}: no config.json; is it the workdir of a run?"]
  bad_flag = subprocess.run([sys.executable, "-m", "diloco.cli.compare", a, "--report_dri=x"],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
  assert bad_flag.returncode != 0 and len(bad_flag.stderr.strip().splitlines()) == 1
  assert "report_dri" in bad_flag.stderr


def test_a_report_dir_that_is_a_file_is_refused_in_one_line_and_kept(tmp_path):
  a = _run(tmp_path / "a", evals=[(0, 100.0, 5.0), (10, 110.0, 2.0)])
  target = tmp_path / "notes.txt"
  target.write_text("mine")
  with pytest.raises(SystemExit) as e:
    compare.main(["diloco compare", a, f"--report_dir={target}"])
  assert str(e.value.code) == (f"diloco compare: error: --report_dir: {str(target)!r} exists "
                               "and is not a folder")
  assert target.read_text() == "mine"


def test_dozens_of_curves_stay_apart_and_the_legend_fits(tmp_path):
  styles = [tuple(sorted(curves.line_style(i).items())) for i in range(40)]
  assert len(set(styles)) == 40  # an experiment's runs: colour and dash together tell them apart
  many = {f"run {i}": [{"tokens": 0, "time": 0.0, "eval_loss": 5.0},
                       {"tokens": 10, "time": 1.0, "eval_loss": 5.0 - i / 40}] for i in range(36)}
  few = dict(list(many.items())[:2])
  for name, drawn in (("many.png", many), ("few.png", few)):
    curves.plot_curves(drawn, str(tmp_path / name), "t", time_key="time")
  # The figure grows with its legend, which sits below both panels rather than over them.
  height = lambda name: image.imread(tmp_path / name).shape[0]  # noqa: E731
  assert height("many.png") > height("few.png") + 100
