"""What a stale delivery should count for: `outer.stale=paper` vs `rebase` (docs/design.md 2.4).

Command (about 30 minutes on a 2-core CPU; `--preset=tiny` runs the same pipeline in minutes):

    python -m experiments.stale.run

Setting: 4 learners of the `configs/decoupled.py:cpu` model on the deterministic virtual clock,
half of them 18% slower with 10% per-step variation (the paper's heterogeneous setting), so the
slow learners' deliveries regularly miss the round of their base version and arrive stale.
K = 1 with the grace window (the defaults) and K = 1 without it (gamma = 0, where every round
merges one learner and staleness is highest), each with the three rules, two seeds each.

Expected outcome: with `paper`, a stale delivery is anchored at the current G, so its outer
gradient also points back toward the learner's older lineage and partly undoes the rounds it
missed; `rebase` merges only its own progress, damped by 1 / (1 + staleness). Rebase should
reach a lower eval loss where staleness is high (no grace) and about the same where the grace
window keeps it low.
"""

from experiments.harness import Run

NAME = "stale"
CONFIG = "configs/decoupled.py:{preset}"
SEEDS = (0, 1)
HETEROGENEOUS = (("learners.virtual_clock", True), ("learners.speeds", "1,1,1.18,1.18"),
                 ("learners.step_jitter", 0.1))
SETTINGS = (("K=1 grace", 0.8), ("K=1 no grace", 0.0))
# "align" (HeLoCo's projection: a stale delivery's component against the outer momentum removed,
# per tensor) came later; its runs join the same table.
RULES = ("paper", "rebase", "align")
COLUMNS = ("method", "seed", "tokens", "eval_loss", "mean_learners_per_round",
           "staleness_mean", "goodput", "bytes_up", "bytes_down", "wall_s")


def runs(preset: str = "cpu", seeds=SEEDS) -> list[Run]:
  out = []  # seed-major, so that an interrupted experiment still compares every method
  for seed in seeds:
    for setting, gamma in SETTINGS:
      for rule in RULES:
        out.append(Run(f"{setting}, stale={rule}", CONFIG.format(preset=preset), seed,
                       HETEROGENEOUS + (("sync.gamma", gamma), ("outer.stale", rule))))
  return out
