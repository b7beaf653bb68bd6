"""A researcher's hooks (`diloco.Hook`, `diloco.observe.hooks`): when they run, what they see,
that a slow one never holds a learner back, and what a failing or stopping one does."""

import dataclasses
import json
import os
import threading
import time

import numpy as np
import pytest

import diloco
from diloco.artifacts import export
from diloco.observe import hooks


def _config(kind: str, steps: int, **extra):
  overrides = {"train.steps": steps, "train.eval_every": 0, "checkpoint.every_steps": 0}
  if kind == "decoupled":
    overrides.update({"learners.count": 2, "checkpoint.every_rounds": 0, "sync.period": 4,
                      "sync.num_fragments": 2})
  overrides.update(extra)
  return diloco.load_config(f"configs/{kind}.py:tiny", overrides)


def test_a_busy_hook_skips_calls_and_a_failing_one_is_one_line(capsys):
  release = threading.Event()
  seen = []
  runner = hooks.HookRunner([
      diloco.Hook(lambda v: (seen.append(v.step), release.wait(30)), every=1, name="slow"),
      diloco.Hook(lambda v: 1 / 0, every=2, name="bad"),
      diloco.Hook(lambda v: diloco.STOP if v.step >= 4 else None, every=4, name="stopper")])
  for step in range(1, 9):
    runner.offer(runner.due("learner", step), step,
                 lambda p, s=step: hooks.HookView("learner", s, 0, {}, None), source=0)
    while not seen:  # the first call has started (and blocks) before the next comes
      time.sleep(0.01)
  # Another learner's call at the same time is not the first one's: it waits its turn.
  runner.offer(runner.due("learner", 4), 4,
               lambda p: hooks.HookView("learner", 4, 1, {}, None), source=1)
  time.sleep(0.5)
  release.set()
  counts = runner.close()
  assert counts["slow"]["calls"] + counts["slow"]["skipped"] == 9
  # Learner 0: its first call ran and blocked, its second waited, the other six were skipped.
  assert counts["slow"]["skipped"] == 6 and counts["slow"]["calls"] == 3 and seen[0] == 1
  assert counts["bad"]["errors"] == counts["bad"]["calls"] >= 1
  assert runner.stop.is_set() and "stopper asked to stop" in runner.reason
  err = capsys.readouterr().err
  assert "hook bad at step 2: ZeroDivisionError: division by zero\n" in err


@pytest.mark.parametrize("kwargs, message", [
    ({"every": 0}, "every must be an integer >= 1"), ({"on": "eval"}, "on must be one of"),
    ({"on_error": "ignore"}, "on_error must be one of"), ({"every": 1.5}, "every must be")])
def test_a_bad_hook_is_refused_naming_it(kwargs, message):
  with pytest.raises(diloco.ConfigError, match=f"hook f: {message}"):
    diloco.Hook(**{"fn": lambda v: None, "every": 2, "name": "f", **kwargs})


_HOOKS_FILE = """
import diloco
HOOKS = [diloco.Hook(lambda view: None, every=2, name="each"),
         diloco.Hook(lambda view: None, every=3, on="syncer", name="rounds")]
"""


@pytest.mark.parametrize("text, message", [
    (None, "log.hooks: file '{spec}' does not exist"),
    ("import no_such_module_here\n", "log.hooks: cannot import '{spec}': ModuleNotFoundError"),
    ("x = 1\n", "log.hooks: '{spec}' must define HOOKS, a list of diloco.Hook, got NoneType"),
    ("HOOKS = [print]\n", "log.hooks: '{spec}' must define HOOKS, a list of diloco.Hook, got list"),
    ("import diloco\nHOOKS = [diloco.Hook(print, every=0)]\n", "hook print: every must be")])
def test_a_hooks_file_that_cannot_be_used_is_one_line_naming_the_field(tmp_path, text, message):
  path = tmp_path / "my_hooks.py"
  if text is not None:
    path.write_text(text)
  with pytest.raises(diloco.ConfigError) as e:
    hooks.load(str(path))
  assert str(e.value).startswith(message.format(spec=path)) and "\n" not in str(e.value)


def test_a_hooks_file_gives_each_process_the_hooks_of_its_kind(tmp_path):
  path = tmp_path / "my_hooks.py"
  path.write_text(_HOOKS_FILE)
  assert [h.name for h in hooks.load(str(path))] == ["each", "rounds"]
  assert hooks.load("") == []
  mine = diloco.Hook(print, every=1, name="mine")
  learner = hooks.for_process(str(path), [mine], on=("learner",))
  assert [w.hook.name for w in learner.due("learner", 6)] == ["mine", "each"]
  assert learner.due("syncer", 6) == []
  syncer = hooks.for_process(str(path), on=("syncer",))
  assert [w.hook.name for w in syncer.due("syncer", 6)] == ["rounds"]
  for runner in (learner, syncer):
    runner.close()


def test_a_data_parallel_run_refuses_a_syncer_hook_of_its_hooks_file(tmp_path):
  path = tmp_path / "my_hooks.py"
  path.write_text(_HOOKS_FILE)
  with pytest.raises(diloco.ConfigError, match="a data-parallel run has no syncer rounds"):
    diloco.run(_config("dp", 4, **{"log.hooks": str(path)}), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.mark.slow
def test_data_parallel_hooks_see_their_steps_params_and_can_stop_the_run(tmp_path, capsys):
  seen = []

  def watch(view):
    seen.append((view.step, dict(view.metrics), view.params))
    with pytest.raises(ValueError):  # read-only
      next(iter(view.params.values()))[...] = 0
    return diloco.STOP if view.step == 6 else None

  workdir = str(tmp_path / "run")
  diloco.run(_config("dp", 16), workdir, hooks=[diloco.Hook(watch, every=3, params=True)])
  steps = [s for s, _, _ in seen]
  assert steps[:2] == [3, 6] and all(s % 3 == 0 for s in steps)
  assert "train/loss" in seen[0][1] and np.isfinite(seen[0][1]["train/loss"])
  # The parameters of step 3 are not those of step 6 (a copy per call, not a shared buffer).
  a, b = seen[0][2], seen[1][2]
  assert a.keys() == b.keys() and any(not np.array_equal(a[k], b[k]) for k in a)
  _, meta = export.load(workdir)
  assert 6 <= meta["step"] < 16  # stopped early, as at a last step: exported
  out = capsys.readouterr()
  assert "stopping the run: hook watch asked to stop at step 6" in out.err
  assert "hook watch: " in out.out and " calls, " in out.out


@pytest.mark.slow
def test_a_failing_hook_is_reported_and_the_run_goes_on_or_stops_as_asked(tmp_path, capsys):
  def broken(view):
    raise RuntimeError(f"no metric at {view.step}")

  diloco.run(_config("dp", 8), str(tmp_path / "on"), hooks=[diloco.Hook(broken, every=4)])
  err = capsys.readouterr().err
  assert "hook broken at step 4: RuntimeError: no metric at 4" in err
  assert export.load(str(tmp_path / "on"))[1]["step"] == 8
  diloco.run(_config("dp", 16), str(tmp_path / "off"),
             hooks=[diloco.Hook(broken, every=2, on_error="stop")])
  assert export.load(str(tmp_path / "off"))[1]["step"] < 16
  assert "stopping the run: hook broken failed at step 2" in capsys.readouterr().err


@pytest.mark.slow
def test_a_slow_hook_never_holds_a_learner_back(tmp_path):
  """Threaded Decoupled run, two learners: `slow`'s first call blocks until `watch` sees a
  learner's last step. Were a learner waiting for `slow`, that step would never come (the
  wait times out and the test fails); instead every learner finishes while `slow` is busy,
  and its calls in between are skipped."""
  cfg = _config("decoupled", 16)
  last_step = threading.Event()
  released = []

  def slow(view):
    if not released:
      released.append(last_step.wait(300))

  def watch(view):
    if view.step == cfg.train.steps:
      last_step.set()

  seen_rounds = []

  def rounds(view):
    seen_rounds.append((view.step, view.metrics["fragment"], sorted(view.params)))

  # `log.hooks` too: a file's hook, imported by the run, beside the ones handed over here.
  (tmp_path / "file_hooks.py").write_text(
      "import json, os\nimport diloco\n"
      "def note(view):\n"
      "  with open(os.path.join(os.path.dirname(__file__), 'calls.jsonl'), 'a') as f:\n"
      "    f.write(json.dumps([view.learner, view.step]) + '\\n')\n"
      "HOOKS = [diloco.Hook(note, every=4)]\n")
  cfg = dataclasses.replace(cfg, log=dataclasses.replace(
      cfg.log, hooks=str(tmp_path / "file_hooks.py")))
  metrics = diloco.run(cfg, str(tmp_path / "run"), hooks=[
      diloco.Hook(slow, every=1), diloco.Hook(watch, every=1),
      diloco.Hook(rounds, every=2, on="syncer", params=True)])
  assert released == [True]  # released by the last step, not by the wait's timeout
  assert np.isfinite(metrics["eval/loss"])
  assert seen_rounds and all(r % 2 == 0 for r, _, _ in seen_rounds)
  with open(os.path.join(tmp_path, "run", "tape.jsonl")) as f:
    fragments = {json.loads(line)["round"] + 1: json.loads(line)["fragment"] for line in f}
  for r, fragment, paths in seen_rounds:
    assert fragments[r] == fragment and "embedder/embedding" in paths
  calls = [tuple(json.loads(line)) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
  # Every learner's calls at its steps 4, 8, ... (a call is skipped only while its learner's
  # previous one has not started: on a loaded host, possibly one).
  assert len(set(calls)) == len(calls) and {m for m, _ in calls} == {0, 1}
  assert set(calls) <= {(m, s) for m in (0, 1) for s in (4, 8, 12, 16)}
