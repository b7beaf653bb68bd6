"""Corpus files wherever they live: a local path, or a URL such as gs://bucket/corpus.

Local paths keep `os` and `glob` (recursive `**` globs, no extra dependency). URLs go
through fsspec, as `etils.epath` and Orbax do for gs:// (install `gcsfs`: `pip install -e
".[gcs]"`), so any fsspec filesystem works (s3://, memory://, ...). fsspec is used directly
rather than through epath: epath's walk drops the scheme of the directories it yields
(gs://b/x comes back as b/x) and epath knows four schemes only. Checks list names and never
read a file's contents, so a run checks its data at start however large the corpus is.
"""

from __future__ import annotations

import glob
import os
import posixpath
import re
from typing import IO, Any

from diloco import documents
from diloco.errors import ConfigError, DocumentError

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_GLOB_CHARS = re.compile(r"[*?\[]")


def is_url(path: str) -> bool:
  """Whether `path` names an object store or other fsspec location (`scheme://...`)."""
  return bool(_URL.match(path or ""))


def _fs(path: str):
  """The fsspec filesystem of a URL and the path within it."""
  import fsspec  # pylint: disable=import-outside-toplevel
  try:
    return fsspec.core.url_to_fs(path)
  except ImportError as e:
    raise ConfigError(f"data.path: {path!r} needs a filesystem package that is not installed "
                      f"({e}); for gs:// run pip install -e \".[gcs]\"") from None
  except ValueError as e:
    raise ConfigError(f"data.path: {path!r} is not a URL fsspec can open ({e})") from None


def isdir(path: str) -> bool:
  if not is_url(path):
    return os.path.isdir(path)
  fs, inner = _fs(path)
  return bool(fs.isdir(inner))


def isfile(path: str) -> bool:
  if not is_url(path):
    return os.path.isfile(path)
  fs, inner = _fs(path)
  return bool(fs.isfile(inner))


def join(path: str, *names: str) -> str:
  """Names joined with '/' under a URL (the store's separator on every OS)."""
  return posixpath.join(path, *names) if is_url(path) else os.path.join(path, *names)


def dirname(path: str) -> str:
  return posixpath.dirname(path) if is_url(path) else os.path.dirname(path)


def relpath(path: str, start: str) -> str:
  """`path` relative to the directory `start`: the name that keys a document's split, the
  same for a corpus on local disk and its copy in a bucket."""
  if not is_url(path):
    return os.path.relpath(path, start)
  inner, top = _fs(path)[1], _fs(start)[1].rstrip("/")
  return inner[len(top) + 1:] if inner.startswith(top + "/") else inner


def matches(path: str) -> bool:
  """Whether `path` is a directory or a glob (or file) that matches something: names only."""
  if not is_url(path):
    return os.path.isdir(path) or bool(glob.glob(path, recursive=True))
  fs, inner = _fs(path)
  return bool(fs.glob(inner)) if _GLOB_CHARS.search(inner) else bool(fs.exists(inner))


def list_files(path: str, suffixes: tuple[str, ...] = ()) -> list[str]:
  """Sorted regular files under a directory (recursively; only `suffixes` if given), or a
  glob's matches; a URL's names keep their scheme (gs://bucket/...)."""
  if not is_url(path):
    if os.path.isdir(path):
      found = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
               if not suffixes or f.endswith(suffixes)]
    else:
      found = glob.glob(path, recursive=True)
    files = [f for f in found if os.path.isfile(f)]
  else:
    fs, inner = _fs(path)
    if fs.isdir(inner):  # one recursive listing, not a request per directory
      names = [n for n in fs.find(inner) if not suffixes or n.endswith(suffixes)]
    else:
      names = [n for n, info in fs.glob(inner, detail=True).items() if info["type"] == "file"]
    files = [fs.unstrip_protocol(n) for n in names]
  if not files:
    kinds = f" ({', '.join(suffixes)})" if suffixes else ""
    raise ConfigError(f"data.path: no files{kinds} found at {path!r}")
  return sorted(files)


def open_file(path: str, mode: str = "rb") -> IO[Any]:
  """A local file, or a URL's object (streamed: nothing is read up front)."""
  if not is_url(path):
    return open(path, mode, encoding=None if "b" in mode else "utf-8")
  fs, inner = _fs(path)
  return fs.open(inner, mode)


def read_json(path: str, what: str = "") -> Any:
  """The JSON document at `path` (a local file or a URL), read through `diloco.documents`:
  bounded in size and depth, one DocumentError naming the file (as `what`, default the path)
  when it cannot be read or is not JSON."""
  name = what or path
  try:
    with open_file(path, "rb") as f:
      data = f.read(documents.MAX_BYTES + 1)
  except OSError as e:
    raise DocumentError(name, "", f"cannot be read ({e.strerror or e})") from None
  if len(data) > documents.MAX_BYTES:
    raise DocumentError(name, "", f"is larger than {documents.MAX_BYTES} bytes")
  return documents.parse(data, name)
