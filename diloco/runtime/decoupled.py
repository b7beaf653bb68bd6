"""A Decoupled DiLoCo run on the single-controller runtime: wiring, status, results.

`run(cfg, workdir)` trains `learners.count` learners against the host syncer, prints
a live status, evaluates the global parameters on schedule, and leaves in `workdir`:
metrics.jsonl, tape.jsonl (one record per merged round), activity.jsonl, loss.png,
timeline.png, accounting.json (goodput, uptime, bandwidth ledger, ...), tensorboard/ (learner_<m>
and syncer runs) and export/ (the final global parameters, diloco/artifacts/export.py). The end of
the run is `diloco.observe.report`, shared with the launcher.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import jax
from absl import logging

from diloco import fragments as fragments_lib
from diloco.artifacts import export
from diloco.config.run_config import Config, check_in_process_eval
from diloco.model.sharding import batch_sharding
from diloco.observe import accounting, fidelity, tracking
from diloco.observe import hooks as hooks_lib
from diloco.observe import metrics as metrics_lib
from diloco.observe import report as report_lib
from diloco.runtime import run_checkpoint
from diloco.runtime.core import Runtime, Slot
from diloco.runtime.threaded_driver import ThreadedDriver
from diloco.runtime.virtual_driver import VirtualDriver
from diloco.train import data as data_lib


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
    stats = fidelity.round_stats(tape)
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


def run(cfg: Config, workdir: str, hooks=()) -> dict[str, float]:
  """Trains `cfg` (learners.count >= 1) in `workdir`; returns final eval and accounting.
  `hooks` (`diloco.observe.hooks.Hook`, and those of `log.hooks`) see the learners' steps and
  the syncer's rounds."""
  return run_with_runtime(cfg, workdir, hooks)[1]


def run_with_runtime(cfg: Config, workdir: str, hooks=()) -> tuple[Runtime, dict[str, float]]:
  """`run`, also returning the runtime (syncer state, records) for tests and notebooks.

  Resumes from `workdir`'s newest committed run checkpoint if it has one (see
  `diloco.runtime.run_checkpoint`); checkpoints every `checkpoint.every_rounds` rounds and at
  the end.
  """
  hook_runner = hooks_lib.for_process(cfg.log.hooks, hooks)
  ckpt = None
  try:
    os.makedirs(workdir, exist_ok=True)
    ckpt = run_checkpoint.RunCheckpointer(workdir, cfg)
    return _run(cfg, workdir, ckpt, hook_runner)
  finally:
    hooks_lib.report(hook_runner.close())
    if ckpt is not None:
      ckpt.close()  # waits for the last save: a finished run's final checkpoint is committed


def _run(cfg: Config, workdir: str, ckpt: run_checkpoint.RunCheckpointer,
         hook_runner: hooks_lib.HookRunner) -> tuple[Runtime, dict[str, float]]:
  """Prepare the workdir, build (or restore) the runtime, train, close the records, export G,
  report (`diloco.observe.report`, shared with the launcher)."""
  snapshot = _prepare(cfg, workdir, ckpt)
  rt = _runtime(cfg, workdir, ckpt, snapshot)
  session = _Session(cfg, workdir, rt, ckpt, snapshot, hook_runner)
  try:
    try:
      final = session.train()
    finally:
      session.close_records()
    session.status.maybe_print(force=True)
    session.export(final)
    summary = session.report(final)
  finally:
    session.writer.close()
  return rt, summary


def _prepare(cfg: Config, workdir: str, ckpt: run_checkpoint.RunCheckpointer
             ) -> run_checkpoint.Snapshot | None:
  """Checks the config, loads the newest run checkpoint (rewinding the logs to it, or
  starting them afresh without one) and writes config.json."""
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
  from diloco.runtime import data_parallel  # pylint: disable=import-outside-toplevel
  data_parallel.check_vocab(cfg)
  return snapshot


def _runtime(cfg: Config, workdir: str, ckpt: run_checkpoint.RunCheckpointer,
             snapshot: run_checkpoint.Snapshot | None) -> Runtime:
  """The runtime, restored from `snapshot` when there is one."""
  rt = Runtime(cfg, workdir, resume=snapshot is not None)
  if snapshot is not None:
    rt.restart = run_checkpoint.restore(rt, snapshot)
    print(f"resumed from {ckpt.directory}/{ckpt.latest_step()}: round {rt.syncer.rounds}, "
          f"t={rt.clock_start:.1f}s, versions {rt.syncer.versions}, learners "
          + ", ".join(f"L{s.index} s{s.resume.local_step}" for s in rt.slots
                      if s.index in rt.restart), flush=True)
  logging.info("%d learner groups, %d fragments, %d parameters", len(rt.slots),
               rt.plan.num_fragments, rt.num_params)
  return rt


@dataclasses.dataclass
class _LastEval:
  """The last global eval recorded: at which step, after how many rounds, its loss."""
  step: int | None = None
  rounds: int = -1
  loss: float | None = None


class _Session:
  """One run of the runtime: its writers, evals, checkpoints and the driver's callbacks."""

  def __init__(self, cfg: Config, workdir: str, rt: Runtime,
               ckpt: run_checkpoint.RunCheckpointer, snapshot: run_checkpoint.Snapshot | None,
               hook_runner: hooks_lib.HookRunner | None = None):
    self.cfg, self.workdir, self.rt, self.ckpt, self.snapshot = cfg, workdir, rt, ckpt, snapshot
    self.hooks = hook_runner or hooks_lib.HookRunner()
    rt.stop_requested = self.hooks.stop
    if self.hooks:
      first = rt.syncer.rounds  # a resumed run's rounds replayed from the tape are not new
      rt.recorder.follow(lambda record: self._syncer_hooks(record, first))
    slot0 = rt.slots[0].spec
    self.eval_set = [jax.device_put(b, batch_sharding(slot0.mesh)) for b in data_lib.eval_batches(
        cfg.data, batch_size=cfg.train.batch_size, num_batches=cfg.train.eval_batches)]
    # A resumed run hides the TensorBoard events written after its checkpoint (they are redone).
    resumed_at = max(s.resume.local_step for s in rt.slots) if snapshot is not None else 0
    self.writer = metrics_lib.open_writer(cfg.log, workdir, role="syncer", process="decoupled",
                                          config=dataclasses.asdict(cfg),
                                          purge_step=resumed_at or None)
    # Learners' train/* go to WORKDIR/tensorboard/learner_<m> from their own threads: a
    # tracker only enqueues (see diloco/observe/tracking.py).
    self.learner_writers = {s.index: metrics_lib.open_writer(
        cfg.log, workdir, role="learner", learner=s.index, process="decoupled",
        purge_step=s.resume.local_step + 1 if s.resume.local_step else None) for s in rt.slots}
    self.status = Status(rt, cfg.log.progress_every_s)
    self.written: dict[int, int] = {}
    self.points, self.merged = run_checkpoint.ResumePoints(), run_checkpoint.MergedSteps()
    rt.recorder.follow(self.merged.add)
    rt.on_done = self.on_done
    self.virtual = cfg.learners.virtual_clock
    self.last_saved = rt.syncer.rounds
    self.last_eval = _LastEval()
    if snapshot is not None:  # the evals kept by the rewind: a resumed run adds none at a step
      evals = [r for r in metrics_lib.read_metrics(self.writer.path)
               if r.get("role") == "syncer" and "eval/loss" in r]
      if evals:
        self.last_eval = _LastEval(evals[-1]["step"], int(evals[-1].get("outer/rounds", -1)),
                                   evals[-1]["eval/loss"])
    self.initial: float | None = None
    self.started = time.monotonic()
    self.driver = (VirtualDriver if self.virtual else ThreadedDriver)(rt, self.on_eval,
                                                                      self.on_step)

  def now(self) -> float:
    return self.driver.now if self.virtual else self.driver.now()

  def progress(self) -> int:
    return max(s.learner.local_step if s.learner else s.resume.local_step for s in self.rt.slots)

  def on_eval(self, now: float, final: bool = False) -> float | None:
    """The global eval, one record per step: a periodic eval at the last step, or at a step
    already evaluated, is left to the final one; the final eval of parameters evaluated
    already at its step reuses that loss. Only the final eval is not printed here (the
    report's table shows it)."""
    if self.cfg.train.eval_mode == "off":
      return None
    step, rounds, last = self.progress(), self.rt.syncer.rounds, self.last_eval
    if not final and (step >= self.cfg.train.steps or step == last.step):
      return None
    if final and step == last.step and rounds == last.rounds:
      return last.loss
    loss = self.rt.evaluate(self.eval_set)
    if not math.isfinite(loss):
      raise FloatingPointError(f"global eval/loss is {loss} at t={now:.1f}s")
    self.writer.write(step, {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50)),
                             "time": now, "outer/rounds": rounds})
    self.last_eval = _LastEval(step, rounds, loss)
    if not final:
      print(f"t={now:.1f}s step {step}: global eval/loss {loss:.4f}", flush=True)
    return loss

  def snapshot_now(self, finished: bool = False) -> run_checkpoint.Snapshot:
    return run_checkpoint.take_snapshot(self.rt, self.points, self.merged, self.now(),
                                        initial_loss=self.initial, finished=finished)

  def write_learner(self, slot: Slot) -> None:
    last = slot.learner.last_values
    if last is not None and self.written.get(slot.index) != last[0]:
      self.written[slot.index] = last[0]
      self.learner_writers[slot.index].write(last[0],
                                             dict(last[1], incarnation=slot.incarnation))

  def on_done(self, slot: Slot) -> None:
    try:
      slot.learner.read_metrics()  # its last step's metrics, which no next step reads
    except FloatingPointError as e:
      logging.warning("learner %d: last step's metrics not written: %s", slot.index, e)
      return
    self.write_learner(slot)

  def _syncer_hooks(self, record: dict, first: int) -> None:
    """The syncer's hooks due after this round (the syncer's thread: a hand-over only; G is
    read, under the runtime's lock, by the hook's thread)."""
    if int(record.get("round", -1)) + 1 > first:
      hooks_lib.offer_round(self.hooks, record,
                            lambda: fragments_lib.flatten_tree(self.rt.global_params()))

  def on_step(self, slot: Slot) -> None:
    if self.hooks:  # the learner's thread, between steps: a hand-over
      hooks_lib.offer_learner_step(self.hooks, slot.learner.local_step, slot.index,
                                   slot.learner.hook_parts)
    self.write_learner(slot)
    every = self.cfg.checkpoint.every_rounds
    if self.virtual and every and self.rt.syncer.rounds >= self.last_saved + every:
      # Before this step's note: its deliveries are not ticked yet, so it is replayed.
      self.last_saved = self.rt.syncer.rounds
      self.ckpt.save(self.snapshot_now())
    self.points.note(slot)  # this learner's thread, between its steps
    self.status.maybe_print()

  def train(self) -> float | None:
    """Evaluates the initial parameters, runs the driver to the end (checkpointing every
    `checkpoint.every_rounds` rounds), evaluates and checkpoints the end; the final loss."""
    rt, every = self.rt, self.cfg.checkpoint.every_rounds
    self.initial = self.on_eval(rt.clock_start)
    if self.snapshot is not None:
      self.initial = self.snapshot.meta["initial_loss"]
    periodic = None
    if every and not self.virtual:
      periodic = run_checkpoint.Periodic(self.snapshot_now, self.ckpt,
                                         lambda: rt.syncer.rounds, every)
      periodic.start()
    try:
      self.driver.run()
    finally:
      if periodic is not None:
        periodic.stop()
    final = self.on_eval(self.now(), final=True)
    if every:
      self.ckpt.save(self.snapshot_now(finished=True))
    return final

  def close_records(self) -> None:
    self.rt.recorder.close()
    for w in self.learner_writers.values():
      w.close()

  def export(self, final: float | None) -> None:
    export.save(self.workdir, self.rt.global_params(), model=self.cfg.model,
                data=self.cfg.data, seed=self.cfg.seed, step=self.progress(),
                runtime="decoupled", extra={"outer/rounds": self.rt.syncer.rounds,
                                            "eval/loss": final})

  def report(self, final: float | None) -> dict[str, float]:
    rt, cfg = self.rt, self.cfg
    figures = report_lib.RunFigures(
        eval_loss=final, initial_loss=self.initial, eval_step=self.progress(),
        wall_s=time.monotonic() - self.started,
        restarts=sum(max(s.incarnation, 0) for s in rt.slots), syncer_restarts=0,
        chaos_events=len(rt.faults),
        chaos_applied=self.driver.faults_fired - self.driver.faults_ignored)
    return report_lib.finish(
        self.workdir, num_fragments=rt.plan.num_fragments, num_params=rt.num_params,
        figures=figures, tape=rt.recorder.tape(), activity=rt.recorder.activity(),
        writer=self.writer,
        loss_title=f"Decoupled DiLoCo, M={cfg.learners.count}, {cfg.model.name}",
        timeline_title=f"M={cfg.learners.count}, K={cfg.sync.quorum or 'M'}, "
                       f"P={rt.plan.num_fragments}, H={cfg.sync.period}")
