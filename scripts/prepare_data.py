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
      --path='corpus/*.parquet' --tokenizer=/models/gemma/tokenizer.model --seq_len=1024
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
from absl import app, flags
from array_record.python.array_record_module import ArrayRecordWriter

from diloco.config_lib import DATA_SOURCES, ConfigError, DataConfig, validate_data
from diloco.train import data as data_lib
from diloco.train import tokenizers

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
flags.mark_flag_as_required("out")


def train_sentencepiece(cfg: DataConfig, out: str, vocab_size: int) -> str:
  """Trains a BPE SentencePiece model on the train split's documents; returns its path."""
  import sentencepiece as spm  # pylint: disable=import-outside-toplevel
  text_cfg = dataclasses.replace(cfg, tokenizer="byte")
  stream = data_lib.split_tokens(text_cfg)["train"]
  bos = tokenizers.ByteTokenizer.bos_id
  docs = np.split(stream, np.flatnonzero(stream == bos))

  def sentences():
    for doc in docs:
      text = bytes(doc[doc < 256].astype(np.uint8)).decode("utf-8", errors="replace")
      yield from (line for line in text.splitlines() if line.strip())

  prefix = os.path.join(out, "tokenizer")
  spm.SentencePieceTrainer.train(
      sentence_iterator=sentences(), model_prefix=prefix, vocab_size=vocab_size,
      model_type="bpe", byte_fallback=True, character_coverage=1.0, pad_id=0, unk_id=1,
      bos_id=2, eos_id=3, input_sentence_size=200_000, shuffle_input_sentence=True,
      remove_extra_whitespaces=False, normalization_rule_name="identity", minloglevel=2)
  return prefix + ".model"


def write_shards(tokens: np.ndarray, seq_len: int, out: str, split: str, shards: int) -> list:
  windows = data_lib.TokenWindows(tokens, seq_len + 1)
  names = [f"{split}-{i:05d}-of-{shards:05d}.array_record" for i in range(shards)]
  writers = [ArrayRecordWriter(os.path.join(out, n), "group_size:1") for n in names]
  for i in range(len(windows)):
    writers[i % shards].write(np.ascontiguousarray(windows[i], np.int32).tobytes())
  for w in writers:
    w.close()
  return names


def prepare(cfg: DataConfig, out: str, tokenizer: str, vocab_size: int, shards: int) -> dict:
  """Writes shards and meta.json for `cfg`'s corpus; returns the metadata."""
  if shards < 1:
    raise ConfigError(f"--shards must be >= 1, got {shards}")
  os.makedirs(out, exist_ok=True)
  if tokenizer == "sentencepiece":
    cfg = dataclasses.replace(cfg, tokenizer=train_sentencepiece(cfg, out, vocab_size))
  elif tokenizer != "byte":
    source = tokenizers.resolve(tokenizer)
    tokenizers.make(source)  # fails here, naming the file, before anything is copied
    copy = os.path.join(out, "tokenizer" + (".json" if source.endswith(".json") else ".model"))
    if os.path.abspath(source) != os.path.abspath(copy):
      shutil.copyfile(source, copy)
    cfg = dataclasses.replace(cfg, tokenizer=copy)
  streams = data_lib.split_tokens(cfg)
  tok = tokenizers.make(cfg.tokenizer)
  meta = {
      "tokenizer": tok.name,
      "tokenizer_model": os.path.basename(cfg.tokenizer) if tok.name != "byte" else None,
      "vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
      "pad_id": tok.pad_id, "seq_len": cfg.seq_len, "source": cfg.source,
      "eval_fraction": cfg.eval_fraction,
      "shards": {"train": write_shards(streams["train"], cfg.seq_len, out, "train", shards),
                 "eval": write_shards(streams["eval"], cfg.seq_len, out, "eval", 1)},
      "tokens": {k: int(len(v)) for k, v in streams.items()},
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
    meta = prepare(cfg, _OUT.value, _TOKENIZER.value, _VOCAB.value, _SHARDS.value)
  except ConfigError as e:
    raise SystemExit(f"prepare_data: {e}") from None
  print(json.dumps({k: meta[k] for k in ("tokenizer", "vocab_size", "seq_len", "tokens")}))


if __name__ == "__main__":
  app.run(main)
