"""The device bundle (scripts/device/) rehearsed on CPU, so that it cannot rot between loans."""

import json
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK_SH = os.path.join(ROOT, "scripts", "device", "check.sh")


def _import_check():
  sys.path.insert(0, os.path.join(ROOT, "scripts", "device"))
  try:
    import check  # noqa: PLC0415
  finally:
    sys.path.pop(0)
  return check


def _bundle(out, *args):
  env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
  return subprocess.run(["bash", CHECK_SH, *args], env=env, capture_output=True, text=True,
                        timeout=600, cwd=ROOT)


@pytest.mark.slow
def test_tiny_plan_writes_the_results_table_logs_and_traces(tmp_path):
  proc = _bundle(tmp_path, "--plan=tiny", "--budget_s=900")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  lines = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
  env = next(r for r in lines if r.get("bench") == "env")
  import jax  # noqa: PLC0415
  assert env["jax"] == jax.__version__ and env["backend"] == "cpu"
  steps = [r for r in lines if r.get("bench") == "train_step" and "variant" in r]
  check = _import_check()
  # The GPU plan's own variants ran: the rehearsal catches a switch the GPU run would refuse.
  assert len([r for r in steps if r["item"] == "m35_sweep"]) == len(check.M35_VARIANTS)
  assert len([r for r in steps if r["item"] == "gemma_2b_sweep"]) == len(check.GEMMA_VARIANTS)
  assert all(r["step_s"] > 0 and r["host_ops"] == [] and "error" not in r for r in steps)
  assert all(r["program"]["host_transfer_count"] == 0 for r in steps)
  overhead = next(r for r in lines if r.get("bench") == "learner_overhead")
  assert overhead["ratio"] > 0
  statuses = {r["item"]: r["status"] for r in lines if "status" in r}
  assert statuses == {name: "ok" for name in ("env", "m35_sweep", "gemma_2b_sweep",
                                              "learner_overhead", "profile_gemma_2b")}
  table = (tmp_path / "results.md").read_text()
  assert "| gemma_2b_sweep | ok |" in table and "| profile_gemma_2b | ok |" in table
  # What the device tool brings back: at most eight plain files, none in a folder.
  files = sorted(os.listdir(tmp_path))
  assert files == ["logs.tar.gz", "results.jsonl", "results.md", "traces.tar.gz"]
  with tarfile.open(tmp_path / "logs.tar.gz") as tar:
    assert {"logs/env.log", "logs/gemma_2b_sweep.log"} <= set(tar.getnames())
  with tarfile.open(tmp_path / "traces.tar.gz") as tar:
    names = tar.getnames()
  assert any(name.endswith(".xplane.pb") for name in names)
  assert f"traces/hlo/v{len(check.GEMMA_VARIANTS) - 1}.hlo.txt.gz" in names


def test_items_that_no_longer_fit_the_budget_are_skipped_and_said_so(tmp_path):
  proc = _bundle(tmp_path, "--plan=tiny", "--budget_s=20", "--only=m35_sweep,profile_gemma_2b")
  assert proc.returncode == 1  # nothing measured is not a success
  lines = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
  assert [r["status"] for r in lines] == ["skipped", "skipped"]
  assert "needs about 60" in lines[0]["reason"]


def test_unknown_items_and_plans_are_one_line_errors(tmp_path):
  proc = _bundle(tmp_path, "--plan=tiny", "--only=nope")
  assert proc.returncode != 0 and "--only names unknown items ['nope']" in proc.stderr
  proc = _bundle(tmp_path, "--plan=tpu9")
  assert proc.returncode != 0 and "unknown --plan 'tpu9'" in proc.stderr


def test_an_item_that_hangs_after_its_last_line_is_killed_and_keeps_its_line(tmp_path,
                                                                            monkeypatch):
  check = _import_check()
  monkeypatch.setattr(check, "_EXIT_GRACE_S", 1.0)
  line = json.dumps({"bench": "train_step", "step_s": 0.5})
  hangs = check.Item("hangs", (sys.executable, "-c",
                               f"import time; print({line!r}, flush=True); time.sleep(600)"),
                     1, 60)
  status, _, records = check._run(hangs, 60, str(tmp_path / "hangs.log"))
  assert status == "ok" and records == [{"bench": "train_step", "step_s": 0.5}]
  slow = check.Item("slow", (sys.executable, "-c", "import time; time.sleep(600)"), 1, 60)
  status, _, records = check._run(slow, 1.5, str(tmp_path / "slow.log"))
  assert status == "timeout" and records == []
  assert "killed (timeout)" in (tmp_path / "slow.log").read_text()


def test_the_import_shim_stands_in_only_for_missing_hijax_names():
  shim = os.path.join(ROOT, "scripts", "device", "shim")
  code = ("import jax.experimental.hijax as h\n"
          "real = [n for n in dir(h) if not n.startswith('_')]\n"
          "from jax.experimental.hijax import NotInThisJax\n"
          "class Sub(NotInThisJax): pass\n"
          "Sub(1, key=2)\n"
          "assert all(getattr(h, n).__module__ != 'sitecustomize' for n in real)\n"
          "print(NotInThisJax.__module__)")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": shim}, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == "sitecustomize"
