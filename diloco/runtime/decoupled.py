"""A Decoupled DiLoCo run on the single-controller runtime: wiring, status, results.

`run(cfg, workdir)` trains `learners.count` learners against the host syncer, prints
a live status, evaluates the global parameters on schedule, and leaves in `workdir`:
metrics.jsonl, tape.jsonl (one record per merged round), activity.jsonl, loss.png,
timeline.png, accounting.json (goodput, uptime, bandwidth ledger, ...), tensorboard/ (learner_<m>
and syncer runs) and export/ (the final global parameters, diloco/train/export.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import jax
from absl import logging

from diloco.config_lib import Config, check_in_process_eval
from diloco.model.sharding import batch_sharding
from diloco.observe import accounting
from diloco.observe import metrics as metrics_lib
from diloco.observe import timeline
from diloco.observe import tracking
from diloco.runtime import checkpoint as run_checkpoint
from diloco.runtime.core import Runtime, Slot
from diloco.runtime.drivers import ThreadedDriver, VirtualDriver
from diloco.train import data as data_lib
from diloco.train import export


class Status:
  """Rate-limited one-screen status: learners and syncer."""

  def __init__(self, rt: Runtime, every_s: float):
    self.rt, self.every_s = rt, every_s
    self._last = 0.0
    self._tokens: dict[int, tuple[float, int]] = {}

  def line(self) -> str:
    parts = []
    now = time.monotonic()
    for slot in self.rt.slots:
      if slot.status == "idle":
        continue
      step = slot.learner.local_step if slot.learner else slot.resume.local_step
      t0, s0 = self._tokens.get(slot.index, (now, step))
      rate = (step - s0) * self.rt.cfg.train.batch_size * self.rt.cfg.data.seq_len / max(
          now - t0, 1e-9)
      self._tokens[slot.index] = (now, step)
      parts.append(f"L{slot.index} {slot.status} s{step} {rate:,.0f}tok/s")
    s = self.rt.syncer
    tape, activity = self.rt.recorder.recent()  # a window: all of a short run's records
    goodput = accounting.goodput(tape, activity, self.rt.plan.num_fragments)
    stats = accounting.round_stats(tape)
    return (" | ".join(parts) + f" || syncer: rounds {s.rounds}, learners/round "
            f"{stats['mean_learners']:.2f} (last {s.last_quorum}), grace {s.last_grace:.2f}s, "
            f"rejected {sum(s.rejections.values())}, goodput {goodput:.2f}")

  def maybe_print(self, force: bool = False) -> None:
    now = time.monotonic()
    if force or now - self._last >= self.every_s:
      self._last = now
      line = self.line()
      logging.info("%s", line)
      print(line, flush=True)


def run(cfg: Config, workdir: str) -> dict[str, float]:
  """Trains `cfg` (learners.count >= 1) in `workdir`; returns final eval and accounting."""
  return run_with_runtime(cfg, workdir)[1]


def run_with_runtime(cfg: Config, workdir: str) -> tuple[Runtime, dict[str, float]]:
  """`run`, also returning the runtime (syncer state, records) for tests and notebooks.

  Resumes from `workdir`'s newest committed run checkpoint if it has one (see
  `diloco.runtime.checkpoint`); checkpoints every `checkpoint.every_rounds` rounds and at the end.
  """
  os.makedirs(workdir, exist_ok=True)
  ckpt = run_checkpoint.RunCheckpointer(workdir, cfg)
  try:
    return _run(cfg, workdir, ckpt)
  finally:
    ckpt.close()  # waits for the last save: a finished run's final checkpoint is committed


def _run(cfg: Config, workdir: str, ckpt: run_checkpoint.RunCheckpointer
         ) -> tuple[Runtime, dict[str, float]]:
  tracking.check(cfg.log)
  check_in_process_eval(cfg, "single-controller runtime")
  snapshot = ckpt.load()
  if snapshot is not None:
    run_checkpoint.check_resumable(snapshot, cfg, workdir)
    run_checkpoint.rewind_logs(workdir, snapshot)
  elif os.path.exists(os.path.join(workdir, metrics_lib.METRICS_FILE)):
    os.remove(os.path.join(workdir, metrics_lib.METRICS_FILE))  # a run that never checkpointed
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=2)
  from diloco.train import data_parallel as train  # pylint: disable=import-outside-toplevel
  train.check_vocab(cfg)
  rt = Runtime(cfg, workdir, resume=snapshot is not None)
  if snapshot is not None:
    rt.restart = run_checkpoint.restore(rt, snapshot)
    print(f"resumed from {ckpt.directory}/{ckpt.latest_step()}: round {rt.syncer.rounds}, "
          f"t={rt.clock_start:.1f}s, versions {rt.syncer.versions}, learners "
          + ", ".join(f"L{s.index} s{s.resume.local_step}" for s in rt.slots
                      if s.index in rt.restart), flush=True)
  logging.info("%d learner groups, %d fragments, %d parameters", len(rt.slots),
               rt.plan.num_fragments, rt.num_params)
  slot0 = rt.slots[0].spec
  eval_set = [jax.device_put(b, batch_sharding(slot0.mesh)) for b in data_lib.eval_batches(
      cfg.data, batch_size=cfg.train.batch_size, num_batches=cfg.train.eval_batches)]
  # A resumed run hides the TensorBoard events written after its checkpoint (they are redone).
  resumed_at = max(s.resume.local_step for s in rt.slots) if snapshot is not None else 0
  writer = metrics_lib.open_writer(cfg, workdir, role="syncer", process="decoupled",
                                   log_config=True, purge_step=resumed_at or None)
  # Learners' train/* go to WORKDIR/tensorboard/learner_<m> from their own threads: a tracker
  # only enqueues (see diloco/observe/tracking.py).
  learner_writers = {s.index: metrics_lib.open_writer(
      cfg, workdir, role="learner", learner=s.index, process="decoupled",
      purge_step=s.resume.local_step + 1 if s.resume.local_step else None) for s in rt.slots}
  status = Status(rt, cfg.log.progress_every_s)
  written: dict[int, int] = {}
  points, merged = run_checkpoint.ResumePoints(), run_checkpoint.MergedSteps()
  rt.recorder.follow(merged.add)
  every = cfg.checkpoint.every_rounds
  virtual = cfg.learners.virtual_clock
  driver_cls = VirtualDriver if virtual else ThreadedDriver

  def progress() -> int:
    return max(s.learner.local_step if s.learner else s.resume.local_step for s in rt.slots)

  def on_eval(now: float) -> float | None:
    if cfg.train.eval_mode == "off":
      return None
    loss = rt.evaluate(eval_set)
    if not math.isfinite(loss):
      raise FloatingPointError(f"global eval/loss is {loss} at t={now:.1f}s")
    writer.write(progress(), {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50)),
                              "time": now, "outer/rounds": rt.syncer.rounds})
    print(f"t={now:.1f}s step {progress()}: global eval/loss {loss:.4f}", flush=True)
    return loss

  def snapshot_now(finished: bool = False) -> run_checkpoint.Snapshot:
    now = driver.now if virtual else driver.now()
    return run_checkpoint.take_snapshot(rt, points, merged, now, initial_loss=initial,
                                        finished=finished)

  last_saved = rt.syncer.rounds

  def write_learner(slot: Slot) -> None:
    last = slot.learner.last_values
    if last is not None and written.get(slot.index) != last[0]:
      written[slot.index] = last[0]
      learner_writers[slot.index].write(last[0], dict(last[1], incarnation=slot.incarnation))

  def on_done(slot: Slot) -> None:
    try:
      slot.learner.read_metrics()  # its last step's metrics, which no next step reads
    except FloatingPointError as e:
      logging.warning("learner %d: last step's metrics not written: %s", slot.index, e)
      return
    write_learner(slot)

  rt.on_done = on_done

  def on_step(slot: Slot) -> None:
    nonlocal last_saved
    write_learner(slot)
    if virtual and every and rt.syncer.rounds >= last_saved + every:
      # Before this step's note: its deliveries are not ticked yet, so it is replayed.
      last_saved = rt.syncer.rounds
      ckpt.save(snapshot_now())
    points.note(slot)  # this learner's thread, between its steps
    status.maybe_print()

  driver = driver_cls(rt, on_eval, on_step)
  started = time.monotonic()
  initial = on_eval(rt.clock_start)
  if snapshot is not None:
    initial = snapshot.meta["initial_loss"]
  periodic = None
  if every and not virtual:
    periodic = run_checkpoint.Periodic(snapshot_now, ckpt, lambda: rt.syncer.rounds, every)
    periodic.start()
  try:
    try:
      try:
        driver.run()
      finally:
        if periodic is not None:
          periodic.stop()
      final = on_eval(driver.now if virtual else driver.now())
      if every:
        ckpt.save(snapshot_now(finished=True))
    finally:
      rt.recorder.close()
      for w in learner_writers.values():
        w.close()
    status.maybe_print(force=True)
    tape = rt.recorder.tape()
    print(accounting.fidelity_line(tape), flush=True)
    summary = accounting.summary(workdir, num_fragments=rt.plan.num_fragments,
                                 num_params=rt.num_params)
    summary.update({"eval/loss": final, "eval/initial_loss": initial,
                    "wall_s": time.monotonic() - started})
    writer.track(progress(), {k: v for k, v in summary.items() if not k.startswith("eval/")})
    export.save(workdir, rt.global_params(), cfg, step=progress(), runtime="decoupled",
                extra={"outer/rounds": rt.syncer.rounds, "eval/loss": final})
  finally:
    writer.close()
  with open(os.path.join(workdir, "accounting.json"), "w") as f:
    json.dump(summary, f, indent=2)
  records = metrics_lib.read_metrics(os.path.join(workdir, metrics_lib.METRICS_FILE))
  metrics_lib.plot_loss(records, os.path.join(workdir, "loss.png"),
                        title=f"Decoupled DiLoCo, M={cfg.learners.count}, {cfg.model.name}")
  timeline.plot_timeline(tape, rt.recorder.activity(),
                         os.path.join(workdir, "timeline.png"),
                         title=f"M={cfg.learners.count}, K={cfg.sync.quorum or 'M'}, "
                               f"P={rt.plan.num_fragments}, H={cfg.sync.period}")
  return rt, summary
