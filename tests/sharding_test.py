"""Learner meshes and the shardings of parameters, optimizer state and activations."""

import types

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from diloco.errors import ConfigError
from diloco.model import presets as model_presets
from diloco.model.sharding import batch_sharding
from diloco.train import mesh as mesh_lib
from diloco.train import optim
from diloco.train import state as train_state
from diloco.train.mesh import MeshConfig
from diloco.train.optim import OptimConfig


@pytest.fixture
def mesh_2x4():
  return mesh_lib.learner_mesh(jax.devices(), MeshConfig(data=1, fsdp=2, tensor=4))


def test_resolve_shape_fills_one_axis():
  assert mesh_lib.resolve_shape(MeshConfig(data=-1, fsdp=2, tensor=1), 8) == (4, 2, 1)
  assert mesh_lib.resolve_shape(MeshConfig(data=2, fsdp=1, tensor=-1), 8) == (2, 1, 4)


def test_mesh_product_mismatch_names_fields():
  with pytest.raises(ConfigError, match=r"mesh data x fsdp x tensor = 2 x 2 x 1 = 4 .* 8"):
    mesh_lib.resolve_shape(MeshConfig(data=2, fsdp=2, tensor=1), 8)
  with pytest.raises(ConfigError, match=r"mesh.data=-1 cannot fill 8"):
    mesh_lib.resolve_shape(MeshConfig(data=-1, fsdp=3, tensor=1), 8)


def test_device_groups_contiguous_and_by_slice():
  devices = jax.devices()
  groups = mesh_lib.device_groups(devices, [2, 2, 4])
  assert [[d.id for d in g] for g in groups] == [[0, 1], [2, 3], [4, 5, 6, 7]]
  fake = [types.SimpleNamespace(id=i, slice_index=1 - i // 4) for i in range(8)]
  by_slice = mesh_lib.device_groups(fake, [4, 4])
  assert [d.id for d in by_slice[0]] == [4, 5, 6, 7]  # slice 0 first
  with pytest.raises(ConfigError, match="span slices"):
    mesh_lib.device_groups(fake, [2, 6])
  with pytest.raises(ConfigError, match="sum to 6"):
    mesh_lib.device_groups(devices, [2, 4])


def test_learner_mesh_on_a_device_subset():
  mesh = mesh_lib.learner_mesh(jax.devices()[4:], MeshConfig(data=-1, fsdp=1, tensor=2))
  assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2}
  assert {d.id for d in mesh.devices.flat} == {4, 5, 6, 7}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_parameter_and_optimizer_shardings(mesh_2x4):
  cfg = model_presets.get("tiny")
  spec = train_state.make_spec(cfg, optim.inner_optimizer(OptimConfig(), 10), mesh_2x4)
  state = train_state.create(cfg, spec, jax.random.key(0))
  params = state["params"]
  assert params["embedder"]["embedding"].sharding.spec == P("tensor", "fsdp")
  attn = params["layers"][0]["attn"]
  assert attn["q_DNH"].sharding.spec == P("fsdp", "tensor", None)
  assert attn["k_DKH"].sharding.spec == P("fsdp", None, None)
  assert attn["o_NHD"].sharding.spec == P("tensor", None, "fsdp")
  mlp = params["layers"][1]["mlp"]
  assert mlp["gate_DF"].sharding.spec == P("fsdp", "tensor")
  assert mlp["down_FD"].sharding.spec == P("tensor", "fsdp")
  # Each device holds 1/8 of the MLP matrix: 2-way fsdp times 4-way tensor.
  shard = mlp["down_FD"].addressable_shards[0].data
  assert shard.shape == (cfg.mlp_dim // 4, cfg.embed_dim // 2)
  # AdamW moments are sharded like their parameters, the count is replicated.
  adam = state["opt_state"][1][0]
  assert adam.mu["layers"][1]["mlp"]["down_FD"].sharding.spec == P("tensor", "fsdp")
  assert adam.count.sharding.spec == P()


def test_activation_shardings(mesh_2x4):
  cfg = model_presets.get("tiny")
  spec = train_state.make_spec(cfg, optim.inner_optimizer(OptimConfig(), 10), mesh_2x4)
  state = train_state.create(cfg, spec, jax.random.key(0))
  from flax import nnx
  tokens = jax.device_put(jnp.zeros((4, 16), jnp.int32), batch_sharding(mesh_2x4))
  assert tokens.sharding.spec == P(("data", "fsdp"), None)
  with jax.set_mesh(mesh_2x4):
    logits, _ = jax.jit(lambda p, t: nnx.merge(spec.graphdef, p)(t))(state["params"], tokens)
  # data has size 1 here, so JAX may write the spec as P('fsdp', None, 'tensor').
  expected = jax.sharding.NamedSharding(mesh_2x4, P(("data", "fsdp"), None, "tensor"))
  assert logits.sharding.is_equivalent_to(expected, 3)
  assert logits.addressable_shards[0].data.shape == (2, 16, cfg.vocab_size // 4)
