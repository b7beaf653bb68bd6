"""Single-controller (Pathways-style) runtime: M learner meshes, one syncer, one process.

`jax.devices()` is split into disjoint learner groups (by slice when devices have a
`slice_index`). Two drivers share the learners and the syncer:
  * `VirtualDriver`: one thread and an event heap on a virtual clock; step times come
    from the configured speeds and a seeded jitter, so the same seed gives bit-identical
    global parameters and event tapes (tests use it);
  * `ThreadedDriver`: one thread per learner and one for the syncer on the wall clock.
Faults are cooperative (`diloco.faults`): a learner is dropped and restarted, losing
its local state, or added from spare device groups, or retired.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import os
import threading
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from diloco import faults as faults_lib
from diloco import fragments as fragments_lib
from diloco import mesh as mesh_lib
from diloco import optim, train_state, train_step
from diloco.config_lib import Config, ConfigError, parse_floats
from diloco.learner import Learner, Resume
from diloco.sharding import batch_sharding
from diloco.syncer import Syncer
from diloco.transport import Heartbeat, InMemoryTransport


@dataclasses.dataclass
class Slot:
  """A device group and what outlives its learners' incarnations (compiled step, resume)."""
  index: int
  spec: train_state.StateSpec
  step_fn: Any
  speed: float
  devices: int
  rng: np.random.Generator
  status: str = "idle"   # idle | up | down | retired | done
  incarnation: int = -1
  learner: Learner | None = None
  resume: Resume = dataclasses.field(default_factory=Resume)
  steps_done_tokens: int = 0


class Recorder:
  """Appends tape and activity records to JSONL files and keeps them for accounting."""

  def __init__(self, workdir: str):
    self.tape: list[dict] = []
    self.activity: list[dict] = []
    self._lock = threading.Lock()
    self._tape_file = open(os.path.join(workdir, "tape.jsonl"), "w", encoding="utf-8")
    self._activity_file = open(os.path.join(workdir, "activity.jsonl"), "w", encoding="utf-8")

  def round(self, record: dict) -> None:
    with self._lock:
      self.tape.append(record)
      self._tape_file.write(json.dumps(record) + "\n")
      self._tape_file.flush()

  def span(self, slot: Slot, kind: str, start: float, end: float, **extra) -> None:
    record = {"learner": slot.index, "incarnation": max(slot.incarnation, 0), "kind": kind,
              "start": start, "end": end, "devices": slot.devices, "slowdown": slot.speed,
              "local_step": extra.get("local_step", 0), "tokens": extra.get("tokens", 0)}
    with self._lock:
      self.activity.append(record)
      self._activity_file.write(json.dumps(record) + "\n")

  def close(self) -> None:
    self._tape_file.close()
    self._activity_file.close()


def group_sizes(cfg: Config, num_devices: int) -> list[int]:
  sizes = [int(x) for x in parse_floats(cfg.learners.devices, "learners.devices")]
  if not sizes:
    if num_devices % cfg.learners.count:
      raise ConfigError(f"learners.count={cfg.learners.count} does not divide the "
                        f"{num_devices} devices; set learners.devices, e.g. '2,2,4'")
    sizes = [num_devices // cfg.learners.count] * cfg.learners.count
  if sum(sizes) > num_devices:
    raise ConfigError(f"learners.devices={cfg.learners.devices!r} needs {sum(sizes)} devices, "
                      f"only {num_devices} are visible")
  return sizes


def _compiled_step(cfg: Config, spec: train_state.StateSpec, schedule):
  """The train step compiled ahead of time, so no learner compiles on the run's clock."""
  batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.data.seq_len + 1), np.int32,
                               sharding=batch_sharding(spec.mesh))
  with jax.set_mesh(spec.mesh):
    return train_step.make_train_step(spec, cfg.optim, schedule).lower(
        spec.abstract, batch).compile()


class Runtime:
  """Builds the slots, the syncer and the transport; drivers move time."""

  def __init__(self, cfg: Config, workdir: str, devices=None):
    self.cfg, self.workdir = cfg, workdir
    devices = list(devices if devices is not None else jax.devices())
    sizes = group_sizes(cfg, len(devices))
    groups = mesh_lib.device_groups(devices[:sum(sizes)], sizes)
    speeds = parse_floats(cfg.learners.speeds, "learners.speeds") or [1.0] * len(sizes)
    total = cfg.train.steps
    schedule = optim.lr_schedule(cfg.optim, total)
    tx = optim.inner_optimizer(cfg.optim, total)
    self.slots = []
    for g, group in enumerate(groups):
      mesh = mesh_lib.learner_mesh(group, cfg.mesh)
      width = mesh_lib.data_parallel_width(mesh)
      if cfg.train.batch_size % width:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} must be divisible by "
                          f"learner {g}'s data x fsdp = {width}")
      spec = train_state.make_spec(cfg.model, tx, mesh)
      self.slots.append(Slot(g, spec, _compiled_step(cfg, spec, schedule), speeds[g],
                             len(group), np.random.default_rng([cfg.seed, g])))
    flat_shapes = fragments_lib.flatten_tree(self.slots[0].spec.abstract["params"])
    self.plan = fragments_lib.plan_fragments({k: v.shape for k, v in flat_shapes.items()},
                                             cfg.sync.num_fragments, cfg.sync.scheme)
    init = train_state.create(cfg.model, self.slots[0].spec, jax.random.key(cfg.seed))
    global_params = {k: np.asarray(v) for k, v in
                     fragments_lib.flatten_tree(jax.device_get(init["params"])).items()}
    self.recorder = Recorder(workdir)
    delay = cfg.learners.virtual_sync_s if cfg.learners.virtual_clock else None
    self.syncer = Syncer(global_params, self.plan, cfg.sync, cfg.outer, sync_delay_s=delay,
                         on_round=self.recorder.round)
    self.transport = InMemoryTransport()
    self.faults = faults_lib.parse(cfg.learners.faults)
    for f in self.faults:
      if f.kind != "add" and not 0 <= f.learner < len(self.slots):
        raise ConfigError(f"learners.faults: learner {f.learner} does not exist "
                          f"(groups 0..{len(self.slots) - 1})")
    self.eval_fn = train_step.make_eval_step(self.slots[0].spec)
    self.num_params = sum(v.size for v in global_params.values())

  def start_learner(self, slot: Slot, background_io: bool, now: float) -> Learner:
    """A new incarnation on `slot`: loads the published fragments and announces itself."""
    slot.incarnation += 1
    slot.learner = Learner(
        learner_id=slot.index, incarnation=slot.incarnation, num_groups=len(self.slots),
        cfg=self.cfg, spec=slot.spec, step_fn=slot.step_fn, plan=self.plan,
        transport=self.transport, resume=slot.resume, background_io=background_io)
    slot.learner.load_global()
    # Registered before its first delivery, so K = M rounds wait for it from the start.
    self.transport.heartbeat(Heartbeat(slot.index, slot.incarnation, slot.learner.local_step,
                                       0.0, now))
    slot.status = "up"
    return slot.learner

  def stop_learner(self, slot: Slot, status: str) -> None:
    if slot.learner is not None:
      slot.resume = slot.learner.resume_point()
      slot.learner.close()
    slot.learner = None
    slot.status = status

  def step_duration(self, slot: Slot) -> float:
    jitter = self.cfg.learners.step_jitter
    noise = 1.0 + jitter * slot.rng.uniform(-1.0, 1.0) if jitter else 1.0
    return slot.speed * noise

  def global_params(self) -> dict:
    return fragments_lib.unflatten_tree(self.syncer.global_params())

  def evaluate(self, batches) -> float:
    spec = self.slots[0].spec
    params = jax.device_put(self.global_params(), spec.shardings["params"])
    with jax.set_mesh(spec.mesh):
      return float(np.mean(jax.device_get([self.eval_fn(params, b) for b in batches])))


class VirtualDriver:
  """Deterministic discrete-event driver on a virtual clock (one thread)."""

  def __init__(self, runtime: Runtime, on_eval, on_step):
    self.rt, self.on_eval, self.on_step = runtime, on_eval, on_step
    self.cfg = runtime.cfg
    self.now = 0.0
    self._heap: list = []
    self._seq = itertools.count()
    self._waiting: dict[int, tuple[float, list[int]]] = {}
    self._tick_at: float | None = None

  def _push(self, at: float, kind: str, data: Any = None) -> None:
    heapq.heappush(self._heap, (at, next(self._seq), kind, data))

  def _schedule_step(self, slot: Slot, start: float) -> None:
    duration = self.rt.step_duration(slot) * self.cfg.learners.virtual_step_s
    self._push(start + duration, "step", (slot.index, slot.incarnation, start))

  def _tick(self) -> None:
    for g in self._waiting:  # waiting learners are alive
      slot = self.rt.slots[g]
      self.rt.transport.heartbeat(Heartbeat(g, slot.incarnation, slot.learner.local_step, 0.0,
                                            self.now))
    beats, payloads = self.rt.transport.take()
    merged, deadline = self.rt.syncer.tick(self.now, beats, payloads)
    for m in merged:
      self._push(m.published_at, "publish", m)
    if deadline is not None and (self._tick_at is None or deadline < self._tick_at
                                 or self._tick_at <= self.now):
      self._tick_at = deadline
      self._push(deadline, "tick")

  def _after_step(self, slot: Slot) -> None:
    learner = slot.learner
    blocked = learner.sync_point()
    if blocked:
      self._waiting[slot.index] = (self.now, blocked)
      self._push(self.now + self.cfg.sync.heartbeat_timeout_s, "give_up",
                 (slot.index, slot.incarnation, learner.local_step))
    elif learner.local_step >= self.cfg.train.steps:
      self.rt.stop_learner(slot, "done")
    else:
      self._schedule_step(slot, self.now)

  def _join(self, slot: Slot) -> None:
    self.rt.start_learner(slot, background_io=False, now=self.now)
    load = self.cfg.learners.virtual_step_s
    self.rt.recorder.span(slot, "load", self.now, self.now + load)
    self._schedule_step(slot, self.now + load)

  def run(self) -> None:
    cfg = self.cfg
    for m in self.rt.syncer.initial(0.0):
      self.rt.transport.publish(m)
    for slot in self.rt.slots[:cfg.learners.count]:
      self._join(slot)
    for f in self.rt.faults:
      self._push(f.at, "fault", f)
    if cfg.train.eval_every:
      self._push(cfg.train.eval_every * cfg.learners.virtual_step_s, "eval")
    down_since: dict[int, float] = {}
    while self._heap:
      if all(s.status in ("idle", "retired", "done") for s in self.rt.slots):
        break
      self.now, _, kind, data = heapq.heappop(self._heap)
      if kind == "step":
        g, incarnation, start = data
        slot = self.rt.slots[g]
        if slot.status != "up" or slot.incarnation != incarnation:
          continue  # the learner failed during this step: its work is lost
        slot.learner.step(self.now, self.now - start)
        self.rt.recorder.span(slot, "step", start, self.now, local_step=slot.learner.local_step,
                              tokens=slot.learner.tokens_per_step)
        self.on_step(slot)
        self._tick()
        self._after_step(slot)
      elif kind in ("publish", "tick"):
        if kind == "publish":
          self.rt.transport.publish(data)
        self._tick()
        self._wake_waiting()
      elif kind == "give_up":
        g, incarnation, step = data
        slot = self.rt.slots[g]
        if g in self._waiting and slot.incarnation == incarnation and \
            slot.learner.local_step == step:
          since, blocked = self._waiting.pop(g)
          logging.warning("learner %d gave up waiting for fragments %s", g, blocked)
          slot.learner.give_up_waiting(blocked)
          self.rt.recorder.span(slot, "wait", since, self.now)
          self._after_step(slot)
      elif kind == "fault":
        self._fault(data, down_since)
      elif kind == "down_end":
        slot = self.rt.slots[data]
        self.rt.recorder.span(slot, "down", down_since.pop(data), self.now)
        self._join(slot)
      elif kind == "eval":
        self.on_eval(self.now)
        if any(s.status == "up" for s in self.rt.slots):
          self._push(self.now + cfg.train.eval_every * cfg.learners.virtual_step_s, "eval")

  def _wake_waiting(self) -> None:
    for g in sorted(self._waiting):
      slot = self.rt.slots[g]
      blocked = slot.learner.sync_point()
      if not blocked:
        since, _ = self._waiting.pop(g)
        self.rt.recorder.span(slot, "wait", since, self.now)
        if slot.learner.local_step >= self.cfg.train.steps:
          self.rt.stop_learner(slot, "done")
        else:
          self._schedule_step(slot, self.now)

  def _fault(self, fault: faults_lib.Fault, down_since: dict[int, float]) -> None:
    if fault.kind == "add":
      idle = [s for s in self.rt.slots if s.status == "idle"]
      if not idle:
        logging.warning("fault add@%s: no spare device group left; ignored", fault.at)
        return
      self._join(idle[0])
      return
    slot = self.rt.slots[fault.learner]
    if slot.status != "up":
      logging.warning("fault %s: learner %d is %s; ignored", fault.kind, slot.index, slot.status)
      return
    self._waiting.pop(slot.index, None)
    if fault.kind == "remove":
      self.rt.stop_learner(slot, "retired")
      return
    self.rt.stop_learner(slot, "down")
    down_since[slot.index] = self.now
    self._push(self.now + fault.duration, "down_end", slot.index)


class ThreadedDriver:
  """Wall-clock driver: a thread per learner, one for the syncer; faults from the main thread."""

  def __init__(self, runtime: Runtime, on_eval, on_step):
    self.rt, self.on_eval, self.on_step = runtime, on_eval, on_step
    self.cfg = runtime.cfg
    self._t0 = time.monotonic()
    self._done = threading.Event()
    self._errors: list[BaseException] = []
    self._stops: dict[int, threading.Event] = {}
    self._threads: dict[int, threading.Thread] = {}
    self.lock = threading.Lock()  # guards the syncer against concurrent readers

  def now(self) -> float:
    return time.monotonic() - self._t0

  def _guard(self, fn, *args) -> None:
    try:
      fn(*args)
    except BaseException as e:  # surfaced by the main thread
      logging.exception("runtime thread failed")
      self._errors.append(e)
      self._done.set()

  def _syncer_loop(self) -> None:
    deadline = None
    while not self._done.is_set():
      wait = 0.05 if deadline is None else min(0.05, max(deadline - self.now(), 0.0))
      self.rt.transport.wait_for_messages(wait)
      beats, payloads = self.rt.transport.take()
      with self.lock:
        merged, deadline = self.rt.syncer.tick(self.now(), beats, payloads)
      for m in merged:
        self.rt.transport.publish(m)

  def _learner_loop(self, slot: Slot, stop: threading.Event) -> None:
    start = self.now()
    learner = self.rt.start_learner(slot, background_io=True, now=start)
    self.rt.recorder.span(slot, "load", start, self.now())
    previous = self.now()
    step_time = 0.0
    steps = self.cfg.train.steps
    while not stop.is_set() and learner.local_step < steps and not self._done.is_set():
      learner.step(self.now(), step_time)
      measured = self.now() - previous
      extra = (self.rt.step_duration(slot) - 1.0) * measured
      if extra > 0 and stop.wait(extra):
        break
      end = self.now()
      step_time = end - previous
      self.rt.recorder.span(slot, "step", previous, end, local_step=learner.local_step,
                            tokens=learner.tokens_per_step)
      self.on_step(slot)
      blocked = learner.sync_point()
      waited_from = self.now()
      while blocked and not stop.is_set() and not self._done.is_set():
        if self.now() - waited_from > self.cfg.sync.heartbeat_timeout_s:
          logging.warning("learner %d gave up waiting for fragments %s", slot.index, blocked)
          learner.give_up_waiting(blocked)
          break
        self.rt.transport.heartbeat(Heartbeat(slot.index, slot.incarnation, learner.local_step,
                                              step_time, self.now()))
        p = blocked[0]
        self.rt.transport.wait_for(p, self.rt.transport.latest_version(p) + 1, 0.2)
        blocked = learner.sync_point()
      if self.now() - waited_from > 1e-3:
        self.rt.recorder.span(slot, "wait", waited_from, self.now())
      previous = self.now()
    learner.read_metrics()
    learner.flush()
    finished = learner.local_step >= steps
    self.rt.stop_learner(slot, "done" if finished and not stop.is_set() else slot.status)

  def _start(self, slot: Slot) -> None:
    stop = threading.Event()
    self._stops[slot.index] = stop
    slot.status = "up"
    thread = threading.Thread(target=self._guard, args=(self._learner_loop, slot, stop),
                              name=f"learner-{slot.index}", daemon=True)
    self._threads[slot.index] = thread
    thread.start()

  def _stop(self, slot: Slot, status: str) -> None:
    slot.status = status  # read by the learner thread when it exits
    self._stops[slot.index].set()
    self._threads[slot.index].join()

  def run(self) -> None:
    cfg = self.cfg
    for m in self.rt.syncer.initial(0.0):
      self.rt.transport.publish(m)
    syncer = threading.Thread(target=self._guard, args=(self._syncer_loop,), name="syncer",
                              daemon=True)
    syncer.start()
    for slot in self.rt.slots[:cfg.learners.count]:
      self._start(slot)
    pending = list(self.rt.faults)
    returns: list[tuple[float, Slot, float]] = []
    next_eval = cfg.train.eval_every
    while not self._done.is_set():
      now = self.now()
      while pending and pending[0].at <= now:
        self._fault(pending.pop(0), returns)
      for item in [r for r in returns if r[0] <= now]:
        returns.remove(item)
        _, slot, since = item
        self.rt.recorder.span(slot, "down", since, self.now())
        self._start(slot)
      progress = max((s.resume.local_step if s.learner is None else s.learner.local_step)
                     for s in self.rt.slots)
      if next_eval and progress >= next_eval:
        with self.lock:
          self.on_eval(self.now())
        next_eval += cfg.train.eval_every
      if all(s.status in ("idle", "retired", "done") for s in self.rt.slots) and not returns:
        break
      time.sleep(0.05)
    self._done.set()
    syncer.join()
    for thread in self._threads.values():
      thread.join()
    if self._errors:
      raise self._errors[0]
    beats, payloads = self.rt.transport.take()
    self.rt.syncer.tick(self.now(), beats, payloads)

  def _fault(self, fault: faults_lib.Fault, returns) -> None:
    if fault.kind == "add":
      idle = [s for s in self.rt.slots if s.status == "idle"]
      if idle:
        self._start(idle[0])
      else:
        logging.warning("fault add@%s: no spare device group left; ignored", fault.at)
      return
    slot = self.rt.slots[fault.learner]
    if slot.status != "up":
      logging.warning("fault %s: learner %d is %s; ignored", fault.kind, slot.index, slot.status)
      return
    if fault.kind == "remove":
      self._stop(slot, "retired")
      return
    self._stop(slot, "down")
    returns.append((self.now() + fault.duration, slot, self.now()))
