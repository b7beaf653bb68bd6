"""Score a trained run on text: `python -m diloco.cli.evaluate --workdir=RUN [--data=SOURCE:PATH]`.

Reports the mean next-token cross-entropy (nats per token) and its perplexity exp(loss) of
the run's final export (or checkpoint `--step`) over windows of `--seq_len + 1` tokens, cut
and tokenised exactly as training cuts them (`diloco.train.data`, with the run's tokenizer).

Flags: --workdir (a run or an export folder); --data: `stdlib`, `text:DIR_OR_GLOB`,
`jsonl:FILES`, `parquet:FILES`, `datasets:DIR` or `array_record:DIR` (default: the run's own
data, from WORKDIR/config.json); --split (eval: the held-out documents, or train);
--seq_len (default: the run's); --batch_size (8); --num_batches (16; 0: every window);
--text_key, --dataset_split, --max_bytes, --eval_fraction (the data fields of the same names);
--step; --json (print one JSON line instead of text).

With --tasks=a,b it scores lm-evaluation-harness tasks instead (`diloco.cli.benchmarks`):
--include_path (a folder of task YAMLs), --num_fewshot, --limit (examples per task, or a
fraction below 1), --batch_size and --seq_len (the model's max_length); the results JSON goes
to WORKDIR/benchmarks/results.json and one line per task is printed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from diloco.artifacts import export, trained
from diloco.cli import benchmarks, command
from diloco.errors import ConfigError
from diloco.train import data as data_lib
from diloco.train import storage
from diloco.train.data import DATA_SOURCES, DataConfig
from diloco.train.step import chunk_positions, head_losses, token_losses

FLAGS = flags.FlagValues()
flags.DEFINE_string("workdir", None, "The run's workdir, or an export folder.", flag_values=FLAGS)
flags.DEFINE_string("data", None, "SOURCE or SOURCE:PATH (default: the run's data).",
                    flag_values=FLAGS)
flags.DEFINE_enum("split", "eval", ["eval", "train"], "Held-out or training documents.",
                  flag_values=FLAGS)
flags.DEFINE_integer("seq_len", None, "Tokens per window (default: the run's).",
                     flag_values=FLAGS)
flags.DEFINE_integer("batch_size", 8, "Windows per batch.", flag_values=FLAGS)
flags.DEFINE_integer("num_batches", 16, "Batches to score; 0 scores every window.",
                     flag_values=FLAGS)
flags.DEFINE_string("text_key", None, "data.text_key: the text field of records.",
                    flag_values=FLAGS)
flags.DEFINE_string("dataset_split", None, "data.split: the split of a datasets directory.",
                    flag_values=FLAGS)
flags.DEFINE_integer("max_bytes", None, "data.max_bytes: cap on the text read (0: none).",
                     flag_values=FLAGS)
flags.DEFINE_float("eval_fraction", None, "data.eval_fraction: documents held out.",
                   flag_values=FLAGS)
flags.DEFINE_integer("step", None, "Use checkpoint STEP of the run instead of its export.",
                     flag_values=FLAGS)
flags.DEFINE_bool("json", False, "Print one JSON line.", flag_values=FLAGS)
flags.DEFINE_string("tasks", None, "lm-evaluation-harness tasks, comma-separated (instead of "
                    "--data).", flag_values=FLAGS)
flags.DEFINE_string("include_path", None, "With --tasks: a folder of task YAMLs.",
                    flag_values=FLAGS)
flags.DEFINE_integer("num_fewshot", None, "With --tasks: few-shot examples (default: the "
                     "task's).", flag_values=FLAGS)
flags.DEFINE_float("limit", None, "With --tasks: examples per task (a fraction when < 1).",
                   flag_values=FLAGS)
command.define_trust_flag(FLAGS)


def _run_data(model: trained.Trained) -> DataConfig:
  """The run's DataConfig (WORKDIR/config.json beside the export), else the defaults."""
  found = export.export_dir(FLAGS.workdir) if FLAGS.step is None else None
  run_dir = os.path.dirname(found) if found else FLAGS.workdir
  path = os.path.join(run_dir, trained.RUN_CONFIG)
  if os.path.isfile(path):
    run = trained.read_run_config(path)
    if "data" in run.raw:
      return run.data
  if FLAGS.data is None:
    raise ConfigError(f"--data: required here: {model.source} has no run config.json beside "
                      "it to say what it trained on")
  return DataConfig()


def data_config(model: trained.Trained) -> DataConfig:
  """The data to score: the run's, with the flags' overrides and the model's tokenizer."""
  cfg = _run_data(model)
  updates = {}
  if FLAGS.data is not None:
    source, _, path = FLAGS.data.partition(":")
    if source not in DATA_SOURCES:
      raise ConfigError(f"--data: source {source!r} is not one of {list(DATA_SOURCES)}")
    if source != "stdlib" and not path:
      raise ConfigError(f"--data: source {source!r} needs a path, e.g. --data={source}:DIR")
    if path and not storage.matches(path):
      raise ConfigError(f"--data: no directory or files match {path!r}")
    updates.update(source=source, path=path)
  for flag, field in (("seq_len", "seq_len"), ("text_key", "text_key"),
                      ("dataset_split", "split"), ("max_bytes", "max_bytes"),
                      ("eval_fraction", "eval_fraction")):
    if FLAGS[flag].value is not None:
      updates[field] = FLAGS[flag].value
  cfg = dataclasses.replace(cfg, **updates)
  command.at_least(cfg.seq_len, 2, "seq_len")
  command.at_least(cfg.max_bytes, 0, "max_bytes")
  if not 0 < cfg.eval_fraction < 1:
    raise ConfigError(f"--eval_fraction: must be in (0, 1), got {cfg.eval_fraction}")
  # Shards are already tokenised; text is tokenised with the model's own tokenizer.
  return dataclasses.replace(
      cfg, tokenizer="byte" if cfg.source == "array_record" else model.tokenizer_spec)


def batches(cfg: DataConfig, split: str, batch_size: int, num_batches: int) -> list[np.ndarray]:
  """The first `batch_size * num_batches` windows of `split` (all when 0), in batches; the
  last batch may be shorter. Each window is scored once."""
  windows = data_lib.split_windows(cfg, split)
  n = len(windows) if num_batches == 0 else min(len(windows), batch_size * num_batches)
  if n == 0:
    raise ConfigError(f"--data: the {split} split has no window of {cfg.seq_len + 1} tokens")
  rows = [np.asarray(windows[i]) for i in range(n)]
  return [np.stack(rows[i:i + batch_size]) for i in range(0, n, batch_size)]


@functools.partial(jax.jit, static_argnums=0)
def _loss_sum(graphdef, state, tokens_BL1):
  """Summed next-token cross-entropy of a batch of windows (float32)."""
  model = nnx.merge(graphdef, state)
  inputs_BL, targets_BL = tokens_BL1[:, :-1], tokens_BL1[:, 1:]
  chunk = getattr(getattr(model, "cfg", None), "loss_chunk", 0)
  batch, length = targets_BL.shape
  if chunk and chunk_positions(chunk, batch) < length and hasattr(model, "hidden"):
    x_BLD, _ = model.hidden(inputs_BL)
    ce_BL, _ = head_losses(model, x_BLD, targets_BL, chunk)
  else:
    out = model(inputs_BL)
    logits_BLV = out[0] if isinstance(out, tuple) else out
    ce_BL, _ = token_losses(logits_BLV, targets_BL)
  return jnp.sum(ce_BL)


def score(model: nnx.Module, token_batches: list[np.ndarray]) -> dict:
  """{"loss": mean cross-entropy per predicted token, "perplexity", "tokens", "windows"}."""
  graphdef, state = nnx.split(model)
  total, tokens = 0.0, 0
  for batch in token_batches:
    total += float(_loss_sum(graphdef, state, jnp.asarray(batch, jnp.int32)))
    tokens += batch[:, 1:].size
  loss = total / tokens
  return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": tokens,
          "windows": sum(len(b) for b in token_batches)}


def _benchmarks() -> None:
  """--tasks: lm-evaluation-harness tasks on the model (`diloco.cli.benchmarks`)."""
  for flag in ("data", "split", "num_batches", "text_key", "dataset_split", "max_bytes",
               "eval_fraction"):
    if FLAGS[flag].present:
      raise ConfigError(f"--{flag}: scores held-out text; it does not go with --tasks")
  if FLAGS.num_fewshot is not None:
    command.at_least(FLAGS.num_fewshot, 0, "num_fewshot")
  limit = FLAGS.limit
  if limit is not None:
    if limit <= 0:
      raise ConfigError(f"--limit: must be > 0, got {limit}")
    limit = int(limit) if limit >= 1 else limit
  if FLAGS.seq_len is not None:
    command.at_least(FLAGS.seq_len, 2, "seq_len")
  benchmarks.task_names(FLAGS.tasks)  # an empty list fails before a model is loaded
  model = trained.load(FLAGS.workdir, FLAGS.step, trust_code=FLAGS.trust_export_code)
  results, path = benchmarks.evaluate(
      model, FLAGS.workdir, tasks=FLAGS.tasks, include_path=FLAGS.include_path,
      num_fewshot=FLAGS.num_fewshot, limit=limit, batch_size=FLAGS.batch_size,
      max_length=FLAGS.seq_len)
  if FLAGS.json:
    print(json.dumps({"results": benchmarks.metrics(results), "file": path}))
  else:
    print("\n".join([model.source, *benchmarks.lines(results), f"results: {path}"]))


def _evaluate() -> None:
  command.at_least(FLAGS.batch_size, 1, "batch_size")
  if FLAGS.tasks is not None:
    _benchmarks()
    return
  for flag in ("include_path", "num_fewshot", "limit"):
    if FLAGS[flag].value is not None:
      raise ConfigError(f"--{flag}: goes with --tasks=NAMES (lm-evaluation-harness tasks)")
  command.at_least(FLAGS.num_batches, 0, "num_batches")
  model = trained.load(FLAGS.workdir, FLAGS.step, trust_code=FLAGS.trust_export_code)
  cfg = data_config(model)
  data_lib.check_vocab(cfg, model.cfg.vocab_size)
  result = score(model.model, batches(cfg, FLAGS.split, FLAGS.batch_size, FLAGS.num_batches))
  where = cfg.source + (f":{cfg.path}" if cfg.path else "")
  if FLAGS.json:
    print(json.dumps(dict(result, source=model.source, data=where, split=FLAGS.split,
                          seq_len=cfg.seq_len)))
  else:
    print(f"{model.source}\n{where} ({FLAGS.split} split, {result['windows']} windows of "
          f"{cfg.seq_len} predicted tokens): loss {result['loss']:.4f}, perplexity "
          f"{result['perplexity']:.2f}")


def main(argv: list[str]) -> None:
  """`argv[0]` is the program name; the rest are this command's flags (module docstring)."""
  command.run(FLAGS, argv, _evaluate)


if __name__ == "__main__":
  command.app_run(main)
