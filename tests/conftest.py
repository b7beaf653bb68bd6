"""Test setup: 8 emulated CPU devices, set before JAX starts its backend."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import dataclasses  # noqa: E402

import pytest  # noqa: E402
from absl import flags  # noqa: E402

flags.FLAGS.mark_as_parsed()


@pytest.fixture
def tiny_config():
  """The tiny data-parallel config as frozen dataclasses (fast: 2 layers, seq 64)."""
  from configs import dp
  from diloco import config_lib
  return config_lib.from_config_dict(dp.get_config("tiny"))


@pytest.fixture
def replace():
  """`replace(cfg, group, **fields)`: a copy of a frozen Config with one group changed."""
  def _replace(cfg, group, **fields):
    return dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group), **fields)})
  return _replace
