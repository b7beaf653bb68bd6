"""Tokenises a text corpus offline into ArrayRecord shards (and optionally trains SentencePiece).

  python scripts/prepare_data.py --out=runs/data/stdlib_sp --tokenizer=sentencepiece \
      --vocab_size=2048 --seq_len=128

writes `OUT/{train,eval}-NNNNN-of-NNNNN.array_record` (one record = seq_len + 1 int32
tokens), `OUT/meta.json`, and for SentencePiece `OUT/tokenizer.model`, trained on the
train split only. Train with `--config.data.source=array_record --config.data.path=OUT`.

`--source` takes every text source of `data.source` (stdlib, text, jsonl, parquet,
datasets; with `--text_key` and `--split`), and `--tokenizer` also takes an existing
tokenizer (a SentencePiece .model, a tokenizer.json or a directory with one), which is
copied into OUT so that the shards say how to decode them:

  python scripts/prepare_data.py --out=runs/data/gemma --source=parquet \
      --path='corpus/*.parquet' --tokenizer=/models/gemma/tokenizer.model --seq_len=1024 \
      --max_bytes=0 --workers=16

The corpus streams through (`diloco.train.array_records`): chunks of `--chunk_mb` are tokenised by
`--workers` processes and their windows written as they come, so memory stays bounded
whatever the corpus size (`--max_bytes=0` reads all of it). `--path` may be a URL
(gs://bucket/corpus/*.jsonl.gz); OUT is a local directory (copy it to a bucket afterwards).
meta.json is written last: a run interrupted half-way leaves no usable-looking shards.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

from absl import app, flags, logging

from diloco.config.run_config import validate_data
from diloco.errors import ConfigError
from diloco.train import array_records, corpus, tokenizers
from diloco.train import data as data_lib
from diloco.train.data import DATA_SOURCES, DataConfig

_OUT = flags.DEFINE_string("out", None, "Output directory (created).")
_SOURCE = flags.DEFINE_enum("source", "stdlib", [s for s in DATA_SOURCES if s != "array_record"],
                            "Corpus to read (as data.source).")
_PATH = flags.DEFINE_string("path", "", "Files or directory of the corpus (as data.path).")
_TEXT_KEY = flags.DEFINE_string("text_key", "text", "Text field or column (as data.text_key).")
_SPLIT = flags.DEFINE_string("split", "train", "Split of a datasets directory (as data.split).")
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", "byte", "'byte', 'sentencepiece' (train one on the train split), or an "
    "existing SentencePiece .model, tokenizer.json or directory with one (as data.tokenizer).")
_VOCAB = flags.DEFINE_integer("vocab_size", 2048, "SentencePiece vocabulary size.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "Tokens per training example (plus one).")
_EVAL_FRACTION = flags.DEFINE_float("eval_fraction", 0.02, "Held-out fraction of documents.")
_MAX_BYTES = flags.DEFINE_integer("max_bytes", 8_000_000, "Cap on bytes read (0 = none).")
_SHARDS = flags.DEFINE_integer("shards", 4, "Number of train shards.")
_WORKERS = flags.DEFINE_integer("workers", os.cpu_count() or 1,
                                "Tokenizer processes (0: tokenise in this process).")
_CHUNK_MB = flags.DEFINE_float("chunk_mb", 4.0, "Megabytes of text per tokenised chunk; the "
                               "pipeline holds about 2 x workers x chunk x 5 (docs/data.md).")
flags.mark_flag_as_required("out")


def train_sentencepiece(cfg: DataConfig, out: str, vocab_size: int) -> str:
  """Trains a BPE SentencePiece model on the train split's documents; returns its path.

  The documents stream in (SentencePiece samples at most 200,000 of their lines)."""
  import sentencepiece as spm  # pylint: disable=import-outside-toplevel

  def sentences():
    for docs in array_records.chunks(corpus.documents(cfg), 1 << 20, cfg.max_bytes):
      for key, raw in docs:
        if not data_lib.is_eval_document(key, cfg.eval_fraction):
          text = raw.decode("utf-8", errors="replace")
          yield from (line for line in text.splitlines() if line.strip())

  prefix = os.path.join(out, "tokenizer")
  spm.SentencePieceTrainer.train(
      sentence_iterator=sentences(), model_prefix=prefix, vocab_size=vocab_size,
      model_type="bpe", byte_fallback=True, character_coverage=1.0, pad_id=0, unk_id=1,
      bos_id=2, eos_id=3, input_sentence_size=200_000, shuffle_input_sentence=True,
      remove_extra_whitespaces=False, normalization_rule_name="identity", minloglevel=2)
  return prefix + ".model"


def write_shards(cfg: DataConfig, out: str, train_shards: int, *, workers: int,
                 chunk_bytes: int) -> tuple[dict, dict]:
  """Streams `cfg`'s corpus into shards; returns their names and the tokens per split."""
  writers = {"train": array_records.ShardWriter(out, "train", train_shards),
             "eval": array_records.ShardWriter(out, "eval", 1)}
  cutters = {s: array_records.WindowCutter(cfg.seq_len + 1) for s in array_records.SPLITS}
  try:
    for streams in array_records.tokenized(corpus.documents(cfg), cfg.tokenizer, cfg.eval_fraction,
                                    workers=workers, chunk_bytes=chunk_bytes,
                                    max_bytes=cfg.max_bytes):
      for split, tokens in streams.items():
        writers[split].write(cutters[split].add(tokens))
  finally:
    for w in writers.values():
      w.close()
  tokens = {s: cutters[s].tokens for s in array_records.SPLITS}
  where = cfg.path or corpus.root(cfg)
  if not sum(tokens.values()):
    field = f" in data.text_key={cfg.text_key!r}" if cfg.source in corpus.RECORD_SOURCES else ""
    raise ConfigError(f"data.path: {cfg.source} corpus {where!r} has no non-empty "
                      f"documents{field}")
  for split, count in tokens.items():
    if count < 2 * (cfg.seq_len + 1):
      raise ConfigError(f"data: the {split} split of {cfg.source!r} ({where}) has only {count} "
                        f"tokens, too few for --seq_len={cfg.seq_len}; add text, raise "
                        "--max_bytes or change --eval_fraction")
  logging.info("prepare_data: %s windows", {s: w.windows for s, w in writers.items()})
  return {s: w.names for s, w in writers.items()}, tokens


def prepare(cfg: DataConfig, out: str, tokenizer: str, vocab_size: int, num_shards: int, *,
            workers: int = 0, chunk_bytes: int = 4 << 20) -> dict:
  """Writes shards and meta.json for `cfg`'s corpus; returns the metadata."""
  if num_shards < 1:
    raise ConfigError(f"--shards must be >= 1, got {num_shards}")
  if workers < 0 or chunk_bytes < 1:
    raise ConfigError(f"--workers must be >= 0 and --chunk_mb > 0, got {workers}, "
                      f"{chunk_bytes / 2**20:g}")
  os.makedirs(out, exist_ok=True)
  stale = os.path.join(out, data_lib.META_FILE)
  if os.path.exists(stale):  # written again last, once every shard is complete
    os.remove(stale)
  if tokenizer == "sentencepiece":
    cfg = dataclasses.replace(cfg, tokenizer=train_sentencepiece(cfg, out, vocab_size))
  elif tokenizer != "byte":
    source = tokenizers.resolve(tokenizer)
    tokenizers.make(source)  # fails here, naming the file, before anything is copied
    copy = os.path.join(out, "tokenizer" + (".json" if source.endswith(".json") else ".model"))
    if os.path.abspath(source) != os.path.abspath(copy):
      shutil.copyfile(source, copy)
    cfg = dataclasses.replace(cfg, tokenizer=copy)
  names, tokens = write_shards(cfg, out, num_shards, workers=workers, chunk_bytes=chunk_bytes)
  tok = tokenizers.make(cfg.tokenizer)
  meta = {
      "tokenizer": tok.name,
      "tokenizer_model": os.path.basename(cfg.tokenizer) if tok.name != "byte" else None,
      "vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
      "pad_id": tok.pad_id, "seq_len": cfg.seq_len, "source": cfg.source,
      "eval_fraction": cfg.eval_fraction,
      "shards": names,
      "tokens": tokens,
  }
  with open(os.path.join(out, data_lib.META_FILE), "w") as f:
    json.dump(meta, f, indent=2)
  return meta


def main(argv):
  del argv
  cfg = DataConfig(source=_SOURCE.value, path=_PATH.value, seq_len=_SEQ_LEN.value,
                   text_key=_TEXT_KEY.value, split=_SPLIT.value,
                   eval_fraction=_EVAL_FRACTION.value, max_bytes=_MAX_BYTES.value)
  try:
    validate_data(dataclasses.replace(cfg, tokenizer="byte"))
    meta = prepare(cfg, _OUT.value, _TOKENIZER.value, _VOCAB.value, _SHARDS.value,
                   workers=_WORKERS.value, chunk_bytes=int(_CHUNK_MB.value * 2**20))
  except ConfigError as e:
    raise SystemExit(f"prepare_data: {e}") from None
  print(json.dumps({k: meta[k] for k in ("tokenizer", "vocab_size", "seq_len", "tokens")}))


if __name__ == "__main__":
  app.run(main)
