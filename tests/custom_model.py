"""A user's model, registered by name: what `--config.model.module=tests/custom_model.py
--config.model.arch=mixer_lm` plugs in (diloco/model/registry.py lists the contract)."""

import jax
import jax.numpy as jnp
from flax import nnx

from diloco.model import registry


class _Mixer(nnx.Module):
  """Residual MLP over a causal running mean of the sequence."""

  def __init__(self, d: int, f: int, *, rngs: nnx.Rngs):
    self.up_DF = nnx.Param(jax.nn.initializers.normal(d ** -0.5)(rngs.params(), (d, f)),
                           out_sharding=("embed", "mlp"))
    self.down_FD = nnx.Param(jax.nn.initializers.normal(f ** -0.5)(rngs.params(), (f, d)),
                             out_sharding=("mlp", "embed"))
    self.scale_D = nnx.Param(jnp.ones((d,)), out_sharding=("embed",))

  def __call__(self, x_BLD):
    length = x_BLD.shape[1]
    mean_BLD = jnp.cumsum(x_BLD, axis=1) / jnp.arange(1, length + 1)[None, :, None]
    h_BLF = jax.nn.gelu((x_BLD + mean_BLD) @ self.up_DF[...])
    return x_BLD + (h_BLF @ self.down_FD[...]) * self.scale_D[...]


class MixerLM(nnx.Module):
  """Token embedding, `num_layers` mixers, tied output head; returns logits only."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d = cfg.embed_dim
    self.embed = nnx.Param(jax.nn.initializers.normal(d ** -0.5)(
        rngs.params(), (cfg.vocab_size, d)), out_sharding=("vocab", "embed"))
    self.layers = nnx.List([_Mixer(d, cfg.mlp_dim, rngs=rngs) for _ in range(cfg.num_layers)])

  def __call__(self, tokens_BL):
    table_VD = self.embed[...]
    x_BLD = table_VD[tokens_BL]
    for layer in self.layers:
      x_BLD = layer(x_BLD)
    return x_BLD @ table_VD.T


registry.register("mixer_lm", MixerLM, embedding_paths=("embed",))
