"""Typed reading of the JSON documents the project reads back from disk (an export's meta, a
run's config, a run checkpoint's meta, a tokenizer's config).

A document is parsed, then each field the reader uses is checked for presence and type before
anything is built from it; every failure is one `DocumentError` naming the file and the field.
Types are strict: no string is taken for a number, `true` is not an integer, and a number a
reader uses must be finite.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from diloco.errors import ConfigError, DocumentError
from diloco.settings import check_fields

# Every document the project writes is a few kilobytes; a larger file is not one of them (and
# is not read into memory whole).
MAX_BYTES = 16 << 20

_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
               dict: "an object", list: "a list", type(None): "null"}
# The forms of the config rules' messages (diloco/settings.py, diloco/config/run_config.py):
# "group.field: detail", "unknown field group.field; detail", "group.field must be TYPE, ...".
_FIELD_MESSAGES = (re.compile(r"^([A-Za-z_][\w.]*(?:/[\w.]+)?): (.*)$", re.DOTALL),
                   re.compile(r"^unknown field ([\w.]+); (.*)$", re.DOTALL),
                   re.compile(r"^([A-Za-z_]\w*\.\w+) (must be .*)$", re.DOTALL))


@dataclasses.dataclass(frozen=True)
class Field:
  """What a reader takes for one key: its kind (a type or a tuple of types), whether the key
  must be there, and whether a number may be NaN or infinite (a logged loss may be)."""
  kind: type | tuple[type, ...]
  required: bool = True
  finite: bool = True


def show(value: Any, limit: int = 60) -> str:
  """`repr(value)` cut to `limit` characters, for an error line."""
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def parse(text: str | bytes, file: str) -> Any:
  """The JSON value of `text`; DocumentError naming `file` when it is not JSON."""
  try:
    return json.loads(text)
  except (ValueError, RecursionError) as e:  # also bad UTF-8, too deep, an integer too long
    raise DocumentError(file, "", f"is not JSON ({show(str(e), 120)})") from None


def read(path: str, file: str | None = None) -> Any:
  """The JSON value of the file at `path` (`file` names it in errors; default: the path)."""
  file = file or path
  try:
    with open(path, "rb") as f:
      data = f.read(MAX_BYTES + 1)
  except OSError as e:
    raise DocumentError(file, "", f"cannot be read ({e.strerror or e})") from None
  if len(data) > MAX_BYTES:
    raise DocumentError(file, "", f"is larger than {MAX_BYTES} bytes; not a document of diloco")
  return parse(data, file)


def _is(value: Any, kind: type) -> bool:
  if kind is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if kind is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  return isinstance(value, kind)


def value(v: Any, kind: type | tuple[type, ...], file: str, field: str,
          finite: bool = True) -> Any:
  """`v` if it is of `kind` (an integer is taken for a float, and returned as one)."""
  kinds = kind if isinstance(kind, tuple) else (kind,)
  for k in kinds:
    if not _is(v, k):
      continue
    if k is not float:
      return v
    try:
      number = float(v)
    except OverflowError:
      number = math.inf
    if finite and not math.isfinite(number):
      raise DocumentError(file, field, f"must be a finite number, got {show(v)}")
    return number
  wanted = " or ".join(_KIND_NAMES.get(k, k.__name__) for k in kinds)
  raise DocumentError(file, field, f"must be {wanted}, got {show(v)}")


def obj(v: Any, file: str, field: str = "") -> dict:
  """`v` if it is a JSON object (`field` "" for the document itself)."""
  return value(v, dict, file, field)


def fields(doc: dict, spec: dict[str, Field | type], file: str, prefix: str = "") -> dict:
  """The keys of `spec` that `doc` has, each checked against its Field (a bare type is a
  required Field of that type); keys outside `spec` are left to the caller."""
  out = {}
  for key, want in spec.items():
    want = want if isinstance(want, Field) else Field(want)
    if key not in doc:
      if want.required:
        raise DocumentError(file, prefix + key, "is missing")
      continue
    out[key] = value(doc[key], want.kind, file, prefix + key, want.finite)
  return out


def from_config_error(e: ConfigError, file: str) -> DocumentError:
  """A config rule's error (which names its field) as the error of the document `file`."""
  if isinstance(e, DocumentError):
    return e
  for pattern in _FIELD_MESSAGES:
    m = pattern.match(str(e))
    if m:
      return DocumentError(file, m.group(1), m.group(2))
  return DocumentError(file, "", str(e))


def non_finite(doc: Any, file: str) -> None:
  """DocumentError naming a NaN or infinite number anywhere in `doc`."""
  stack = [("", doc)]  # not recursive: a document may nest as deep as the parser allows
  while stack:
    path, item = stack.pop()
    if isinstance(item, float) and not math.isfinite(item):
      raise DocumentError(file, path or "(top level)", f"must be a finite number, got {item!r}")
    children = item.items() if isinstance(item, dict) else (
        enumerate(item) if isinstance(item, list) else ())
    stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in children)


def group(cls: type, name: str, values: Any, file: str, across: bool = True) -> Any:
  """The config group `cls` from the document's object `name`: every key a field of `cls`,
  every value of its field's type (see `value`), then the group's own rules (each field's
  `setting` rule and, if `across`, the group's `check`), as a config file's values are
  checked. `across=False` where `check` looks at the files a field names (`data.path`) and
  the reader does not use them."""
  values = obj(values, file, name)
  known = {f.name for f in dataclasses.fields(cls)}
  defaults = cls()
  checked = {}
  for key, v in values.items():
    if key not in known:
      raise DocumentError(file, f"{name}.{key[:40]}", "is not a field of this version of diloco")
    checked[key] = value(v, type(getattr(defaults, key)), file, f"{name}.{key}")
  instance = cls(**checked)
  try:
    check_fields(name, instance)
    if across and hasattr(instance, "check"):
      instance.check()
  except ConfigError as e:
    raise from_config_error(e, file) from None
  return instance
