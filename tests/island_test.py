"""A learner island's programs (`island.build_learner`): the learners of one configuration share
one jitted init and train step, traced and lowered once and compiled on each learner's own
devices, and what each learner runs is the program it would have compiled alone."""

import jax
import numpy as np
import runtime_configs

from diloco.learner import island
from diloco.model.sharding import batch_sharding
from diloco.train import mesh as mesh_lib
from diloco.train import optim
from diloco.train import state as train_state
from diloco.train import step as train_step


def _cfg(**dotted):
  return runtime_configs.load(**{"learners__count": 2, "learners__devices": "2,2", **dotted})


def _count_traces(monkeypatch) -> list[int]:
  """A list that grows by one each time a train step is traced (its forward pass runs)."""
  calls = []
  forward = train_step._forward

  def counted(*args):
    calls.append(1)
    return forward(*args)

  monkeypatch.setattr(train_step, "_forward", counted)
  return calls


def _devices_of(shardings) -> set:
  return set().union(*(s.device_set for s in jax.tree.leaves(shardings)))


def test_learners_of_one_configuration_trace_their_step_once(monkeypatch):
  monkeypatch.setattr(island, "_shared", type(island._shared)())
  traces = _count_traces(monkeypatch)
  cfg = _cfg()
  devices = jax.devices()
  built = [island.build_learner(cfg, devices[2 * i:2 * i + 2], i) for i in range(2)]
  assert len(traces) == 1
  for i, (spec, init, step) in enumerate(built):
    own = set(devices[2 * i:2 * i + 2])
    assert set(spec.mesh.devices.flat) == own
    assert _devices_of(init.output_shardings) == own
    assert _devices_of(step.input_shardings) == own
    assert _devices_of(step.output_shardings[0]) == own
  # Another length with the same schedule (its decay set apart from the length) is the same
  # program; another schedule is another.
  spec = built[0][0]

  def programs(**dotted):
    other = _cfg(**dotted)
    return island.shared_programs(other, spec, optim.lr_schedule(other.optim,
                                                                 other.train.steps))

  decay, first = cfg.optim.decay_steps, programs()
  assert len(island._shared) == 1 and len(traces) == 1
  assert programs(train__steps=cfg.train.steps + 5, optim__decay_steps=decay) == first
  assert programs(optim__decay_steps=decay + 1) != first
  assert programs(optim__decay_steps=0, train__steps=decay + 1) != first


def test_the_shared_step_is_the_program_a_learner_compiles_alone():
  """Lowered on learner 1's mesh, the shared step (placed by PartitionSpecs) is the program
  placed by learner 1's own NamedShardings, and one step of each gives the same state bit for
  bit."""
  cfg = _cfg()
  devices = jax.devices()
  island.build_learner(cfg, devices[:2], 0)  # learner 0 makes the shared programs
  spec, init, step = island.build_learner(cfg, devices[2:4], 1)
  schedule = optim.lr_schedule(cfg.optim, cfg.train.steps)
  alone = train_step.make_train_step(spec, cfg.optim, schedule)
  batch_spec = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.data.seq_len + 1), np.int32,
                                    sharding=batch_sharding(spec.mesh))
  with jax.set_mesh(spec.mesh):
    shared_text = island.shared_programs(cfg, spec, schedule)[1].lower(
        spec.abstract, batch_spec).as_text()
    alone_text = alone.lower(spec.abstract, batch_spec).as_text()
  assert shared_text == alone_text

  tokens = np.random.default_rng(0).integers(
      0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.data.seq_len + 1), dtype=np.int32)
  results = []
  for run in (step, alone):
    state = init(jax.random.key(3))
    with jax.set_mesh(spec.mesh):
      state, metrics = run(state, jax.device_put(tokens, batch_sharding(spec.mesh)))
    results.append(jax.device_get((state, metrics)))
  for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
    np.testing.assert_array_equal(a, b)


def test_the_shared_programs_keep_the_latest_configurations(monkeypatch):
  monkeypatch.setattr(island, "_shared", type(island._shared)())
  extra = 3
  cfgs = [_cfg(optim__decay_steps=20 + i) for i in range(island._SHARED_MAX + extra)]
  for cfg in cfgs:
    tx = optim.inner_optimizer(cfg.optim, cfg.train.steps)
    spec = train_state.make_spec(cfg.model, tx,
                                 mesh_lib.learner_mesh(jax.devices()[:2], cfg.mesh))
    island.shared_programs(cfg, spec, optim.lr_schedule(cfg.optim, cfg.train.steps))
  assert [key[3] for key in island._shared] == [c.optim.decay_steps for c in cfgs[extra:]]
