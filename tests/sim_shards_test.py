"""The shard planner (`diloco.sim.capacity`) against closed forms."""

import math

import pytest

from diloco.sim import capacity


def test_gemma_9b_rates_match_the_hand_count():
  # 8 learners each deliver one fragment of 9e9 / 24 fp32 values per 2 s step (P = H = 24):
  # 8 x 9e9 / 24 x 4 B = 12 GB per step in, the same out.
  p = capacity.plan(params=9e9, learners=8, fragments=24, H=24, step_time=2.0, bits=32,
                  down_bits=32, net_gbps=100.0, merge_gbytes_s=5.0)
  assert p.bytes_in_per_s == pytest.approx(6e9)
  assert p.bytes_out_per_s == pytest.approx(6e9)
  # 100 Gbit/s = 12.5 GB/s per direction; merging 5 GB/s: the merge needs ceil(6 / 5) = 2.
  assert p.shards == 2 and p.limited_by == "merge"
  assert p.per_shard_in_per_s == pytest.approx(3e9)


def test_int4_payloads_cut_the_inbound_rate_by_their_bits_and_scales():
  full = capacity.plan(params=9e9, learners=8, fragments=24, H=24, step_time=2.0, bits=32)
  int4 = capacity.plan(params=9e9, learners=8, fragments=24, H=24, step_time=2.0, bits=4,
                     block=32)
  assert int4.bytes_in_per_s / full.bytes_in_per_s == pytest.approx((4 + 32 / 32) / 32)
  assert int4.bytes_out_per_s == full.bytes_out_per_s


@pytest.mark.parametrize("net, merge, expected", [(1.0, 100.0, "network in"),
                                                   (100.0, 0.1, "merge")])
def test_smallest_shard_count_is_the_tightest_limit_rounded_up(net, merge, expected):
  p = capacity.plan(params=1e9, learners=4, fragments=24, H=24, step_time=1.0, bits=32,
                  down_bits=16, net_gbps=net, merge_gbytes_s=merge)
  rate_in = 4 * 1e9 * 4 / 24
  need = rate_in / (net * 1e9 / 8) if expected == "network in" else rate_in / (merge * 1e9)
  assert p.limited_by == expected and p.shards == math.ceil(need)
  assert p.per_shard_in_per_s * p.shards == pytest.approx(rate_in)


@pytest.mark.parametrize("field", ["params", "learners", "H", "step_time", "net_gbps",
                                   "merge_gbytes_s"])
@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_bad_inputs_name_the_field(field, bad):
  args = dict(params=1e9, learners=4, fragments=24, H=24, step_time=1.0)
  args[field] = bad
  with pytest.raises(ValueError, match=field):
    capacity.plan(**args)


def test_importing_the_planner_defines_no_flags():
  # Its flags exist only when it runs as a command, so tests and tools can import it beside
  # other commands (diloco.sim.bandwidth defines --params too).
  from absl import flags
  assert "merge_gbytes_s" not in flags.FLAGS
