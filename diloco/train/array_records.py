"""Streams a corpus into ArrayRecord shards: tokenised in worker processes, in bounded memory.

`scripts/prepare_data.py` writes, for each split, the windows of `seq_len + 1` tokens that
the in-memory text pipeline (`data.split_tokens` then `data.TokenWindows`) would cut, window
i into shard i mod N. Here the corpus is read one chunk of documents at a time; chunks are
tokenised by a pool of processes (tokenisers are single-threaded Python or C++ calls) and
consumed in order, so the output does not depend on the number of workers. At most
`in_flight` chunks exist at once and each split keeps less than one window of tokens
between chunks, so memory is bounded by the chunk size, not by the corpus: a multi-GB
corpus prepares like a small one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import multiprocessing
import os
from collections.abc import Iterable, Iterator

import numpy as np

from diloco.train import tokenizers

SPLITS = ("train", "eval")


@functools.lru_cache(maxsize=2)
def _tokenizer(spec: str):
  return tokenizers.make(spec)


def tokenize_chunk(spec: str, eval_fraction: float,
                   docs: list[tuple[str | bytes, bytes]]) -> dict[str, np.ndarray]:
  """The token stream of each split of `docs`: every document preceded by `bos_id`."""
  from diloco.train import data  # pylint: disable=import-outside-toplevel
  tok = _tokenizer(spec)
  parts: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
  for key, raw in docs:
    split = "eval" if data.is_eval_document(key, eval_fraction) else "train"
    parts[split] += [np.asarray([tok.bos_id], np.int32), tok.encode(raw)]
  return {s: np.concatenate(p) if p else np.zeros((0,), np.int32) for s, p in parts.items()}


def chunks(documents: Iterable[tuple[str | bytes, bytes]], chunk_bytes: int,
           max_bytes: int = 0) -> Iterator[list[tuple[str | bytes, bytes]]]:
  """Documents grouped into lists of about `chunk_bytes`, stopping as `data.split_tokens`
  does once `max_bytes` are read (0 = all): the document that crosses the cap is kept."""
  budget = max_bytes or float("inf")
  chunk, size = [], 0
  for key, raw in documents:
    if budget <= 0:
      break
    budget -= len(raw)
    chunk.append((key, raw))
    size += len(raw)
    if size >= chunk_bytes:
      yield chunk
      chunk, size = [], 0
  if chunk:
    yield chunk


def tokenized(documents: Iterable[tuple[str | bytes, bytes]], spec: str, eval_fraction: float,
              *, workers: int, chunk_bytes: int, max_bytes: int = 0,
              in_flight: int = 0) -> Iterator[dict[str, np.ndarray]]:
  """Token streams of consecutive chunks, in corpus order, at most `in_flight` (default:
  2 per worker) read ahead. `workers=0` tokenises in this process."""
  groups = chunks(documents, chunk_bytes, max_bytes)
  if workers == 0:
    for docs in groups:
      yield tokenize_chunk(spec, eval_fraction, docs)
    return
  in_flight = in_flight or 2 * workers
  # spawn: the parent may hold threads (grain, JAX) that a fork would copy half-way.
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
    pending: collections.deque = collections.deque()
    for docs in groups:
      pending.append(pool.submit(tokenize_chunk, spec, eval_fraction, docs))
      if len(pending) >= in_flight:
        yield pending.popleft().result()
    while pending:
      yield pending.popleft().result()


class WindowCutter:
  """Cuts a split's stream, arriving in pieces, into the windows of the whole stream."""

  def __init__(self, length: int):
    self.length = length
    self.carry = np.zeros((0,), np.int32)  # always shorter than one window
    self.tokens = 0

  def add(self, tokens: np.ndarray) -> np.ndarray:
    """The complete windows, `[n, length]`, that `tokens` finishes."""
    self.tokens += len(tokens)
    joined = np.concatenate([self.carry, tokens]) if len(self.carry) else tokens
    n = len(joined) // self.length
    self.carry = np.array(joined[n * self.length:], np.int32)
    return joined[:n * self.length].reshape(n, self.length)


class ShardWriter:
  """Window i of a split into shard i mod `count` (`{split}-NNNNN-of-NNNNN.array_record`)."""

  def __init__(self, out: str, split: str, count: int):
    from array_record.python.array_record_module import (  # pylint: disable=import-outside-toplevel
        ArrayRecordWriter,
    )
    self.names = [f"{split}-{i:05d}-of-{count:05d}.array_record" for i in range(count)]
    self._writers = [ArrayRecordWriter(os.path.join(out, n), "group_size:1")
                     for n in self.names]
    self.windows = 0

  def write(self, windows: np.ndarray) -> None:
    for row in windows:
      self._writers[self.windows % len(self._writers)].write(
          np.ascontiguousarray(row, np.int32).tobytes())
      self.windows += 1

  def close(self) -> None:
    for w in self._writers:
      w.close()
