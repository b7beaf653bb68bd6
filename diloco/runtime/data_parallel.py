"""The data-parallel run: one learner over all visible devices, no syncer.

This is the quality and speed reference of docs/design.md 2.6 and the loop the DiLoCo
learner reuses: dispatch step t, then read step t-1's metrics (already computed), so
the host never stalls the device; evaluate and checkpoint on schedule; resume from
the last checkpoint with the exact same trajectory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import jax
import jax.numpy as jnp
from absl import logging

from diloco import fragments as fragments_lib
from diloco.artifacts import export, hf_import
from diloco.config.run_config import Config, check_in_process_eval
from diloco.distributed.store import global_view
from diloco.errors import ConfigError
from diloco.model.sharding import batch_sharding
from diloco.observe import hooks as hooks_lib
from diloco.observe import metrics as metrics_lib
from diloco.observe import report, tracking
from diloco.train import checkpoint as checkpoint_lib
from diloco.train import data as data_lib
from diloco.train import mesh as mesh_lib
from diloco.train import optim
from diloco.train import state as train_state
from diloco.train import step as train_step


def check_batch(cfg: Config, mesh: jax.sharding.Mesh) -> None:
  width = mesh_lib.data_parallel_width(mesh)
  if cfg.train.batch_size % width:
    raise ConfigError(f"train.batch_size={cfg.train.batch_size} must be divisible by "
                      f"mesh data x fsdp = {width}")


def check_vocab(cfg: Config) -> None:
  data_lib.check_vocab(cfg.data, cfg.model.vocab_size)


def _finite_or_raise(step: int, values: dict[str, float]) -> None:
  bad = {k: v for k, v in values.items() if not math.isfinite(v)}
  if bad:
    raise FloatingPointError(f"non-finite metrics at step {step}: {bad}; lower "
                             "optim.learning_rate or check the data")


def _device_params(params, spec: train_state.StateSpec):
  """Nested NumPy parameters put onto the state's parameter shardings."""
  shardings = fragments_lib.flatten_tree(spec.shardings["params"])
  return fragments_lib.unflatten_tree({k: jax.device_put(v, shardings[k]) for k, v in
                                       fragments_lib.flatten_tree(params).items()})


def evaluate(eval_fn, params, batches) -> dict[str, float]:
  loss = train_step.mean_eval_loss(eval_fn, params, batches)
  return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}


def _prepare(cfg: Config, workdir: str):
  """Checks what can be checked before anything is built; the mesh and the resolved config
  (also written to WORKDIR/config.json)."""
  check_in_process_eval(cfg, "data-parallel runtime")
  os.makedirs(workdir, exist_ok=True)
  mesh = mesh_lib.learner_mesh(jax.devices(), cfg.mesh)
  check_batch(cfg, mesh)
  check_vocab(cfg)
  tracking.check(cfg.log)
  logging.info("data-parallel run: %s", mesh_lib.describe(mesh))
  config_json = dataclasses.asdict(cfg)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(config_json, f, indent=2)
  return mesh, config_json


def _restore_or_create(cfg: Config, spec, ckpt, data_iter, identity: dict):
  """The newest checkpoint's state (and data position), else a fresh state, with the
  parameters of `train.init_from` when given (fresh optimizer state)."""
  latest = ckpt.latest_step()
  if latest is not None:
    state, _ = ckpt.restore(latest, spec.abstract, data_iter, expect_meta=identity)
    logging.info("resumed from %s at step %d", ckpt.directory, latest)
    return state
  state = train_state.create(cfg.model, spec, jax.random.key(cfg.seed))
  if cfg.train.init_from:
    state = dict(state, params=_device_params(export.load_init(
        cfg.train.init_from, spec.abstract["params"], global_view.read_store,
        hf_import.read_folder), spec))
  return state


def run(cfg: Config, workdir: str, hooks=()) -> dict[str, float]:
  """Trains `cfg` data-parallel in `workdir`, resuming if it holds a checkpoint; `hooks`
  (`diloco.observe.hooks.Hook`, on="learner", and those of `log.hooks`) see its steps, and
  one may end it early.

  Returns the last evaluation metrics.
  """
  hooks = [*hooks, *hooks_lib.load(cfg.log.hooks)]
  if any(isinstance(h, hooks_lib.Hook) and h.on == "syncer" for h in hooks):
    raise ConfigError("hooks: a data-parallel run has no syncer rounds; use on='learner'")
  hook_runner = hooks_lib.HookRunner(hooks)
  try:
    return _run(cfg, workdir, hook_runner)
  finally:
    hooks_lib.report(hook_runner.close())


def _run(cfg: Config, workdir: str, hook_runner: hooks_lib.HookRunner) -> dict[str, float]:
  mesh, config_json = _prepare(cfg, workdir)
  total = cfg.train.steps
  schedule = optim.lr_schedule(cfg.optim, total)
  spec = train_state.make_spec(cfg.model, optim.inner_optimizer(cfg.optim, total), mesh)
  data_iter = iter(data_lib.train_dataset(cfg.data, batch_size=cfg.train.batch_size,
                                          seed=cfg.seed))
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint)
  identity = {"model": config_json["model"], "data": config_json["data"], "seed": cfg.seed}
  state = _restore_or_create(cfg, spec, ckpt, data_iter, identity)
  start = int(jax.device_get(state["step"]))

  step_fn = train_step.make_train_step(spec, cfg.optim, schedule)
  eval_fn = train_step.make_eval_step(spec)
  tokens_sharding = batch_sharding(mesh)
  eval_set = [jax.device_put(b, tokens_sharding) for b in data_lib.eval_batches(
      cfg.data, batch_size=cfg.train.batch_size, num_batches=cfg.train.eval_batches)]
  writer = metrics_lib.open_writer(cfg.log, workdir, role="dp", config=dataclasses.asdict(cfg),
                                   purge_step=start + 1 if start else None)
  progress = metrics_lib.Progress(total, cfg.log.progress_every_s, start_step=start)
  pending = None  # (step, device metrics) of the step dispatched last
  last_eval: dict[str, float] = {}
  evaluating = cfg.train.eval_mode != "off"

  def flush():
    nonlocal pending
    if pending is None:
      return
    step, device_metrics = pending
    pending = None
    values = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    _finite_or_raise(step, values)
    writer.write(step, values)
    progress.update(step, values["train/tokens"], values["train/loss"], force=step == total)

  try:
    with jax.set_mesh(mesh):
      if start == 0 and evaluating:
        last_eval = evaluate(eval_fn, state["params"], eval_set)
        writer.write(0, last_eval)
      t_start = time.monotonic()
      last = start
      for step in range(start + 1, total + 1):
        batch = jax.device_put(next(data_iter), tokens_sharding)
        state, device_metrics = step_fn(state, batch)
        flush()  # step - 1's metrics: ready by now, read while step runs
        pending = (step, device_metrics)
        last = step
        if hook_runner:  # called at once: a device copy of the parameters if a hook asks
          params = state["params"]
          hooks_lib.offer_learner_step(hook_runner, step, None, lambda with_params: (
              step, device_metrics, jax.tree.map(jnp.copy, params) if with_params else None))
        stopping = hook_runner.stop.is_set()
        eval_due = evaluating and (step == total or stopping or (
            cfg.train.eval_every and step % cfg.train.eval_every == 0))
        if eval_due:
          flush()
          last_eval = evaluate(eval_fn, state["params"], eval_set)
          _finite_or_raise(step, last_eval)
          writer.write(step, last_eval)
          logging.info("step %d: eval/loss %.4f", step, last_eval["eval/loss"])
          if step < total:  # the final one is the summary's first row
            print(f"step {step}: eval/loss {last_eval['eval/loss']:.4f} "
                  f"(perplexity {last_eval['eval/perplexity']:.2f})", flush=True)
        every = cfg.checkpoint.every_steps
        if every and (step % every == 0 or step == total or stopping):
          ckpt.save(step, state, data_iter, identity)
        if stopping:
          break
      flush()
      elapsed = time.monotonic() - t_start
    trained = last - start
    writer.track(last, {
        "accounting/wall_s": elapsed, "accounting/steps": trained,
        "accounting/tokens_per_s": trained * cfg.train.batch_size * cfg.data.seq_len
        / max(elapsed, 1e-9)})
    export.save(workdir, state["params"], model=cfg.model, data=cfg.data, seed=cfg.seed,
                step=last, runtime="data_parallel",
                extra={"eval/loss": last_eval.get("eval/loss", float("nan"))})
  finally:
    writer.close()
    ckpt.close()
  logging.info("trained steps %d..%d in %.1fs", start + 1, last, elapsed)
  records = metrics_lib.read_metrics(writer.path)
  metrics_lib.plot_loss(records, os.path.join(workdir, "loss.png"),
                        title=f"data-parallel, {cfg.model.name}")
  initial = next((r["eval/loss"] for r in records if r.get("step") == 0 and "eval/loss" in r),
                 None)  # a resumed run evaluated step 0 in an earlier process
  print(report.data_parallel_table(
      workdir, eval_loss=last_eval.get("eval/loss"), initial_loss=initial, eval_step=last,
      tokens=trained * cfg.train.batch_size * cfg.data.seq_len, train_s=elapsed), flush=True)
  return last_eval
