"""Scavenging: learners added for a while and removed again, against fixed M.

Command (about 10 minutes on a 2-core CPU):

    python -m experiments.scavenging.run

Setting: `configs/decoupled.py:tiny` on the virtual clock (1 virtual second per step), 128
inner steps per learner, evaluated every 8 virtual seconds. "fixed M=2": two learners for
the whole run. "scavenging": the same two, plus two learners that join at t = 24 s on spare
device groups and retire at t = 88 s (`learners.faults`: add@24;add@24;retire:2@88;retire:3@88),
as idle capacity would come and go. "fixed M=4" is the run with that capacity throughout.
"scavenging, cohort schedule" is the scavenging run with `learners.join_schedule=cohort`: the
added learners start at their peers' step, so at their learning rate, instead of a warmup and
a whole schedule of their own (the default, "own"). Two seeds.

Measured: the virtual time at which each run's global eval loss first reaches the fixed-M=2
run's final loss (same seed; linear interpolation between evaluations), and the final loss.

Expected outcome (docs/design.md 5, "Dynamic scaling"): the added learners shorten the
time to the target loss and the final loss is at least as good; nothing stops or restarts
when learners join or leave.
"""

from experiments.harness import Run

NAME = "scavenging"
CONFIG = "configs/decoupled.py:tiny"
SEEDS = (0, 1)
STEPS = 128
ADD_AT, REMOVE_AT = 24, 88
BASE = (("learners.virtual_clock", True), ("learners.devices", "2,2,2,2"),
        ("train.eval_every", 8))
COLUMNS = ("method", "seed", "tokens", "eval_loss", "time_to_target_s", "speedup",
           "horizon_s", "goodput", "mean_learners_per_round", "bytes_down")


def faults(add_at: float = ADD_AT, remove_at: float = REMOVE_AT) -> str:
  return f"add@{add_at:g};add@{add_at:g};retire:2@{remove_at:g};retire:3@{remove_at:g}"


def runs(seeds=SEEDS, steps: int = STEPS) -> list[Run]:
  out = []
  scavenging = (("learners.count", 2),
                ("learners.faults", faults(ADD_AT * steps / STEPS, REMOVE_AT * steps / STEPS)))
  for seed in seeds:
    common = BASE + (("train.steps", steps),)
    out += [Run("fixed M=2", CONFIG, seed, common + (("learners.count", 2),)),
            Run("scavenging", CONFIG, seed, common + scavenging),
            Run("fixed M=4", CONFIG, seed, common + (("learners.count", 4),)),
            Run("scavenging, cohort schedule", CONFIG, seed, common + scavenging + (
                ("learners.join_schedule", "cohort"),))]
  return out
