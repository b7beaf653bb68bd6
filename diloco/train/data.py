"""Grain input pipelines over an offline corpus, sharded disjointly per learner.

Sources (`data.source`):
  * `stdlib`: the Python standard library's own `.py` files, real text that exists
    wherever the package installs (the default: no download, no account);
  * `text`: a directory or glob of the user's text files;
  * `jsonl`, `parquet`, `datasets`: records with a text field (`data.text_key`) in
    JSON-lines or parquet files, or a Hugging Face `save_to_disk` directory
    (`data.split`); see `corpus.py`;
  * `array_record`: pre-tokenised shards written by `scripts/prepare_data.py`.

Documents are split into train and eval by a hash of their name (text files) or their
content (records), so the eval split is never trained on and does not depend on the
file order. Each split is tokenised, joined with BOS separators and cut into windows of
`seq_len + 1` tokens (inputs and shifted targets). Learner m of M trains on windows
m, m + M, m + 2M, ... only, reshuffled each epoch with the run seed, so shards are
disjoint and deterministic; the Grain iterator state is what checkpoints save.
"""

from __future__ import annotations

import functools
import os
import zlib

import grain
import numpy as np
from absl import logging

from diloco import documents
from diloco.errors import ConfigError
from diloco.settings import BYTES, NON_NEGATIVE, OneOf, Range, frozen, require, setting
from diloco.train import corpus, storage, tokenizers

META_FILE = "meta.json"
# URL schemes that ArrayRecord's own reader opens (its C++ reader has a GCS client).
ARRAY_RECORD_URLS = ("gs://",)
# The `data.source` values: the corpora of corpus.py, and the prepared shards read here.
DATA_SOURCES = corpus.CORPUS_SOURCES + ("array_record",)


@frozen
class DataConfig:
  """Where tokens come from. `source`: stdlib | text | jsonl | parquet | datasets | array_record."""
  source: str = setting("stdlib", OneOf(DATA_SOURCES))
  # Directory or glob of text files (text), jsonl or parquet files, a Hugging Face
  # save_to_disk or cache directory (datasets), or prepared shards (array_record).
  path: str = ""
  # "byte", a SentencePiece .model file (e.g. Gemma's or one written by
  # scripts/prepare_data.py), a Hugging Face tokenizer.json, or a directory holding one.
  tokenizer: str = "byte"
  # The text field of jsonl records, or the text column of parquet and datasets sources.
  text_key: str = "text"
  # The split of a DatasetDict directory or of a datasets cache (source=datasets).
  split: str = "train"
  seq_len: int = setting(128, Range(low=2))
  # Cap on the corpus size read into memory for text sources (0 = no cap).
  max_bytes: int = setting(8_000_000, BYTES, "0 = no cap")
  # Fraction of documents held out for evaluation (chosen by a hash of the name).
  eval_fraction: float = setting(0.02, Range(low=0, high=1, low_open=True, high_open=True))
  prefetch: int = setting(4, NON_NEGATIVE)

  def check(self) -> None:
    """The rules that relate the data fields or look at the files they name."""
    if self.source != "stdlib":
      require(bool(self.path), "data.path", f"is required when data.source={self.source!r}")
      # Names only (a directory, a glob's matches), local or gs://...: nothing is read here.
      require(storage.matches(self.path), "data.path",
              f"no directory or files match {self.path!r}")
    require(bool(self.text_key), "data.text_key", "must name the text field or column")
    require(bool(self.split), "data.split", "must name a split, e.g. 'train'")
    if self.tokenizer != "byte":
      require(self.source != "array_record", "data.tokenizer",
              "array_record shards are already tokenised; leave data.tokenizer='byte' "
              "(the shards' meta.json names their tokenizer)")
      require(os.path.exists(self.tokenizer), "data.tokenizer",
              "must be 'byte' or an existing SentencePiece .model file, tokenizer.json or "
              f"directory with one, got {self.tokenizer!r} (no such file)")


stdlib_files = corpus.stdlib_files
text_files = corpus.text_files


def is_eval_document(key: str | bytes, eval_fraction: float) -> bool:
  """Whether a document (by name or content) is held out; stable across runs and hosts."""
  raw = key.encode("utf-8") if isinstance(key, str) else key
  return zlib.crc32(raw) % 10_000 < eval_fraction * 10_000


@functools.lru_cache(maxsize=4)
def split_tokens(cfg: DataConfig) -> dict[str, np.ndarray]:
  """Token streams of the train and eval splits of a text corpus (cached per config).

  Every document is preceded by the tokenizer's `bos_id` (its BOS, or EOS if it has none).
  """
  tokenizer = tokenizers.make(cfg.tokenizer)
  parts: dict[str, list[np.ndarray]] = {"train": [], "eval": []}
  budget = cfg.max_bytes or float("inf")
  count = held_out = 0
  for key, raw in corpus.documents(cfg):
    if budget <= 0:
      break
    budget -= len(raw)
    count += 1
    split = "eval" if is_eval_document(key, cfg.eval_fraction) else "train"
    held_out += split == "eval"
    parts[split].append(np.asarray([tokenizer.bos_id], np.int32))
    parts[split].append(tokenizer.encode(raw))
  where = cfg.path or corpus.root(cfg)
  if not count:
    field = f" in data.text_key={cfg.text_key!r}" if cfg.source in corpus.RECORD_SOURCES else ""
    raise ConfigError(f"data.path: {cfg.source} corpus {where!r} has no non-empty "
                      f"documents{field}")
  streams = {k: np.concatenate(v) if v else np.zeros((0,), np.int32) for k, v in parts.items()}
  logging.info("data: %d documents (%d held out) from %s %r, tokenizer %s: %d train and %d "
               "eval tokens", count, held_out, cfg.source, where, tokenizer.name,
               len(streams["train"]), len(streams["eval"]))
  for split, tokens in streams.items():
    if len(tokens) < 2 * (cfg.seq_len + 1):
      raise ConfigError(f"data: the {split} split of {cfg.source!r} ({where}) has "
                        f"only {len(tokens)} tokens, too few for data.seq_len={cfg.seq_len}; "
                        "add text, raise data.max_bytes or change data.eval_fraction")
  return streams


class TokenWindows:
  """Random access to non-overlapping windows of `length` tokens of one stream."""

  def __init__(self, tokens: np.ndarray, length: int):
    self._tokens, self._length = tokens, length

  def __len__(self) -> int:
    return len(self._tokens) // self._length

  def __getitem__(self, index: int) -> np.ndarray:
    start = int(index) * self._length
    return self._tokens[start:start + self._length]


def read_meta(directory: str) -> dict:
  path = storage.join(directory, META_FILE)
  if not storage.isfile(path):
    raise ConfigError(f"data.path: {directory!r} has no {META_FILE}; write shards with "
                      "scripts/prepare_data.py")
  meta = documents.obj(storage.read_json(path), path)
  meta.update(documents.fields(meta, {"seq_len": int, "vocab_size": int, "shards": dict}, path))
  for split, names in meta["shards"].items():
    documents.value(names, list, path, f"shards.{split}")
    for i, name in enumerate(names):
      documents.value(name, str, path, f"shards.{split}[{i}]")
  return meta


def shard_paths(cfg: DataConfig, split: str) -> list[str]:
  """The ArrayRecord files of `split`, all checked to exist (by name: nothing is read)."""
  meta = read_meta(cfg.path)
  if meta["seq_len"] != cfg.seq_len:
    raise ConfigError(f"data.seq_len={cfg.seq_len} does not match the shards in {cfg.path!r}, "
                      f"which hold windows for seq_len={meta['seq_len']}")
  if storage.is_url(cfg.path) and not cfg.path.startswith(ARRAY_RECORD_URLS):
    raise ConfigError(f"data.path: {cfg.path!r}: ArrayRecord's reader opens local files and "
                      f"{', '.join(ARRAY_RECORD_URLS)} URLs only; copy the shards or mount the "
                      "bucket (e.g. gcsfuse)")
  if split not in meta["shards"]:
    raise ConfigError(f"data.path: {storage.join(cfg.path, META_FILE)} lists no {split!r} "
                      f"shards; it has {sorted(meta['shards'])}")
  paths = [storage.join(cfg.path, name) for name in meta["shards"][split]]
  missing = [p for p in paths if not storage.isfile(p)]
  if missing:
    raise ConfigError(f"data.path: shard files missing: {missing}")
  return paths


def _array_record_source(cfg: DataConfig, split: str):
  source = grain.sources.ArrayRecordDataSource(shard_paths(cfg, split))
  return grain.MapDataset.source(source).map(
      lambda record: np.frombuffer(record, dtype=np.int32))


def split_windows(cfg: DataConfig, split: str) -> grain.MapDataset:
  """The `seq_len + 1`-token windows of one split ("train" or "eval"), in corpus order."""
  if cfg.source == "array_record":
    return _array_record_source(cfg, split)
  return grain.MapDataset.source(TokenWindows(split_tokens(cfg)[split], cfg.seq_len + 1))


def vocab_size(cfg: DataConfig) -> int:
  """Number of token ids the data can contain (the model's vocabulary must cover it)."""
  if cfg.source == "array_record":
    return int(read_meta(cfg.path)["vocab_size"])
  return tokenizers.make(cfg.tokenizer).vocab_size


def check_vocab(cfg: DataConfig, model_vocab_size: int) -> None:
  """Fails when the model cannot embed every id the data holds (naming both fields)."""
  needed = vocab_size(cfg)
  if model_vocab_size < needed:
    origin = (f"data.path={cfg.path!r}" if cfg.source == "array_record"
              else f"data.tokenizer={cfg.tokenizer!r}")
    raise ConfigError(f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's "
                      f"{needed} ids ({origin}); set --config.model.vocab_size={needed} or more")


def train_dataset(cfg: DataConfig, *, batch_size: int, learner_id: int = 0,
                  num_learners: int = 1, seed: int = 0) -> grain.IterDataset:
  """Endless batches `[batch_size, seq_len + 1]` int32 of learner `learner_id`'s shard."""
  if not 0 <= learner_id < num_learners:
    raise ConfigError(f"learner_id={learner_id} must be in [0, num_learners={num_learners})")
  windows = split_windows(cfg, "train")
  shard = windows[learner_id::num_learners]
  if len(shard) == 0:
    raise ConfigError(f"data: learner {learner_id} of {num_learners} gets no training window "
                      f"(the train split has {len(windows)} windows)")
  ds = (shard.shuffle(seed=seed).repeat()
        .batch(batch_size, drop_remainder=True, batch_fn=np.stack))
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=cfg.prefetch))


EVAL_REPEATS = 4


def eval_batches(cfg: DataConfig, *, batch_size: int, num_batches: int) -> list[np.ndarray]:
  """A fixed list of held-out batches (the first windows of the eval split, cycled if short)."""
  windows = split_windows(cfg, "eval")
  n = len(windows)
  if n == 0:
    raise ConfigError("data: the eval split is empty; raise data.eval_fraction")
  # Cycling a short split only repeats its windows: a few times over is a small split's eval
  # set, far more is a typo that would take memory and time for nothing.
  if batch_size * num_batches > max(EVAL_REPEATS * n, batch_size):
    raise ConfigError(f"train.eval_batches: {num_batches} batches of {batch_size} sequences "
                      f"would repeat the eval split's {n} windows more than {EVAL_REPEATS} "
                      f"times; at most {max(EVAL_REPEATS * n // batch_size, 1)}")
  rows = [np.asarray(windows[i % n]) for i in range(batch_size * num_batches)]
  return [np.stack(rows[i * batch_size:(i + 1) * batch_size]) for i in range(num_batches)]
