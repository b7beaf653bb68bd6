"""What a setting accepts, stated once beside its field: a numeric range or a fixed set of
choices (docs/architecture.md, "Where a config rule lives").

A config group is a `@frozen` class beside the code it configures, each field declared as
`name: type = setting(default, rule)`; `check_fields` then checks every field of the group
against its rule, and the group's `check` method holds only the rules that relate fields to
each other.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from diloco.errors import ConfigError


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Range:
  """Numbers between `low` and `high` (None: unbounded), each end closed unless marked open.

  NaN never passes, and infinities only where `infinite_ok` says they mean something; `finite`
  only says so in the wording. `integer` keeps floats out (the config's type check does that
  too; the policy relies on this one). `text` replaces the generated wording where the bare
  interval would mislead (quorum's 0)."""
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  finite: bool = False
  integer: bool = False
  text: str = ""
  infinite_ok: bool = False

  def admits(self, value: Any) -> bool:
    if not _is_number(value) or math.isnan(value):
      return False
    if self.integer and not isinstance(value, int):
      return False
    if not self.infinite_ok and not math.isfinite(value):
      return False
    if self.low is not None and (value <= self.low if self.low_open else value < self.low):
      return False
    return self.high is None or (value < self.high if self.high_open else value <= self.high)

  def describe(self) -> str:
    if self.text:
      return self.text
    kind = "a finite number " if self.finite else ""
    if self.high is None:
      return f"{kind}{'>' if self.low_open else '>='} {self.low:g}"
    if self.low is None:
      return f"{kind}{'<' if self.high_open else '<='} {self.high:g}"
    left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
    return f"{kind}in {left}{self.low:g}, {self.high:g}{right}"


@dataclasses.dataclass(frozen=True)
class OneOf:
  """One of a fixed tuple of values, imported from the module that acts on them."""
  choices: tuple

  def admits(self, value: Any) -> bool:
    return any(value == c and type(value) is type(c) for c in self.choices)

  def describe(self) -> str:
    return f"one of {self.choices}"


Rule = Range | OneOf

# The rules that most fields share.
POSITIVE = Range(low=0, low_open=True)
NON_NEGATIVE = Range(low=0)
AT_LEAST_ONE = Range(low=1)
FRACTION = Range(low=0, high=1, high_open=True)  # [0, 1)
# Sizes in bytes, which may pass MAX_INT (below).
BYTES = Range(low=0, high=2**53, text=">= 0 (bytes)")


def frozen(cls: type) -> type:
  """The dataclass form of every config group: immutable, keyword-only, slotted."""
  return dataclasses.dataclass(frozen=True, kw_only=True, slots=True)(cls)


def setting(default: Any, rule: Rule | None = None, note: str = "") -> Any:
  """A dataclass field with its default and the rule its values must satisfy; `note` says
  what a special value means (e.g. "0 = off") in the error message."""
  return dataclasses.field(default=default, metadata={"rule": rule, "note": note})


def rule_of(cls: type, name: str) -> Rule | None:
  """The rule declared for field `name` of the dataclass `cls` (None: any value of its type)."""
  return cls.__dataclass_fields__[name].metadata.get("rule")


def message(rule: Rule, value: Any, note: str = "") -> str:
  """'must be <rule> (<note>), got <value>': the end of every rule's error message."""
  text = rule.describe()
  if (isinstance(rule, Range) and _is_number(value) and not math.isfinite(value)
      and not rule.finite):
    text = f"a finite number {text}"
  return f"must be {text}{f' ({note})' if note else ''}, got {value!r}"


# Rules every field keeps whatever its own: a number is finite and an int of at most this much
# (a larger count or size is a typo, not a plan: it would hang or exhaust memory later), and a
# string holds no control character or lone surrogate (a path or name with a newline would end
# up in a script, a log line or a file name; a surrogate cannot even be written to config.json).
MAX_INT = 2**31 - 1
_CONTROL = frozenset(chr(c) for c in range(32)) | {"\x7f"}


# What a free-text value (a prompt, a shell line) may hold beside printable characters.
TEXT_CONTROL = frozenset("\n\t")


def general_problem(value: Any, rule: Rule | None = None, *, text: bool = False) -> str | None:
  """What breaks the general rules in `value` (None: nothing); `rule` is the value's own (a
  Range past MAX_INT allows larger ints); `text` admits newlines and tabs (free text)."""
  if isinstance(value, str):
    allowed = TEXT_CONTROL if text else frozenset()
    if any(c in _CONTROL and c not in allowed or "\ud800" <= c <= "\udfff" for c in value):
      what = "lone surrogate or control character but newline and tab" if text else (
          "control character or lone surrogate")
      return f"must hold no {what}, got {value!r}"
    return None
  if not _is_number(value) or isinstance(rule, OneOf):
    return None
  if isinstance(value, float) and not math.isfinite(value) and rule is None:
    return f"must be a finite number, got {value!r}"  # (a Range says so in its own words)
  if isinstance(value, int) and abs(value) > MAX_INT and not (
      isinstance(rule, Range) and rule.high is not None and rule.high > MAX_INT):
    return f"must be at most {MAX_INT} in size, got {value!r}"
  return None


def check_fields(group: str, values: Any) -> None:
  """ConfigError naming `group.field` for the first field of the dataclass instance `values`
  whose value breaks the general rules (`MAX_INT`, above) or its declared rule."""
  for f in dataclasses.fields(values):
    rule = f.metadata.get("rule")
    value = getattr(values, f.name)
    problem = general_problem(value, rule)
    if problem:
      raise ConfigError(f"{group}.{f.name}: {problem}")
    if rule is not None and not rule.admits(value):
      raise ConfigError(f"{group}.{f.name}: {message(rule, value, f.metadata.get('note', ''))}")


def check_flags(flag_values: Any, names=None, text_flags=()) -> None:
  """ConfigError naming the first flag (of `names`, default all of `flag_values`) whose value
  breaks the general rules of config fields (`general_problem`): a number finite and
  at most `MAX_INT` in size (unless the flag's own upper bound is larger), a string
  free of control characters and lone surrogates (`text_flags`: free text, newlines and tabs
  allowed). `flag_values`: an absl FlagValues; every command runs this before its body
  (`diloco.cli.command.run`), so every flag of every command keeps the rules."""
  for name in flag_values if names is None else names:
    flag = flag_values[name]
    if flag.name != name:
      continue  # a short name of another flag
    high = getattr(flag.parser, "upper_bound", None)
    rule = Range(high=high) if high is not None and high > MAX_INT else None
    for value in flag.value if isinstance(flag.value, list) else [flag.value]:
      problem = general_problem(value, rule, text=name in text_flags)
      if problem:
        raise ConfigError(f"--{name}: {problem}")


def require(ok: bool, field: str, message_text: str) -> None:
  """ConfigError `field: message_text` unless `ok`: the rules that relate fields."""
  if not ok:
    raise ConfigError(f"{field}: {message_text}")
