"""The config's `sync` group and the syncer policy accept exactly the same values (docs/design.md
2.3-2.4): values drawn around every bound go through both, and both accept or both reject."""

import math

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from diloco import settings
from diloco.config import run_config
from diloco.errors import ConfigError
from diloco.sync import policy
from diloco.sync.policy import SyncConfig


def _config_accepts(field, value):
  """Whether the config takes `sync.<field> = value`: its type check, then the sync group's
  rules (the field's own and those across the group's fields)."""
  try:
    run_config.check_group("sync", run_config.group_from_dict("sync", {field: value}))
  except ConfigError:
    return False
  return True


def _policy_accepts(field, value):
  try:
    policy.PolicyConfig.from_config(SyncConfig(), **{field: value})
  except ValueError:
    return False
  return True


def _around(edge):
  """Values at, just beside and a little way from `edge`, as ints and floats."""
  near_float = st.sampled_from([edge, math.nextafter(edge, -math.inf),
                                math.nextafter(edge, math.inf)])
  return st.one_of(near_float, st.floats(edge - 2.0, edge + 2.0),
                   st.integers(math.floor(edge) - 3, math.ceil(edge) + 3))


def _values(bound):
  edges = [e for e in (bound.low, bound.high) if e is not None]
  odd = st.sampled_from([math.inf, -math.inf, math.nan, True, False])
  return st.one_of(*[_around(float(e)) for e in edges], odd)


@pytest.mark.parametrize("field", sorted(policy.SYNC_BOUNDS))
def test_sync_fields_declare_the_policy_bound(field):
  assert settings.rule_of(SyncConfig, field) is policy.SYNC_BOUNDS[field]


@pytest.mark.parametrize("field", sorted(policy.SYNC_BOUNDS))
def test_config_and_policy_accept_the_same_values(field):
  @hypothesis_settings(max_examples=300, deadline=None, derandomize=True)
  @given(_values(policy.SYNC_BOUNDS[field]))
  def both_or_neither(value):
    assert _config_accepts(field, value) == _policy_accepts(field, value), (field, value)

  both_or_neither()


@pytest.mark.parametrize("field, accepted, rejected", [
    # Independent statements of docs/design.md 2.3-2.4's ranges, not read from the bounds table.
    ("quorum", [0, 1, 7], [-1, 1.0, True]),
    ("tau", [0, 1, 23], [-1, 2.5]),
    ("gamma", [0, 0.0, 0.8, 10, 10.0], [-1e-9, 10.000001, math.nan, math.inf]),
    ("heartbeat_timeout_s", [1e-9, 30, math.inf], [0, 0.0, -1.0, math.nan]),
    ("max_staleness", [0, 8], [-1, 8.0]),
])
def test_both_follow_the_design_ranges(field, accepted, rejected):
  for value in accepted:
    assert _config_accepts(field, value) and _policy_accepts(field, value), value
  for value in rejected:
    assert not _config_accepts(field, value) and not _policy_accepts(field, value), value


def test_the_sync_defaults_are_the_policy_defaults():
  cfg = policy.PolicyConfig.from_config(SyncConfig())
  for field in policy.SYNC_BOUNDS:
    assert getattr(cfg, field) == getattr(SyncConfig(), field)


def test_the_policy_declares_the_sync_fields_it_reads_with_their_types_and_defaults():
  """`PolicyConfig` is written out (readable, seen by IDEs): its fields are the bounded `sync`
  fields, declared with `SyncConfig`'s types and defaults, then its own `ema_decay`."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  fields = {f.name: f for f in dataclasses.fields(policy.PolicyConfig)}
  sync = {f.name: f for f in dataclasses.fields(SyncConfig)}
  assert list(fields) == [*policy.SYNC_BOUNDS, "ema_decay"]
  for name in policy.SYNC_BOUNDS:
    assert (fields[name].type, fields[name].default) == (sync[name].type, sync[name].default)
  assert policy.PolicyConfig() == policy.PolicyConfig.from_config(SyncConfig())


def test_the_syncer_and_the_simulator_build_the_policy_from_the_same_defaults():
  from diloco.sim import params  # pylint: disable=import-outside-toplevel
  assert params.SimConfig().policy_config() == policy.PolicyConfig.from_config(SyncConfig())
  assert params.SimConfig(grace=False).policy_config().gamma == 0.0


def test_range_semantics():
  half_open = settings.Range(low=0, high=1, high_open=True)
  assert [half_open.admits(v) for v in (0, 0.5, 1, -0.0, math.nan, True)] == [
      True, True, False, True, False, False]
  assert half_open.describe() == "in [0, 1)"
  assert settings.POSITIVE.describe() == "> 0" and not settings.POSITIVE.admits(0)
  finite = settings.Range(low=0, finite=True)
  assert finite.admits(1e300) and not finite.admits(math.inf)
  choice = settings.OneOf((0, 16, 8))
  assert choice.admits(16) and not choice.admits(16.0) and not choice.admits(False)
