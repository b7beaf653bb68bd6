"""The global model's evaluation in the multi-process runtime, kept off the merge path.

Where it runs is `train.eval_mode`:
  * "background": in the syncer process, on a thread. The syncer never waits for it (the
    first evaluation included); only the final one, after the last merge, is waited for.
    Fine on CPU hosts and small models; it shares the syncer host's cores.
  * "process": in a process of its own (`--role=evaluator`, started and supervised by the
    launcher), on its own devices (an accelerator where the host has one). It reads the
    published versions from the store, as a learner does, and never writes there. At large
    scale this is the one to use: a syncer host's CPU takes on the order of an hour to
    evaluate a 2B model.
  * "off": no global evaluation; `eval/loss` is absent from the run's results.

Evaluations follow the learners' progress (their heartbeats' local steps): one at the start,
one every `train.eval_every` steps (skipped while the previous one is still running), and
one on the final versions. Records go to `WORKDIR/metrics.jsonl` with role "syncer" (the
global model's metrics, whoever computes them); which version of each fragment an evaluation
used goes to `WORKDIR/eval_versions.jsonl` ({"step", "time", "versions": {fragment: version}}).

With a sharded syncer (`sync.shards` > 1, docs/design.md 3.1) no syncer holds the whole model:
the evaluator process assembles G from every shard's newest committed versions
(`read_global` over `store.shard_stores`), and a run asking for "background" evaluates in the
evaluator process instead (the launcher starts it).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time

import jax
from absl import logging

from diloco import fragments as fragments_lib
from diloco.config.run_config import Config
from diloco.distributed.store import Store, global_index, shard_stores
from diloco.distributed.store import layout as store_layout
from diloco.distributed.store.global_view import published, read_global, read_store, stopped
from diloco.learner.island import fragment_plan, initial_global
from diloco.model.sharding import batch_sharding
from diloco.observe import metrics as metrics_lib
from diloco.train import data as data_lib
from diloco.train import mesh as mesh_lib
from diloco.train import optim
from diloco.train import state as train_state
from diloco.train import step as train_step

# How often the evaluator process looks at the store's heartbeats and registry.
_POLL_S = 0.5
VERSIONS_FILE = "eval_versions.jsonl"


def model_on_first_device(cfg: Config):
  """Spec, init and eval step of the model on this process's first device."""
  mesh = mesh_lib.learner_mesh(jax.devices()[:1], type(cfg.mesh)(data=1, fsdp=1, tensor=1))
  spec = train_state.make_spec(cfg.model, optim.inner_optimizer(cfg.optim, cfg.train.steps),
                               mesh)
  return spec, train_state.make_init(cfg.model, spec), train_step.make_eval_step(spec)


class Evaluator:
  """Evaluates flat global parameters on the held-out batches, in place or on a thread (one
  at a time: a request while one runs is skipped, so evaluations never queue up)."""

  def __init__(self, cfg: Config, spec, eval_fn, writer: metrics_lib.MetricWriter,
               versions_path: str | None = None):
    """`versions_path`: where each evaluation's fragment versions are appended (None: not)."""
    self.spec, self.eval_fn, self.writer = spec, eval_fn, writer
    self.versions_path = versions_path
    self.batches = [jax.device_put(b, batch_sharding(spec.mesh)) for b in data_lib.eval_batches(
        cfg.data, batch_size=cfg.train.batch_size, num_batches=cfg.train.eval_batches)]
    self._thread: threading.Thread | None = None
    self.last: float | None = None
    self._last_at: tuple[int, int] | None = None  # (step, rounds) of `last`
    self.skipped = 0

  def evaluate(self, flat_params: dict, step: int, now: float, rounds: int,
               versions: dict[int, int] | None = None) -> float:
    params = jax.device_put(fragments_lib.unflatten_tree(flat_params),
                            self.spec.shardings["params"])
    with jax.set_mesh(self.spec.mesh):
      loss = train_step.mean_eval_loss(self.eval_fn, params, self.batches)
    if not math.isfinite(loss):
      raise FloatingPointError(f"global eval/loss is {loss} at t={now:.1f}s")
    self.writer.write(step, {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50)),
                             "time": now, "outer/rounds": rounds})
    if versions is not None and self.versions_path is not None:
      with open(self.versions_path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": int(step), "time": now, "eval/loss": loss, "versions": {
            str(p): int(v) for p, v in sorted(versions.items())}}) + "\n")
    print(f"t={now:.1f}s step {step}: global eval/loss {loss:.4f} after {rounds} rounds",
          flush=True)
    self.last, self._last_at = loss, (step, rounds)
    return loss

  def recall(self, workdir: str) -> bool:
    """Takes the last global eval recorded in `workdir` (by an earlier incarnation of this
    process) as its own, so that a restart evaluates no step twice; False if there is none."""
    path = os.path.join(workdir, metrics_lib.METRICS_FILE)
    evals = [r for r in (metrics_lib.read_metrics(path) if os.path.exists(path) else [])
             if r.get("role") == "syncer" and "eval/loss" in r]
    if evals:
      self.last = evals[-1]["eval/loss"]
      self._last_at = (evals[-1]["step"], int(evals[-1].get("outer/rounds", -1)))
    return bool(evals)

  def final(self, flat_params: dict, step: int, now: float, rounds: int,
            versions: dict[int, int] | None = None) -> float:
    """The end-of-run eval; the last eval's loss when that one saw the same step and rounds
    (the same parameters), so that metrics.jsonl keeps one eval record per step."""
    if self._last_at == (step, rounds) and self.last is not None:
      return self.last
    return self.evaluate(flat_params, step, now, rounds, versions)

  def due(self, step: int, next_eval: int, total_steps: int) -> bool:
    """Whether a periodic eval is due at `step`: not at the last step (the final eval is
    that step's record), nor at a step evaluated already."""
    evaluated = self._last_at is not None and self._last_at[0] == step
    return bool(next_eval) and next_eval <= step < total_steps and not evaluated

  def start(self, flat_params: dict, step: int, now: float, rounds: int) -> bool:
    """Evaluates on a background thread; False (skipped) while the previous one runs."""
    if self._thread is not None and self._thread.is_alive():
      self.skipped += 1
      return False
    self._thread = threading.Thread(target=self.evaluate, args=(flat_params, step, now, rounds),
                                    daemon=True, name="eval")
    self._thread.start()
    return True

  def join(self) -> None:
    if self._thread is not None:
      self._thread.join()


def _progress(store: Store) -> int:
  """The learners' furthest local step, from their heartbeats."""
  steps = [0]
  for record in store.learners.heartbeats().values():
    try:
      steps.append(int(record["local_step"]))
    except (KeyError, TypeError, ValueError):
      continue
  return max(steps)


def run(cfg: Config, workdir: str, store_root: str) -> dict:
  """`--role=evaluator`: evaluates published versions until every syncer shard has stopped."""
  stores = shard_stores(store_root, cfg.sync.shards)
  store = stores[0].shared
  spec, init_fn, eval_fn = model_on_first_device(cfg)
  layout = store_layout.layout_record(cfg.sync.shards, fragment_plan(cfg, spec),
                                     spec.abstract["params"])
  store_layout.claim(store, layout)
  writer = metrics_lib.open_writer(cfg.log, workdir, role="syncer", process="evaluator")
  evaluator = Evaluator(cfg, spec, eval_fn, writer, os.path.join(workdir, VERSIONS_FILE))
  restarted = evaluator.recall(workdir)
  origin = store.run.start() or time.time()
  clock = lambda: time.time() - origin  # noqa: E731  (the run's clock, shared by all processes)
  paths = fragments_lib.flatten_tree(spec.abstract["params"]).keys()
  try:
    if not restarted:  # version 0, as the syncer seeds it (merges may be published already)
      with jax.set_mesh(spec.mesh):
        start = initial_global(init_fn, cfg.seed, cfg, spec.abstract["params"],
                               read_store)
      evaluator.evaluate(start, 0, clock(), 0)
    while not published(stores, layout):  # each shard publishes its version 0s
      time.sleep(_POLL_S)
    index = global_index(stores)
    progress = _progress(store)
    every = cfg.train.eval_every
    next_eval = (progress // every + 1) * every if every else 0
    print(f"evaluator: on {jax.devices()[0].device_kind}, from step {progress}", flush=True)
    while True:
      if all(stopped(s) for s in stores):
        flat, index, rounds = read_global(stores, with_rounds=True, paths=paths, layout=layout)
        final = evaluator.final(flat, _progress(store), clock(), rounds, index)
        break
      progress = _progress(store)
      if evaluator.due(progress, next_eval, cfg.train.steps):
        flat, index, rounds = read_global(stores, with_rounds=True, paths=paths, layout=layout)
        evaluator.evaluate(flat, progress, clock(), rounds, index)
        next_eval = (progress // every + 1) * every
      time.sleep(_POLL_S)
  finally:
    writer.close()
  logging.info("evaluator: final versions %s", index)
  print(f"evaluator: stopped, eval/loss {final:.4f}", flush=True)
  return {"eval/loss": final}
