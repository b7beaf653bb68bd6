"""A learner over two hosts: real processes in one `jax.distributed` world, beside a one-host
learner and a syncer process, all on one store (every wait bounded)."""

import ast
import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

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
         f"--config.train.steps={STEPS}", "--config.learners.min_step_s=0",
         f"--workdir={workdir}", f"--store={workdir / 'store'}", *args]
  out = open(workdir / log, "w", encoding="utf-8")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT), out


def _result(workdir, log) -> dict:
  lines = [ln for ln in (workdir / log).read_text().splitlines() if ln.startswith("done: ")]
  assert lines, f"{log} has no result line:\n" + (workdir / log).read_text()[-3000:]
  return ast.literal_eval(lines[-1][len("done: "):])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("multihost")
  port = _free_port()
  procs = [_start(workdir, "syncer.log", 1, "--role=syncer")]
  for host in (0, 1):
    procs.append(_start(workdir, f"l0h{host}.log", 2, "--role=learner", "--learner_id=0",
                        "--jax_distributed", f"--coordinator_address=127.0.0.1:{port}",
                        "--num_processes=2", f"--process_id={host}"))
  procs.append(_start(workdir, "l1.log", 2, "--role=learner", "--learner_id=1"))
  try:
    for proc, _ in procs[1:]:
      proc.wait(timeout=_TIMEOUT_S)
    (workdir / "store" / "stop.json").write_text(json.dumps({"time": 0}))
    procs[0][0].wait(timeout=120)
  finally:
    for proc, out in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
      out.close()
  codes = {log: proc.returncode for (proc, _), log in
           zip(procs, ("syncer.log", "l0h0.log", "l0h1.log", "l1.log"))}
  return workdir, codes


def test_every_process_finishes(run):
  workdir, codes = run
  assert codes == dict.fromkeys(codes, 0), {
      log: (workdir / log).read_text()[-2000:] for log, code in codes.items() if code}


def test_the_hosts_took_the_same_decisions_and_only_host_0_wrote(run):
  workdir, _ = run
  leader, follower = _result(workdir, "l0h0.log"), _result(workdir, "l0h1.log")
  assert (leader["host"], follower["host"], leader["hosts"]) == (0, 1, 2)
  assert leader["incarnation"] == follower["incarnation"] == 0
  assert leader["local_step"] == follower["local_step"] == STEPS
  assert leader["agreements"] == follower["agreements"]  # same count, same digest
  assert leader["agreements"]["count"] > STEPS  # one per step, plus the join
  assert leader["bytes_up"] > 0 and follower["bytes_up"] == 0
  assert follower["bytes_down"] > 0  # each host downloads merged fragments itself
  assert json.loads((workdir / "store" / "incarnations" / "l0.json").read_text()) == {
      "incarnation": 0}  # one incarnation for the learner, not one per host


def test_the_two_host_learner_contributes_once_per_delivery(run):
  workdir, _ = run
  tape = [json.loads(ln) for ln in (workdir / "tape.jsonl").read_text().splitlines()]
  admitted = [(a["fragment"], a["local_step"]) for r in tape
              for a in [dict(x, fragment=r["fragment"]) for x in r["admitted"]]
              if a["learner"] == 0]
  assert len(admitted) >= 8
  assert len(admitted) == len(set(admitted))
  steps = lambda path: sum(1 for ln in path.read_text().splitlines()  # noqa: E731
                           if json.loads(ln)["kind"] == "step")
  assert steps(workdir / "activity" / "l0.jsonl") == STEPS  # host 0's records only
  assert steps(workdir / "hosts" / "h1" / "activity" / "l0.jsonl") == STEPS


def test_the_global_model_learns(run):
  workdir, _ = run
  evals = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines()]
  losses = [r["eval/loss"] for r in evals if r.get("role") == "syncer" and "eval/loss" in r]
  assert len(losses) >= 2 and losses[-1] < losses[0] - 1.0
