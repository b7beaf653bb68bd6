"""The config on the command line: unknown keys, field help and the resolved summary.

ml_collections rejects a misspelled `--config.outer.lr=0.5` with a bare AttributeError deep
in flag parsing; `unknown_override` names the key and its nearest valid keys instead. The
help of a field is the `#` comment above it in its dataclass, read from the source, so the
text lives in one place (`python -m diloco.main --config_help[=FILTER]`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import io
import re
import sys
import textwrap
import tokenize
from typing import Any

import ml_collections

from diloco.cli import command
from diloco.config import files as config_files
from diloco.config import run_config
from diloco.learner import receipt

_OVERRIDE = re.compile(r"^--?(?:no)?config\.([^=\s]+)")
_SPEC = re.compile(r"^--?config(?:=(.*))?$")


def override_keys(argv: list[str]) -> list[str]:
  """The dotted keys of the `--config.KEY[=VALUE]` overrides in `argv`."""
  return [m.group(1) for m in map(_OVERRIDE.match, argv) if m]


def config_spec(argv: list[str]) -> str | None:
  """The value of `--config=FILE.py[:PRESET]` (or `--config FILE`) in `argv`, if any."""
  for i, arg in enumerate(argv):
    m = _SPEC.match(arg)
    if m:
      return m.group(1) if m.group(1) is not None else (argv[i + 1] if i + 1 < len(argv)
                                                         else None)
  return None


def _leaf_keys(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  out = []
  for key, value in cfg.items():
    if isinstance(value, ml_collections.ConfigDict):
      out += _leaf_keys(value, f"{prefix}{key}.")
    else:
      out.append(f"{prefix}{key}")
  return out


def _initials(name: str) -> str:
  return "".join(word[0] for word in name.split("_") if word)


def nearest_keys(key: str, valid: list[str], n: int = 3) -> list[str]:
  """Valid dotted keys closest to `key`, those of its own group first: a close spelling of
  the field's name or an abbreviation of it (`lr` for `learning_rate`); then the same name
  in another group; then close names or abbreviations in other groups."""
  group, _, name = key.rpartition(".")
  def close(keys):
    names = {k.rpartition(".")[2]: k for k in keys}
    out = [k for k in keys if len(name) > 1 and _initials(k.rpartition(".")[2]) == name]
    return out + [names[m] for m in difflib.get_close_matches(name, list(names), n, 0.7)]
  mine = [k for k in valid if k.rpartition(".")[0] == group]
  others = [k for k in valid if k.rpartition(".")[0] != group]
  out = close(mine) + [k for k in others if k.rpartition(".")[2] == name] + close(others)
  return list(dict.fromkeys(k for k in out if k != key))[:n]


def unknown_key_message(cfg: ml_collections.ConfigDict, key: str) -> str | None:
  """A short message naming `key` and the nearest valid keys, or None if `key` exists."""
  group, _, field = key.partition(".")
  if group == "sync" and field in receipt.FORMER_SYNC_FIELDS:
    return (f"--config.{key} is now --config.receipt.{receipt.FORMER_SYNC_FIELDS[field]} "
            "(the learner's receipt group)")
  node, parts = cfg, key.split(".")
  for depth, part in enumerate(parts):
    if isinstance(node, ml_collections.ConfigDict) and part in node:
      node = node[part]
      continue
    if depth == 0 and len(parts) > 1:
      groups = sorted(k for k, v in cfg.items() if isinstance(v, ml_collections.ConfigDict))
      near = difflib.get_close_matches(part, groups, n=1, cutoff=0.5)
      hint = f"did you mean {near[0]}? " if near else ""
      return f"unknown config group {part!r} in --config.{key}; {hint}groups: {', '.join(groups)}"
    near = nearest_keys(key, _leaf_keys(cfg))
    message = f"unknown config key --config.{key}"
    if near:
      message += f"; did you mean {' or '.join(near)}?"
    parent = ".".join(parts[:depth])
    if isinstance(node, ml_collections.ConfigDict):
      message += f" ({parent or 'the config'} has: {', '.join(sorted(node.keys()))})"
    return message
  return None


def unknown_override(argv: list[str]) -> str | None:
  """The message for the first `--config.KEY` override in `argv` that names no field."""
  spec = config_spec(argv)
  if spec is None:
    return None
  try:
    cfg = config_files.load(spec)
  except run_config.ConfigError:
    return None  # `with_config_resolved` reports the file's own error first
  for key in override_keys(argv):
    message = unknown_key_message(cfg, key)
    if message is not None:
      return message
  return None


def with_config_resolved(argv: list[str]) -> list[str]:
  """`argv` with its `--config=SPEC` made a path that exists (`decoupled:tiny` names a shipped
  file, see `diloco.config.files`), after loading it once: a missing file, a file that fails
  to load or an unknown preset is a one-line ConfigError here, not a traceback in the flag
  parser."""
  for i, arg in enumerate(argv):
    m = _SPEC.match(arg)
    if not m:
      continue
    if m.group(1) is None:  # `--config SPEC`
      if i + 1 == len(argv):
        raise run_config.ConfigError("--config needs a value, e.g. --config=decoupled:tiny")
      spec, span = argv[i + 1], slice(i, i + 2)
    else:
      spec, span = m.group(1), slice(i, i + 1)
    config_files.load(spec)
    return argv[:span.start] + [f"--config={config_files.resolve(spec)}"] + argv[span.stop:]
  return argv


_BAD_VALUE = re.compile(r"^flag --config\.([^=\s]+)=(.*?): (.*)$", re.S)


def bad_value_message(argv: list[str], error: str) -> str:
  """absl's error for an override that does not parse (`--config.train.steps=abc`), as one line
  naming the field and the type it needs."""
  error = " ".join(error.split())
  m = _BAD_VALUE.match(error)
  spec = config_spec(argv)
  if m is None or spec is None:
    return error
  key, value = m.group(1), m.group(2)
  try:
    node = config_files.load(spec)
    for part in key.split("."):
      node = node[part]
  except (run_config.ConfigError, KeyError, TypeError):
    return error
  return f"--config.{key}={value}: {key} must be {type(node).__name__}, got {value!r}"


def _comments(cls: type) -> tuple[str, dict[str, str]]:
  """(class docstring, {field: its comment}) read from the dataclass's source: the `#` lines
  right above a field and a comment at the end of its line."""
  source = textwrap.dedent(inspect.getsource(cls))
  lines = source.splitlines()
  comments = {t.start[0]: t.string.lstrip("#").strip()
              for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type == tokenize.COMMENT}
  classdef = ast.parse(source).body[0]
  out = {}
  for node in classdef.body:
    if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
      continue
    text, row = [], node.lineno - 1
    while row in comments and lines[row - 1].lstrip().startswith("#"):
      text.insert(0, comments[row])
      row -= 1
    if node.lineno in comments:
      text.append(comments[node.lineno])
    out[node.target.id] = " ".join(text)
  return (ast.get_docstring(classdef) or "").split("\n\n")[0].replace("\n", " "), out


def field_help() -> dict[str, tuple[str, dict[str, str]]]:
  """{group: (its docstring, {field: help})} for every config group, "" for top-level fields."""
  out = {name: _comments(cls) for name, cls in run_config.GROUPS.items()}
  top = _comments(run_config.Config)[1]
  out[""] = ("", {k: v for k, v in top.items() if k not in run_config.GROUPS})
  return out


def _values(cfg: ml_collections.ConfigDict | None) -> dict[str, dict[str, Any]]:
  if cfg is not None:
    raw = cfg.to_dict()
  else:
    raw = {name: dataclasses.asdict(cls()) for name, cls in run_config.GROUPS.items()}
    raw["seed"] = run_config.Config.__dataclass_fields__["seed"].default
  return {"": {k: v for k, v in raw.items() if not isinstance(v, dict)},
          **{k: v for k, v in raw.items() if isinstance(v, dict)}}


def help_text(cfg: ml_collections.ConfigDict | None = None, pattern: str = "") -> str:
  """`group.field = value  # help` lines of a group (`pattern` names it) or of the fields whose
  key contains `pattern` (all when empty), with the values of `cfg` (else the defaults)."""
  values, helps, out = _values(cfg), field_help(), []
  pattern = pattern.lower()
  for group, (doc, fields) in helps.items():
    if pattern in run_config.GROUPS and group != pattern:
      continue
    keys = [(f"{group}.{f}" if group else f, f) for f in fields if f in values.get(group, {})]
    keys = [(k, f) for k, f in keys if pattern in k.lower()]
    if not keys:
      continue
    if group:
      out.append(f"[{group}] {doc}".rstrip())
    for key, f in keys:
      line = f"  {key} = {values[group][f]!r}"
      if fields.get(f):
        line += f"  # {fields[f]}"
      out.append(textwrap.fill(line, width=100, subsequent_indent="      # ",
                               break_on_hyphens=False))
  if not out:
    raise run_config.ConfigError(f"--config_help={pattern}: no config field matches; groups: "
                                 f"{', '.join(run_config.GROUPS)}")
  return "\n".join(out)


def _describe(group: str, field: str, value: Any, cfg: run_config.Config) -> str:
  if (group, field) == ("sync", "quorum") and value == run_config.ALL_LEARNERS:
    return f"quorum=0 (all learners, K = M = {cfg.learners.count})"
  return f"{field}={value!r}"


def summary(cfg: run_config.Config) -> list[str]:
  """One compact line per group of the resolved config, listing the fields that differ from
  the dataclass defaults (the whole config is in WORKDIR/config.json)."""
  out = []
  for group, cls in run_config.GROUPS.items():
    value, default = getattr(cfg, group), cls()
    changed = [_describe(group, f.name, getattr(value, f.name), cfg)
               for f in dataclasses.fields(cls)
               if getattr(value, f.name) != getattr(default, f.name)]
    if changed:
      out += textwrap.wrap(f"{group}: " + " ".join(changed), width=100,
                           subsequent_indent="    ", break_on_hyphens=False)
  return out + [f"seed: {cfg.seed}"]


def run_command(flag_values, argv: list[str], body, prog: str) -> None:
  """`command.run` for a subcommand that takes --config: the file and preset resolved first,
  one line when they cannot be (`prog` names the command when argv has no program name)."""
  try:
    argv = with_config_resolved(list(argv))
  except run_config.ConfigError as e:
    sys.exit(f"{argv[0] if argv else prog}: error: {e}")
  command.run(flag_values, argv, body)

