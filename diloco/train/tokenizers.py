"""Tokenizers: raw bytes (default), SentencePiece models, Hugging Face `tokenizers` JSON files.

`data.tokenizer` is "byte", a SentencePiece `.model` file (one trained by
`scripts/prepare_data.py`, or an existing one such as Gemma's `tokenizer.model`), a
Hugging Face `tokenizer.json`, or a directory holding one of those two files.

All three expose the same interface: `encode(bytes) -> int32 ids` without special tokens,
`decode(ids) -> str` that drops special tokens, `vocab_size` (one more than the largest
id), `bos_id` (the id put before every document: the tokenizer's BOS, or its EOS when it
has no BOS, as GPT-2's `<|endoftext|>`), `eos_id` and `pad_id` (-1 when absent). The
pipeline packs documents into windows and never pads, so `pad_id` is informational.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from diloco import documents
from diloco.errors import ConfigError

# The file beside a `tokenizer.json` that names its special tokens (transformers' layout).
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Special tokens looked up by name in a `tokenizer.json` without a `tokenizer_config.json`.
_BOS_NAMES = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]", "<|endoftext|>")
_EOS_NAMES = ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>", "[SEP]")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


class ByteTokenizer:
  """UTF-8 bytes 0..255, then BOS = 256 and EOS = 257."""
  name = "byte"
  vocab_size = 258
  bos_id = 256
  eos_id = 257
  pad_id = -1

  def encode(self, data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def _separator(path: str, bos: int, eos: int) -> int:
  if bos >= 0:
    return bos
  if eos >= 0:
    return eos
  raise ConfigError(f"data.tokenizer: {path!r} has neither a BOS nor an EOS token; the "
                    "pipeline needs one to separate documents")


class SentencePieceTokenizer:
  """A SentencePiece model file, e.g. one written by `scripts/prepare_data.py` or Gemma's."""
  name = "sentencepiece"

  def __init__(self, path: str):
    import sentencepiece as spm  # pylint: disable=import-outside-toplevel
    if not os.path.isfile(path):
      raise ConfigError(f"data.tokenizer: SentencePiece model {path!r} does not exist")
    self.path = path
    try:
      self._sp = spm.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as e:
      raise ConfigError(f"data.tokenizer: {path!r} is not a SentencePiece model ({e})") from None
    self.vocab_size = self._sp.get_piece_size()
    self.eos_id = self._sp.eos_id()
    self.pad_id = self._sp.pad_id()
    self.bos_id = _separator(path, self._sp.bos_id(), self.eos_id)

  def encode(self, data: bytes) -> np.ndarray:
    return np.asarray(self._sp.encode(data.decode("utf-8", errors="replace")), dtype=np.int32)

  def decode(self, ids) -> str:
    return self._sp.decode([int(i) for i in ids])


def _token_content(value) -> str | None:
  """A special token as `tokenizer_config.json` writes it: a string or {"content": ...}."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


class HuggingFaceTokenizer:
  """A Hugging Face `tokenizers` JSON file (`tokenizer.json`), loaded without any hub access.

  Special tokens come from a `tokenizer_config.json` beside it when there is one (as
  `transformers` saves them), else from the first well-known name in the vocabulary.
  """
  name = "hf_tokenizers"

  def __init__(self, path: str):
    try:
      from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
    except ImportError:
      raise ConfigError("data.tokenizer: a tokenizer.json needs the `tokenizers` package; "
                        'pip install -e ".[hf]"') from None
    if not os.path.isfile(path):
      raise ConfigError(f"data.tokenizer: {path!r} does not exist")
    self.path = path
    try:
      self._tok = Tokenizer.from_file(path)
    except Exception as e:  # pylint: disable=broad-except  (the Rust side raises plain Exception)
      raise ConfigError(f"data.tokenizer: {path!r} is not a `tokenizers` JSON file "
                        f"({str(e)[:200]})") from None
    vocab = self._tok.get_vocab(with_added_tokens=True)
    self.vocab_size = max(vocab.values()) + 1
    named = self._configured_tokens(os.path.join(os.path.dirname(path), TOKENIZER_CONFIG_FILE))

    def find(kind: str, candidates: tuple[str, ...]) -> int:
      token = named.get(kind)
      if token is not None and token in vocab:
        return vocab[token]
      return next((vocab[t] for t in candidates if t in vocab), -1)

    self.eos_id = find("eos_token", _EOS_NAMES)
    self.pad_id = find("pad_token", _PAD_NAMES)
    bos = find("bos_token", _BOS_NAMES)
    if bos < 0 and self.eos_id < 0:
      raise ConfigError(f"data.tokenizer: {path!r} has no BOS or EOS token (looked for "
                        f"{sorted(set(_BOS_NAMES + _EOS_NAMES))} and a tokenizer_config.json); "
                        "the pipeline needs one to separate documents")
    self.bos_id = _separator(path, bos, self.eos_id)

  @staticmethod
  def _configured_tokens(config_path: str) -> dict[str, str]:
    if not os.path.isfile(config_path):
      return {}
    config = documents.obj(documents.read(config_path), config_path)
    tokens = {k: _token_content(config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
    return {k: v for k, v in tokens.items() if v is not None}

  def encode(self, data: bytes) -> np.ndarray:
    text = data.decode("utf-8", errors="replace")
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


Tokenizer = ByteTokenizer | SentencePieceTokenizer | HuggingFaceTokenizer


def resolve(spec: str) -> str:
  """The tokenizer file that `data.tokenizer` names ("byte" stays "byte")."""
  if spec == "byte":
    return spec
  if os.path.isdir(spec):
    for name in ("tokenizer.json", "tokenizer.model"):
      if os.path.isfile(os.path.join(spec, name)):
        return os.path.join(spec, name)
    raise ConfigError(f"data.tokenizer: directory {spec!r} has no tokenizer.json or "
                      "tokenizer.model")
  if not os.path.isfile(spec):
    raise ConfigError(f"data.tokenizer: must be 'byte', a SentencePiece .model file, a "
                      f"tokenizer.json or a directory with one, got {spec!r} (no such file)")
  return spec


def _is_json(path: str) -> bool:
  if path.endswith(".json"):
    return True
  with open(path, "rb") as f:
    return f.read(64).lstrip().startswith(b"{")


@functools.lru_cache(maxsize=8)
def make(spec: str) -> Tokenizer:
  """'byte', or the path of a SentencePiece model, a tokenizer.json, or a directory of one."""
  path = resolve(spec)
  if path == "byte":
    return ByteTokenizer()
  return HuggingFaceTokenizer(path) if _is_json(path) else SentencePieceTokenizer(path)
