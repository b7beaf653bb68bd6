"""The Pallas splash kernel (`attention_impl="splash"`, and `"auto"` on TPU) computes the
reference attention: on CPU through Pallas' interpreter, whole and inside a `shard_map` over a
data x tensor mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import runtime_configs
from flax import nnx

from diloco import fragments as fragments_lib
from diloco.deploy import tpu_topology
from diloco.learner import island
from diloco.model import presets, splash, transformer
from diloco.train import step as train_step

# Two layers (one local with a window of 40, one global) over 128 tokens: one block of the
# kernel's, masked two ways.
_LENGTH = 128


def _cfg(**overrides):
  base = {"num_layers": 2, "attention_pattern": "LG", "sliding_window": 40,
          "query_pre_attn_scalar": 24.0}
  return dataclasses.replace(presets.get("tiny"), **{**base, **overrides})


def _loss_and_grads(cfg, mesh=None):
  tokens = jax.random.randint(jax.random.key(3), (4, _LENGTH + 1), 0, cfg.vocab_size)
  with nnx.use_eager_sharding(False):
    graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)))

  def loss_fn(p):
    logits, _ = nnx.merge(graphdef, p)(tokens[:, :-1])
    ce, _ = train_step.token_losses(logits, tokens[:, 1:])
    return jnp.mean(ce), logits

  run = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
  if mesh is None:
    (loss, logits), grads = run(params)
  else:
    with jax.set_mesh(mesh):
      (loss, logits), grads = run(params)
  flat = {k: np.asarray(v) for k, v in fragments_lib.flatten_tree(nnx.to_pure_dict(grads)).items()}
  return float(loss), np.asarray(logits), flat


def _assert_same(got, want):
  loss, logits, grads = got
  loss0, logits0, grads0 = want
  np.testing.assert_allclose(loss, loss0, rtol=1e-5)
  np.testing.assert_allclose(logits, logits0, rtol=1e-4, atol=1e-4 * np.abs(logits0).max())
  assert grads.keys() == grads0.keys()
  for k in grads0:
    scale = float(np.abs(grads0[k]).max())
    np.testing.assert_allclose(grads[k], grads0[k], rtol=1e-3, atol=1e-4 * scale, err_msg=k)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_splash_is_the_reference_attention(kv_heads):
  """MQA, GQA and MHA: the kernel's logits and every gradient match the einsum reference."""
  want = _loss_and_grads(_cfg(num_kv_heads=kv_heads))
  got = _loss_and_grads(_cfg(num_kv_heads=kv_heads, attention_impl="splash"))
  _assert_same(got, want)


@pytest.mark.parametrize("data, tensor, kv_heads", [(2, 4, 2), (4, 2, 1), (2, 2, 4)])
def test_splash_in_a_shard_map_is_the_reference_attention(data, tensor, kv_heads):
  """Query heads split over tensor: a shard's heads read the kv heads of their own groups
  (4 heads over 4 shards with 2 kv heads: one head a shard, half a group), and the gradient of
  the kv heads every shard reads is summed over the shards."""
  devices = np.array(jax.devices()[:data * tensor]).reshape(data, 1, tensor)
  mesh = jax.sharding.Mesh(devices, ("data", "fsdp", "tensor"))
  want = _loss_and_grads(_cfg(num_kv_heads=kv_heads), mesh)
  got = _loss_and_grads(_cfg(num_kv_heads=kv_heads, attention_impl="splash"), mesh)
  _assert_same(got, want)


def test_what_splash_cannot_run_is_named_and_auto_falls_back():
  assert splash.block_size(4096) == 512 and splash.block_size(384) == 128
  assert "not a multiple of 128" in splash.supports(64, 4, 2)
  assert splash.supports(128, 4, 2) == ""
  with pytest.raises(ValueError, match=r"attention_impl='splash': the sequence length 64"):
    q = jnp.zeros((1, 64, 4, 16))
    splash.attention(q, q[:, :, :2], q[:, :, :2], scale=1.0, window=None)
  # Off TPU "auto" never means splash; on a TPU mesh it does, whatever the host.
  assert transformer.resolve_attention_impl("auto", jnp.bfloat16) == "xla"
  tpu = tpu_topology.devices(tpu_topology.parse("v5e-4"), 1)
  mesh = jax.sharding.Mesh(np.array(tpu).reshape(4, 1, 1), ("data", "fsdp", "tensor"))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    assert splash.mesh_platform() == "tpu"
    assert transformer.resolve_attention_impl("auto", jnp.float32) == "splash"


def test_auto_lowers_to_xla_attention_where_no_block_divides_the_length():
  """On TPU "auto" is the kernel (`tests/tpu_compile_test.py` counts its calls in a compiled
  learner step); at a length no block divides, it lowers to XLA's attention, without one."""
  cfg = runtime_configs.load("decoupled.py:tiny", data__seq_len=64, model__dtype="bfloat16",
                             model__attention_impl="auto")
  _, _, lowered = island.lower_learner(cfg, tpu_topology.devices(tpu_topology.parse("v5e-4"), 1),
                                       0)
  text = lowered.as_text()
  assert "tpu_custom_call" not in text and "dot_general" in text
