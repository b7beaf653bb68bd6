"""Heterogeneous learners: K = M vs K = 1 vs K = 1 with the grace window.

Command (about 15 minutes on a 2-core CPU):

    python -m experiments.heterogeneous.run

Setting (the paper's): M = 4 learners of `configs/decoupled.py:tiny` on the virtual clock,
two of them 18% slower, every step 10% longer or shorter at random (`learners.speeds`,
`learners.step_jitter`), 128 inner steps each (equal tokens for every method). Three
quorum policies, each with the design's outer optimiser (lr 0.7, Nesterov 0.9) and with plain
averaging (lr 1, no momentum; see the parity experiment), two seeds:
- K = M: every round waits for all learners (synchronous quorum, no grace);
- K = 1: a round merges as soon as one delivery arrived (no grace);
- K = 1 + grace: the design default (gamma = 0.8): after quorum a round keeps admitting
  deliveries while tau leaves slack.

Each policy and outer setting also runs at twice the presets' inner learning rate (6e-3, the
rate the compute-optimal parity experiment found best for data-parallel and for one to eight
learners once the outer step is swept with it, `experiments/scaling/`), to check whether that
pick holds with learners of unequal speed (docs/design.md 5.1: why the presets keep 3e-3).

Each policy also runs with the keep_local receipt (the design's outer optimiser): the columns
`compute_goodput` (the paper's goodput: time spent computing), `goodput` (ours: work that
reached G), `dropped_fraction` (step time never delivered: overwritten on receipt) and
`rejected_fraction` (delivered, but only in rejected, e.g. stale, deliveries) show where the
trained work goes.

Expected outcome (docs/design.md 5): K = M wastes the fast learners' time (lowest goodput,
longest run); K = 1 keeps them busy but merges about one learner per round and loses
quality; K = 1 with the grace window keeps both goodput and quality.
"""

from experiments.harness import Run

NAME = "heterogeneous"
CONFIG = "configs/decoupled.py:tiny"
SEEDS = (0, 1)
STEPS = 128
SETTING = (("learners.virtual_clock", True), ("learners.speeds", "1,1,1.18,1.18"),
           ("learners.step_jitter", 0.1), ("train.steps", STEPS), ("train.eval_every", 16))
POLICIES = (("K=M", 0, 0.0), ("K=1", 1, 0.0), ("K=1 + grace", 1, 0.8))
# The design's outer optimiser and plain averaging (outer lr 1, no momentum).
OUTERS = (("outer 0.7/0.9", (0.7, 0.9)), ("outer 1.0/0.0", (1.0, 0.0)))
# Receipt modes (docs/design.md 2.3): every policy and outer setting with the paper's
# overwrite (the default); keep_local with the design's outer optimiser, to show where
# overwrite's unmerged work goes and what keeping it changes; and keep_local with stale
# deliveries rebased (`outer.stale=rebase`: a late delivery counts as its own progress, scaled
# by 1 / (1 + staleness)), to test whether keep_local's loss under K = 1 comes from stale
# deliveries undoing the rounds they missed.
RECEIPTS = (("overwrite", "paper"), ("keep_local", "paper"), ("keep_local", "rebase"))
# Inner learning rates of the overwrite runs: the presets' (no label) and the parity pick.
INNERS = (("", None), (", inner 6e-3", 6e-3))
COLUMNS = ("method", "seed", "tokens", "eval_loss", "goodput", "compute_goodput",
           "horizon_s", "mean_learners_per_round", "median_grace_s", "staleness_mean",
           "wait_fraction", "bytes_down")


def runs(seeds=SEEDS, steps: int = STEPS) -> list[Run]:
  out = []  # seed-major, so that an interrupted experiment still compares every method
  for seed in seeds:
    for receipt, stale in RECEIPTS:
      overwrite = receipt == "overwrite"
      for inner, inner_lr in INNERS if overwrite else INNERS[:1]:
        for outer, (lr, momentum) in OUTERS if overwrite else OUTERS[:1]:
          for policy, quorum, gamma in POLICIES:
            label = f"{policy}, {outer}" + ("" if overwrite else f", {receipt}")
            label += ("" if stale == "paper" else f", stale={stale}") + inner
            out.append(Run(label, CONFIG, seed, SETTING + (
                ("sync.quorum", quorum), ("sync.gamma", gamma), ("outer.learning_rate", lr),
                ("outer.momentum", momentum), ("receipt.mode", receipt),
                ("outer.stale", stale), ("train.steps", steps))
                + ((("optim.learning_rate", inner_lr),) if inner_lr else ())))
  return out
