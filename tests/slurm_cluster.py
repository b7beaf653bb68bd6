"""A real single-node SLURM cluster for the tests: munged, slurmctld and slurmd started from a
slurm.conf generated in a temporary folder, and stopped again by the test that started them.

The daemons are Debian's `slurm-wlm` and `munge` packages (`.ci/run` installs them). The
configuration needs no cgroups and no systemd: process tracking by /proc, no task plugin,
consumable cores (oversubscribed, so a 2-core machine holds a syncer and two learners), root
as SlurmUser, and the state and spool folders inside the temporary folder.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol",
           "squeue", "scancel")


def missing_binaries() -> list[str]:
  """The SLURM and munge programs this machine lacks."""
  found = {name: shutil.which(name) or next(
      (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.path.exists(p)), None)
           for name in DAEMONS}
  return [name for name, path in found.items() if path is None]


def _binary(name: str) -> str:
  return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Cluster:
  """One controller and one node on this machine; `env` is what SLURM's clients need."""

  def __init__(self, root: pathlib.Path):
    self.root = root
    self.procs: list[subprocess.Popen] = []
    self.node = socket.gethostname().split(".")[0]
    self.cpus = os.cpu_count() or 1
    self.conf = root / "slurm.conf"
    self.env = dict(os.environ, SLURM_CONF=str(self.conf))

  def _write_conf(self) -> None:
    for sub in ("state", "spool", "log", "munge"):
      (self.root / sub).mkdir(parents=True, exist_ok=True)
    ctld, slurmd = _free_port(), _free_port()
    conf = f"""\
ClusterName=diloco-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.root / 'munge' / 'munge.socket'},cred_expire=10
StateSaveLocation={self.root / 'state'}
SlurmdSpoolDir={self.root / 'spool'}
SlurmctldPidFile={self.root / 'slurmctld.pid'}
SlurmdPidFile={self.root / 'slurmd.pid'}
SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}
SlurmdLogFile={self.root / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
KillWait=20
MinJobAge=600
InactiveLimit=0
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
"""
    self.conf.write_text(conf, encoding="utf-8")

  def _start(self, *argv: str, log: str) -> subprocess.Popen:
    with open(self.root / "log" / log, "ab") as out:  # the daemon keeps its own descriptor
      proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env=self.env,
                              start_new_session=True)
    self.procs.append(proc)
    return proc

  def start(self, timeout: float = 60.0) -> None:
    """Starts the three daemons and waits until the node takes jobs."""
    self._write_conf()
    munge = self.root / "munge"
    key = munge / "munge.key"
    subprocess.run([_binary("mungekey"), "--create", f"--keyfile={key}"], check=True,
                   capture_output=True)
    key.chmod(0o600)
    self._start(_binary("munged"), "--foreground", "--force", f"--key-file={key}",
                f"--socket={munge / 'munge.socket'}", f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}",
                log="munged.out")
    self._wait(lambda: (munge / "munge.socket").exists(), timeout, "munged")
    self._start(_binary("slurmctld"), "-D", "-i", "-f", str(self.conf), log="slurmctld.out")
    self._start(_binary("slurmd"), "-D", "-f", str(self.conf), log="slurmd.out")
    self._wait(self._idle, timeout, "the node to be idle (sinfo)")

  def _idle(self) -> bool:
    out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()
    return out.startswith("idle")

  def _wait(self, ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
      dead = [p.args[0] for p in self.procs if p.poll() is not None]
      if dead or time.monotonic() > deadline:
        raise RuntimeError(f"SLURM test cluster: waited for {what}; exited: {dead}\n"
                           + self.logs())
      time.sleep(0.5)

  def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """A SLURM client command against this cluster."""
    return subprocess.run([_binary(argv[0]), *argv[1:]], env=self.env, capture_output=True,
                          text=True, check=check, timeout=60)

  def logs(self, tail: int = 40) -> str:
    parts = []
    for path in sorted((self.root / "log").glob("*")):
      lines = path.read_text(errors="replace").splitlines()[-tail:]
      parts.append(f"--- {path.name}\n" + "\n".join(lines))
    return "\n".join(parts)

  def stop(self) -> None:
    """Cancels every job, then stops the daemons this cluster started (and only those)."""
    if self.procs and all(p.poll() is None for p in self.procs):
      self.run("scancel", "--full", "--user=root", check=False)
      deadline = time.monotonic() + 30
      while self.run("squeue", "-h", check=False).stdout.strip() and (
          time.monotonic() < deadline):
        time.sleep(1)
    for proc in reversed(self.procs):
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    for proc in reversed(self.procs):
      try:
        proc.wait(timeout=20)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    self.procs = []
