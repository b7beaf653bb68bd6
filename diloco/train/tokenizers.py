"""Tokenizers: raw bytes (default, needs nothing) and SentencePiece (trained offline)."""

from __future__ import annotations

import os

import numpy as np

from diloco.config_lib import ConfigError


class ByteTokenizer:
  """UTF-8 bytes 0..255, then BOS = 256 and EOS = 257."""
  name = "byte"
  vocab_size = 258
  bos_id = 256
  eos_id = 257

  def encode(self, data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
  """A SentencePiece model file, e.g. one written by `scripts/prepare_data.py`."""
  name = "sentencepiece"

  def __init__(self, path: str):
    import sentencepiece as spm  # pylint: disable=import-outside-toplevel
    if not os.path.isfile(path):
      raise ConfigError(f"data.tokenizer: SentencePiece model {path!r} does not exist")
    self.path = path
    self._sp = spm.SentencePieceProcessor(model_file=path)
    self.vocab_size = self._sp.get_piece_size()
    self.bos_id = self._sp.bos_id()
    self.eos_id = self._sp.eos_id()

  def encode(self, data: bytes) -> np.ndarray:
    return np.asarray(self._sp.encode(data.decode("utf-8", errors="replace")), dtype=np.int32)

  def decode(self, ids) -> str:
    return self._sp.decode([int(i) for i in ids])


def make(spec: str) -> ByteTokenizer | SentencePieceTokenizer:
  """'byte' or the path of a SentencePiece model."""
  return ByteTokenizer() if spec == "byte" else SentencePieceTokenizer(spec)
