"""A learner over two hosts: real processes in one `jax.distributed` world, beside a one-host
learner and a syncer process, all on one store (every wait bounded). Midway, host 0 alone gets
a SIGTERM with `store.on_sigterm=restart` (a preempted pod): both hosts checkpoint and exit 143
at the same step, and the learner started again on both hosts resumes from there. Last, the
local launcher runs a two-process learner and restarts it whole when the chaos kills one."""

import ast
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

# These tests join a learner's two hosts by gloo: the README's test command runs them last and
# alone, so that another worker's load never pushes a restarted host past gloo's 30 s
# initialisation deadline.
pytestmark = [pytest.mark.slow, pytest.mark.processes, pytest.mark.gloo]

STEPS = 60
_TIMEOUT_S = 420


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(workdir, log, devices, *args):
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", "diloco.main", "--config=configs/multiprocess.py:tiny",
         "--config.learners.count=2", "--config.launch.chaos_faults=0",
         f"--config.train.steps={STEPS}", "--config.learners.min_step_s=0.1",
         "--config.store.on_sigterm=restart",
         f"--workdir={workdir}", f"--store={workdir / 'store'}", *args]
  out = open(workdir / log, "w", encoding="utf-8")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT), out


def _result(workdir, log) -> dict:
  lines = [ln for ln in (workdir / log).read_text().splitlines() if ln.startswith("done: ")]
  assert lines, f"{log} has no result line:\n" + (workdir / log).read_text()[-3000:]
  return ast.literal_eval(lines[-1][len("done: "):])


def _steps(path) -> dict[int, int]:
  """Step spans per incarnation in an activity file."""
  out: dict[int, int] = {}
  for line in path.read_text().splitlines() if path.exists() else []:
    record = json.loads(line)
    if record["kind"] == "step":
      out[record["incarnation"]] = out.get(record["incarnation"], 0) + 1
  return out


def _start_hosts(workdir, suffix):
  port = _free_port()
  return [_start(workdir, f"l0h{host}{suffix}.log", 2, "--role=learner", "--learner_id=0",
                 "--jax_distributed", f"--coordinator_address=127.0.0.1:{port}",
                 "--num_processes=2", f"--process_id={host}") for host in (0, 1)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("multihost")
  procs = {"syncer.log": _start(workdir, "syncer.log", 1, "--role=syncer")}
  procs.update(zip(("l0h0.log", "l0h1.log"), _start_hosts(workdir, "")))
  procs["l1.log"] = _start(workdir, "l1.log", 2, "--role=learner", "--learner_id=1")
  try:
    deadline = time.monotonic() + _TIMEOUT_S
    while _steps(workdir / "activity" / "l0.jsonl").get(0, 0) < 16:
      assert time.monotonic() < deadline, "learner 0 did not reach step 16"
      assert procs["l0h0.log"][0].poll() is None, (workdir / "l0h0.log").read_text()[-3000:]
      time.sleep(0.05)
    procs["l0h0.log"][0].send_signal(signal.SIGTERM)  # host 0 only
    for log in ("l0h0.log", "l0h1.log"):
      procs[log][0].wait(timeout=120)
    procs.update(zip(("l0h0b.log", "l0h1b.log"), _start_hosts(workdir, "b")))
    for log in ("l0h0b.log", "l0h1b.log", "l1.log"):
      procs[log][0].wait(timeout=_TIMEOUT_S)
    (workdir / "store" / "stop.json").write_text(json.dumps({"time": 0}))
    procs["syncer.log"][0].wait(timeout=120)
  finally:
    for proc, out in procs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait()
      out.close()
  return workdir, {log: proc.returncode for log, (proc, _) in procs.items()}


def test_every_process_finishes(run):
  workdir, codes = run
  want = dict.fromkeys(codes, 0) | {"l0h0.log": 143, "l0h1.log": 143}  # the preempted pair
  assert codes == want, {log: (workdir / log).read_text()[-2000:]
                         for log, code in codes.items() if code != want[log]}


def test_a_sigterm_to_host_0_stops_both_hosts_at_one_checkpointed_step(run):
  workdir, _ = run
  stopped = [re.findall(r"learner 0 incarnation 0: preempted at local step (\d+)",
                        (workdir / log).read_text()) for log in ("l0h0.log", "l0h1.log")]
  assert stopped[0] and stopped[0] == stopped[1]
  step = int(stopped[0][0])
  assert 16 <= step < STEPS
  for log in ("l0h0b.log", "l0h1b.log"):  # only its checkpoint can give it that step back
    assert f"learner 0 incarnation 1: joined at local step {step} " in (workdir / log).read_text()
  for path in (workdir / "activity" / "l0.jsonl",
               workdir / "hosts" / "h1" / "activity" / "l0.jsonl"):
    assert _steps(path) == {0: step, 1: STEPS - step}  # nothing lost, nothing done twice


def test_the_hosts_took_the_same_decisions_and_only_host_0_wrote(run):
  workdir, _ = run
  leader, follower = _result(workdir, "l0h0b.log"), _result(workdir, "l0h1b.log")
  assert (leader["host"], follower["host"], leader["hosts"]) == (0, 1, 2)
  assert leader["incarnation"] == follower["incarnation"] == 1
  assert leader["local_step"] == follower["local_step"] == STEPS
  assert leader["agreements"] == follower["agreements"]  # same count, same digest
  assert leader["agreements"]["count"] > 1
  assert leader["bytes_up"] > 0 and follower["bytes_up"] == 0
  assert follower["bytes_down"] > 0  # each host downloads merged fragments itself
  assert json.loads((workdir / "store" / "incarnations" / "l0.json").read_text()) == {
      "incarnation": 1}  # one incarnation per start of the learner, not one per host


def test_the_two_host_learner_contributes_once_per_delivery(run):
  workdir, _ = run
  tape = [json.loads(ln) for ln in (workdir / "tape.jsonl").read_text().splitlines()]
  admitted = [(r["fragment"], a["incarnation"], a["local_step"]) for r in tape
              for a in r["admitted"] if a["learner"] == 0]
  assert len(admitted) == len(set(admitted))
  assert {i for _, i, _ in admitted} == {0, 1}  # before and after the restart


def test_the_global_model_learns(run):
  workdir, _ = run
  evals = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines()]
  losses = [r["eval/loss"] for r in evals if r.get("role") == "syncer" and "eval/loss" in r]
  assert len(losses) >= 2 and losses[-1] < losses[0] - 1.0


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
  """`--role=launch` with one learner of two processes, one of which the chaos kills."""
  workdir = tmp_path_factory.mktemp("launch_hosts")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cmd = [sys.executable, "-m", "diloco.main", "--config=configs/multiprocess.py:tiny",
         "--role=launch", f"--workdir={workdir}", "--config.learners.count=1",
         "--config.launch.hosts_per_learner=2", "--config.launch.devices_per_learner=2",
         "--config.launch.chaos=kill:0@3", "--config.launch.chaos_faults=0",
         f"--config.train.steps={STEPS}", "--config.learners.min_step_s=0.1",
         "--config.launch.timeout_s=400"]
  out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=_TIMEOUT_S,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  return workdir, out


def test_the_launcher_restarts_a_two_host_learner_whole_when_one_host_dies(launched):
  workdir, out = launched
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  chaos = json.loads((workdir / "chaos.json").read_text())
  assert [(c["event"], c["applied"], c["target"]) for c in chaos] == [("kill:0@3", True,
                                                                       "learner0")]
  starts = [[float(t) for t in re.findall(r"==== start at t=([0-9.]+)s",
                                         (workdir / "logs" / name).read_text())]
            for name in ("learner0.log", "learner0_h1.log")]
  assert len(starts[0]) == len(starts[1]) == 2  # both hosts started again, together
  for name in ("learner0.log", "learner0_h1.log"):  # the launcher stopped the survivor: it was
    log = (workdir / "logs" / name).read_text()   # not left to JAX's heartbeat timeout
    assert "heartbeat timeout" not in log and "stopped sending heartbeats" not in log
  assert json.loads((workdir / "store" / "incarnations" / "l0.json").read_text()) == {
      "incarnation": 1}
  spans = [json.loads(ln) for ln in (workdir / "activity" / "l0.jsonl").read_text().splitlines()]
  last = max(s["local_step"] for s in spans if s["kind"] == "step" and s["incarnation"] == 1)
  assert last == STEPS
  down = [json.loads(ln) for ln in
          (workdir / "activity" / "launcher.jsonl").read_text().splitlines()]
  assert [(d["kind"], d["devices"]) for d in down] == [("down", 2)]  # both processes' devices
  tape = [json.loads(ln) for ln in (workdir / "tape.jsonl").read_text().splitlines()]
  assert {a["incarnation"] for r in tape for a in r["admitted"]} == {0, 1}
  for name in ("learner0.log", "learner0_h1.log"):
    assert "gave up waiting" not in (workdir / "logs" / name).read_text()
  summary = json.loads((workdir / "accounting.json").read_text())
  assert summary["eval/loss"] < summary["eval/initial_loss"] - 1.0
