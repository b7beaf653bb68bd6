"""The learner's pure, jitted train and eval steps. Nothing here knows about DiLoCo."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from diloco.train.optim import OptimConfig
from diloco.train.state import StateSpec

PyTree = Any


def token_losses(logits_BLV: jax.Array, targets_BL: jax.Array):
  """Per-token cross-entropy and z-loss term (log Z)^2, both in float32."""
  logits = logits_BLV.astype(jnp.float32)
  log_z_BL = jax.nn.logsumexp(logits, axis=-1)
  # The target's logit is picked by comparing with the vocabulary index, not by a gather: the
  # gradient is then elementwise (fused with the softmax's), where a gather's is a scatter-add
  # into a zeroed (B, L, V) float32 buffer, one more pass over the step's largest array. Only
  # one term of the sum is not zero, so the value is exact.
  is_target_BLV = targets_BL[..., None] == jnp.arange(logits.shape[-1], dtype=targets_BL.dtype)
  target_logit_BL = jnp.sum(jnp.where(is_target_BLV, logits, 0.0), axis=-1)
  return log_z_BL - target_logit_BL, jnp.square(log_z_BL)


def chunked_token_losses(head: Callable[[jax.Array], jax.Array], x_BLD: jax.Array,
                         targets_BL: jax.Array, chunk: int):
  """`token_losses(head(x_BLD), targets_BL)` computed about `chunk` tokens at a time.

  The (B, L, V) float32 logits are never whole: each chunk's are made, reduced to two numbers
  per token and dropped, and rematerialised for the backward pass. At a 262k vocabulary the
  full logits of a 4096-token sequence are 4 GiB, more than the rest of the activations.
  A chunk is the whole batch (its sharding untouched) at max(1, chunk // B) positions, so its
  logits do not grow with the batch; B is the global batch of `x_BLD`. The length is padded up
  to a multiple of the chunk's positions; the padded positions are dropped. `head` closes over
  whatever it reads (the tied table, cast once): the chunks and their recomputation read it."""
  batch, length = targets_BL.shape
  positions = chunk_positions(chunk, batch)
  n = -(-length // positions)
  pad = n * positions - length
  x_BLD = jnp.pad(x_BLD, ((0, 0), (0, pad), (0, 0)))
  targets_BL = jnp.pad(targets_BL, ((0, 0), (0, pad)))
  # Chunks lead (the axis lax.map walks); the batch axis keeps its sharding.
  x_nBcD = x_BLD.reshape(batch, n, positions, -1).swapaxes(0, 1)
  t_nBc = targets_BL.reshape(batch, n, positions).swapaxes(0, 1)

  @jax.checkpoint
  def one(args):
    x_BcD, t_Bc = args
    return token_losses(head(x_BcD), t_Bc)

  ce_nBc, z_nBc = jax.lax.map(one, (x_nBcD, t_nBc))
  unchunk = lambda v: v.swapaxes(0, 1).reshape(batch, n * positions)[:, :length]  # noqa: E731
  return unchunk(ce_nBc), unchunk(z_nBc)


def chunk_positions(chunk: int, batch: int) -> int:
  """Positions per chunk of `chunk` tokens over a batch of `batch` sequences."""
  return max(1, chunk // batch)


def head_losses(model, x_BLD: jax.Array, targets_BL: jax.Array, chunk: int):
  """Per-token (cross-entropy, z-loss) of `model`'s output head on its final hidden states,
  `chunk` tokens at a time (0: all at once; `chunked_token_losses`)."""
  if hasattr(model, "head_table"):  # the built-in transformer: the tied table is cast once
    table_VD = model.head_table()
    head = lambda x: model.logits(x, table_VD)  # noqa: E731
  else:
    head = model.logits
  batch, length = targets_BL.shape
  if chunk and chunk_positions(chunk, batch) < length:
    return chunked_token_losses(head, x_BLD, targets_BL, chunk)
  return token_losses(head(x_BLD), targets_BL)


def _forward(graphdef, params, tokens_BL1):
  inputs_BL, targets_BL = tokens_BL1[:, :-1], tokens_BL1[:, 1:]
  model = nnx.merge(graphdef, params)
  chunk = getattr(getattr(model, "cfg", None), "loss_chunk", 0)
  batch, length = targets_BL.shape
  if chunk and chunk_positions(chunk, batch) < length and hasattr(model, "hidden"):
    x_BLD, aux = model.hidden(inputs_BL)
    ce_BL, z_BL = head_losses(model, x_BLD, targets_BL, chunk)
  else:
    out = model(inputs_BL)
    # A registered model returns logits, or (logits, aux loss) like the built-in transformer.
    logits_BLV, aux = out if isinstance(out, tuple) else (out, jnp.zeros((), jnp.float32))
    ce_BL, z_BL = token_losses(logits_BLV, targets_BL)
  # Sequences are packed windows of real text: every target counts, none is padding.
  return jnp.mean(ce_BL), jnp.mean(z_BL), aux


def make_train_step(spec: StateSpec, optim: OptimConfig, schedule: optax.Schedule,
                    out_shardings: PyTree = None) -> Callable[[PyTree, jax.Array], tuple]:
  """A jitted `step(state, tokens_BL1) -> (state, metrics)`; `state` is donated. Its new state
  is placed by spec's shardings, or by `out_shardings` (`state.partition_specs(spec)` for a
  program lowered under any mesh of spec's axes)."""

  def loss_fn(params, tokens_BL1):
    ce, z_loss, aux = _forward(spec.graphdef, params, tokens_BL1)
    total = ce + optim.z_loss_weight * z_loss + aux
    return total, {"ce": ce, "z_loss": z_loss, "aux": aux}

  def step(state, tokens_BL1):
    params = state["params"]
    (_, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens_BL1)
    updates, opt_state = spec.tx.update(grads, state["opt_state"], params)
    new_params = optax.apply_updates(params, updates)
    metrics = {
        "train/loss": parts["ce"], "train/z_loss": parts["z_loss"],
        "train/moe_aux_loss": parts["aux"], "train/grad_norm": optax.tree.norm(grads),
        "train/param_norm": optax.tree.norm(new_params),
        "train/update_norm": optax.tree.norm(updates), "train/lr": schedule(state["step"]),
        "train/tokens": jnp.asarray(tokens_BL1[:, 1:].size, jnp.float32),
    }
    return {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

  placed = spec.shardings if out_shardings is None else out_shardings
  return jax.jit(step, donate_argnums=0, out_shardings=(placed, None))


def mean_eval_loss(eval_fn: Callable[[PyTree, Any], Any], params: PyTree, batches,
                   place: Callable[[Any], Any] = lambda b: b) -> float:
  """The mean of `eval_fn(params, place(batch))` over `batches`, one program at a time.

  Each batch's loss is read before the next is dispatched. Evaluation programs do not depend
  on each other, so dispatched together they all run at once, and on XLA's CPU client
  (emulated devices) a collective of one of them can then wait past its 40 s rendezvous
  deadline for a participant stuck behind the others, which aborts the process (seen with 64
  batches on 2 devices on a busy host). The value is the same as reading them all at the end.
  """
  losses = [np.asarray(jax.device_get(eval_fn(params, place(b)))) for b in batches]
  return float(np.mean(losses))


def make_eval_step(spec: StateSpec) -> Callable[[PyTree, jax.Array], tuple]:
  """A jitted `eval(params, tokens_BL1) -> mean token cross-entropy of the batch`."""

  def evaluate(params, tokens_BL1):
    return _forward(spec.graphdef, params, tokens_BL1)[0]

  return jax.jit(evaluate)
