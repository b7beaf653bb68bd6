"""Durable single-controller runs: Orbax checkpoints of the syncer and the learners' resume points.

A checkpoint holds what a killed process cannot rebuild: the global parameters G, the
Nesterov momentum, the fragment versions, the round counter, the syncer's registry and EMAs
(`Syncer.export_state`, one per syncer shard: `syncer` the first, `syncer_shards` all of them
when `sync.shards` > 1), each slot's resume point (local step, Grain iterator state,
incarnation, status), the run's clock, and how much of tape.jsonl, activity.jsonl and
metrics.jsonl it covers. It is taken under `Runtime.lock` (host copies only, so the syncer
waits for a memcpy, never for disk) and written by Orbax in the background.

Resume (the same command and --workdir) restores the syncer from the newest *committed*
checkpoint (Orbax writes into a tmp directory and renames it on commit; a save killed
midway is never listed), cuts the JSONL files back to what that checkpoint covers, and
restarts every learner that was up or down as a new incarnation from its resume point: it
loads the published fragments like any rejoin (docs/design.md 2.5), and its AdamW moments
restart from zero (they are not saved: G, not a learner's state, is the model).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from diloco import documents
from diloco import fragments as fragments_lib
from diloco.config.run_config import Config
from diloco.documents import Field
from diloco.errors import ConfigError, DocumentError
from diloco.learner.learner import Resume
from diloco.model import config as model_config
from diloco.train import data as data_lib

DIRECTORY = "run_checkpoints"
LOG_FILES = ("tape.jsonl", "activity.jsonl")
METRICS_FILE = "metrics.jsonl"
# Groups that may change between a run and its resume: how it prints, how it checkpoints and
# how SLURM schedules it.
_FREE_GROUPS = ("log", "checkpoint", "slurm")
# What a resume reads of a checkpoint's meta (`take_snapshot` writes it), checked on load.
_META_FIELDS = {"syncer": dict, "versions": list, "rounds": int, "clock": float,
                "initial_loss": Field((float, type(None)), finite=False), "identity": dict,
                "lengths": dict, "slots": list, "finished": Field(bool, required=False),
                "syncer_shards": Field(list, required=False)}
_SLOT_FIELDS = {"index": int, "status": str, "incarnation": int, "local_step": int,
                "data_state": (dict, type(None)), "merged_step": int}


@dataclasses.dataclass
class Snapshot:
  """One consistent cut of a run: host copies of G and the momentum, and JSON metadata."""
  params: dict[str, np.ndarray]
  momentum: dict[str, np.ndarray]
  meta: dict[str, Any]
  source: str = DIRECTORY  # the step directory it was loaded from, for errors


def identity(cfg: Config) -> dict[str, Any]:
  """The config fields a resumed run must share with the checkpoint's: all but the free
  groups and the model's speed switches."""
  raw = dataclasses.asdict(cfg)
  return _without_switches({k: v for k, v in raw.items() if k not in _FREE_GROUPS})


def _without_switches(fields: dict[str, Any]) -> dict[str, Any]:
  # Also applied to a saved identity: snapshots written before the switches were left out,
  # and before the syncer had shards (one shard, the defaults).
  if isinstance(fields.get("sync"), dict):
    fields = dict(fields, sync={"shards": 1, "shard": 0, **fields["sync"]})
  return dict(fields, model=model_config.layout(fields["model"])) if "model" in fields else fields


def _differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
  out = []
  for key in sorted(set(saved) | set(current)):
    a, b = saved.get(key), current.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      out += _differences(a, b, f"{prefix}{key}.")
    elif a != b:
      out.append(f"{prefix}{key}: {a!r} -> {b!r}")
  return out


class ResumePoints:
  """Each learner's latest step boundary, recorded by the learner's own thread.

  A Grain iterator is not safe to query while its thread steps it, so learners note
  `(incarnation, Resume)` here between steps and the snapshot only reads these notes.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._notes: dict[int, tuple[int, Resume]] = {}

  def note(self, slot) -> None:
    resume = slot.learner.resume_point()
    with self._lock:
      self._notes[slot.index] = (slot.incarnation, resume)

  def of(self, slot) -> Resume:
    """The slot's resume point: its running incarnation's last note, else the slot's own."""
    with self._lock:
      note = self._notes.get(slot.index)
    if slot.learner is not None and note is not None and note[0] == slot.incarnation:
      return note[1]
    return slot.resume


class MergedSteps:
  """Per (learner, incarnation), the newest local step of its deliveries that G has merged.

  Follows the recorder's round records (`Recorder.follow`); read under `Runtime.lock`.
  """

  def __init__(self):
    self.newest: dict[tuple[int, int], int] = {}

  def add(self, record: dict) -> None:
    for a in record["admitted"]:
      key = (a["learner"], a["incarnation"])
      self.newest[key] = max(self.newest.get(key, -1), a["local_step"])


def take_snapshot(rt, points: ResumePoints, merged: MergedSteps, now: float, *,
                  initial_loss: float, finished: bool = False) -> Snapshot:
  """Copies the run's durable state under `rt.lock`: no disk, no device work."""
  metrics = os.path.join(rt.workdir, METRICS_FILE)
  with rt.lock:
    syncer = rt.syncer
    params = syncer.global_params()
    momentum = {k: v.copy() for k, v in syncer.momentum.items()}
    tape_len, activity_len = rt.recorder.mark()
    states = syncer.export_states()
    meta = {
        "syncer": states[0], "versions": list(syncer.versions),
        "rounds": syncer.rounds, "clock": now, "initial_loss": initial_loss,
        "finished": finished, "identity": identity(rt.cfg),
        "lengths": {"tape.jsonl": tape_len, "activity.jsonl": activity_len,
                    METRICS_FILE: os.path.getsize(metrics) if os.path.exists(metrics) else 0},
        "slots": [],
    }
    if len(states) > 1:
      meta["syncer_shards"] = states
    for slot in rt.slots:
      resume = points.of(slot)
      meta["slots"].append({
          "index": slot.index, "status": slot.status, "incarnation": slot.incarnation,
          "local_step": resume.local_step, "data_state": resume.data_state,
          "merged_step": merged.newest.get((slot.index, slot.incarnation), -1)})
  return Snapshot(params, momentum, meta)


class RunCheckpointer:
  """An Orbax CheckpointManager over `Composite(params, momentum, meta)` in WORKDIR/run_checkpoints.

  Steps number the checkpoints of a run (1, 2, ...; a resumed run continues the count), and
  `max_to_keep` prunes the oldest. `save` returns once Orbax has taken the (already private)
  host arrays; the write and the commit happen on Orbax's background thread.
  """

  def __init__(self, workdir: str, cfg: Config):
    self.directory = os.path.join(os.path.abspath(workdir), DIRECTORY)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=cfg.checkpoint.max_to_keep,
            enable_async_checkpointing=cfg.checkpoint.async_save,
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
            create=True))
    latest = self._manager.latest_step()
    self._next = 1 if latest is None else latest + 1
    self.saved = 0

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, snapshot: Snapshot) -> int:
    step = self._next
    self._next += 1
    self._manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(fragments_lib.unflatten_tree(snapshot.params)),
        momentum=ocp.args.StandardSave(fragments_lib.unflatten_tree(snapshot.momentum)),
        meta=ocp.args.JsonSave(snapshot.meta)), force=True)
    self.saved += 1
    return step

  def load(self, step: int | None = None) -> Snapshot | None:
    """The committed checkpoint `step` (default: the newest), or None if there is none."""
    step = self._manager.latest_step() if step is None else step
    if step is None:
      return None
    where = os.path.join(self.directory, str(step))
    try:
      r = self._manager.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(), momentum=ocp.args.StandardRestore(),
          meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except  (whatever Orbax makes of bad files)
      raise DocumentError(where, "", f"cannot be restored ({type(e).__name__}: "
                          f"{documents.show(str(e), 160)}); it was changed outside the run, or "
                          "use a fresh --workdir") from None

    def flat(tree):
      return {k: np.asarray(v, np.float32) for k, v in fragments_lib.flatten_tree(tree).items()}

    meta = check_meta(r.meta, os.path.join(where, "meta"))
    return Snapshot(flat(r.params), flat(r.momentum), meta, where)

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def check_meta(meta, file: str) -> dict:
  """A checkpoint's meta, checked before a resume reads it: the fields `take_snapshot` writes,
  of their types, whole numbers where they count, one entry per slot index."""
  meta = documents.obj(meta, file)
  documents.fields(meta, _META_FIELDS, file)
  for p, version in enumerate(meta["versions"]):
    if documents.value(version, int, file, f"versions.{p}") < 0:
      raise DocumentError(file, f"versions.{p}", f"must be >= 0, got {version}")
  for name in LOG_FILES + (METRICS_FILE,):
    got = documents.fields(meta["lengths"], {name: int}, file, prefix="lengths.")[name]
    if got < 0:
      raise DocumentError(file, f"lengths.{name}", f"must be >= 0, got {got}")
  for key in ("model", "sync"):
    if key in meta["identity"]:
      documents.obj(meta["identity"][key], file, f"identity.{key}")
  seen = set()
  for i, slot in enumerate(meta["slots"]):
    documents.fields(documents.obj(slot, file, f"slots.{i}"), _SLOT_FIELDS, file,
                     prefix=f"slots.{i}.")
    if slot["index"] < 0 or slot["index"] in seen:
      raise DocumentError(file, f"slots.{i}.index", f"must be a new index >= 0, got "
                          f"{slot['index']}")
    seen.add(slot["index"])
  for i, state in enumerate(meta.get("syncer_shards") or []):
    documents.obj(state, file, f"syncer_shards.{i}")
  return dict(meta)


def check_resumable(snapshot: Snapshot, cfg: Config, workdir: str) -> None:
  """One-line ConfigErrors instead of silently mixing two runs in one workdir."""
  saved_shards = len(snapshot.meta.get("syncer_shards") or [None])
  if saved_shards != cfg.sync.shards:
    raise ConfigError(f"sync.shards: --workdir={workdir} holds a checkpoint of {saved_shards} "
                      f"syncer shard(s), this run asks for {cfg.sync.shards} (fragments would "
                      f"change owner); resume with --config.sync.shards={saved_shards} or use a "
                      "fresh --workdir")
  if snapshot.meta.get("finished"):
    raise ConfigError(f"--workdir={workdir} holds a finished run (its final checkpoint is in "
                      f"{DIRECTORY}/); use a fresh --workdir")
  diff = _differences(_without_switches(snapshot.meta["identity"]), identity(cfg))
  if diff:
    raise ConfigError(f"--workdir={workdir} holds a checkpoint of a different config ("
                      f"{'; '.join(diff[:3])}{'; ...' if len(diff) > 3 else ''}); use a fresh "
                      "--workdir or the original config")


def _cut_lines(path: str, keep: int) -> None:
  """Leaves the first `keep` complete lines of `path` (records written after the checkpoint,
  and a line torn by the kill, go)."""
  lines = []
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      for line in f:
        if len(lines) == keep or not line.endswith("\n"):
          break
        lines.append(line)
  if len(lines) < keep:
    raise DocumentError(path, "", f"has {len(lines)} records, fewer than the {keep} its "
                        "checkpoint covers; it was changed outside the run")
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(lines)
  os.replace(tmp, path)


def _cut_bytes(path: str, size: int) -> None:
  if not os.path.exists(path):
    return
  with open(path, "rb") as f:
    data = f.read(size)
  data = data[:data.rfind(b"\n") + 1]  # whole lines only
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(data)
  os.replace(tmp, path)


def rewind_logs(workdir: str, snapshot: Snapshot) -> None:
  """Cuts tape.jsonl, activity.jsonl and metrics.jsonl back to what `snapshot` covers, so the
  resumed run appends without gaps or duplicates (rounds stay numbered 0, 1, ...)."""
  lengths = snapshot.meta["lengths"]
  for name in LOG_FILES:
    _cut_lines(os.path.join(workdir, name), lengths[name])
  _cut_bytes(os.path.join(workdir, METRICS_FILE), lengths[METRICS_FILE])


def _fast_forward(cfg: Config, learner: int, num_learners: int, data_state: dict | None,
                  batches: int) -> dict:
  """The iterator state `batches` batches past `data_state` (on the restoring thread)."""
  it = iter(data_lib.train_dataset(cfg.data, batch_size=cfg.train.batch_size,
                                   learner_id=learner, num_learners=num_learners, seed=cfg.seed))
  if data_state is not None:
    it.set_state(data_state)
  for _ in range(batches):
    next(it)
  return it.get_state()


def _check_fits(rt, snapshot: Snapshot) -> None:
  """DocumentError when the checkpoint does not hold what this runtime restores: a version per
  fragment, every tensor of the plan, a slot index that exists."""
  file = os.path.join(snapshot.source, "meta")
  if len(snapshot.meta["versions"]) != len(rt.plan.fragments):
    raise DocumentError(file, "versions", f"lists {len(snapshot.meta['versions'])} fragments, "
                        f"the run has {len(rt.plan.fragments)}")
  for paths in rt.plan.fragments:
    for k in paths:
      for what, tensors in (("params", snapshot.params), ("momentum", snapshot.momentum)):
        if k not in tensors:
          raise DocumentError(os.path.join(snapshot.source, what), k, "is missing")
        # As the multi-process `recover` refuses a non-finite version: G never resumes NaN.
        if not np.all(np.isfinite(tensors[k])):
          raise DocumentError(os.path.join(snapshot.source, what), k, "values are not finite "
                              "(NaN or inf); the checkpoint is refused (it was changed outside "
                              "the run); use a fresh --workdir")
  for i, saved in enumerate(snapshot.meta["slots"]):
    if saved["index"] >= len(rt.slots):
      raise DocumentError(file, f"slots.{i}.index", f"is {saved['index']}; the run has "
                          f"{len(rt.slots)} learner slots")


def restore(rt, snapshot: Snapshot) -> list[int]:
  """Puts `snapshot` into a fresh runtime; returns the slots to restart (were up or down).

  A delivery can be merged before its learner noted the step that made it (the snapshot
  falls between the two); such a learner resumes after its newest merged step, its data
  iterator advanced to match, so no batch enters G twice.
  """
  meta = snapshot.meta
  syncer = rt.syncer
  versions = meta["versions"]
  _check_fits(rt, snapshot)
  fragments, history = {}, {}
  for p, paths in enumerate(rt.plan.fragments):
    fragments[p] = (versions[p], {k: snapshot.params[k] for k in paths},
                    {k: snapshot.momentum[k] for k in paths})
    # Restarted learners load the current versions, so only those are ever a delivery's base.
    history[p] = {versions[p]: {k: snapshot.params[k].copy() for k in paths}}
  syncer.restore_states(meta.get("syncer_shards") or [meta["syncer"]], fragments, history)
  if syncer.rounds != meta["rounds"]:
    raise DocumentError(snapshot.source, "rounds", f"its syncer shards hold {syncer.rounds} "
                        f"rounds, its record {meta['rounds']}; it was changed outside the run")
  restart = []
  for saved in meta["slots"]:
    slot = rt.slots[saved["index"]]
    local_step, data_state = saved["local_step"], saved["data_state"]
    ahead = saved["merged_step"] - local_step
    if ahead > 0:
      data_state = _fast_forward(rt.cfg, slot.index, len(rt.slots), data_state, ahead)
      local_step = saved["merged_step"]
      logging.info("learner %d resumes at merged step %d (noted %d)", slot.index, local_step,
                   saved["local_step"])
    slot.resume = Resume(local_step, data_state)
    slot.incarnation = saved["incarnation"]
    slot.status = saved["status"]
    if slot.status in ("up", "down"):
      slot.status = "down"  # until the driver starts its next incarnation
      restart.append(slot.index)
  rt.clock_start = float(meta["clock"])
  rt.faults = [f for f in rt.faults if f.at > rt.clock_start]  # past faults already happened
  return restart


class Periodic:
  """Checkpoints every `every_rounds` merged rounds from its own thread (wall-clock driver).

  The syncer thread only ever waits for the snapshot's memcpy under `Runtime.lock`; Orbax
  writes in the background, and a save that must wait for the previous one waits here.
  """

  def __init__(self, take, checkpointer: RunCheckpointer, rounds, every_rounds: int):
    self._take, self._ckpt, self._rounds, self._every = take, checkpointer, rounds, every_rounds
    self._last = rounds()
    self._stop = threading.Event()
    self.error: BaseException | None = None
    self._thread = threading.Thread(target=self._loop, name="run-checkpoint", daemon=True)

  def start(self) -> None:
    self._thread.start()

  def _loop(self) -> None:
    try:
      while not self._stop.wait(0.1):
        rounds = self._rounds()
        if rounds >= self._last + self._every:
          self._last = rounds
          self._ckpt.save(self._take())
    except BaseException as e:  # surfaced by `stop`
      logging.exception("run checkpoint failed")
      self.error = e

  def stop(self) -> None:
    self._stop.set()
    self._thread.join()
    if self.error is not None:
      raise self.error
