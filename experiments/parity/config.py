"""Parity: data-parallel vs synchronous, Streaming and Decoupled DiLoCo at equal tokens.

Command (the full experiment is about 3 hours on an idle 2-core CPU, half of it the longer
runs; it resumes where it stopped, and `--only=` runs a subset of methods, e.g.
`--only="480 steps"`):

    python -m experiments.parity.run

Setting: the `small` model of the README's CPU presets (`configs/dp.py:cpu` and
`configs/decoupled.py:cpu`): 120 inner steps of 8 sequences of 128 bytes on each of M = 4
learners, against data-parallel with 32 sequences per step for 120 steps, i.e. the same
0.49M tokens. Decoupled runs are on the virtual clock (deterministic; equal learners, so
rounds merge every learner that delivered). Every run evaluates on the same 128 held-out
windows (data-parallel 4 batches of 32, learners 16 batches of 8): with the default
`train.eval_batches` the two would score different windows.

The runs, in the order they are run:
- data-parallel, then Decoupled (M = 4, K = 1, grace) with each setting of `SWEEP`: outer
  learning rate and Nesterov momentum (the design's 0.7 / 0.9 among them) at the preset's
  H = P = 24, and a shorter period H = P = 8;
- with the swept setting of lowest eval loss, picked by the runner from those runs (not
  typed here), and its H: synchronous DiLoCo (P = 1, K = M), Streaming DiLoCo (P fragments,
  K = M, alpha = 0.5), data-parallel at one learner's batch (8 sequences, a quarter of the tokens)
  against Decoupled with M = 1 (the same batch: a check of the outer loop), a second seed of
  data-parallel and Decoupled, and Decoupled warm-started from that data-parallel run's
  step-40 checkpoint for the remaining 80 steps (the DiLoCo paper starts from a
  data-parallel checkpoint; its row counts the 40 data-parallel steps' tokens too), then a
  second seed of synchronous and Streaming DiLoCo and of the M = 1 check;
- at the tuned setting: the inner learning rate halved and doubled (`INNER_LRS`), and M = 2
  learners of 16 sequences (the same tokens per step);
- longer runs: data-parallel and the tuned Decoupled at each of `LENGTHS` (2x and 4x the
  steps, the same batches, warmup and H; the cosine decays over the whole run), so the
  Decoupled / data-parallel ratio is seen against run length (about 25 minutes per run of
  480 steps on an idle 2-core CPU).

Expected outcome: with the design's outer optimiser, Decoupled lands far above data-parallel
at this length (an earlier run measured 1.92 vs 1.63, on different held-out windows); the outer
optimiser's settings or a shorter period should close much of the gap. Target: Decoupled /
data-parallel eval-loss ratio <= 1.02. M = 1 should match data-parallel at the same batch.
The DiLoCo papers reach parity over many outer steps: the ratio should fall with run length.
"""

import dataclasses

from experiments.harness import Run

NAME = "parity"
EVAL_WINDOWS = 128
DP_BATCH, LEARNER_BATCH = 32, 8
STEPS = 120  # the cpu presets'
# The warm start: data-parallel trains the first WARM_STEPS steps (its checkpoint every 40
# steps), Decoupled the remaining STEPS - WARM_STEPS with the same tokens per step.
WARM_STEPS = 40
# Inner learning rates tried at the tuned outer setting: half and twice the presets' 3e-3.
INNER_LRS = (1.5e-3, 6e-3)
# Longer runs of data-parallel and the tuned Decoupled (longest first: the most telling if the
# experiment is stopped before the end).
LENGTHS = (480, 240)
VC = (("learners.virtual_clock", True),)
DESIGN = (0.7, 0.9)  # the design's outer learning rate and Nesterov momentum


def _outer(lr: float, momentum: float) -> tuple[tuple[str, object], ...]:
  return (("outer.learning_rate", lr), ("outer.momentum", momentum))


# Decoupled settings tried (M = 4, seed 0): the outer optimiser at H = P = 24 (tau = 4, the
# preset's), and a shorter period, H = P = 8 with tau = 1 (on the virtual clock a delivery's
# values are on the host at once, so one step of overlap is enough).
SWEEP: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = (
    ("outer 1.0/0.0", _outer(1.0, 0.0)),
    ("outer 0.7/0.9", _outer(*DESIGN)),
    ("H=8 outer 1.0/0.0", _outer(1.0, 0.0) + (("sync.period", 8), ("sync.num_fragments", 8),
                                              ("sync.tau", 1))),
    ("outer 1.4/0.0", _outer(1.4, 0.0)),
)
COLUMNS = ("method", "seed", "steps", "tokens", "eval_loss", "ratio_to_dp", "mean_learners_per_round",
           "staleness_mean", "goodput", "bytes_up", "bytes_down", "wall_s")


def _eval(batch: int) -> tuple[tuple[str, object], ...]:
  return (("train.eval_batches", EVAL_WINDOWS // batch),)


def _length(steps: int) -> tuple[str, tuple[tuple[str, object], ...]]:
  """The method-name suffix and overrides of a run of `steps` steps (none at the presets')."""
  return ("", ()) if steps == STEPS else (f" {steps} steps", (("train.steps", steps),))


def dp(preset: str, seed: int = 0, batch: int = DP_BATCH, steps: int = STEPS) -> Run:
  suffix, length = _length(steps)
  name = ("data-parallel" if batch == DP_BATCH else f"data-parallel B={batch}") + suffix
  return Run(name, f"configs/dp.py:{preset}", seed,
             (("train.batch_size", batch),) + _eval(batch) + length, labels=(("steps", steps),))


def diloco(preset: str, kind: str, setting, seed: int = 0, learners: int = 4,
           steps: int = STEPS, batch: int = LEARNER_BATCH) -> Run:
  """`kind` is decoupled, diloco (synchronous) or streaming: configs/<kind>.py:<preset>, with
  `setting` = (label, overrides) from SWEEP, for `steps` inner steps of `batch` sequences per
  learner."""
  label, overrides = setting
  if kind == "diloco":  # synchronous DiLoCo: the whole model is one fragment, every H steps
    overrides = tuple((k, v) for k, v in overrides if k != "sync.num_fragments")
    if "sync.period" not in dict(overrides):  # the same H as Decoupled (its config has 40)
      overrides += (("sync.period", 24),)
  method = kind if learners == 4 else f"{kind} M={learners}"
  suffix, length = _length(steps)
  return Run(f"{method} {label}{suffix}", f"configs/{kind}.py:{preset}", seed,
             VC + (("learners.count", learners), ("train.batch_size", batch))
             + overrides + _eval(batch) + length, labels=(("steps", steps),))


def sweep(preset: str = "cpu") -> list[Run]:
  """Data-parallel and the Decoupled settings: run first, they pick the tuned setting."""
  return [dp(preset)] + [diloco(preset, "decoupled", s) for s in SWEEP]


def with_tuned(tuned, preset: str = "cpu", outdir: str = "runs/experiments/parity") -> list[Run]:
  """The baselines and checks at the tuned setting (its outer optimiser and H), Decoupled
  warm-started from the second data-parallel run's checkpoint at WARM_STEPS, then second
  seeds of the baselines and of the M = 1 check."""
  label, overrides = tuned
  warm = Run(f"decoupled warm start {label}", f"configs/decoupled.py:{preset}", 1,
             diloco(preset, "decoupled", tuned).overrides + (
                 ("train.init_from", f"{outdir}/data-parallel__s1/checkpoints/{WARM_STEPS}"),
                 ("train.steps", STEPS - WARM_STEPS)), labels=(("steps", STEPS),))
  dp_seed1 = dp(preset, seed=1)
  dp_seed1 = dataclasses.replace(dp_seed1, overrides=dp_seed1.overrides + (
      ("checkpoint.max_to_keep", STEPS // WARM_STEPS),))  # keep the step-40 checkpoint
  checks = lambda seed: [  # noqa: E731
      diloco(preset, "diloco", tuned, seed), diloco(preset, "streaming", tuned, seed),
      dp(preset, seed, batch=LEARNER_BATCH),
      diloco(preset, "decoupled", tuned, seed, learners=1)]
  return (checks(0) + [dp_seed1, diloco(preset, "decoupled", tuned, seed=1), warm]
          + checks(1))


def inner(tuned, preset: str = "cpu") -> list[Run]:
  """The tuned Decoupled with the inner learning rate halved and doubled (the presets' is
  tuned for data-parallel's batch of 32; each learner steps on 8), and with M = 2 learners of
  16 sequences (the same tokens per step: how the gap grows with M). Seed 0."""
  label, overrides = tuned
  return [diloco(preset, "decoupled", (f"{label} inner lr {lr:g}", overrides + (
              ("optim.learning_rate", lr),))) for lr in INNER_LRS] + [
          diloco(preset, "decoupled", tuned, learners=2, batch=DP_BATCH // 2)]


def longer(tuned, preset: str = "cpu") -> list[Run]:
  """Data-parallel and Decoupled at the tuned setting for each of LENGTHS (seed 0)."""
  return [run for steps in LENGTHS
          for run in (dp(preset, steps=steps), diloco(preset, "decoupled", tuned, steps=steps))]


def tuned_setting(losses: dict[str, float]):
  """The SWEEP entry whose run has the lowest eval loss (by label); the design's if none
  finished."""
  settings = dict(SWEEP)
  best = min(losses, key=losses.get) if losses else SWEEP[1][0]
  return best, settings[best]


def shrink(runs: list[Run], steps: int) -> list[Run]:
  """The same runs cut to a few steps: the smoke tests' size of the pipeline."""
  return [dataclasses.replace(r, overrides=r.overrides + (
      ("train.steps", steps), ("train.eval_every", 0), ("optim.warmup_steps", 1)))
          for r in runs]
