"""The local launcher (`--role=launch`): a syncer and M learner processes on one machine.

It starts every process with its own emulated device count, supervises them, restarts a
process that died with an exponential backoff (a run aborts if one keeps dying fast),
and applies the seeded chaos schedule (`diloco.distributed.chaos`) with real signals. With
`launch.hosts_per_learner` > 1 a learner is that many processes in one `jax.distributed`
world, like the hosts of a TPU slice: a kill hits one of them, and the launcher then stops
the others and restarts the learner whole (JAX would take its heartbeat timeout to notice).
When every learner has finished or retired it stops the syncer, gathers the activity logs,
and writes the same report as the single-controller runtime (`launch_report`,
`diloco.observe.report`: accounting.json, loss.png, timeline.png, a short table). While the
run goes on it prints the global evals as the syncer or the evaluator process records them.

On a GPU host or TPU VM (`launch.platform`, `diloco.deploy.accelerators`) each learner
gets its own group of the host's devices and the syncer stays on the CPU. SIGTERM or SIGINT to
the launcher stops every process group it started with SIGTERM; whatever has not exited after
`launch.stop_timeout_s` is SIGKILLed, and the launcher exits 128 + the signal number.

With `sync.shards = S > 1` it starts S syncer processes, one per shard (`--role=syncer` with
`sync.shard = s`, each supervised and restarted on its own; docs/design.md 3.1), the
evaluator process for the global eval (a shard holds only its fragments), and merges the
shards' tapes (WORKDIR/shards/s{s}/tape.jsonl, records tagged with `"shard"`) into the run's
one WORKDIR/tape.jsonl and report (the accounting adds per-shard round figures,
`fidelity.shard_stats`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
from absl import logging

from diloco.config.run_config import Config, ConfigError
from diloco.deploy import accelerators
from diloco.distributed import chaos, launch_report, supervision
from diloco.distributed.store import Store, shard_stores, shared_store
from diloco.distributed.store import layout as store_layout
from diloco.distributed.supervision import EVALUATOR, Proc, syncer_key
from diloco.observe import hooks as hooks_lib
from diloco.observe import metrics as metrics_lib
from diloco.observe import tracking
from diloco.observe.accounting import span_record
from diloco.train import data as data_lib

LAUNCHER_ACTIVITY = "launcher.jsonl"


class Launcher:
  """Starts, supervises and restarts the run's processes, applies the chaos schedule, and
  reports at the end (`supervision` holds the processes, `launch_report` the report)."""

  def __init__(self, cfg: Config, workdir: str, config_json: str):
    self.cfg, self.workdir, self.config_json = cfg, os.path.abspath(workdir), config_json
    self.store_root = cfg.store.root or os.path.join(self.workdir, "store")
    self.store = shared_store(self.store_root, cfg.sync.shards)
    # A store laid out for another sync.shards, or with a symlinked shard folder: refused
    # before any process starts (each process also checks the whole layout).
    store_layout.check_shards(self.store, cfg.sync.shards)
    if cfg.sync.shards > 1:
      self._stores = shard_stores(self.store_root, cfg.sync.shards)
    self.max_learners = chaos.max_learners(cfg)
    self.events = chaos.schedule(
        cfg.launch.chaos, cfg.launch.chaos_faults, seed=cfg.seed,
        start=cfg.launch.chaos_start_s, end=cfg.launch.chaos_end_s,
        count=cfg.learners.count, max_learners=self.max_learners, shards=cfg.sync.shards)
    if cfg.store.on_sigterm != "retire" and any(e.kind == "retire" for e in self.events):
      raise ConfigError("launch.chaos: retire events send SIGTERM, which means restart with "
                        f"store.on_sigterm={cfg.store.on_sigterm!r}; use 'retire' there")
    self.rng = np.random.default_rng([cfg.seed, 104729])
    listed = cfg.learners.device_counts()
    hosts = cfg.launch.hosts_per_learner
    sizes = [listed[m] if m < len(listed) else cfg.launch.devices_per_learner
             for m in range(self.max_learners)]
    # Decided before any process starts, without starting a JAX backend here.
    self.platform, available = accelerators.detect(cfg.launch.platform)
    field = "learners.devices" if listed else "launch.devices_per_learner"
    groups = accelerators.assign(self.platform, available, sizes, hosts, field)
    idle = available[sum(sizes):]
    if idle:
      logging.warning("launcher: %d %s device(s) stay idle (%s): %d learner(s) x %s use %d",
                      len(idle), self.platform, ",".join(idle), len(sizes), field, sum(sizes))
    self.shards = cfg.sync.shards
    self.procs = {syncer_key(s): Proc("syncer" if self.shards == 1 else f"syncer{s}",
                                      syncer_key(s), 1, shard=s) for s in range(self.shards)}
    # The global eval, off the syncer (evaluator.py); a sharded syncer holds no whole model.
    if cfg.train.eval_mode == "process" or (self.shards > 1 and cfg.train.eval_mode != "off"):
      # On an accelerator host it takes a device no learner uses; without one, the host CPU.
      if self.platform != "cpu" and not idle:
        logging.warning("launcher: no spare %s device for the evaluator process: it evaluates "
                        "on CPU (leave one device out of the learners' groups)", self.platform)
      self.procs[EVALUATOR] = Proc("evaluator", EVALUATOR, 1,
                                   device_ids=[list(idle[:1])] if idle else [])
    for m, size in enumerate(sizes):
      self.procs[m] = Proc(f"learner{m}", m, size // hosts, hosts, device_ids=groups[m])
    os.makedirs(os.path.join(self.workdir, "logs"), exist_ok=True)
    os.makedirs(os.path.join(self.workdir, "activity"), exist_ok=True)
    self._activity = open(os.path.join(self.workdir, "activity", LAUNCHER_ACTIVITY), "a",
                          encoding="utf-8")
    self.origin = self.store.run.start(create=True)
    self.started = time.monotonic()
    self.applied: list[dict] = []
    # The global evals as the syncer or the evaluator process records them, for the console.
    self.evals = metrics_lib.EvalFollower(os.path.join(self.workdir, metrics_lib.METRICS_FILE),
                                          last_step=cfg.train.steps)

  def now(self) -> float:
    return time.time() - self.origin

  # Processes.
  def _command(self, proc: Proc, host: int, port: int) -> list[str]:
    # A syncer shard has its own config (sync.shard = s); everyone else the run's.
    config = (self._shard_config(proc.shard) if proc.shard is not None and self.shards > 1
              else self.config_json)
    cmd = [sys.executable, "-m", "diloco.main", f"--config_json={config}",
           f"--workdir={self.workdir}", f"--store={self.store_root}"]
    if proc.learner == EVALUATOR:
      return cmd + ["--role=evaluator"]
    if proc.learner < 0:
      return cmd + ["--role=syncer"]
    cmd += ["--role=learner", f"--learner_id={proc.learner}"]
    if proc.hosts > 1:
      cmd += ["--jax_distributed", f"--coordinator_address=127.0.0.1:{port}",
              f"--num_processes={proc.hosts}", f"--process_id={host}"]
    return cmd

  def _shard_config(self, shard: int) -> str:
    """WORKDIR/config_syncer{s}.json: the run's config with `sync.shard = s`."""
    path = os.path.join(self.workdir, f"config_syncer{shard}.json")
    if not os.path.exists(path):
      with open(self.config_json, encoding="utf-8") as f:
        raw = json.load(f)
      raw["sync"]["shard"] = shard
      with open(path, "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
    return path

  def _syncers(self) -> list[Proc]:
    return [self.procs[syncer_key(s)] for s in range(self.shards)]

  def env(self, proc: Proc, host: int) -> dict[str, str]:
    """The environment of one host process of `proc`: its platform and its own devices."""
    if proc.learner < 0 and not proc.device_ids:  # the syncer; an evaluator without a device
      return accelerators.syncer_env(os.environ, self.platform)
    ids = proc.device_ids[host] if proc.device_ids else []
    return accelerators.child_env(os.environ, self.platform, devices=ids, emulated=proc.devices,
                                  tpu_port=supervision.free_port() if self.platform == "tpu" else 0)

  def start(self, proc: Proc) -> None:
    if not proc.logs:
      names = [proc.name] + [f"{proc.name}_h{h}" for h in range(1, proc.hosts)]
      proc.logs = [open(os.path.join(self.workdir, "logs", f"{n}.log"), "ab") for n in names]
    port = supervision.free_port() if proc.hosts > 1 else 0  # a fresh coordinator for every start
    proc.popens = []
    for host, log in enumerate(proc.logs):
      log.write(f"==== start at t={self.now():.2f}s ====\n".encode())
      log.flush()
      proc.popens.append(subprocess.Popen(self._command(proc, host, port), stdout=log,
                                          stderr=subprocess.STDOUT, env=self.env(proc, host),
                                          start_new_session=True))
    proc.state, proc.started_at = "running", self.now()
    if proc.down_since is not None and proc.learner >= 0:
      self._span(proc, "down", proc.down_since, self.now())
    proc.down_since = None
    logging.info("launcher: started %s (pids %s)", proc.name, [p.pid for p in proc.popens])

  def _span(self, proc: Proc, kind: str, start: float, end: float) -> None:
    self._activity.write(json.dumps(span_record(proc.learner, -1, kind, start, end,
                                                devices=proc.devices * proc.hosts)) + "\n")
    self._activity.flush()

  def _learners(self, *states: str) -> list[Proc]:
    return [p for m, p in sorted(self.procs.items()) if m >= 0 and p.state in states]

  def _reap(self) -> None:
    """Notices exits: learners that finished, and deaths that need a restart."""
    la = self.cfg.launch
    for proc in self.procs.values():
      code = proc.exit_code() if proc.state in ("running", "stopped", "retiring") else None
      if code is None:
        continue
      supervision.stop_all(proc)
      if proc.state == "retiring" or (code == 0 and proc.learner >= 0):
        proc.state = "retired" if proc.state == "retiring" else "done"
        continue
      if code == 0:  # the syncer only exits by itself when every learner has left
        proc.state = "done"
        continue
      now = self.now()
      proc.fast_failures = proc.fast_failures + 1 if now - proc.started_at < 60 else 1
      if proc.fast_failures >= la.max_fast_failures:
        log = os.path.join(self.workdir, "logs", f"{proc.name}.log")
        raise RuntimeError(f"{proc.name} died {proc.fast_failures} times in a row (last exit "
                           f"code {code}); see {self.workdir}/logs/{proc.name}.log:\n"
                           + supervision.tail(log))
      backoff = min(la.restart_backoff_s * 2 ** (proc.fast_failures - 1), la.max_backoff_s)
      proc.state, proc.restart_at, proc.down_since = "waiting", now + backoff, now
      proc.restarts += 1
      logging.warning("launcher: %s exited with %d; restart in %.1f s", proc.name, code, backoff)

  def _pick(self, event: chaos.Event, states=("running",)) -> Proc | None:
    if event.learner != chaos.ANY:
      proc = self.procs.get(event.learner)
      return proc if proc is not None and proc.state in states else None
    live = self._learners(*states)
    return live[int(self.rng.integers(len(live)))] if live else None

  def apply(self, event: chaos.Event) -> None:
    proc: Proc | None
    if event.kind == "kill_syncer":
      proc = self.procs[syncer_key(event.shard)]
      ok = proc.state == "running" and supervision.send(proc, signal.SIGKILL)
    elif event.kind == "add":
      idle = self._learners("idle")
      proc = idle[0] if idle else None
      ok = proc is not None
      if ok:
        self.start(proc)
    else:
      proc = self._pick(event)
      ok = proc is not None
      if ok and event.kind == "kill":  # one host of a learner dies (a process, a machine)
        ok = supervision.send(proc, signal.SIGKILL, host=int(self.rng.integers(proc.hosts)))
      elif ok and event.kind == "stop":
        ok = supervision.send(proc, signal.SIGSTOP)
        if ok:
          proc.state = "stopped"
          self._continue_at.append((self.now() + event.duration, proc))
          self._span(proc, "down", self.now(), self.now() + event.duration)
      elif ok and event.kind == "retire":
        # Retiring the last learner would end training: retire only with others running.
        ok = len(self._learners("running")) > 1 and supervision.send(proc, signal.SIGTERM, host=0)
        if ok:
          proc.state = "retiring"
    if event.kind == "retire" and not ok and event.learner != chaos.ANY:
      down = self.procs.get(event.learner)
      if down is not None and down.state == "waiting":  # dead already: just never restart it
        proc, ok, down.state = down, True, "retired"
    record = {"at": round(self.now(), 3), "event": str(event), "applied": bool(ok),
              "target": None if proc is None else proc.name}
    self.applied.append(record)
    print(f"chaos t={self.now():.1f}s: {event} -> "
          f"{record['target'] if ok else 'skipped (no eligible target)'}", flush=True)

  # Signals to the launcher.
  def _on_signal(self, signum: int, frame) -> None:
    """Only records the signal: the loop stops the processes (a handler must not race it)."""
    del frame
    if self._stop_signal is None:
      self._stop_signal = signum

  def _check_signal(self) -> None:
    if self._stop_signal is not None:
      raise supervision.Stopped(self._stop_signal)

  def forward(self, sig: int) -> None:
    """Stops every live process (`supervision.stop_gracefully`) after the launcher got `sig`."""
    supervision.stop_gracefully(self.procs.values(), sig, self.cfg.launch.stop_timeout_s)

  # The run.
  def run(self) -> dict:
    """Runs to the end; on SIGTERM or SIGINT stops every process and exits 128 + signal."""
    self._stop_signal: int | None = None
    previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
      return self._run()
    except supervision.Stopped as e:  # every process is gone already (the finally of _run)
      raise SystemExit(128 + e.signum) from None
    finally:
      for s, handler in previous.items():
        signal.signal(s, handler)

  def _run(self) -> dict:
    cfg = self.cfg
    self._continue_at: list[tuple[float, Proc]] = []
    pending = list(self.events)
    last_status = last_end_check = 0.0
    chaos_origin = None  # chaos times count from when every initial learner has stepped
    try:
      for syncer in self._syncers():
        self.start(syncer)
      if EVALUATOR in self.procs:
        self.start(self.procs[EVALUATOR])
      for m in range(cfg.learners.count):
        self._check_signal()
        self.start(self.procs[m])
      while True:
        self._check_signal()
        now = self.now()
        if now > cfg.launch.timeout_s:
          raise TimeoutError(f"the run exceeded launch.timeout_s={cfg.launch.timeout_s:.0f} s")
        self._reap()
        for item in [c for c in self._continue_at if c[0] <= now]:
          self._continue_at.remove(item)
          if item[1].state == "stopped":
            supervision.send(item[1], signal.SIGCONT)
            item[1].state = "running"
        for proc in self.procs.values():
          if proc.state == "waiting" and proc.restart_at <= now:
            self.start(proc)
        if chaos_origin is None and self._all_stepping():
          chaos_origin = now
          print(f"launcher: all {cfg.learners.count} learners training at t={now:.1f}s; "
                f"{len(pending)} chaos events from now on", flush=True)
        while chaos_origin is not None and pending and pending[0].at <= now - chaos_origin:
          self.apply(pending.pop(0))
        if pending and now - last_end_check >= 1.0:
          last_end_check = now
          if self.store.run.end_requested():  # a hook ended the run: no more faults, no adds
            print(f"launcher: a hook ended the run early (end.json); {len(pending)} chaos "
                  "events dropped", flush=True)
            pending.clear()
        active = self._learners("running", "stopped", "waiting", "retiring")
        if not active and not [e for e in pending if e.kind == "add"]:
          break
        for line in self.evals.new_lines():
          print(line, flush=True)
        if now - last_status >= cfg.log.progress_every_s:
          last_status = now
          print(self.status_line(), flush=True)
        time.sleep(0.1)
      self.store.run.request_stop({"at": self.now()})
      self._wait_for_syncers()
      self._wait_for_evaluator()
    finally:
      if self._stop_signal is not None:
        self.forward(self._stop_signal)
      self.shutdown()
    print(self.status_line(), flush=True)
    return self.finish()

  def _wait_for_syncers(self) -> None:
    """Every syncer shard settles and stops after stop.json (a dead one is restarted first)."""
    deadline = time.monotonic() + 300
    syncers = self._syncers()
    while any(p.state != "done" for p in syncers) and time.monotonic() < deadline:
      self._check_signal()
      self._reap()
      for syncer in syncers:
        if syncer.state == "waiting" and syncer.restart_at <= self.now():
          self.start(syncer)
      time.sleep(0.1)
    late = [p.name for p in syncers if p.state != "done"]
    if late:
      raise RuntimeError(f"the syncer ({', '.join(late)}) did not stop within 300 s of "
                         f"stop.json; see {self.workdir}/logs/{late[0]}.log")

  def _wait_for_evaluator(self) -> None:
    """The evaluator process evaluates the final versions once the syncer has stopped."""
    proc = self.procs.get(EVALUATOR)
    if proc is None:
      return
    while proc.state != "done":
      if self.now() > self.cfg.launch.timeout_s:
        raise TimeoutError("the evaluator did not finish its final evaluation within "
                           f"launch.timeout_s; see {self.workdir}/logs/evaluator.log")
      self._reap()
      if proc.state == "waiting" and proc.restart_at <= self.now():
        self.start(proc)
      time.sleep(0.1)

  def _all_stepping(self) -> bool:
    beats = self.store.learners.heartbeats()
    return all(beats.get(m, {}).get("local_step", 0) >= 1 for m in range(self.cfg.learners.count))

  def status_line(self) -> str:
    return launch_report.status_line(self.procs, self.store.learners.heartbeats(),
                                     self._syncers(), self._shard_stores())

  def _shard_stores(self) -> list[Store]:
    if not hasattr(self, "_stores"):
      self._stores = [self.store] if self.shards == 1 else shard_stores(self.store_root,
                                                                       self.shards)
    return self._stores

  def shutdown(self) -> None:
    for proc in self.procs.values():
      supervision.stop_all(proc)
      for log in proc.logs:
        log.close()
      proc.logs = []
    self._activity.close()

  def finish(self) -> dict:
    """Writes and prints the run's report (`launch_report.finish`)."""
    return launch_report.finish(self.cfg, self.workdir, self.procs, self._syncers(),
                                self.applied, self.started)


def run(cfg: Config, workdir: str) -> dict:
  """Launches the multi-process run of `cfg` in `workdir`; returns its accounting summary."""
  if cfg.learners.count < 1:
    raise ConfigError("--role=launch needs learners.count >= 1 (a Decoupled DiLoCo config)")
  data_lib.check_vocab(cfg.data, cfg.model.vocab_size)  # before any process starts
  tracking.check(cfg.log)
  hooks_lib.load(cfg.log.hooks)  # every process imports it: a file that cannot be, fails here
  if cfg.log.hooks.endswith(".py"):  # the same file for every process, whatever its cwd
    cfg = dataclasses.replace(cfg, log=dataclasses.replace(
        cfg.log, hooks=os.path.abspath(cfg.log.hooks)))
  os.makedirs(workdir, exist_ok=True)
  config_json = os.path.abspath(os.path.join(workdir, "config.json"))
  with open(config_json, "w") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=2)
  return Launcher(cfg, workdir, config_json).run()
