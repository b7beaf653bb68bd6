"""The inner optimizers: AdamW (the default) and Muon (`optim.name=muon`), checked against optax
applied by hand, and the placement and reset of their state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
import runtime_configs

from diloco.learner import learner as learner_lib
from diloco.train import mesh as mesh_lib
from diloco.train import optim
from diloco.train import state as train_state


@pytest.mark.parametrize("path, ndim, reduction, output", [
    ("layers/0/attn/q_DNH", 3, (0,), (1, 2)),       # width to heads
    ("layers/attn/q_DNH", 4, (1,), (2, 3)),         # a scan's stacked layers: a batch axis
    ("layers/0/attn/o_NHD", 3, (0, 1), (2,)),       # heads back to the width
    ("layers/0/mlp/down_FD", 2, (0,), (1,)),
    ("layers/0/mlp/up_DF", 2, (0,), (1,)),
    ("layers/0/mlp/down_EFD", 3, (1,), (2,)),       # per expert
    ("layers/3/mlp/gate_EDF", 3, (1,), (2,)),
])
def test_muon_takes_each_projection_as_inputs_by_outputs(path, ndim, reduction, output):
  dims = optim.muon_dimensions(path, ndim)
  assert (tuple(dims.reduction_axis), tuple(dims.output_axis)) == (reduction, output)


@pytest.mark.parametrize("path, ndim", [("embedder/embedding", 2), ("final_norm/scale", 1),
                                        ("layers/0/mlp/router_DE", 2),
                                        ("layers/0/attn/q_norm/scale", 1)])
def test_the_embedding_norms_and_router_go_to_adamw(path, ndim):
  assert optim.muon_dimensions(path, ndim) is None


def _config(name, **fields):
  return runtime_configs.load("dp.py:tiny", optim__name=name, optim__warmup_steps=0,
                              optim__grad_clip_norm=0.0, **fields).optim


def test_a_muon_step_on_a_projection_is_optax_muon_on_its_matrix():
  """A (D, N, H) query projection is updated as optax's Muon updates the (D, N x H) matrix."""
  cfg = _config("muon")
  rng = np.random.default_rng(0)
  w = rng.normal(size=(8, 2, 4)).astype(np.float32)
  g = rng.normal(size=(8, 2, 4)).astype(np.float32)
  ours = optim.inner_optimizer(cfg, 10)
  params = {"layers": {"0": {"attn": {"q_DNH": jnp.asarray(w)}}}}
  grads = {"layers": {"0": {"attn": {"q_DNH": jnp.asarray(g)}}}}
  updates, _ = ours.update(grads, ours.init(params), params)
  reference = optax.contrib.muon(optim.lr_schedule(cfg, 10, cfg.muon_learning_rate),
                                 beta=cfg.muon_beta, eps=cfg.eps, weight_decay=cfg.weight_decay)
  flat_w, flat_g = jnp.asarray(w.reshape(8, 8)), jnp.asarray(g.reshape(8, 8))
  expected, _ = reference.update(flat_g, reference.init(flat_w), flat_w)
  np.testing.assert_allclose(np.asarray(updates["layers"]["0"]["attn"]["q_DNH"]).reshape(8, 8),
                             np.asarray(expected), rtol=1e-5, atol=1e-7)
  # Not AdamW's update: Muon's is orthogonalised (its largest singular values near 1 x lr).
  s = np.linalg.svd(np.asarray(expected) / cfg.muon_learning_rate, compute_uv=False)
  assert 0.5 < s.max() < 1.6


def test_adamw_is_unchanged_by_the_switch():
  cfg = _config("adamw")
  reference = optax.adamw(optim.lr_schedule(cfg, 10), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                          weight_decay=cfg.weight_decay, mask=lambda p: jax.tree.map(
                              lambda x: x.ndim >= 2, p))
  params = {"w": jnp.ones((3, 4)), "b": jnp.ones((4,))}
  grads = {"w": jnp.full((3, 4), 0.5), "b": jnp.full((4,), -2.0)}
  ours = optim.inner_optimizer(cfg, 10)
  got, _ = ours.update(grads, ours.init(params), params)
  want, _ = reference.update(grads, reference.init(params), params)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got,
               want)


@pytest.mark.parametrize("name", optim.INNER_OPTIMIZERS)
def test_the_state_is_placed_as_its_parameters(name):
  """Every moment sits where its parameter does; for AdamW exactly as optax's own
  `tree_map_params` places it."""
  cfg = runtime_configs.load("dp.py:tiny", optim__name=name, mesh__fsdp=2, mesh__data=1)
  tx = optim.inner_optimizer(cfg.optim, 10)
  spec = train_state.make_spec(cfg.model, tx, mesh_lib.learner_mesh(jax.devices()[:2],
                                                                    cfg.mesh))
  params = spec.shardings["params"]
  state = spec.shardings["opt_state"]
  moments = [s for s in jax.tree.leaves(state) if s.spec != jax.sharding.PartitionSpec()]
  assert moments and all(s in jax.tree.leaves(params) for s in moments)
  if name == "adamw":
    replicated = jax.sharding.NamedSharding(spec.mesh, jax.sharding.PartitionSpec())
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          spec.abstract["opt_state"])
    expected = optax.tree_map_params(tx, lambda _, s: s, shapes, params,
                                     transform_non_params=lambda _: replicated)
    assert jax.tree.leaves(expected) == jax.tree.leaves(state)


def test_a_receipt_resets_muons_momentum_of_its_fragment_only():
  cfg = _config("muon")
  tx = optim.inner_optimizer(cfg, 10)
  params = {"a": {"up_DF": jnp.ones((4, 4))}, "b": {"up_DF": jnp.ones((4, 4))},
            "norm": {"scale": jnp.ones((4,))}}
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.3), params)
  _, state = tx.update(grads, tx.init(params), params)
  reset = learner_lib._zero_moments(state, {"a/up_DF", "norm/scale"})
  muon = [s for s in jax.tree.leaves(reset, is_leaf=lambda n: isinstance(
      n, optax.contrib.MuonState)) if isinstance(s, optax.contrib.MuonState)][0]
  assert float(jnp.abs(muon.mu["a"]["up_DF"]).max()) == 0.0
  assert float(jnp.abs(muon.mu["b"]["up_DF"]).max()) > 0.0
  adam = [s for s in jax.tree.leaves(reset, is_leaf=lambda n: isinstance(
      n, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)][0]
  assert float(jnp.abs(adam.nu["norm"]["scale"]).max()) == 0.0


@pytest.mark.slow
def test_decoupled_learners_train_with_muon_and_reset_its_moments_on_receipt(tmp_path):
  """A virtual-clock Decoupled run with Muon inside and `receipt.reset_moments`: every learner in
  every round, the global model's loss well below its start, and the export written."""
  import json

  from diloco.runtime import decoupled
  cfg = runtime_configs.load("decoupled.py:tiny", optim__name="muon",
                             learners__virtual_clock=True, train__steps=24,
                             receipt__reset_moments=True)
  final = decoupled.run(cfg, str(tmp_path))
  with open(tmp_path / "tape.jsonl", encoding="utf-8") as f:
    tape = [json.loads(line) for line in f if line.strip()]
  assert tape and all(len(r["admitted"]) == cfg.learners.count for r in tape)
  with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
    evals = [r["eval/loss"] for r in map(json.loads, f) if "eval/loss" in r]
  assert final["eval/loss"] == evals[-1] and evals[-1] < evals[0] - 1.0
  assert (tmp_path / "export" / "export.json").exists()
