"""Real faults on the multi-process runtime: Decoupled vs no faults vs synchronous DiLoCo.

Command (about 25 minutes on a loaded 2-core CPU; `--preset=smoke` runs the same pipeline on
a shorter run):

    python -m experiments.chaos.run

Setting: `configs/multiprocess.py:tiny` (3 learner processes of 2 emulated CPU devices, a
syncer process, one store on local disk, steps paced to at least 0.2 s). The faults are SIGKILLs
of learner processes drawn from the simulator's failure process (`faults.py`: the fitted
`FailureModel`, a Poisson process per slice with its repair and reconfiguration downtime,
time-compressed so that `EXPECTED_KILLS` land in the chaos window); a killed learner is
restarted after the compressed downtime and resumes from its own checkpoint. Three methods per
seed, the faults identical for the two that have them:

- Decoupled DiLoCo (P = 8, K = 1, grace) under the faults;
- the same without faults;
- synchronous DiLoCo under the faults: `configs/diloco.py`'s changes applied to the
  multi-process preset (P = 1, K = all learners, gamma = 0, the same H = 24 and tau = 4).

Expected outcome: the faults cost Decoupled little goodput and eval loss (survivors keep
stepping and rounds keep closing with whoever delivered); synchronous DiLoCo under the same
faults waits at every sync point for the killed learner until its heartbeat times out (6 s), so
its wait fraction rises and its goodput falls below Decoupled's. Orders of events are robust;
absolute seconds depend on the machine's load, as these runs are real-time.
"""

import os

from diloco.config import run_config
from diloco.sim.params import FailureModel
from experiments.chaos import faults
from experiments.harness import REPO, Run

NAME = "chaos"
CONFIG = "configs/multiprocess.py:tiny"
SEEDS = (0, 1)
EXPECTED_KILLS = {"full": 6.0, "smoke": 1.5}  # before thinning
# Chaos window: seconds after every initial learner has stepped.
# The run: 320 paced steps take >= 64 s, so a learner killed in the window is back before the end.
WINDOW = {"full": (4.0, 40.0), "smoke": (2.0, 8.0)}
STEPS = {"full": 320, "smoke": 48}
# Seconds a killed learner process takes to step again beyond the model's downtime (JAX import
# and compilation; 20-40 s on this 2-core host, BUILD_NOTES), during which kills are absorbed.
RESTART_S = {"full": 30.0, "smoke": 5.0}
SYNC = (("sync.num_fragments", 1), ("sync.quorum", 0), ("sync.gamma", 0.0),
        ("sync.period", 24))
COLUMNS = ("method", "seed", "kills", "kills_applied", "restarts", "eval_loss", "goodput",
           "wait_fraction", "down_fraction", "mean_learners_per_round", "rounds", "uptime",
           "tokens", "bytes_up", "bytes_down", "wall_s")


def learners() -> int:
  return run_config.load(os.path.join(REPO, CONFIG)).learners.count


def process(preset: str = "full") -> faults.Compressed:
  start, end = WINDOW[preset]
  return faults.compress(FailureModel(), learners=learners(), window_s=end - start,
                         expected=EXPECTED_KILLS[preset])


def schedule(seed: int, preset: str = "full") -> str:
  start, end = WINDOW[preset]
  return faults.render(faults.draw(process(preset), start_s=start, end_s=end, seed=seed,
                                   restart_s=RESTART_S[preset]))


def runs(preset: str = "full", seeds=SEEDS) -> list[Run]:
  common = (("launch.chaos_faults", 0), ("train.steps", STEPS[preset]),
            ("train.eval_every", STEPS[preset] // 4))
  backoff = (("launch.restart_backoff_s", round(max(process(preset).downtime_s, 0.1), 2)),)
  out = []  # seed-major, so that an interrupted experiment still compares every method
  for seed in seeds:
    kills = common + backoff + (("launch.chaos", schedule(seed, preset)),)
    out += [Run("decoupled, faults", CONFIG, seed, kills, ("--role=launch",)),
            Run("decoupled, no faults", CONFIG, seed, common, ("--role=launch",)),
            Run("sync DiLoCo, faults", CONFIG, seed, kills + SYNC, ("--role=launch",))]
  return out
