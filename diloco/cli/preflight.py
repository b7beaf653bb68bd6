"""Checks of a run's inputs before any model is built or compiled.

A wrong text field or a missing tokenizer would otherwise surface only once every learner
is built and compiled (minutes on a real model). `check` opens the workdir, the tokenizer and
the first document (or the shard index) of the data, in a second or two, and raises a
one-line ConfigError that names the field and the file. The runtimes keep their own checks:
this only moves the common mistakes to the start.
"""

from __future__ import annotations

import os

from diloco.config.run_config import Config
from diloco.errors import ConfigError
from diloco.train import corpus, data, storage, tokenizers

TEXT_SOURCES = ("stdlib", "text") + corpus.RECORD_SOURCES


def check_workdir(workdir: str) -> None:
  """The workdir is a directory (or can be made one) that this process may write."""
  if not workdir.strip():
    raise ConfigError("--workdir is empty; give the run's directory, e.g. --workdir=runs/first")
  if storage.is_url(workdir):
    return  # an object store: its own client reports access on the first write
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f"--workdir: {workdir!r} is a file, not a directory")
  existing = workdir
  while existing and not os.path.exists(existing):
    existing = os.path.dirname(existing.rstrip(os.sep))
  existing = existing or "."
  if not os.path.isdir(existing):
    raise ConfigError(f"--workdir: {existing!r} (a parent of {workdir!r}) is a file")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError(f"--workdir: {existing!r} is not writable")


def check_tokenizer(spec: str) -> None:
  """`data.tokenizer` names a tokenizer that loads (a file that exists, is readable, and
  parses as a SentencePiece model or a tokenizer.json)."""
  if spec == "byte":
    return
  path = tokenizers.resolve(spec)
  try:
    with open(path, "rb") as f:
      f.read(1)
  except OSError as e:
    raise ConfigError(f"data.tokenizer: cannot read {path!r} ({e.strerror})") from None
  tokenizers.make(spec)


def check_data(cfg: Config) -> None:
  """`data.path` holds what `data.source` reads: the shard index and files of prepared shards,
  or at least one document whose text field (`data.text_key`) is a string."""
  source = cfg.data
  if source.source == "array_record":
    data.shard_paths(source, "train")
    return
  if source.source not in TEXT_SOURCES:
    raise ConfigError(f"data.source: {source.source!r} is not one of "
                      f"{', '.join(TEXT_SOURCES + ('array_record',))}")
  if source.source != "stdlib" and not source.path:
    raise ConfigError(f"data.path: source={source.source} needs a path")
  try:
    first = next(iter(corpus.documents(source)), None)
  except OSError as e:
    raise ConfigError(f"data.path: cannot read {source.path!r} ({e})") from None
  if first is None:
    raise ConfigError(f"data.path: {source.path!r} holds no non-empty document "
                      f"(source={source.source}, text_key={source.text_key!r})")


def check(cfg: Config, workdir: str) -> None:
  """Every check above, cheapest first; raises the first problem as a ConfigError."""
  check_workdir(workdir)
  if cfg.data.source != "array_record":  # shards were tokenized when they were written
    check_tokenizer(cfg.data.tokenizer)
  check_data(cfg)
  data.check_vocab(cfg.data, cfg.model.vocab_size)
