"""One factor at a time around the Decoupled DiLoCo defaults (docs/design.md 5).

Command (19 runs per seed, two seeds, of about 80 CPU seconds each as measured, most of it
start-up and compiling, so about 50 CPU minutes in all; finished runs are reused):

    python -m experiments.ablations.run

Setting: `configs/decoupled.py:tiny` (4 learners x 2 emulated CPU devices, P = H = 8, 64 steps)
on the deterministic virtual clock, so the numbers do not depend on the machine's load. One
shared baseline (the defaults: RDA merge, M = 4, float32 payloads, balanced fragments, anchor at
the syncer's G, overwrite on receipt, tau = 2) and one factor varied at a time:
merge (rda | mean, at M = 4 and M = 8 with one device per learner), payload precision
(fp32 | bf16 | int8 | int4 | int2 | 1-bit, the last four with and without error feedback),
fragmentation (balanced | layer | tensor, quality and peak bytes per round), anchor
(syncer | base), receipt (overwrite | mix alpha = 0.5) and tau (1 | 2 | 5). Seeds 0 and 1 (seed 0
ran in session 7 on a heavily shared machine, seed 1 in session 8: only `wall_s` shows it).

Expected outcome (the paper, docs/design.md 5): RDA beats plain averaging (55.4 vs 54.1 at
M = 8); int4 outer gradients are nearly lossless while 2-bit and 1-bit collapse; the three
fragmentation schemes give the same quality and balanced has the flattest bandwidth (lowest
peak bytes per round). The paper reports nothing on anchor, receipt and tau; the defaults
should be at least as good as the alternatives.
"""

from experiments.harness import Run

NAME = "ablations"
CONFIG = "configs/decoupled.py:tiny"
SEEDS = (0, 1)
# The receipt is pinned to the rule these runs were made with (overwrite), so that the
# baseline stays what it was whatever the preset's default.
COMMON = (("learners.virtual_clock", True), ("log.tensorboard", False),
          ("receipt.mode", "overwrite"))


def _bits(bits: int, feedback: bool = False) -> tuple:
  return (("outer.quantize_bits", bits), ("outer.error_feedback", feedback))


# What the shared baseline is called in each factor's table.
BASELINE_LEVEL = {"merge": "rda M=4", "precision": "fp32", "fragmentation": "balanced",
                  "anchor": "syncer", "receipt": "overwrite", "tau": "2"}
# factor -> (level, overrides) of the runs that differ from the baseline.
FACTORS = {
    "merge": (
        ("mean M=4", (("outer.merge", "mean"),)),
        ("rda M=8", (("learners.count", 8),)),
        ("mean M=8", (("outer.merge", "mean"), ("learners.count", 8))),
    ),
    "precision": (
        ("bf16", _bits(16)),
        ("int8", _bits(8)), ("int8 +EF", _bits(8, True)),
        ("int4", _bits(4)), ("int4 +EF", _bits(4, True)),
        ("int2", _bits(2)), ("int2 +EF", _bits(2, True)),
        ("1-bit", _bits(1)), ("1-bit +EF", _bits(1, True)),
    ),
    "fragmentation": (
        ("layer", (("sync.scheme", "layer"),)),
        ("tensor", (("sync.scheme", "tensor"),)),
    ),
    "anchor": (("base", (("outer.anchor", "base"),)),),
    "receipt": (("mix 0.5", (("receipt.mode", "mix"), ("receipt.mixing_alpha", 0.5))),),
    "tau": (("1", (("sync.tau", 1),)), ("5", (("sync.tau", 5),))),
}
COLUMNS = ("method", "factor", "seed", "tokens", "eval_loss", "mean_learners_per_round",
           "bytes_up", "round_bytes_up_peak", "goodput", "wall_s")


def runs(seeds=SEEDS, extra: tuple = ()) -> list[Run]:
  """The baseline and every factor level, seed-major (an interrupted experiment still compares
  every level). `extra` overrides are appended to every run (the smoke test shortens them)."""
  out = []
  for seed in seeds:
    out.append(Run("baseline", CONFIG, seed, COMMON + extra,
                   labels=(("factor", "baseline"), ("level", "baseline"))))
    for factor, levels in FACTORS.items():
      for level, overrides in levels:
        out.append(Run(f"{factor} {level}", CONFIG, seed, COMMON + overrides + extra,
                       labels=(("factor", factor), ("level", level))))
  return out
