"""Decoding speed: the KV cache (`diloco.model.decode`) against re-running the whole sequence.

  python scripts/bench_decode.py                                   # tiny, 256 new tokens
  python scripts/bench_decode.py --preset=small --max_tokens=512 --batch_size=4

Greedy decoding of a random model of the preset, both ways in the same run, each compiled
before it is timed; the uncached way pads the sequence to its final length so that one program
serves every step (the model is causal: the padding changes nothing before it). Checks that
both give the same tokens, then prints one JSON line.
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from diloco.model import decode, registry
from diloco.model import presets as model_presets

_PRESET = flags.DEFINE_string("preset", "tiny", "Model preset (random parameters).")
_BATCH = flags.DEFINE_integer("batch_size", 1, "Sequences decoded together.")
_PROMPT = flags.DEFINE_integer("prompt_len", 16, "Prompt tokens.")
_TOKENS = flags.DEFINE_integer("max_tokens", 256, "New tokens per sequence.")


def main(argv):
  del argv
  cfg = model_presets.get(_PRESET.value)
  with nnx.use_eager_sharding(False):
    model = registry.build(cfg, nnx.Rngs(0))
  b, p, t = _BATCH.value, _PROMPT.value, _TOKENS.value
  prompt = np.random.RandomState(0).randint(0, min(cfg.vocab_size, 256), (b, p)).astype(np.int32)
  decode.generate(model, prompt, max_tokens=t)  # compile
  start = time.perf_counter()
  cached = decode.generate(model, prompt, max_tokens=t)
  cached_s = time.perf_counter() - start

  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)[0])
  seq = np.zeros((b, p + t), np.int32)
  seq[:, :p] = prompt
  forward(state, seq).block_until_ready()  # compile
  start = time.perf_counter()
  for i in range(p, p + t):
    seq[:, i] = np.asarray(forward(state, seq))[:, i - 1].argmax(-1)
  full_s = time.perf_counter() - start
  print(json.dumps({
      "preset": _PRESET.value, "backend": jax.default_backend(), "batch_size": b,
      "prompt_len": p, "max_tokens": t, "cached_tokens_per_s": b * t / cached_s,
      "full_rerun_tokens_per_s": b * t / full_s, "speedup": full_s / cached_s,
      "same_tokens": bool((seq[:, p:] == cached).all())}))


if __name__ == "__main__":
  app.run(main)
