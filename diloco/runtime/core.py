"""Single-controller (Pathways-style) runtime: M learner meshes, one syncer, one process.

The syncer is `sync.shards` independent shards in that process (`diloco.sync.group`).

`jax.devices()` is split into disjoint learner groups (by slice when devices have a
`slice_index`). Two drivers (`diloco.runtime.drivers`) move time over the learners and the syncer:
  * `VirtualDriver`: one thread and an event heap on a virtual clock; step times come
    from the configured speeds and a seeded jitter, so the same seed gives bit-identical
    global parameters and event tapes (tests use it);
  * `ThreadedDriver`: one thread per learner and one for the syncer on the wall clock.
Faults are cooperative (`diloco.runtime.faults`): a learner is dropped and restarted, losing
its local state, or added from spare device groups, or retired.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
from typing import Any

import jax
import numpy as np
from absl import logging

from diloco import fragments as fragments_lib
from diloco.config.run_config import Config
from diloco.distributed.store import global_view
from diloco.errors import ConfigError
from diloco.learner import island
from diloco.learner import loop as learner_loop
from diloco.learner.learner import Learner, Resume
from diloco.runtime import faults as faults_lib
from diloco.sync import intake
from diloco.sync.group import SyncerGroup
from diloco.train import mesh as mesh_lib
from diloco.train import state as train_state
from diloco.train import step as train_step
from diloco.transport import Heartbeat, InMemoryTransport


@dataclasses.dataclass
class Slot:
  """A device group and what outlives its learners' incarnations (compiled step, resume)."""
  index: int
  spec: train_state.StateSpec
  init_fn: Any
  step_fn: Any
  speed: float
  devices: int
  rng: np.random.Generator
  status: str = "idle"   # idle | up | down | retired | done
  incarnation: int = -1
  learner: Learner | None = None
  resume: Resume = dataclasses.field(default_factory=Resume)
  nonfinite_failures: int = 0
  poison_on_start: bool = False  # a `nan:M@T` fault that found no running learner yet
  align_pending: bool = False  # joined running peers: align its schedule at its first step


class Recorder:
  """Streams tape and activity records to JSONL files as they happen.

  A long run's records never all sit in memory: the recorder keeps how many each file holds
  (a checkpoint covers exactly these), the newest `recent` of each for the live status line,
  and hands every round record to its `followers`. `tape()` and `activity()` read the files
  back whole, for the end of a run. `append=True` (a resumed run) continues files already cut
  back to its checkpoint.
  """

  def __init__(self, workdir: str, append: bool = False, recent: int = 4096):
    self._lock = threading.Lock()
    self.tape_path, self.activity_path = (os.path.join(workdir, name)
                                          for name in ("tape.jsonl", "activity.jsonl"))
    self.recent_tape: collections.deque = collections.deque(maxlen=recent)
    self.recent_activity: collections.deque = collections.deque(maxlen=4 * recent)
    self.tape_count = self.activity_count = 0
    if append:
      for record in _iter_jsonl(self.tape_path):
        self.recent_tape.append(record)
        self.tape_count += 1
      for record in _iter_jsonl(self.activity_path):
        self.recent_activity.append(record)
        self.activity_count += 1
    self._followers: list = []
    mode = "a" if append else "w"
    self._tape_file = open(self.tape_path, mode, encoding="utf-8")
    self._activity_file = open(self.activity_path, mode, encoding="utf-8")

  def follow(self, fn) -> None:
    """Calls `fn(record)` with every round record so far (from the file) and from now on."""
    with self._lock:
      self._tape_file.flush()
      for record in _iter_jsonl(self.tape_path):
        fn(record)
      self._followers.append(fn)

  def round(self, record: dict) -> None:
    with self._lock:
      self.recent_tape.append(record)
      self.tape_count += 1
      self._tape_file.write(json.dumps(record) + "\n")
      self._tape_file.flush()
      for fn in self._followers:
        fn(record)

  def span(self, slot: Slot, kind: str, start: float, end: float, **extra) -> None:
    """Records an activity span of the slot's current incarnation (`learner_loop.SpanLog`)."""
    learner_loop.SpanLog(self._activity, slot.index, slot.incarnation, slot.devices,
                         slot.speed)(kind, start, end, **extra)

  def _activity(self, record: dict) -> None:
    with self._lock:
      self.recent_activity.append(record)
      self.activity_count += 1
      self._activity_file.write(json.dumps(record) + "\n")

  def recent(self) -> tuple[list[dict], list[dict]]:
    """Copies of the newest tape and activity records (all of them in a short run)."""
    with self._lock:
      return list(self.recent_tape), list(self.recent_activity)

  def mark(self) -> tuple[int, int]:
    """Flushes both files; returns how many tape and activity records they hold (a checkpoint
    covers exactly these)."""
    with self._lock:
      for f in (self._tape_file, self._activity_file):
        if not f.closed:
          f.flush()
      return self.tape_count, self.activity_count

  def tape(self) -> list[dict]:
    """Every round record of the run, read back from `tape.jsonl`."""
    self.mark()
    return list(_iter_jsonl(self.tape_path))

  def activity(self) -> list[dict]:
    """Every activity span of the run, read back from `activity.jsonl`."""
    self.mark()
    return list(_iter_jsonl(self.activity_path))

  def close(self) -> None:
    with self._lock:
      self._tape_file.close()
      self._activity_file.close()


def _iter_jsonl(path: str):
  with open(path, encoding="utf-8") as f:
    for line in f:
      yield json.loads(line)


def group_sizes(cfg: Config, num_devices: int) -> list[int]:
  sizes = cfg.learners.device_counts()
  if not sizes:
    if num_devices % cfg.learners.count:
      raise ConfigError(f"learners.count={cfg.learners.count} does not divide the "
                        f"{num_devices} devices; set learners.devices, e.g. '2,2,4'")
    sizes = [num_devices // cfg.learners.count] * cfg.learners.count
  if sum(sizes) > num_devices:
    raise ConfigError(f"learners.devices={cfg.learners.devices!r} needs {sum(sizes)} devices, "
                      f"only {num_devices} are visible")
  return sizes


class Runtime:
  """Builds the slots, the syncer and the transport; drivers move time."""

  def __init__(self, cfg: Config, workdir: str, devices=None, resume: bool = False):
    """`resume`: a run restored from a checkpoint (`run_checkpoint.restore` follows)."""
    self.cfg, self.workdir = cfg, workdir
    devices = list(devices if devices is not None else jax.devices())
    if cfg.learners.share_devices:  # time-shared on the virtual clock
      groups = [devices] * cfg.learners.count
    else:
      sizes = group_sizes(cfg, len(devices))
      groups = mesh_lib.device_groups(devices[:sum(sizes)], sizes)
    speeds = cfg.learners.speed_factors() or [1.0] * len(groups)
    self.slots = []
    for g, group in enumerate(groups):
      spec, init_fn, step_fn = island.build_learner(cfg, group, g)
      self.slots.append(Slot(g, spec, init_fn, step_fn, speeds[g], len(group),
                             np.random.default_rng([cfg.seed, g])))
    self.plan = island.fragment_plan(cfg, self.slots[0].spec)
    # train.init_from seeds G; a resumed run's checkpoint replaces it (checkpoint.restore).
    global_params = island.initial_global(self.slots[0].init_fn, cfg.seed,
                                          None if resume else cfg,
                                          self.slots[0].spec.abstract["params"],
                                          global_view.read_store)
    self.recorder = Recorder(workdir, append=resume)
    delay = cfg.learners.virtual_sync_s if cfg.learners.virtual_clock else None
    # `sync.shards` policy instances, each merging its own fragments (docs/design.md 3.1).
    self.syncer = SyncerGroup(global_params, self.plan, cfg.sync, cfg.outer, sync_delay_s=delay,
                              on_round=self.recorder.round,
                              limits=intake.Limits(cfg.train.batch_size * cfg.data.seq_len,
                                                   len(self.slots) or None))
    self.transport = InMemoryTransport()
    self.lock = threading.Lock()  # guards the syncer against concurrent readers
    # Set to end the run early (a hook's STOP): the drivers stop as at the last step.
    self.stop_requested = threading.Event()
    self._poison_lock = threading.Lock()
    self.faults = faults_lib.parse(cfg.learners.faults)
    for f in self.faults:
      if f.kind != "add" and not 0 <= f.learner < len(self.slots):
        raise ConfigError(f"learners.faults: learner {f.learner} does not exist "
                          f"(groups 0..{len(self.slots) - 1})")
    self.eval_fn = train_step.make_eval_step(self.slots[0].spec)
    self.eval_device = _eval_device(cfg, devices, groups)
    self.num_params = sum(v.size for v in global_params.values())
    # Where the drivers' clock starts and which slots they start (a resumed run changes both).
    self.clock_start = 0.0
    self.restart: list[int] | None = None
    # Called with a slot whose learner finished, before it closes (its last metrics).
    self.on_done = None

  def initial_slots(self) -> list[Slot]:
    if self.restart is not None:
      return [self.slots[g] for g in self.restart]
    return self.slots[:self.cfg.learners.count]

  def start_learner(self, slot: Slot, background_io: bool, now: float, clock,
                    joins_running: bool = True, sender=None) -> Learner:
    """A new incarnation on `slot`: loads the published fragments and announces itself.

    `clock` is the run's clock (wall or virtual): deliveries time their transit on it.
    `sender`: a `diloco.learner.sender.Sender` the driver shares (`Learner`'s argument).
    `joins_running`: the learner joins peers already training (a rejoin, or one added mid-run);
    its schedule is aligned with theirs at its first step (`align_schedule`). False for the
    initial learners, which all start at once.
    """
    slot.incarnation += 1
    slot.learner = Learner(
        learner_id=slot.index, incarnation=slot.incarnation, num_groups=len(self.slots),
        cfg=self.cfg, spec=slot.spec, init_fn=slot.init_fn, step_fn=slot.step_fn,
        plan=self.plan, transport=self.transport, resume=slot.resume,
        background_io=background_io, clock=clock, sender=sender)
    slot.learner.load_global()
    slot.align_pending = joins_running
    with self._poison_lock:
      if slot.poison_on_start:
        slot.poison_on_start = False
        slot.learner.poison()
    # Registered before its first delivery, so K = M rounds wait for it from the start.
    self.transport.heartbeat(Heartbeat(slot.index, slot.incarnation, slot.learner.local_step,
                                       0.0, now))
    slot.status = "up"
    return slot.learner

  def align_schedule(self, slot: Slot) -> None:
    """Before the first step of a learner that joined running peers: aligns its fragment
    schedule with theirs (`learner_loop.align_with_peers`), as the learner processes do."""
    if not slot.align_pending:
      return
    slot.align_pending = False
    learner_loop.align_with_peers(slot.learner, self._live_peer_steps(slot), self.cfg)

  def _live_peer_steps(self, slot: Slot) -> list[int]:
    return [s.learner.local_step for s in self.slots
            if s is not slot and s.learner is not None and s.status == "up"]

  def stop_learner(self, slot: Slot, status: str) -> None:
    """Ends the slot's incarnation. A learner that retires or finishes flushes its deliveries
    and tells the syncer it left, so quorums stop counting it at once (a failed one is only
    timed out, as a crashed island would be)."""
    if slot.learner is not None:
      if status == "done" and self.on_done is not None:
        self.on_done(slot)
      slot.resume = slot.learner.resume_point()
      slot.learner.close()
      if status in ("retired", "done"):
        self.transport.leave(slot.index, slot.incarnation)
    slot.learner = None
    slot.status = status

  def poison(self, slot: Slot) -> None:
    """Fault `nan:M@T`: the learner's next step starts from NaN parameters (fault injection
    for the non-finite failure path); a learner thread still starting gets it at its start."""
    with self._poison_lock:
      if slot.learner is None:
        slot.poison_on_start = True
      else:
        slot.learner.poison()

  def learner_failed(self, slot: Slot, error: Exception) -> bool:
    """A learner's step went non-finite: that learner fails, the run goes on (docs/design.md 2.5).

    Returns True when it should rejoin from the global fragments (a new incarnation at its
    resume point, fresh AdamW moments); after `learners.nonfinite_retries` such failures
    it is retired instead, since it would only blow up again.
    """
    slot.nonfinite_failures += 1
    retire = slot.nonfinite_failures > self.cfg.learners.nonfinite_retries
    logging.warning("learner %d incarnation %d failed (%s); %s", slot.index, slot.incarnation,
                    error, "retired: too many non-finite failures" if retire else
                    "rejoining from the global fragments")
    self.stop_learner(slot, "retired" if retire else "down")
    return not retire

  def step_duration(self, slot: Slot) -> float:
    jitter = self.cfg.learners.step_jitter
    noise = 1.0 + jitter * slot.rng.uniform(-1.0, 1.0) if jitter else 1.0
    return slot.speed * noise

  def global_params(self) -> dict:
    with self.lock:  # a consistent copy while the syncer thread may be merging
      return fragments_lib.unflatten_tree(self.syncer.global_params())

  def evaluate(self, batches) -> float:
    """The mean eval loss of G over `batches`: on `eval_device` when there is one (the wall
    clock: learners keep their memory and their devices' time), else on learner 0's mesh."""
    if self.eval_device is not None:
      params = jax.device_put(self.global_params(), self.eval_device)
      return train_step.mean_eval_loss(self.eval_fn, params, batches,
                                       lambda b: jax.device_put(b, self.eval_device))
    spec = self.slots[0].spec
    params = jax.device_put(self.global_params(), spec.shardings["params"])
    with jax.set_mesh(spec.mesh):
      return train_step.mean_eval_loss(self.eval_fn, params, batches)


def _eval_device(cfg: Config, devices, groups):
  """Where the wall clock's global eval runs, off the learners' devices: a visible device no
  learner group holds, else the host's CPU device on an accelerator host; None (learner 0's
  mesh) on the virtual clock, whose eval stays bit-identical, or when neither exists."""
  if cfg.learners.virtual_clock:
    return None
  used = {d for group in groups for d in group}
  spare = [d for d in devices if d not in used]
  if spare:
    return spare[0]
  if devices and devices[0].platform != "cpu":
    try:
      return jax.devices("cpu")[0]
    except RuntimeError:  # no CPU backend in this process
      return None
  return None
