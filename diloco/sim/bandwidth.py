"""Cross-datacenter bandwidth of data-parallel vs Decoupled DiLoCo (docs/design.md 3.2 and 5).

    python -m diloco.sim.bandwidth --params=12e9 --step_time=1.7 --datacenters=8 \
        --fragments=24 --H=24 --tau=2 --bits=4 [--json]

Assumptions (also printed):

1. Data-parallel spans the D datacenters: gradients are reduced inside each datacenter first, then
   one ring all-reduce of `dp_bits` (bf16) gradients per step runs between datacenters, in which
   every datacenter sends (and receives) `2 (D - 1) / D` times the gradient per step. Nothing is
   overlapped away or compressed.
2. Decoupled DiLoCo puts one learner in each datacenter. Over every H inner steps a learner sends
   every parameter once (P fragments of N / P parameters, one every H / P steps) as a quantised
   outer gradient of `bits` bits plus one `scale_bits` scale per `block` values, and receives the
   merged fragment in `down_bits` (bf16: the learner overwrites its fragment with it).
3. Transfers run off the critical path but must finish within tau steps of the delivery, so the
   link needs the larger of the mean rate and `fragment / (tau * step_time)`.
4. Rates are per datacenter link and per direction, in Gbit/s (1e9 bits/s); the syncer's own
   link carries D times a learner's traffic. Protocol overheads and retransmits are ignored.

The defaults (12B parameters at 1.7 s per step) are one pair of inputs for which assumption 1
gives the paper's 198 Gbps; they are not the paper's stated setting.

The paper (Douillard et al., 2026) reports 198 Gbps for data-parallel and 0.84 Gbps for Decoupled
DiLoCo with 8 datacenters, a ratio of about 236; it does not state every input above, so the
comparison is made on the ratio, which does not depend on the model size or the step time.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

from absl import app, flags

PAPER_DP_GBPS = 198.0
PAPER_DECOUPLED_GBPS = 0.84


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bandwidth:
  """Per-datacenter link rates in Gbit/s (see the module docstring for the assumptions)."""
  dp_gbps: float
  upload_mean_gbps: float
  download_mean_gbps: float
  upload_required_gbps: float
  download_required_gbps: float
  syncer_ingress_gbps: float
  ratio: float


def estimate(*, params: float, step_time: float, datacenters: int, fragments: int, H: int,
             tau: int, bits: int, down_bits: int = 16, dp_bits: int = 16, block: int = 32,
             scale_bits: int = 16) -> Bandwidth:
  """Bandwidth of both schemes under the module's assumptions.

  Args:
    params: N, parameters of the model.
    step_time: seconds per inner (and data-parallel) step.
    datacenters: D.
    fragments: P.
    H: inner steps between two syncs of the same fragment.
    tau: steps a fragment's transfer may take.
    bits: payload bits per value of an outer gradient (learner to syncer).
    down_bits: bits per value of the merged fragment (syncer to learner).
    dp_bits: bits per gradient value of the data-parallel all-reduce.
    block: values per quantisation block (one scale each); ignored for bits >= 16.
    scale_bits: bits of one block scale.

  Returns:
    The rates.
  """
  if min(params, step_time, datacenters, fragments, H, bits, down_bits, dp_bits) <= 0:
    raise ValueError("params, step_time, datacenters, fragments, H and bits must be > 0")
  d = datacenters
  dp = 2.0 * (d - 1) / d * params * dp_bits / step_time if d > 1 else 0.0
  up_bits = bits + (scale_bits / block if bits < 16 else 0.0)
  up_mean = params * up_bits / (H * step_time)
  down_mean = params * down_bits / (H * step_time)
  window = max(tau, 1) * step_time
  up_req = max(up_mean, params / fragments * up_bits / window)
  down_req = max(down_mean, params / fragments * down_bits / window)
  g = 1e9
  return Bandwidth(dp_gbps=dp / g, upload_mean_gbps=up_mean / g,
                   download_mean_gbps=down_mean / g, upload_required_gbps=up_req / g,
                   download_required_gbps=down_req / g, syncer_ingress_gbps=d * up_req / g,
                   ratio=dp / up_req if up_req else math.inf)


flags.DEFINE_float("params", 12e9, "Model parameters N.")
flags.DEFINE_float("step_time", 1.7, "Seconds per step.")
flags.DEFINE_integer("datacenters", 8, "D datacenters (one learner each).")
flags.DEFINE_integer("fragments", 24, "P fragments.")
flags.DEFINE_integer("H", 24, "Inner steps between syncs of one fragment.")
flags.DEFINE_integer("tau", 2, "Steps a fragment transfer may take.")
flags.DEFINE_integer("bits", 4, "Outer-gradient payload bits (4 = int4).")
flags.DEFINE_integer("down_bits", 16, "Bits of the merged fragment sent back.")
flags.DEFINE_integer("dp_bits", 16, "Gradient bits of the data-parallel all-reduce.")
flags.DEFINE_integer("block", 32, "Values per quantisation block.")
flags.DEFINE_bool("json", False, "Print one JSON line last.")
FLAGS = flags.FLAGS


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  f = FLAGS
  bw = estimate(params=f.params, step_time=f.step_time, datacenters=f.datacenters,
                fragments=f.fragments, H=f.H, tau=f.tau, bits=f.bits, down_bits=f.down_bits,
                dp_bits=f.dp_bits, block=f.block)
  print(__doc__.split("Assumptions (also printed):")[1].split("The paper")[0].strip())
  print()
  print(f"N = {f.params:.3g} params, step {f.step_time:g} s, D = {f.datacenters}, "
        f"P = {f.fragments}, H = {f.H}, tau = {f.tau}, up {f.bits} bits, down {f.down_bits} bits")
  print(f"  data-parallel, per datacenter          {bw.dp_gbps:10.2f} Gbps")
  print(f"  Decoupled learner upload (mean / need) {bw.upload_mean_gbps:10.3f} / "
        f"{bw.upload_required_gbps:.3f} Gbps")
  print(f"  Decoupled learner download (mean/need) {bw.download_mean_gbps:10.3f} / "
        f"{bw.download_required_gbps:.3f} Gbps")
  print(f"  syncer ingress (all learners)          {bw.syncer_ingress_gbps:10.3f} Gbps")
  print(f"  ratio data-parallel / Decoupled upload {bw.ratio:10.1f}x")
  print(f"  paper: {PAPER_DP_GBPS:g} vs {PAPER_DECOUPLED_GBPS:g} Gbps, ratio "
        f"{PAPER_DP_GBPS / PAPER_DECOUPLED_GBPS:.0f}x")
  if f.json:
    record = dataclasses.asdict(bw)
    record.update(paper_dp_gbps=PAPER_DP_GBPS, paper_decoupled_gbps=PAPER_DECOUPLED_GBPS)
    print(json.dumps(record, sort_keys=True))


if __name__ == "__main__":
  app.run(main)
