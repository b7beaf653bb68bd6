"""Every field of every config group, enumerated from the groups' own definitions, takes the
values users mistype (NaN, infinities, -1, 0, 10**18, an empty string, a newline, a lone
surrogate) and either accepts them or says so in one line naming the field: never another
exception, never a non-finite number, a count past `settings.MAX_INT` or a control character."""

import dataclasses
import math
import typing

import pytest

from diloco import settings
from diloco.config import run_config
from diloco.errors import ConfigError

MISTYPED = (math.nan, math.inf, -math.inf, -1, 0, 10**18, "", "\n", "a\x00b", "\ud800")
FIELDS = [(group, f.name, typing.get_type_hints(cls)[f.name])
          for group, cls in run_config.GROUPS.items() for f in dataclasses.fields(cls)]


def test_every_numeric_field_declares_its_rule():
  missing = [f"{g}.{n}" for g, n, kind in FIELDS if kind in (int, float)
             and settings.rule_of(run_config.GROUPS[g], n) is None]
  assert not missing, f"give these a setting(default, rule): {missing}"


@pytest.mark.parametrize("group, name, kind", FIELDS, ids=[f"{g}.{n}" for g, n, _ in FIELDS])
def test_a_mistyped_value_is_accepted_or_refused_in_one_line(group, name, kind):
  rule = settings.rule_of(run_config.GROUPS[group], name)
  for value in MISTYPED:
    try:
      run_config.check_group(group, run_config.group_from_dict(group, {name: value}))
    except ConfigError as e:
      text = str(e)
      assert f"{group}.{name}" in text or text.startswith(f"{group}"), (value, text)
      assert "\n" not in text.replace(repr(value), ""), (value, text)
      continue
    # Accepted: then it is a value of the field's type that the general rules allow.
    assert kind is not bool and isinstance(value, kind if kind is not float else (int, float))
    if isinstance(value, float):
      assert math.isfinite(value) or (isinstance(rule, settings.Range) and rule.infinite_ok)
    if kind is int:
      assert abs(value) <= settings.MAX_INT or (rule.high or 0) > settings.MAX_INT, (group, name)
    if isinstance(value, str):
      assert value.isprintable() or value == "", (group, name, value)


def test_the_general_rules_name_what_they_refuse():
  with pytest.raises(ConfigError, match=r"model.rope_base_local: must be a finite number > 0, "
                                        r"got nan"):
    run_config.check_group("model", run_config.group_from_dict(
        "model", {"rope_base_local": math.nan}))
  with pytest.raises(ConfigError, match=r"train.eval_batches: must be at most 2147483647"):
    run_config.check_group("train", run_config.group_from_dict("train", {"eval_batches": 10**9 *
                                                                         10**9}))
  with pytest.raises(ConfigError, match=r"data.path: must hold no control character"):
    run_config.check_group("data", run_config.group_from_dict("data", {"path": "a\nb"}))
  # Sizes in bytes may pass MAX_INT.
  run_config.check_group("data", run_config.group_from_dict("data", {"max_bytes": 2**40}))
