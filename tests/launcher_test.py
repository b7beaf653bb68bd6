"""The local launcher on accelerators and under signals.

Device placement is checked on the environment each child would get, with a fake
`nvidia-smi` on PATH standing in for an 8-GPU host (no GPU here). Signals are checked with
real processes: real SIGTERMs, real process groups, pids looked up in /proc.
"""

import dataclasses
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from configs import multiprocess
from diloco.config import run_config
from diloco.deploy import accelerators
from diloco.distributed.launcher import Launcher
from diloco.distributed.supervision import Proc
from diloco.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMULATED = "--xla_force_host_platform_device_count"


def _fake_gpus(directory, count: int) -> str:
  """A `nvidia-smi` that lists `count` H100s, as the real one prints them; returns its dir."""
  lines = "\n".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d})" for i in range(count))
  path = os.path.join(directory, "nvidia-smi")
  with open(path, "w") as f:
    f.write(f"#!/bin/sh\ncat <<'EOF'\n{lines}\nEOF\n")
  os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
  return str(directory)


def _fake_cuda_plugin(directory, monkeypatch) -> None:
  """An importable `jax_cuda12_plugin` package (the launcher only looks for it, never loads it)."""
  (directory / "jax_cuda12_plugin").mkdir(parents=True)
  (directory / "jax_cuda12_plugin" / "__init__.py").write_text("")
  monkeypatch.syspath_prepend(str(directory))


@pytest.fixture
def gpu_host(tmp_path, monkeypatch):
  """An 8-GPU host with JAX's CUDA plugin, as the launcher sees it: nvidia-smi lists 8 GPUs,
  no JAX_PLATFORMS forced."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  _fake_cuda_plugin(tmp_path / "site", monkeypatch)
  monkeypatch.setenv("PATH", _fake_gpus(bin_dir, 8) + os.pathsep + os.environ["PATH"])
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  return tmp_path


def _config(count: int, **launch) -> run_config.Config:
  raw = multiprocess.get_config("tiny")
  raw.learners.count = count
  raw.launch.max_learners = 0
  for key, value in launch.items():
    if key == "learners_devices":
      raw.learners.devices = value
    elif key == "eval_mode":
      raw.train.eval_mode = value
    else:
      setattr(raw.launch, key, value)
  return run_config.from_config_dict(raw)


def _envs(cfg, workdir) -> dict:
  """The environment of every process (learner m, host h) the launcher would start."""
  launcher = Launcher(cfg, str(workdir / "run"), config_json="unused.json")
  try:
    return {(m, h): launcher.env(proc, h) for m, proc in launcher.procs.items()
            for h in range(proc.hosts)}
  finally:
    launcher.shutdown()


def test_eight_gpus_four_learners_two_each_and_syncer_on_cpu(gpu_host):
  envs = _envs(_config(4, devices_per_learner=2), gpu_host)
  for m in range(4):
    env = envs[(m, 0)]
    assert env["JAX_PLATFORMS"] == "cuda"
    assert env["CUDA_VISIBLE_DEVICES"] == f"{2 * m},{2 * m + 1}"
    assert EMULATED not in env.get("XLA_FLAGS", "")
  syncer = envs[(-1, 0)]
  assert syncer["JAX_PLATFORMS"] == "cpu" and syncer["CUDA_VISIBLE_DEVICES"] == ""
  assert f"{EMULATED}=1" in syncer["XLA_FLAGS"]


def test_three_learners_on_eight_gpus_leave_two_idle(gpu_host, caplog):
  envs = _envs(_config(3, devices_per_learner=2), gpu_host)
  assert [envs[(m, 0)]["CUDA_VISIBLE_DEVICES"] for m in range(3)] == ["0,1", "2,3", "4,5"]
  assert "2 cuda device(s) stay idle (6,7)" in caplog.text


def test_evaluator_process_takes_a_spare_gpu_or_the_cpu(gpu_host, caplog):
  envs = _envs(_config(3, devices_per_learner=2, eval_mode="process"), gpu_host)
  evaluator = envs[(-2, 0)]
  assert evaluator["JAX_PLATFORMS"] == "cuda" and evaluator["CUDA_VISIBLE_DEVICES"] == "6"
  envs = _envs(_config(4, devices_per_learner=2, eval_mode="process"), gpu_host)
  assert envs[(-2, 0)]["JAX_PLATFORMS"] == "cpu"  # every GPU is a learner's
  assert "no spare cuda device for the evaluator" in caplog.text


def test_uneven_groups_and_hosts_split_each_group(gpu_host):
  envs = _envs(_config(3, learners_devices="4,2,2"), gpu_host)
  assert [envs[(m, 0)]["CUDA_VISIBLE_DEVICES"] for m in range(3)] == ["0,1,2,3", "4,5", "6,7"]
  envs = _envs(_config(2, devices_per_learner=4, hosts_per_learner=2), gpu_host)
  assert [envs[(m, h)]["CUDA_VISIBLE_DEVICES"] for m in range(2) for h in range(2)] == [
      "0,1", "2,3", "4,5", "6,7"]


def test_too_few_gpus_name_the_field(gpu_host):
  with pytest.raises(ConfigError, match=r"^launch.devices_per_learner: 3 learner\(s\) need 9 "
                     r"cuda devices .* this host has 8"):
    _envs(_config(3, devices_per_learner=3), gpu_host)
  with pytest.raises(ConfigError, match=r"^learners.devices: .* need 10 cuda devices"):
    _envs(_config(3, learners_devices="4,4,2"), gpu_host)


def test_visible_devices_of_the_launcher_are_the_ones_split(gpu_host, monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
  envs = _envs(_config(2, devices_per_learner=2), gpu_host)
  assert [envs[(m, 0)]["CUDA_VISIBLE_DEVICES"] for m in range(2)] == ["4,5", "6,7"]


def test_cpu_stays_as_before(gpu_host, monkeypatch):
  """platform=cpu (or JAX_PLATFORMS=cpu under auto) on a GPU host: emulated devices only."""
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
  for platform, forced in (("cpu", None), ("auto", "cpu")):
    if forced:
      monkeypatch.setenv("JAX_PLATFORMS", forced)
    envs = _envs(_config(2, devices_per_learner=2, platform=platform), gpu_host)
    for key in ((0, 0), (1, 0), (-1, 0)):
      env = envs[key]
      count = 1 if key[0] < 0 else 2
      # Exactly what the launcher gave before accelerators: the parent's environment, the
      # emulated device count appended to XLA_FLAGS, JAX on the CPU.
      expected = dict(os.environ, JAX_PLATFORMS="cpu",
                      XLA_FLAGS=f"--xla_cpu_enable_fast_math=false {EMULATED}={count}")
      assert env == expected


def test_gpus_without_jax_cuda_stay_on_cpu(tmp_path, monkeypatch):
  """GPUs but a CPU-only JAX: auto keeps the CPU; asking for cuda says what to install."""
  monkeypatch.setenv("PATH", _fake_gpus(tmp_path, 8) + os.pathsep + os.environ["PATH"])
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  assert accelerators.detect("auto") == ("cpu", [])
  with pytest.raises(ConfigError, match=r'^launch.platform=cuda: .*pip install -e "\.\[cuda\]"'):
    accelerators.detect("cuda")


def test_platforms_without_devices_fail_clearly(tmp_path, monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi at all
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  _fake_cuda_plugin(tmp_path / "site", monkeypatch)
  with pytest.raises(ConfigError, match="^launch.platform=cuda: this host shows no cuda"):
    accelerators.detect("cuda")
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  assert accelerators.detect("auto") == ("cpu", [])
  monkeypatch.setenv("JAX_PLATFORMS", "rocm")
  with pytest.raises(ConfigError, match="JAX_PLATFORMS='rocm'"):
    accelerators.detect("auto")
  with pytest.raises(ConfigError, match="^launch.platform: must be one of"):
    _config(1, platform="gpu")


def test_tpu_chips_get_their_own_one_process_world():
  env = accelerators.child_env({"XLA_FLAGS": f"{EMULATED}=8"}, "tpu", devices=["2", "3"],
                               tpu_port=8479)
  assert env["TPU_VISIBLE_CHIPS"] == "2,3" and env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"
  assert env["TPU_PROCESS_BOUNDS"] == "1,1,1" and env["TPU_PROCESS_PORT"] == "8479"
  assert env["JAX_PLATFORMS"] == "tpu" and "XLA_FLAGS" not in env
  with pytest.raises(ConfigError, match="^launch.devices_per_learner: .* 1, 2, 4 or 8 chips"):
    accelerators.child_env({}, "tpu", devices=["0", "1", "2"])
  assert accelerators.assign("tpu", [str(i) for i in range(8)], [4, 4], 1, "f") == [
      [["0", "1", "2", "3"]], [["4", "5", "6", "7"]]]


# Signals.
def _children(pid: int) -> set[int]:
  """Every live descendant of `pid`, from /proc."""
  parents = {}
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/stat") as f:
          parents[int(name)] = int(f.read().rpartition(")")[2].split()[1])
      except (OSError, IndexError, ValueError):
        continue
  found, frontier = set(), {pid}
  while frontier:
    frontier = {p for p, parent in parents.items() if parent in frontier} - found
    found |= frontier
  return found


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rpartition(")")[2].split()[0] != "Z"
  except OSError:
    return False


def _spawn(code: str) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_forward_stops_children_with_sigterm_kills_stragglers_and_their_helpers(tmp_path, sig):
  cfg = _config(1, platform="cpu")
  cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, stop_timeout_s=2.0))
  launcher = Launcher(cfg, str(tmp_path / "run"), config_json="unused.json")
  ready = tmp_path / "ready"
  # A learner-like child that exits on SIGTERM; one that ignores it and has a helper process
  # of its own (in its process group); and one that is stopped (SIGSTOP) when the signal comes.
  polite = _spawn("import time\nwhile True: time.sleep(1)")
  stubborn = _spawn(
      "import signal, subprocess, sys, time\n"
      "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
      "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
      "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
      f"open({str(ready)!r}, 'w').close()\n"
      "while True: time.sleep(1)")
  stopped = _spawn("import time\nwhile True: time.sleep(1)")
  deadline = time.monotonic() + 60
  while not ready.exists() or len(_children(stubborn.pid)) < 1:
    assert time.monotonic() < deadline, "the test's child processes did not start"
    time.sleep(0.05)
  helper = next(iter(_children(stubborn.pid)))
  os.kill(stopped.pid, signal.SIGSTOP)
  launcher.procs = {-1: Proc("syncer", -1, 1, popens=[polite]),
                    0: Proc("learner0", 0, 2, popens=[stubborn, stopped])}
  started = time.monotonic()
  launcher.forward(sig)
  assert 1.5 < time.monotonic() - started < 30  # waited for stop_timeout_s, not forever
  assert polite.returncode == -signal.SIGTERM and stopped.returncode == -signal.SIGTERM
  assert stubborn.returncode == -signal.SIGKILL
  deadline = time.monotonic() + 10
  while _alive(helper) and time.monotonic() < deadline:  # init reaps it once it is killed
    time.sleep(0.05)
  assert not _alive(helper)
  launcher.shutdown()


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_a_real_launcher_leaves_no_process_behind(tmp_path, sig):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  launcher = subprocess.Popen(
      [sys.executable, "-m", "diloco.main", "--config=configs/multiprocess.py:tiny",
       f"--workdir={tmp_path}", "--role=launch", "--config.learners.count=2",
       "--config.launch.chaos_faults=0", "--config.launch.platform=auto",
       "--config.train.steps=100000", "--config.launch.stop_timeout_s=120"],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  seen: set[int] = set()
  lines = []
  try:
    for line in launcher.stdout:  # until both learners are stepping
      lines.append(line)
      seen |= _children(launcher.pid)
      if "learners training at" in line:
        break
    seen |= _children(launcher.pid)
    assert len(seen) >= 3, "".join(lines)  # the syncer and two learners at least
    launcher.send_signal(sig)
    out, _ = launcher.communicate(timeout=300)
  finally:
    if launcher.poll() is None:
      launcher.kill()
  lines.append(out)
  assert launcher.returncode == 128 + sig, "".join(lines)[-3000:]
  assert f"launcher: {signal.Signals(sig).name}: " in out and " 0 killed" in out, out[-3000:]
  assert [pid for pid in seen if _alive(pid)] == []


@pytest.mark.slow
@pytest.mark.processes
def test_sigint_to_a_learner_process_retires_it_as_sigterm_does(tmp_path):
  """A Ctrl-C on a learner started by hand (beside its syncer): it finishes its step, says
  goodbye and exits 0, with no KeyboardInterrupt raised into whatever line it was on."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}

  def start(*args):
    return subprocess.Popen(
        [sys.executable, "-m", "diloco.main", "--config=configs/multiprocess.py:tiny",
         f"--workdir={tmp_path}", f"--store={tmp_path / 'store'}", "--config.learners.count=1",
         "--config.train.steps=100000", "--config.launch.chaos_faults=0", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

  syncer = start("--role=syncer")
  learner = start("--role=learner", "--learner_id=0")
  activity = tmp_path / "activity" / "l0.jsonl"
  try:
    deadline = time.monotonic() + 300
    while '"kind": "step"' not in (activity.read_text() if activity.exists() else ""):
      assert learner.poll() is None and time.monotonic() < deadline, learner.stdout.read()
      time.sleep(0.1)
    learner.send_signal(signal.SIGINT)
    out, _ = learner.communicate(timeout=120)
  finally:
    for proc in (learner, syncer):
      if proc.poll() is None:
        proc.kill()
    syncer.communicate()
  assert learner.returncode == 0, out[-3000:]
  assert "learner 0 incarnation 0: retired at local step " in out, out[-3000:]
  assert "KeyboardInterrupt" not in out and "Traceback" not in out, out[-3000:]
