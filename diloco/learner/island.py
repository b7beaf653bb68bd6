"""A learner island: what both runtimes build for one learner before it starts.

Its mesh and ahead-of-time compiled init and train step, the fragment plan of its parameters,
the global parameters at version 0, and the pacing that emulates a slower island on a small
host. Shared by the single-controller runtime (a group of this process's devices) and the
learner and syncer processes (all devices of one process).
"""

from __future__ import annotations

import collections
import threading

import jax
import numpy as np

from diloco import fragments as fragments_lib
from diloco.errors import ConfigError
from diloco.learner.learner import LearnerConfig
from diloco.model import registry
from diloco.model.sharding import batch_sharding
from diloco.train import mesh as mesh_lib
from diloco.train import optim
from diloco.train import state as train_state
from diloco.train import step as train_step


def pacing_wait(measured_s: float, factor: float, min_step_s: float) -> float:
  """Seconds to wait after a step that took `measured_s` on the wall clock, so that it lasts
  `factor * max(measured_s, min_step_s)`: a learner `factor` times slower than its hardware,
  on steps at least `min_step_s` long (`learners.min_step_s` paces a small host like a big
  model, so fault schedules in seconds mean the same on fast and slow machines)."""
  return max(factor * max(measured_s, min_step_s) - measured_s, 0.0)


def build_learner(cfg: LearnerConfig, devices, index: int):
  """A learner's mesh over `devices`, its state spec, and its init and train step compiled.

  Compiled ahead of time so that no learner compiles on the run's clock; shared by both
  runtimes (a group of this process's devices, or all devices of a learner process).
  """
  spec, init, step = lower_learner(cfg, devices, index)
  return spec, init.compile(), step.compile()


def lower_learner(cfg: LearnerConfig, devices, index: int):
  """`build_learner`'s spec and its init and train step lowered, not yet compiled (for
  devices of any platform: `diloco compile` lowers them for a TPU slice on a CPU host)."""
  total = cfg.train.steps
  schedule = optim.lr_schedule(cfg.optim, total)
  tx = optim.inner_optimizer(cfg.optim, total)
  mesh = mesh_lib.learner_mesh(list(devices), cfg.mesh)
  width = mesh_lib.data_parallel_width(mesh)
  if cfg.train.batch_size % width:
    raise ConfigError(f"train.batch_size={cfg.train.batch_size} must be divisible by "
                      f"learner {index}'s data x fsdp = {width}")
  spec = train_state.make_spec(cfg.model, tx, mesh)
  batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.data.seq_len + 1), np.int32,
                               sharding=batch_sharding(spec.mesh))
  key = jax.eval_shape(lambda: jax.random.key(0))
  init_fn, step_fn = shared_programs(cfg, spec, schedule)
  with jax.set_mesh(spec.mesh):
    return spec, init_fn.lower(key), step_fn.lower(spec.abstract, batch)


# The jitted init and train step of each recent learner configuration, shared by every learner
# built with it: JAX traces and lowers a shared program once per mesh shape and compiles it per
# device set (its outputs are placed by PartitionSpecs, resolved on the mesh it is lowered
# under; meshes of another shape get their own), and in one process a learner rebuilt on the
# same devices reuses the executable.
# M learners of one run used to trace and lower M copies of the same program.
_SHARED_MAX = 8
_shared: collections.OrderedDict = collections.OrderedDict()
_shared_lock = threading.Lock()


def shared_programs(cfg: LearnerConfig, spec: train_state.StateSpec, schedule):
  """(init, step) jitted for `cfg`'s model, inner optimiser and schedule, with mesh-free output
  placements; the same objects for every learner of that configuration (the last
  `_SHARED_MAX` configurations are kept)."""
  key = (cfg.model, registry.get(cfg.model), cfg.optim,
         optim.decay_length(cfg.optim, cfg.train.steps), tuple(spec.mesh.shape.items()))
  with _shared_lock:
    if key in _shared:
      _shared.move_to_end(key)
      return _shared[key]
    specs = train_state.partition_specs(spec)
    programs = (train_state.make_init(cfg.model, spec, out_shardings=specs),
                train_step.make_train_step(spec, cfg.optim, schedule, out_shardings=specs))
    _shared[key] = programs
    while len(_shared) > _SHARED_MAX:
      _shared.popitem(last=False)
    return programs


def fragment_plan(cfg: LearnerConfig, spec: train_state.StateSpec) -> fragments_lib.FragmentPlan:
  flat = fragments_lib.flatten_tree(spec.abstract["params"])
  embedding = registry.get(cfg.model).embedding_paths
  missing = sorted(set(embedding) - set(flat))
  if missing:
    raise ConfigError(f"model.arch={cfg.model.arch!r}: its embedding_paths {missing} are not "
                      f"parameters of the model; it has {sorted(flat)[:8]}...")
  return fragments_lib.plan_fragments({k: v.shape for k, v in flat.items()},
                                      cfg.sync.num_fragments, cfg.sync.scheme,
                                      embedding_paths=embedding)


def initial_global(init_fn, seed: int, cfg: LearnerConfig | None = None,
                   abstract_params=None, read_store=None) -> dict[str, np.ndarray]:
  """The global parameters at version 0, flattened: learner init with the run's seed, or the
  parameters of `cfg.train.init_from` (shape-checked against `abstract_params`; a store is read
  by `read_store`, an `export.StoreReader` the runtime passes)."""
  if cfg is not None and cfg.train.init_from:
    from diloco.artifacts import export, hf_import  # pylint: disable=import-outside-toplevel
    params = export.load_init(cfg.train.init_from, abstract_params, read_store,
                              hf_import.read_folder)
    return {k: np.asarray(v) for k, v in fragments_lib.flatten_tree(params).items()}
  init = init_fn(jax.random.key(seed))
  return {k: np.asarray(v) for k, v in
          fragments_lib.flatten_tree(jax.device_get(init["params"])).items()}
