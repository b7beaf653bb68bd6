"""Runs many experiment runs at once, each pinned to its own few cores, and records where.

`harness.run_all` runs one run at a time over the whole host: right for a 2-core machine,
wasteful on a 16-core one, where a `tiny` run keeps about one core busy. `run_parallel`
keeps `parallel` runs going, run `i` of a slot pinned (sched_setaffinity) to that slot's
`threads` cores with XLA's multi-threaded Eigen off, so that concurrent runs do not fight
over the same cores. Each finished run gets the harness's `harness.json` (wall time, load)
and `provenance.json` (which machine and device ran it), so runs copied back from another
machine say where they came from in the report.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Sequence

from experiments import harness

PROVENANCE_FILE = "provenance.json"


def device_description(env: dict) -> str:
  """The JAX backend and device kind that runs under `env` get (one short subprocess)."""
  code = ("import jax; d = jax.devices()[0]; "
          "print(f'{d.platform}: {d.device_kind} x {jax.device_count()}')")
  try:
    return subprocess.check_output([sys.executable, "-c", code], env=env, text=True,
                                   stderr=subprocess.DEVNULL, timeout=300).strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def run_env(devices: int, pinned: bool) -> dict:
  """The environment of a run: emulated CPU devices (ignored on GPU), single-threaded Eigen
  when pinned, this repo first on the path."""
  xla = f"--xla_force_host_platform_device_count={devices}"
  if pinned:
    xla += " --xla_cpu_multi_thread_eigen=false"
  return dict(os.environ, XLA_FLAGS=xla,
              JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
              PYTHONPATH=harness.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def slot_cores(slot: int, threads: int, cores: Sequence[int]) -> list[int]:
  """The cores of slot `slot`: `threads` consecutive ones of `cores`, wrapping around."""
  if threads < 1:
    raise ValueError(f"threads must be >= 1, got {threads}")
  return [cores[(slot * threads + i) % len(cores)] for i in range(threads)]


def _start(run: harness.Run, workdir: str, env: dict, cores: list[int] | None):
  """Starts a run's process (pinned to `cores` if given); its log stays open until it ends."""
  os.makedirs(workdir, exist_ok=True)
  log = open(os.path.join(workdir, "run.log"), "w", encoding="utf-8")  # noqa: SIM115
  pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
  proc = subprocess.Popen(run.command(workdir), stdout=log, stderr=subprocess.STDOUT,
                          env=env, cwd=harness.REPO, preexec_fn=pin)
  return proc, log, time.monotonic()


def with_count(device: str, n: int) -> str:
  """`device_description` ("cpu: cpu x 8") with the device count a run was given."""
  return re.sub(r" x \d+$", f" x {n}", device)


def _devices(run: harness.Run, default: int) -> int:
  """The emulated devices of `run`: its "devices" label (a data-parallel batch smaller than
  `default` cannot be split over `default` devices), else `default`."""
  return int(dict(run.labels).get("devices", default))


def _record(workdir: str, wall: float, where: dict, cores: list[int] | None) -> None:
  with open(os.path.join(workdir, harness.HARNESS_FILE), "w", encoding="utf-8") as f:
    json.dump({"wall_s": wall, "loadavg": list(os.getloadavg())}, f)
  with open(os.path.join(workdir, PROVENANCE_FILE), "w", encoding="utf-8") as f:
    json.dump(dict(where, cores=cores or "all", wall_s=round(wall, 1)), f, indent=1)


def run_parallel(runs: Sequence[harness.Run], outdir: str, *, parallel: int = 1,
                 threads: int = 0, devices: int = 8, label: str = "") -> float:
  """Runs what has not finished, `parallel` at a time; returns the wall seconds spent.

  `threads` > 0 pins each run to that many cores (0: no pinning, XLA's own threads).
  `label` names the machine in provenance.json. A failed run does not stop the others;
  the failures are raised together at the end."""
  if parallel < 1:
    raise ValueError(f"--parallel must be >= 1, got {parallel}")
  todo = [r for r in runs if not harness.finished(os.path.join(outdir, r.name))]
  env = run_env(devices, pinned=threads > 0)
  where = {"label": label, "host": platform.node(), "machine": harness.machine(),
           "device": device_description(env) if todo else "", "parallel": parallel,
           "threads": threads or "all"}
  cores = sorted(os.sched_getaffinity(0))
  started, active, failed, free = time.monotonic(), {}, [], list(range(parallel))
  while todo or active:
    while todo and free:
      slot, run = free.pop(0), todo.pop(0)
      pinned = slot_cores(slot, threads, cores) if threads else None
      print(f"[{len(runs) - len(todo)}/{len(runs)}] slot {slot} {run.name}", flush=True)
      n = _devices(run, devices)
      this_env = env if n == devices else run_env(n, pinned=threads > 0)
      active[slot] = (run, pinned) + _start(run, os.path.join(outdir, run.name), this_env,
                                            pinned)
    time.sleep(0.5)
    for slot, (run, pinned, proc, log, t0) in list(active.items()):
      if proc.poll() is None:
        continue
      log.close()
      del active[slot]
      free.append(slot)
      workdir = os.path.join(outdir, run.name)
      if proc.returncode:
        failed.append(f"{run.name} (exit {proc.returncode}; see {workdir}/run.log)")
        continue
      n = _devices(run, devices)
      _record(workdir, time.monotonic() - t0,
              dict(where, devices=n, device=with_count(where["device"], n)), pinned)
      print(f"    {run.name} done in {time.monotonic() - t0:.0f} s", flush=True)
  if failed:
    raise RuntimeError("runs failed: " + "; ".join(failed))
  return time.monotonic() - started
