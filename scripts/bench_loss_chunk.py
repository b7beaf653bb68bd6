"""Memory and time of the output head + loss, whole vs in chunks of tokens (`model.loss_chunk`).

  python scripts/bench_loss_chunk.py                       # gemma_2b's head, compiled only
  python scripts/bench_loss_chunk.py --preset=gemma_9b --batch_size=2 --seq_len=8192

Memory: the compiled gradient of the loss w.r.t. the hidden states and the tied table, at the
preset's vocabulary and width (`temp_size_in_bytes` of XLA's memory analysis; nothing is
allocated, so this runs on a CPU for any preset). Time: the same gradient executed at
`--time_vocab` x `--time_width`, a size a CPU runs in seconds. Each chunk size is reported as
a ratio to the whole sequence at once, measured in the same run. Prints one JSON line.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from diloco.model import presets as model_presets
from diloco.train import step as train_step

_PRESET = flags.DEFINE_string("preset", "gemma_2b", "Model preset whose head is measured.")
_BATCH = flags.DEFINE_integer("batch_size", 1, "Sequences per device.")
_SEQ = flags.DEFINE_integer("seq_len", 4096, "Positions per sequence.")
_CHUNKS = flags.DEFINE_list("chunks", ["0", "256", "1024"],
                            "Chunk sizes in tokens, batch x positions (0 = whole).")
_TIME_VOCAB = flags.DEFINE_integer("time_vocab", 16384, "Vocabulary of the timed runs.")
_TIME_WIDTH = flags.DEFINE_integer("time_width", 256, "Width of the timed runs.")
_TIME_SEQ = flags.DEFINE_integer("time_seq_len", 1024, "Positions of the timed runs.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per chunk size (after one warm-up).")


def loss_grad(chunk: int, dtype):
  """jit(grad of the summed CE + z-loss) w.r.t. (hidden states, table) for one chunk size."""
  def loss(x_BLD, table_VD, targets_BL):
    head = lambda x: jnp.einsum("BLD,VD->BLV", x.astype(dtype), table_VD.astype(dtype),  # noqa: E731
                                preferred_element_type=jnp.float32)
    if chunk:
      ce, z = train_step.chunked_token_losses(head, x_BLD, targets_BL, chunk)
    else:
      ce, z = train_step.token_losses(head(x_BLD), targets_BL)
    return jnp.mean(ce) + 1e-4 * jnp.mean(z)
  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def shapes(batch: int, length: int, vocab: int, width: int):
  return (jax.ShapeDtypeStruct((batch, length, width), jnp.float32),
          jax.ShapeDtypeStruct((vocab, width), jnp.float32),
          jax.ShapeDtypeStruct((batch, length), jnp.int32))


def main(argv):
  del argv
  cfg = model_presets.get(_PRESET.value)
  dtype = jnp.dtype(cfg.dtype)
  chunks = [int(c) for c in _CHUNKS.value]
  memory = {}
  for chunk in chunks:
    compiled = loss_grad(chunk, dtype).lower(
        *shapes(_BATCH.value, _SEQ.value, cfg.vocab_size, cfg.embed_dim)).compile()
    memory[chunk] = compiled.memory_analysis().temp_size_in_bytes
  rng = np.random.default_rng(0)
  b, t, v, d = _BATCH.value, _TIME_SEQ.value, _TIME_VOCAB.value, _TIME_WIDTH.value
  args = (jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32),
          jnp.asarray(rng.normal(size=(v, d)) * d ** -0.5, jnp.float32),
          jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32))
  seconds = {}
  for chunk in chunks:
    fn = loss_grad(chunk, dtype)
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(_REPEATS.value):
      jax.block_until_ready(fn(*args))
    seconds[chunk] = (time.perf_counter() - start) / _REPEATS.value
  base_mem, base_s = memory.get(0), seconds.get(0)
  print(json.dumps({
      "bench": "loss_chunk", "preset": _PRESET.value, "backend": jax.default_backend(),
      "vocab": cfg.vocab_size, "width": cfg.embed_dim, "dtype": cfg.dtype,
      "batch_size": _BATCH.value, "seq_len": _SEQ.value,
      "temp_bytes": {str(c): m for c, m in memory.items()},
      "temp_ratio_to_whole": {str(c): round(m / base_mem, 4) for c, m in memory.items()}
      if base_mem else None,
      "timed_shape": {"batch_size": b, "seq_len": t, "vocab": v, "width": d},
      "step_s": {str(c): round(s, 5) for c, s in seconds.items()},
      "time_ratio_to_whole": {str(c): round(s / base_s, 3) for c, s in seconds.items()}
      if base_s else None}))


if __name__ == "__main__":
  app.run(main)
