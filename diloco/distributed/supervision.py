"""Process supervision for the local launcher: supervised processes and the signals they get.

A `Proc` is one supervised learner (one process per host), a syncer shard or the evaluator.
Each process leads its own process group (`start_new_session`), so a signal meant to stop
it reaches its helpers too, and a terminal's Ctrl-C reaches only the launcher.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable

EVALUATOR = -2  # the evaluator process's key in `Launcher.procs`
SYNCER = -1  # the syncer's key (shard 0's with several shards; `syncer_key`)


def syncer_key(shard: int) -> int:
  """Syncer shard `shard`'s key in `Launcher.procs`: -1, then -3, -4, ... (-2 is the
  evaluator's)."""
  return SYNCER if shard == 0 else -2 - shard


@dataclasses.dataclass
class Proc:
  """One supervised learner, as one process per host, or a syncer shard (learner -1, or
  `syncer_key(s)`), or the evaluator (learner -2)."""
  name: str
  learner: int
  devices: int  # per process
  hosts: int = 1
  # The accelerator ids each host process sees (empty on cpu: emulated devices instead).
  device_ids: list[list[str]] = dataclasses.field(default_factory=list)
  popens: list[subprocess.Popen] = dataclasses.field(default_factory=list)
  state: str = "idle"  # idle | running | stopped | waiting (to restart) | done | retired
  restarts: int = 0
  fast_failures: int = 0
  started_at: float = 0.0
  restart_at: float = 0.0
  down_since: float | None = None
  logs: list = dataclasses.field(default_factory=list)
  shard: int | None = None  # a syncer's shard

  def exit_code(self) -> int | None:
    """None while it runs; else the first failed exit code of its processes, or 0 once all of
    them exited cleanly (hosts of one learner finish together)."""
    codes = [p.poll() for p in self.popens]
    failed = [c for c in codes if c not in (None, 0)]
    if failed:
      return failed[0]
    return None if not codes or None in codes else 0


class Stopped(Exception):
  """The launcher got SIGTERM or SIGINT: every process is stopped, then it exits 128 + signum."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


def send(proc: Proc, sig: int, host: int | None = None) -> bool:
  """Sends `sig` to one host's process, or to all of them; False if none was running."""
  targets = proc.popens if host is None else proc.popens[host:host + 1]
  sent = False
  for popen in targets:
    if popen.poll() is None:
      os.kill(popen.pid, sig)
      sent = True
  return sent


def stop_all(proc: Proc) -> None:
  """Kills what is left of a learner whose host died: the others cannot go on without it.

  The whole process group of each live process goes, so that no helper it started outlives
  it (a group whose leader has exited and been reaped is left alone: its id may be reused).
  """
  for popen in proc.popens:
    if popen.poll() is None:
      _signal_group(popen, signal.SIGCONT)
      _signal_group(popen, signal.SIGKILL)
  for popen in proc.popens:
    popen.wait(timeout=30)


def stop_gracefully(procs: Iterable[Proc], sig: int, stop_timeout_s: float) -> None:
  """Stops every live process with SIGTERM, whichever of SIGTERM and SIGINT the launcher got
  (`sig`, which the closing line names); waits up to `stop_timeout_s` for all of them to exit
  (a learner checkpoints on SIGTERM), then SIGKILLs the stragglers.

  SIGTERM is the one stop every role handles as a stop: a learner sets a flag its loop reads,
  a syncer or evaluator ends. A forwarded SIGINT would raise KeyboardInterrupt wherever the
  child happens to be, e.g. inside the start of an I/O thread, whose half-started thread
  then blocks the interpreter's exit until the SIGKILL. Each process leads its own process
  group (`start_new_session`), so a terminal's Ctrl-C reaches only the launcher; the signal
  goes to the whole group, helpers included.
  """
  live = [p for proc in procs for p in proc.popens if p.poll() is None]
  for popen in live:
    for s in (signal.SIGCONT, signal.SIGTERM):  # a SIGSTOPped process could not act on it
      _signal_group(popen, s)
  deadline = time.monotonic() + stop_timeout_s
  while any(p.poll() is None for p in live) and time.monotonic() < deadline:
    time.sleep(0.05)
  stragglers = [p for p in live if p.poll() is None]
  for popen in stragglers:
    _signal_group(popen, signal.SIGKILL)
    popen.wait(timeout=30)
  print(f"launcher: {signal.Signals(sig).name}: {len(live) - len(stragglers)} process(es) "
        f"exited, {len(stragglers)} killed after launch.stop_timeout_s="
        f"{stop_timeout_s:g}", flush=True)


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
  """`sig` to the process group that `popen` leads, if it is still there."""
  try:
    os.killpg(popen.pid, sig)
  except ProcessLookupError:
    pass


def free_port() -> int:
  """A free TCP port on the loopback interface (a coordinator's, a TPU runtime's)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def tail(path: str, lines: int = 30) -> str:
  """The last `lines` lines of a log file ("" if it cannot be read)."""
  try:
    with open(path, "rb") as f:
      return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
  except OSError:
    return ""
