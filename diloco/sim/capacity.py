"""How many syncer shards a run needs: the capacity planner of the sharded syncer.

    python -m diloco.sim.capacity --params=9e9 --learners=8 --fragments=24 --H=24 \
        --step_time=2 --bits=32 --net_gbps=100 --merge_gbytes_s=5 [--json]

Assumptions (docs/design.md 3.1, "Sharded syncer"):
1. Over every H inner steps each of the M learners delivers every parameter once (P fragments of
   N / P parameters), as `bits`-bit values or outer gradients plus one `scale_bits` scale per
   `block` values when quantised (bits < 16), and receives every merged fragment once, as
   `down_bits`-bit values. So the syncer takes in M N bits_up / (H step_time) bytes per second and
   sends out M N bits_down / (H step_time), spread evenly over its shards (fragments are
   byte-balanced across shards).
2. A shard is one host: its network carries `net_gbps` Gbit/s in each direction (full duplex),
   and it merges `merge_gbytes_s` GB/s of incoming payload (measure one host with
   `scripts/bench_merge.py`).
3. The syncer stays off the learners' critical path when every shard keeps up with the mean
   rates: the smallest S with in/S and out/S within the network and in/S within the merge rate.
   Bursts are ignored (with P = H one fragment arrives per step, so the load is nearly flat).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

from absl import app, flags


@dataclasses.dataclass(frozen=True)
class ShardPlan:
  """Rates of the whole syncer (bytes/s) and the smallest shard count that keeps up."""
  bytes_in_per_s: float
  bytes_out_per_s: float
  shards: int
  per_shard_in_per_s: float
  per_shard_out_per_s: float
  limited_by: str  # "network in", "network out" or "merge"


def payload_bits(bits: int, block: int, scale_bits: int = 32) -> float:
  """Bits per value of a delivery: full-precision values, or quantised with per-block scales."""
  return float(bits) if bits >= 16 else bits + scale_bits / block


def plan(*, params: float, learners: int, fragments: int, H: int, step_time: float,
         bits: int = 32, down_bits: int = 32, block: int = 32, net_gbps: float = 100.0,
         merge_gbytes_s: float = 5.0) -> ShardPlan:
  """The rates of assumption 1 and the smallest S of assumption 3."""
  for name, value in (("params", params), ("learners", learners), ("fragments", fragments),
                      ("H", H), ("step_time", step_time), ("net_gbps", net_gbps),
                      ("merge_gbytes_s", merge_gbytes_s), ("block", block)):
    if not value > 0 or not math.isfinite(value):
      raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
  period_s = H * step_time
  up = learners * params * payload_bits(bits, block) / 8 / period_s
  down = learners * params * down_bits / 8 / period_s
  net = net_gbps * 1e9 / 8
  needs = {"network in": up / net, "network out": down / net,
           "merge": up / (merge_gbytes_s * 1e9)}
  limited_by = max(needs, key=needs.get)
  shards = max(1, math.ceil(needs[limited_by] - 1e-12))
  return ShardPlan(up, down, shards, up / shards, down / shards, limited_by)


def define_flags() -> None:
  """The command line (defined only when run as a script: importing defines no flags)."""
  flags.DEFINE_float("params", 9e9, "Model parameters N.")
  flags.DEFINE_integer("learners", 8, "M learners.")
  flags.DEFINE_integer("fragments", 24, "P fragments (at most this many shards can share them).")
  flags.DEFINE_integer("H", 24, "Inner steps between syncs of one fragment.")
  flags.DEFINE_float("step_time", 2.0, "Seconds per inner step.")
  flags.DEFINE_integer("bits", 32, "Bits per delivered value (32 fp32, 16 bf16, 8/4 quantised).")
  flags.DEFINE_integer("down_bits", 32, "Bits per value of a published merged fragment.")
  flags.DEFINE_integer("block", 32, "Values per quantisation block (one fp32 scale each).")
  flags.DEFINE_float("net_gbps", 100.0, "Network of one syncer host, Gbit/s per direction.")
  flags.DEFINE_float("merge_gbytes_s", 5.0, "Payload one syncer host merges, GB/s.")
  flags.DEFINE_bool("json", False, "Print one JSON line last.")


def main(argv: Sequence[str]) -> None:
  del argv
  f = flags.FLAGS
  p = plan(params=f.params, learners=f.learners, fragments=f.fragments, H=f.H,
           step_time=f.step_time, bits=f.bits, down_bits=f.down_bits, block=f.block,
           net_gbps=f.net_gbps, merge_gbytes_s=f.merge_gbytes_s)
  if p.shards > f.fragments:
    print(f"note: {p.shards} shards exceed the {f.fragments} fragments; raise --fragments")
  print(f"syncer in {p.bytes_in_per_s / 1e9:.2f} GB/s, out {p.bytes_out_per_s / 1e9:.2f} GB/s; "
        f"smallest S = {p.shards} (limited by {p.limited_by}); per shard in "
        f"{p.per_shard_in_per_s / 1e9:.2f} GB/s, out {p.per_shard_out_per_s / 1e9:.2f} GB/s")
  if f.json:
    print(json.dumps(dataclasses.asdict(p)))


if __name__ == "__main__":
  define_flags()
  app.run(main)
