"""Autoregressive decoding with a KV cache: prefill the prompt once, then one token a step.

`generate` compiles one function per (model, prompt shape, settings): the prompt's forward
pass fills every layer's key/value cache (`Transformer.decode`), then a `jax.lax.scan` runs
the single-token steps, each reading the cache instead of re-running the sequence. Tokens are
picked greedily (temperature 0) or sampled from softmax(logits / temperature), optionally
restricted to the top k logits. Any model with `init_cache(batch, length)` and
`decode(tokens_BL, positions_BL, cache) -> (logits_BLV, cache)` decodes here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How each next token is picked. temperature 0: greedy (argmax); top_k 0: no cut-off.
  `vocab_limit`: only ids below it may be picked (a model whose table is padded beyond the
  tokenizer's ids); 0 means the whole table."""
  temperature: float = 0.0
  top_k: int = 0
  vocab_limit: int = 0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if self.vocab_limit < 0:
      raise ValueError(f"vocab_limit must be >= 0, got {self.vocab_limit}")


def pick(logits_BV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """The next token of each row, int32 [B]."""
  logits_BV = logits_BV.astype(jnp.float32)
  if sampling.vocab_limit:
    ids_V = jnp.arange(logits_BV.shape[-1])
    logits_BV = jnp.where(ids_V < sampling.vocab_limit, logits_BV, _NEG_INF)
  if sampling.temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  if sampling.top_k:
    k = min(sampling.top_k, logits_BV.shape[-1])
    kth_B1 = jax.lax.top_k(logits_BV, k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, _NEG_INF, logits_BV)
  return jax.random.categorical(key, logits_BV / sampling.temperature).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_tokens", "sampling"))
def _generate(graphdef, state, prompt_BP, key, *, max_tokens: int, sampling: Sampling):
  model = nnx.merge(graphdef, state)
  batch, prompt_len = prompt_BP.shape
  cache = model.init_cache(batch, prompt_len + max_tokens)
  positions_BP = jnp.broadcast_to(jnp.arange(prompt_len), (batch, prompt_len))
  logits_BPV, cache = model.decode(prompt_BP, positions_BP, cache)
  keys = jax.random.split(key, max_tokens)
  first_B = pick(logits_BPV[:, -1], keys[0], sampling)

  def step(carry, inputs):
    token_B, cache = carry
    position, step_key = inputs
    positions_B1 = jnp.full((batch, 1), position, jnp.int32)
    logits_B1V, cache = model.decode(token_B[:, None], positions_B1, cache)
    token_B = pick(logits_B1V[:, 0], step_key, sampling)
    return (token_B, cache), token_B

  positions = prompt_len + jnp.arange(max_tokens - 1, dtype=jnp.int32)
  _, rest_TB = jax.lax.scan(step, (first_B, cache), (positions, keys[1:]))
  return jnp.concatenate([first_B[:, None], rest_TB.T], axis=1)


def generate(model: nnx.Module, prompt_BP, *, max_tokens: int, sampling: Sampling = Sampling(),
             seed: int = 0) -> np.ndarray:
  """`max_tokens` new tokens after each row of `prompt_BP` (int ids, [B, P], P >= 1):
  int32 [B, max_tokens]. The same seed gives the same tokens."""
  prompt_BP = jnp.asarray(prompt_BP, jnp.int32)
  if prompt_BP.ndim != 2 or prompt_BP.shape[1] < 1:
    raise ValueError(f"prompt must be [batch, length >= 1] token ids, got shape "
                     f"{prompt_BP.shape}")
  if max_tokens < 1:
    raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
  graphdef, state = nnx.split(model)
  out = _generate(graphdef, state, prompt_BP, jax.random.key(seed), max_tokens=max_tokens,
                  sampling=sampling)
  return np.asarray(out)
