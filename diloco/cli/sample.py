"""Generate text from a trained run: `python -m diloco.cli.sample --workdir=RUN --prompt=TEXT`.

Reads the run's final export (or checkpoint `--step`), encodes the prompt with the run's
tokenizer after its BOS (as every training document starts), and decodes `--max_tokens` new
tokens with a KV cache (`diloco.model.decode`, one compiled program). The continuation stops
at the first document boundary (BOS or EOS id) unless `--nostop_at_boundary`.

Flags: --workdir (a run or an export folder), --prompt or --prompt_ids (comma-separated ids),
--max_tokens (64), --temperature (0.8; 0 is greedy), --top_k (0: all), --seed (0),
--num_samples (1), --step (a checkpoint instead of the export), --nobos, --trust_export_code
(build a model whose export names code to import: that code runs).
"""

from __future__ import annotations

import sys
import time

import numpy as np
from absl import flags

from diloco.artifacts import trained
from diloco.cli import command
from diloco.errors import ConfigError
from diloco.model import decode

FLAGS = flags.FlagValues()
MAX_TOKENS, MAX_SAMPLES = 1 << 20, 1 << 12
flags.DEFINE_string("workdir", None, "The run's workdir, or an export folder.", flag_values=FLAGS)
flags.DEFINE_string("prompt", None, "The text to continue.", flag_values=FLAGS)
flags.DEFINE_string("prompt_ids", None, "Instead of --prompt: token ids, comma-separated.",
                    flag_values=FLAGS)
flags.DEFINE_integer("max_tokens", 64, "New tokens to generate (>= 1).", flag_values=FLAGS)
flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 picks the most likely token.",
                   flag_values=FLAGS)
flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens only (0: all).",
                     flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Sampling seed: the same seed gives the same text.",
                     flag_values=FLAGS)
flags.DEFINE_integer("num_samples", 1, "Continuations of the prompt, decoded as one batch.",
                     flag_values=FLAGS)
flags.DEFINE_integer("step", None, "Use checkpoint STEP of the run instead of its export.",
                     flag_values=FLAGS)
flags.DEFINE_bool("bos", True, "Put the tokenizer's BOS before the prompt, as in training.",
                  flag_values=FLAGS)
flags.DEFINE_bool("stop_at_boundary", True, "Cut each continuation at the first BOS or EOS.",
                  flag_values=FLAGS)
command.define_trust_flag(FLAGS)


def check_flags() -> decode.Sampling:
  """The sampling settings, after checking every numeric flag (one-line ConfigErrors)."""
  # Bounds where size costs memory: the KV cache holds num_samples x (prompt + max_tokens).
  command.at_least(FLAGS.max_tokens, 1, "max_tokens", high=MAX_TOKENS)
  command.at_least(FLAGS.temperature, 0, "temperature")
  command.at_least(FLAGS.top_k, 0, "top_k", high=2**31 - 1)
  command.at_least(FLAGS.num_samples, 1, "num_samples", high=MAX_SAMPLES)
  return decode.Sampling(temperature=FLAGS.temperature, top_k=FLAGS.top_k)


def prompt_tokens(model: trained.Trained, text: str | None, ids: str | None,
                  bos: bool) -> np.ndarray:
  """The prompt's token ids (int32 [P]), checked against the model's vocabulary."""
  if (text is None) == (ids is None):
    raise ConfigError("--prompt: give exactly one of --prompt=TEXT or --prompt_ids=1,2,3")
  if ids is not None:
    try:
      tokens = np.asarray([int(t) for t in ids.split(",") if t.strip()], np.int64)
    except ValueError:
      raise ConfigError(f"--prompt_ids: must be comma-separated integers, got {ids!r}") from None
    flag = "--prompt_ids"
  else:
    if not text:
      raise ConfigError("--prompt: is empty; give some text to continue")
    tokens = model.tokenizer.encode(text.encode("utf-8")).astype(np.int64)
    flag = "--prompt"
  if tokens.size == 0:
    raise ConfigError(f"{flag}: encodes to no tokens")
  vocab = model.cfg.vocab_size
  bad = tokens[(tokens < 0) | (tokens >= vocab)]
  if bad.size:
    raise ConfigError(f"{flag}: token id {int(bad[0])} is outside the model's vocabulary "
                      f"[0, {vocab})")
  if bos:
    tokens = np.concatenate([[model.tokenizer.bos_id], tokens])
  return tokens.astype(np.int32)


def continuation(model: trained.Trained, ids: np.ndarray, stop: bool) -> str:
  """The text of generated `ids`, cut at the first document boundary when `stop`."""
  if stop:
    tok = model.tokenizer
    ends = [i for i, t in enumerate(ids) if int(t) in (tok.bos_id, tok.eos_id)]
    ids = ids[:ends[0]] if ends else ids
  return model.tokenizer.decode(ids)


def _sample() -> None:
  sampling = check_flags()
  model = trained.load(FLAGS.workdir, FLAGS.step, trust_code=FLAGS.trust_export_code)
  prompt = prompt_tokens(model, FLAGS.prompt, FLAGS.prompt_ids, FLAGS.bos)
  # Only ids the tokenizer can decode (a table padded for sharding has more).
  sampling = decode.Sampling(temperature=sampling.temperature, top_k=sampling.top_k,
                             vocab_limit=min(model.tokenizer.vocab_size, model.cfg.vocab_size))
  batch = np.tile(prompt[None], (FLAGS.num_samples, 1))
  started = time.monotonic()
  out = decode.generate(model.model, batch, max_tokens=FLAGS.max_tokens, sampling=sampling,
                        seed=FLAGS.seed)
  elapsed = time.monotonic() - started
  shown = FLAGS.prompt if FLAGS.prompt is not None else model.tokenizer.decode(prompt)
  for i, row in enumerate(out):
    if FLAGS.num_samples > 1:
      print(f"--- sample {i} ---")
    print(shown + continuation(model, row, FLAGS.stop_at_boundary), flush=True)
  print(f"{model.source}: {out.size} tokens in {elapsed:.2f}s (compile included)",
        file=sys.stderr)


def main(argv: list[str]) -> None:
  """`argv[0]` is the program name; the rest are this command's flags (module docstring)."""
  command.run(FLAGS, argv, _sample, text_flags=("prompt",))


if __name__ == "__main__":
  command.app_run(main)
