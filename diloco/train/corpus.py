"""Documents of a corpus, one at a time, whatever the file format.

`documents(cfg)` yields `(key, text)` pairs: `text` is one document's UTF-8 bytes and
`key` decides its split (train or eval) by hash. Files of text are keyed by their
relative name (as before); records of jsonl, parquet and `datasets` directories are keyed
by their content, so the holdout does not depend on row order or sharding, and
duplicates of a document land in the same split.

Record sources read one text field (`data.text_key`):
  * `jsonl`: JSON-lines files (`.jsonl`, `.json`, optionally gzipped), one object a line;
  * `parquet`: parquet files, read column-wise with pyarrow;
  * `datasets`: a directory written by Hugging Face `Dataset.save_to_disk` or
    `DatasetDict.save_to_disk` (`data.split` picks the split), or a `datasets` cache
    directory (`<builder>-<split>[-NNNNN-of-NNNNN].arrow`). The Arrow files are read
    with pyarrow alone, so training needs no `datasets` install.
pyarrow is imported only by the sources that need it (`pip install -e ".[hf]"`).
Every source also reads from URLs (`gs://bucket/corpus/*.jsonl.gz`) through `storage`.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import re
import sysconfig
import zlib
from typing import Iterator

from diloco import documents as documents_lib
from diloco.errors import ConfigError
from diloco.train import storage

RECORD_SOURCES = ("jsonl", "parquet", "datasets")
# The `data.source` values that `documents` reads (array_record shards: diloco/train/data.py).
CORPUS_SOURCES = ("stdlib", "text") + RECORD_SOURCES
_SUFFIXES = {"jsonl": (".jsonl", ".jsonl.gz", ".json", ".json.gz"), "parquet": (".parquet",)}


# Directories that hold no standard-library sources: not descended into.
_NOT_STDLIB = ("site-packages", "dist-packages", "__pycache__")


def stdlib_files() -> list[str]:
  """Sorted `.py` files of this interpreter's standard library (site-packages excluded)."""
  return list(_stdlib_files(sysconfig.get_paths()["stdlib"]))


@functools.cache
def _stdlib_files(root: str) -> tuple[str, ...]:
  """`root/**/*.py` as `glob` finds it, listed once a process (preflight and data both ask).

  A walk that skips installed packages reads ~2x fewer directories than the glob did; it
  keeps the glob's rules: hidden names are skipped and linked directories are followed.
  """
  files = []
  for top, dirs, names in os.walk(root, followlinks=True):
    dirs[:] = [d for d in dirs if not d.startswith(".") and d not in _NOT_STDLIB]
    files += [os.path.join(top, n) for n in names + dirs
              if n.endswith(".py") and not n.startswith(".")]
  return tuple(sorted(f for f in files if "site-packages" not in f and "dist-packages" not in f))


def text_files(path: str, suffixes: tuple[str, ...] = ()) -> list[str]:
  """Regular files under a directory (recursively; only `suffixes` if given), or a glob's."""
  return storage.list_files(path, suffixes)


def _pyarrow():
  try:
    import pyarrow  # pylint: disable=import-outside-toplevel
    import pyarrow.ipc  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import pyarrow.parquet  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise ConfigError("data.source: parquet and datasets sources need pyarrow; "
                      'pip install -e ".[hf]"') from None
  return pyarrow


def _check_text(value, key: str, where: str):
  if value is not None and not isinstance(value, str):
    raise ConfigError(f"data.text_key: field {key!r} at {where} is a {type(value).__name__}, "
                      "not a string")
  if value and any("\ud800" <= c <= "\udfff" for c in value):  # JSON's \ud800 escapes
    raise ConfigError(f"data.path: {where}: field {key!r} holds a lone surrogate, which is no "
                      "text UTF-8 can carry")
  return value


def _lines(name: str, binary) -> Iterator[tuple[int, str]]:
  """(line number, text) of a JSON-lines file as it streams: a line that is not UTF-8, or a
  gzip file that is cut short or corrupt, is a one-line error naming the file (and line)."""
  lineno = 0
  try:
    for lineno, raw in enumerate(binary, 1):
      try:
        yield lineno, raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ConfigError(f"data.path: {name}:{lineno} is not UTF-8 ({e.reason} at byte "
                          f"{e.start})") from None
  except (EOFError, gzip.BadGzipFile, zlib.error) as e:
    raise ConfigError(f"data.path: {name} is cut short or not gzip after line {lineno} "
                      f"({e})") from None


def _jsonl_documents(path: str, key: str) -> Iterator[str]:
  for name in text_files(path, () if _is_single(path) else _SUFFIXES["jsonl"]):
    with storage.open_file(name, "rb") as raw:
      binary = gzip.GzipFile(fileobj=raw) if name.endswith(".gz") else raw
      for lineno, line in _lines(name, binary):
        if not line.strip():
          continue
        where = f"{name}:{lineno}"
        try:
          record = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deep
          raise ConfigError(f"data.path: {where} is not valid JSON ({str(e)[:100]})") from None
        if not isinstance(record, dict):
          raise ConfigError(f"data.path: {where} is a JSON {type(record).__name__}, not an object")
        if key not in record:
          raise ConfigError(f"data.text_key: {where} has no field {key!r}; it has "
                            f"{sorted(record)}")
        yield _check_text(record[key], key, where)


def _text_column(batches, schema, key: str, where: str) -> Iterator[str]:
  """The string column `key` of Arrow record batches, checked once against the schema."""
  pa = _pyarrow()
  if key not in schema.names:
    raise ConfigError(f"data.text_key: {where} has no column {key!r}; it has {schema.names}")
  kind = schema.field(key).type
  is_view = getattr(pa.types, "is_string_view", lambda _: False)
  if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)):
    raise ConfigError(f"data.text_key: column {key!r} of {where} is {kind}, not a string")
  for batch in batches:
    yield from batch.column(key).to_pylist()


def _parquet_documents(path: str, key: str) -> Iterator[str]:
  pa = _pyarrow()
  for name in text_files(path, () if _is_single(path) else _SUFFIXES["parquet"]):
    try:
      pf = pa.parquet.ParquetFile(name if not storage.is_url(name)
                                  else storage.open_file(name, "rb"))
    except (pa.ArrowInvalid, OSError) as e:
      raise ConfigError(f"data.path: {name} is not a parquet file ({e})") from None
    schema = pf.schema_arrow
    cols = [key] if key in schema.names else None
    yield from _text_column(pf.iter_batches(batch_size=1024, columns=cols), schema, key, name)


def datasets_arrow_files(path: str, split: str) -> list[str]:
  """The Arrow files of one split of a `save_to_disk` or cache directory, in row order."""
  if not storage.isdir(path):
    raise ConfigError(f"data.path: {path!r} is not a directory (source=datasets expects one "
                      "written by Dataset.save_to_disk or DatasetDict.save_to_disk)")
  if storage.isfile(storage.join(path, "dataset_dict.json")):       # a DatasetDict
    listing = storage.join(path, "dataset_dict.json")
    splits = documents_lib.fields(documents_lib.obj(storage.read_json(listing), listing),
                                  {"splits": list}, listing)["splits"]
    if split not in splits:
      raise ConfigError(f"data.split: {split!r} is not a split of {path!r}; it has {splits}")
    path = storage.join(path, split)
  if storage.isfile(storage.join(path, "state.json")):              # a Dataset
    state = storage.join(path, "state.json")
    entries = documents_lib.fields(documents_lib.obj(storage.read_json(state), state),
                                   {"_data_files": list}, state)["_data_files"]
    names = [documents_lib.fields(documents_lib.obj(e, state, f"_data_files[{i}]"),
                                  {"filename": str}, state, f"_data_files[{i}].")["filename"]
             for i, e in enumerate(entries)]
    files = [storage.join(path, n) for n in names]
    missing = [f for f in files if not storage.isfile(f)]
    if missing:
      raise ConfigError(f"data.path: {path!r} lists Arrow files that are missing: {missing}")
    return files
  # A `datasets` cache directory: <builder>-<split>.arrow or <builder>-<split>-N-of-M.arrow.
  pattern = re.compile(rf".+-{re.escape(split)}(-\d{{5}}-of-\d{{5}})?\.arrow$")
  try:
    names = storage.list_files(path)
  except ConfigError:  # an empty directory: reported below
    names = []
  found = sorted(f for f in names if pattern.match(f.rsplit("/", 1)[-1]))
  dirs = sorted({storage.dirname(f) for f in found})
  if len(dirs) > 1:
    raise ConfigError(f"data.path: {path!r} holds several cached datasets with split "
                      f"{split!r}: {dirs}; point data.path at one of them")
  if not found:
    raise ConfigError(f"data.path: {path!r} holds no `datasets` directory (no "
                      f"dataset_dict.json or state.json) and no cached '*-{split}.arrow' files")
  return found


def _datasets_documents(path: str, key: str, split: str) -> Iterator[str]:
  pa = _pyarrow()
  for name in datasets_arrow_files(path, split):
    source = storage.open_file(name, "rb") if storage.is_url(name) else pa.memory_map(name)
    try:
      reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
      try:
        reader = pa.ipc.open_file(source)
      except pa.ArrowInvalid as e:
        raise ConfigError(f"data.path: {name} is not an Arrow file ({e})") from None
      batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
      batches = iter(reader)
    yield from _text_column(batches, reader.schema, key, name)


def _is_single(path: str) -> bool:
  return storage.isfile(path)


def root(cfg) -> str:
  """The directory that text files' names are taken relative to."""
  if cfg.source == "stdlib":
    return sysconfig.get_paths()["stdlib"]
  return cfg.path if storage.isdir(cfg.path) else storage.dirname(cfg.path)


def documents(cfg) -> Iterator[tuple[str | bytes, bytes]]:
  """`(split key, utf-8 text)` of every non-empty document of `cfg.source`, in a fixed order."""
  if cfg.source in ("stdlib", "text"):
    top = root(cfg)
    for path in stdlib_files() if cfg.source == "stdlib" else text_files(cfg.path):
      with storage.open_file(path, "rb") as f:
        raw = f.read()
      if raw:
        yield storage.relpath(path, top), raw
    return
  if cfg.source == "jsonl":
    texts = _jsonl_documents(cfg.path, cfg.text_key)
  elif cfg.source == "parquet":
    texts = _parquet_documents(cfg.path, cfg.text_key)
  elif cfg.source == "datasets":
    texts = _datasets_documents(cfg.path, cfg.text_key, cfg.split)
  else:
    raise ConfigError(f"data.source: {cfg.source!r} is not a text corpus")
  for text in texts:
    if text:  # None (a missing value) and "" carry no tokens
      raw = text.encode("utf-8")
      yield raw, raw
