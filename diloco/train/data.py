"""Grain input pipelines over an offline corpus, sharded disjointly per learner.

Sources (`data.source`):
  * `stdlib`: the Python standard library's own `.py` files, real text that exists
    wherever the package installs (the default: no download, no account);
  * `text`: a directory or glob of the user's text files;
  * `array_record`: pre-tokenised shards written by `scripts/prepare_data.py`.

Documents are split into train and eval by a hash of their name, so the eval split
is never trained on and does not depend on the file order. Each split is tokenised,
joined with BOS separators and cut into windows of `seq_len + 1` tokens (inputs and
shifted targets). Learner m of M trains on windows m, m + M, m + 2M, ... only,
reshuffled each epoch with the run seed, so shards are disjoint and deterministic;
the Grain iterator state is what checkpoints save.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import sysconfig
import zlib

import grain
import numpy as np

from diloco.config_lib import ConfigError, DataConfig
from diloco.train import tokenizers

META_FILE = "meta.json"


def stdlib_files() -> list[str]:
  """Sorted `.py` files of this interpreter's standard library (site-packages excluded)."""
  root = sysconfig.get_paths()["stdlib"]
  files = [f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
           if "site-packages" not in f and "dist-packages" not in f]
  return sorted(files)


def text_files(path: str) -> list[str]:
  """All regular files under a directory (recursively), or those matching a glob."""
  if os.path.isdir(path):
    found = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
  else:
    found = glob.glob(path, recursive=True)
  files = sorted(f for f in found if os.path.isfile(f))
  if not files:
    raise ConfigError(f"data.path: no files found at {path!r}")
  return files


def is_eval_document(name: str, eval_fraction: float) -> bool:
  return zlib.crc32(name.encode("utf-8")) % 10_000 < eval_fraction * 10_000


def _corpus_files(cfg: DataConfig) -> tuple[str, list[str]]:
  if cfg.source == "stdlib":
    return sysconfig.get_paths()["stdlib"], stdlib_files()
  root = cfg.path if os.path.isdir(cfg.path) else os.path.dirname(cfg.path)
  return root, text_files(cfg.path)


@functools.lru_cache(maxsize=4)
def split_tokens(cfg: DataConfig) -> dict[str, np.ndarray]:
  """Token streams of the train and eval splits of a text corpus (cached per config)."""
  tokenizer = tokenizers.make(cfg.tokenizer)
  root, files = _corpus_files(cfg)
  parts: dict[str, list[np.ndarray]] = {"train": [], "eval": []}
  budget = cfg.max_bytes or float("inf")
  for path in files:
    if budget <= 0:
      break
    name = os.path.relpath(path, root)
    with open(path, "rb") as f:
      raw = f.read()
    if not raw:
      continue
    budget -= len(raw)
    split = "eval" if is_eval_document(name, cfg.eval_fraction) else "train"
    parts[split].append(np.asarray([tokenizer.bos_id], np.int32))
    parts[split].append(tokenizer.encode(raw))
  streams = {k: np.concatenate(v) if v else np.zeros((0,), np.int32) for k, v in parts.items()}
  for split, tokens in streams.items():
    if len(tokens) < 2 * (cfg.seq_len + 1):
      raise ConfigError(f"data: the {split} split of {cfg.source!r} ({cfg.path or root}) has "
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
  path = os.path.join(directory, META_FILE)
  if not os.path.isfile(path):
    raise ConfigError(f"data.path: {directory!r} has no {META_FILE}; write shards with "
                      "scripts/prepare_data.py")
  with open(path) as f:
    return json.load(f)


def _array_record_source(cfg: DataConfig, split: str):
  meta = read_meta(cfg.path)
  if meta["seq_len"] != cfg.seq_len:
    raise ConfigError(f"data.seq_len={cfg.seq_len} does not match the shards in {cfg.path!r}, "
                      f"which hold windows for seq_len={meta['seq_len']}")
  paths = [os.path.join(cfg.path, name) for name in meta["shards"][split]]
  missing = [p for p in paths if not os.path.isfile(p)]
  if missing:
    raise ConfigError(f"data.path: shard files missing: {missing}")
  source = grain.sources.ArrayRecordDataSource(paths)
  return grain.MapDataset.source(source).map(
      lambda record: np.frombuffer(record, dtype=np.int32))


def _windows(cfg: DataConfig, split: str) -> grain.MapDataset:
  if cfg.source == "array_record":
    return _array_record_source(cfg, split)
  return grain.MapDataset.source(TokenWindows(split_tokens(cfg)[split], cfg.seq_len + 1))


def vocab_size(cfg: DataConfig) -> int:
  """Number of token ids the data can contain (the model's vocabulary must cover it)."""
  if cfg.source == "array_record":
    return int(read_meta(cfg.path)["vocab_size"])
  return tokenizers.make(cfg.tokenizer).vocab_size


def train_dataset(cfg: DataConfig, *, batch_size: int, learner_id: int = 0,
                  num_learners: int = 1, seed: int = 0) -> grain.IterDataset:
  """Endless batches `[batch_size, seq_len + 1]` int32 of learner `learner_id`'s shard."""
  if not 0 <= learner_id < num_learners:
    raise ConfigError(f"learner_id={learner_id} must be in [0, num_learners={num_learners})")
  windows = _windows(cfg, "train")
  shard = windows[learner_id::num_learners]
  if len(shard) == 0:
    raise ConfigError(f"data: learner {learner_id} of {num_learners} gets no training window "
                      f"(the train split has {len(windows)} windows)")
  ds = (shard.shuffle(seed=seed).repeat()
        .batch(batch_size, drop_remainder=True, batch_fn=np.stack))
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=cfg.prefetch))


def eval_batches(cfg: DataConfig, *, batch_size: int, num_batches: int) -> list[np.ndarray]:
  """A fixed list of held-out batches (the first windows of the eval split, cycled if short)."""
  windows = _windows(cfg, "eval")
  n = len(windows)
  if n == 0:
    raise ConfigError("data: the eval split is empty; raise data.eval_fraction")
  rows = [np.asarray(windows[i % n]) for i in range(batch_size * num_batches)]
  return [np.stack(rows[i * batch_size:(i + 1) * batch_size]) for i in range(num_batches)]
