"""Compute-optimal parity: data-parallel vs synchronous and Decoupled DiLoCo at D = 20N.

Setting: the `tiny` model (N = `tiny_params()`, counted from the model) trained on
`STEPS` = 20N / (32 x 64) steps: data-parallel steps on 32 sequences of 64 bytes, each of
M learners on 32 / M, so every method trains the same tokens and evaluates the same
`EVAL_WINDOWS` held-out windows every `EVAL_EVERY` steps (the same tokens seen). Decoupled
and synchronous DiLoCo run on the virtual clock (deterministic interleaving).

Stage one (seed 0), for each M in `LEARNERS`: synchronous DiLoCo (configs/diloco.py: P = 1,
K = M, H = 30, and tau = 0: no overlap, as in the study) and Decoupled (configs/decoupled.py:
K = 1, grace, tau = 2, H = 30 over `DECOUPLED_FRAGMENTS` fragments) with every receipt mode,
each at every outer setting of `OUTER` (the DiLoCo scaling-law study's sweep); data-parallel at batch 32 and at one learner's
batch. Stage two: the second seed of data-parallel and of the setting of lowest eval loss
per method and M (picked from stage one's runs). Stage three: a third seed of every pair
whose difference is within the seeds' spread. Stage m8 (no sweep of its own): M = 8 for
data-parallel at one learner's batch, synchronous DiLoCo and each receipt mode at its M = 4
pick, and M = 1 (Decoupled with overwrite, and synchronous DiLoCo) at its M = 2 pick. Stage
inner: synchronous DiLoCo and Decoupled (overwrite) at their picks with the inner
learning rate at 2, 1/2 and 1/4 times the preset's (a learner's batch is M times smaller), and
data-parallel at the scales above 1. The data-parallel reference is tuned like every method:
"data-parallel" is the inner rate of lowest seed-0 loss at batch 32, and stages two and three
seed that one. Stage cross: each of the two at the other's pick, where not run yet. Stage m1
(seed 0, at the reference's inner rate): the M = 1 controls of `M1_RUNS`, synchronous DiLoCo
with outer 1 / 0 (G = the learner's parameters each round: data-parallel through the DiLoCo
machinery), Decoupled with the overlap at 1 / 0, keep_local, and outer momenta beside the
study's 0.4 / 0.9; its rows join the M = 1 sweep, so stages two and three seed a new pick. The
second model size (`small`, one seed): data-parallel at the tuned reference's inner rate
against Decoupled M = 4 at its tiny pick (receipt, outer and inner rates), for
`--small_steps` steps. Stage size (`--preset=nano` or `mini`, about 4x fewer or more
parameters than tiny, at 20N): the same protocol at another size (`SIZE_*` below), then stages
2 and 3 at that preset.
Stage batch (`--preset=nano`; the study tuned the global batch per method and M): stage size
at each global batch B of `BATCH_SWEEP` beside 32, at the same 20N tokens (20N / (B x 64)
steps), warmup and evaluations at the same tokens as at 32 (`batch_shape`), each learner on
B / M sequences: data-parallel at every inner rate of `SIZE_INNER_SCALES` (each B's reference
tuned anew), then both DiLoCo methods at that reference's inner rate, first at the outer
setting each picked at batch 32, then at `SIZE_OUTER`. Each B is its own group (its steps
differ), reported best against best: every method at data-parallel's best B, and each
method and M at its own best B. Stage period: H at each of `PERIODS` beside 30 at M = 2 and
4, both methods at their batch-32 picks, Decoupled with a fragment due every 5 steps (and at
each receipt of `--receipts`); these runs name their H and never enter the picks. Stage outer:
both methods at each outer setting of `OUTER_BELOW` (or `--outer`) in one group; these runs
join its picks. Stage optim (`--optimizer=muon`): the protocol with Muon inside, a group of
its own (`model_label`) whose data-parallel reference trains with Muon too (`MUON_*`).

Targets: M = 1 at or below data-parallel; Decoupled M = 2 within 1.5 % and M = 4 within 3 %
of data-parallel; Decoupled no worse than synchronous DiLoCo at the same M beyond the seeds'
spread.
"""

from __future__ import annotations

import functools

from experiments.harness import Run

NAME = "scaling"
DP_BATCH, SEQ_LEN = 32, 64
DEVICES = 8  # emulated CPU devices per run: one per learner at M = 8
TOKENS_PER_PARAM = 20  # D = 20N: the compute-optimal budget of the study
EVAL_WINDOWS = 128
EVAL_EVERY = 100
WARMUP = 50
PERIOD = 30  # H, the study's
DECOUPLED_FRAGMENTS = 6  # a fragment due every 5 steps, more than tau = 2 apart
TAU = 2
MIX_ALPHA = 0.5
LEARNERS = (1, 2, 4)
RECEIPTS = ("overwrite", "mix", "keep_local")
# The study's outer sweep: learning rate with Nesterov momentum 0.9, and plain averaging.
OUTER = ((0.4, 0.9), (0.6, 0.9), (0.8, 0.9), (1.0, 0.9), (1.0, 0.0))
# Charles et al. 2025, "Scaling Laws for DiLoCo", Table 4: eval loss of the 35M-parameter
# model at D = 20N, H = 30 (data-parallel, then DiLoCo with M replicas).
STUDY_35M = {"data-parallel": 3.485, 1: 3.482, 2: 3.508, 4: 3.554, 8: 3.621}
STUDY_CITATION = 'Charles et al. 2025, "Scaling Laws for DiLoCo", Table 4 (35M, D = 20N)'
# The study's fitted laws (its Table 7: DiLoCo against data-parallel, each a power law in N)
# extrapolated to tiny's N = 148,096, as quoted where this comparison was planned; the laws'
# coefficients are not in this repository, so no other N's value is computed here.
STUDY_LAW_AT_TINY = {1: 0.33, 2: 1.57, 4: 4.06, 8: 7.47}
TARGET_GAP = {2: 1.5, 4: 3.0}  # Decoupled's allowed gap to data-parallel, in percent
# --stage=m8 (no sweep of its own): M = 8 at each mode's seed-0 pick at M = M8_FROM; M = 1
# (Decoupled with M1_RECEIPT, and synchronous DiLoCo) at its seed-0 pick at M = M1_FROM, the
# nearest swept M (the configs' 0.7 / 0.9 is not on the study's grid, so no row compares it).
# M1_RECEIPT: overwrite, the paper's receipt and the design default (docs/design.md 5.1).
M8_FROM = 4
M1_FROM = 2
M1_RECEIPT = "overwrite"
# --stage=m1: what keeps one learner behind data-parallel at the same batch. Each entry,
# (kind, receipt, outer), runs at M = 1 with seed 0 at the data-parallel reference's inner rate.
# Outer 1 / 0 makes G the learner's own parameters at every round, so synchronous DiLoCo there
# is data-parallel through the DiLoCo machinery (its schedule, data order, rounds and final
# sync): its gap is the machinery's, and the rest of the picked M = 1's gap is the outer step's.
# Decoupled at 1 / 0 adds the overlap (overwrite drops the tau steps between each delivery and
# its receipt); keep_local at the study's 0.4 / 0.9 keeps them; the momentum neighbours of
# 0.4 / 0.9 finish the outer grid the earlier M = 1 runs swept only in the rate.
M1_RUNS = (("diloco", "overwrite", (1.0, 0.0)), ("decoupled", "overwrite", (1.0, 0.0)),
           ("decoupled", "keep_local", (0.4, 0.9)), ("diloco", "overwrite", (0.4, 0.8)),
           ("diloco", "overwrite", (0.4, 0.95)))
# The inner AdamW peak learning rate each preset's configs set (tests/experiments_scaling_test.py
# checks them against configs/); a run at another one has " inner LR" in its setting.
PRESET_INNER_LR = {"nano": 3e-3, "tiny": 3e-3, "mini": 3e-3, "small": 3e-3, "m35": 2e-3}
# --stage=inner: at M = INNER_M, each method's pick with the inner learning rate scaled down,
# by the square-root (0.5) and the linear (0.25) rule for a batch INNER_M times smaller, and
# up (2.0); data-parallel gets every scale above 1 as well, so the reference is offered the
# same larger step.
INNER_M = 4
INNER_SCALES = (2.0, 0.5, 0.25)
# The second model size: data-parallel vs the best Decoupled M = 4 at `small_steps`.
SMALL_SEQ_LEN = 128
# 1,750 steps: with the two runs side by side, one core each (`--parallel=2 --threads=1`), about
# 1.5 h on the 2-core host (2.9 s per step data-parallel, 3.2 s Decoupled M = 4; usage.md).
SMALL_STEPS = 1750
SMALL_EVAL_EVERY = 250
# --stage=size --preset=P: the protocol at another size at 20N, seed 0. Data-parallel at the
# preset's inner rate times each of SIZE_INNER_SCALES (the reference: the lowest loss); then
# synchronous DiLoCo and Decoupled (overwrite) at each M of SIZE_LEARNERS at the reference's
# inner rate, each at its tiny pick's outer setting (the tiny rows: runs or results.json) and
# at SIZE_OUTER, the neighbours. Stages 2 and 3 with the same --preset seed the picks. The
# scales go past tiny's 0.5-4x: at nano each doubling up to 8x still won (an edge of the grid).
SIZE_INNER_SCALES = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
SIZE_LEARNERS = (1, 2, 4, 8)
SIZE_OUTER = ((1.0, 0.0), (1.4, 0.0), (0.6, 0.9))
# --stage=batch --preset=P: the size protocol at each global batch B of BATCH_SWEEP beside
# DP_BATCH, at the same tokens (`compute_optimal_steps(P, B)` steps), warmup and evaluations
# at the same tokens as at DP_BATCH (`batch_shape`), each learner on B / M sequences; the
# DiLoCo runs start at the outer settings picked at P's DP_BATCH group. The study tuned the
# global batch per method and M (powers of 2). 8: at nano, data-parallel's best of 16-128 was
# 16, the grid's edge, so the grid goes one power below it.
BATCH_SWEEP = (8, 16, 64, 128)
# --stage=period --preset=P: H at each of PERIODS beside PERIOD, at each M of PERIOD_LEARNERS,
# both DiLoCo methods at their picks of P's DP_BATCH group; Decoupled keeps a fragment due
# every FRAGMENT_STEPS steps (`fragments`), tau = TAU. These runs name their H and stay out of
# the main group's picks (rows.groups).
PERIODS = (8, 15)
PERIOD_LEARNERS = (2, 4)
# --stage=outer --preset=P [--steps]: both DiLoCo methods at each M of --learners at each outer
# setting of --outer, at P's group: its global batch and its reference's inner rate. The
# default goes below the lowest rate swept without momentum (1 / 0, picked at every M at nano)
# and adds Nesterov at the low rate the study found best at M = 1.
OUTER_BELOW = ((0.8, 0.0), (0.6, 0.0), (0.4, 0.9))
FRAGMENT_STEPS = 5
# --stage=optim --preset=P --optimizer=O: the protocol with another inner optimizer. Its runs
# form a group of their own, model "P+O" (`model_label`), whose data-parallel reference trains
# with O too, so each DiLoCo method's gap is to data-parallel with the same inner optimizer.
# Data-parallel at batch DP_BATCH with O's matrix rate at MUON_LR times each of MUON_SCALES
# (the AdamW part of the model at the P reference's tuned inner rate); then both DiLoCo
# methods at each M of SIZE_LEARNERS at that reference's rates and at the outer setting each
# picked in P's AdamW group. Stages 2 and 3 with the same --preset and --optimizer seed them.
OPTIMIZERS = ("adamw", "muon")
MUON_LR = 0.02  # optim.muon_learning_rate's default (tests check it against the config)
MUON_SCALES = (0.5, 1.0, 2.0)
# The config preset of a model preset where the names differ: configs/diloco.py and
# configs/decoupled.py call the `small` model's preset `cpu` (configs/dp.py has both).
CONFIG_PRESET = {"small": "cpu"}


def model_label(preset: str, optimizer: str = "adamw") -> str:
  """The `model` of a row: the preset's name, "+<optimizer>" after it unless AdamW (the
  study's), so each inner optimizer's runs are a group with its own reference."""
  if optimizer not in OPTIMIZERS:
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
  return preset if optimizer == "adamw" else f"{preset}+{optimizer}"


def preset_of(model: str) -> str:
  """"tiny+muon" -> "tiny": the model preset of a row's `model`."""
  return model.partition("+")[0]


def optimizer_of(model: str) -> str:
  """"tiny+muon" -> "muon", "tiny" -> "adamw"."""
  return model.partition("+")[2] or "adamw"


def preset_inner_lr(model: str) -> float | None:
  """The inner (AdamW) peak learning rate the configs set for a row's model."""
  return PRESET_INNER_LR.get(preset_of(model))


@functools.cache
def params(preset: str) -> int:
  """N of a model preset (or a row's `model`), counted from its abstract shapes (never
  typed)."""
  from diloco.model import presets, transformer  # pylint: disable=import-outside-toplevel
  return transformer.param_counts(presets.get(preset_of(preset)))["total"]


def tiny_params() -> int:
  return params("tiny")


def compute_optimal_steps(preset: str = "tiny", batch: int = DP_BATCH,
                          seq_len: int = SEQ_LEN) -> int:
  """Steps of `batch` x `seq_len` tokens that reach 20N tokens."""
  return round(TOKENS_PER_PARAM * params(preset) / (batch * seq_len))


def batch_shape(batch: int) -> dict:
  """The keyword arguments of `dp` / `diloco` at global batch `batch`: warmup and evaluation
  cadence at the same tokens as at DP_BATCH (rounded, at least one step), and the batch in
  the run's name (`batch_tag`)."""
  return {"dp_batch": batch, "eval_every": max(1, round(EVAL_EVERY * DP_BATCH / batch)),
          "warmup": max(1, round(WARMUP * DP_BATCH / batch)), "named_batch": True}


def fragments(period: int) -> int:
  """Decoupled's fragment count at H = `period`: one due every FRAGMENT_STEPS steps."""
  return max(1, round(period / FRAGMENT_STEPS))


def batch_tag(dp_batch: int, named: bool = True) -> str:
  """What a run's name says about its global batch: nothing at DP_BATCH (the names of the
  runs made before the batch sweep) or when not `named` (gpu35m's runs, each preset at one
  batch), " batch B" otherwise."""
  return "" if dp_batch == DP_BATCH or not named else f" batch {dp_batch}"


def period_label(period: int) -> str:
  """The suffix of a setting whose H is not the study's PERIOD."""
  return "" if period == PERIOD else f" H={period}"


def outer_label(lr: float, momentum: float) -> str:
  return f"outer {lr:g}/{momentum:g}"


def inner_label(lr: float) -> str:
  """The suffix of a setting whose inner learning rate is not its preset's."""
  return f" inner {lr:g}"


def muon_label(lr: float) -> str:
  """The suffix of a Muon setting whose matrix rate is not MUON_LR (after any inner rate)."""
  return f" muon {lr:g}"


def restart_label(rounds: int) -> str:
  """The suffix of a setting that restarts the outer momentum (after any Muon rate)."""
  return f" restart {rounds}"


def _optimizer_overrides(model: str, muon_lr: float | None) -> tuple[tuple, str]:
  """The overrides and setting suffix of a `model_label`'s inner optimizer."""
  optimizer = optimizer_of(model)
  model_label(preset_of(model), optimizer)  # an unknown optimizer fails here
  if optimizer == "adamw":
    if muon_lr is not None:
      raise ValueError(f"muon_lr is a Muon rate; model {model!r} trains with AdamW")
    return (), ""
  overrides = (("optim.name", optimizer),)
  if muon_lr is None:
    return overrides, ""
  return overrides + (("optim.muon_learning_rate", muon_lr),), muon_label(muon_lr)


def _common(steps: int, batch: int, seq_len: int, eval_every: int, *,
            eval_windows: int = EVAL_WINDOWS, warmup: int = WARMUP) -> tuple:
  """The overrides every run of a comparison shares: the same tokens per step in all, the
  same held-out windows at the same steps."""
  return (("train.steps", steps), ("train.batch_size", batch), ("data.seq_len", seq_len),
          ("train.eval_every", eval_every), ("train.eval_batches", eval_windows // batch),
          ("optim.warmup_steps", warmup), ("checkpoint.every_steps", 0))


def dp(seed: int, steps: int, batch: int = DP_BATCH, preset: str = "tiny",
       seq_len: int = SEQ_LEN, eval_every: int = EVAL_EVERY, *, dp_batch: int = DP_BATCH,
       extra: tuple = (), inner_lr: float | None = None, named_batch: bool = False,
       muon_lr: float | None = None, **common) -> Run:
  """Data-parallel at `batch` sequences per step (one learner's batch when < `dp_batch`).
  `preset` may name an inner optimizer (`model_label`). `extra` overrides are appended;
  `common` goes to `_common` (eval_windows, warmup); `inner_lr` replaces the preset's peak
  learning rate and `muon_lr` Muon's (each a method of its own, not the reference);
  `named_batch` names `dp_batch` in the run's name (`batch_tag`)."""
  method = "data-parallel" if batch == dp_batch else f"data-parallel B={batch}"
  if inner_lr is not None:
    extra = (("optim.learning_rate", inner_lr),) + tuple(extra)
    method += inner_label(inner_lr)
  chosen, suffix = _optimizer_overrides(preset, muon_lr)
  extra, method = chosen + tuple(extra), method + suffix
  # The batch is split over the mesh's devices: below DEVICES sequences, fewer devices.
  devices = (("devices", batch),) if batch < DEVICES else ()
  return Run(f"{preset}{batch_tag(dp_batch, named_batch)} {method}",
             f"configs/dp.py:{preset_of(preset)}",
             seed,
             _common(steps, batch, seq_len, eval_every, **common) + extra,
             labels=(("model", preset), ("kind", "data-parallel"), ("M", 1),
                     ("batch", batch)) + devices)


def diloco(kind: str, learners: int, outer: tuple[float, float], seed: int, steps: int,
           receipt: str = "overwrite", preset: str = "tiny", seq_len: int = SEQ_LEN,
           eval_every: int = EVAL_EVERY, *, dp_batch: int = DP_BATCH, extra: tuple = (),
           inner_lr: float | None = None, period: int = PERIOD, named_batch: bool = False,
           muon_lr: float | None = None, restart: int = 0, **common) -> Run:
  """Synchronous DiLoCo (`kind` = "diloco") or Decoupled with `receipt`, M = `learners`,
  each learner on `dp_batch` / M sequences; `preset`, `muon_lr` and `named_batch` as for
  `dp`; `inner_lr` replaces the preset's inner peak learning rate, `period` the study's H and
  `restart` > 0 restarts the outer momentum every that many rounds of a fragment (each names
  itself in the setting)."""
  batch = dp_batch // learners
  lr, momentum = outer
  overrides = _common(steps, batch, seq_len, eval_every, **common) + (
      ("learners.count", learners), ("learners.virtual_clock", True),
      ("outer.learning_rate", lr), ("outer.momentum", momentum), ("sync.period", period),
      ("checkpoint.every_rounds", 0))
  if kind == "decoupled":
    overrides += (("sync.num_fragments", fragments(period)), ("sync.tau", TAU),
                  ("receipt.mode", receipt))
    if receipt == "mix":
      overrides += (("receipt.mixing_alpha", MIX_ALPHA),)
    setting = f"{receipt} {outer_label(lr, momentum)}"
  elif kind == "diloco":  # the study's DiLoCo: no overlap, the merge applied at once
    overrides += (("sync.tau", 0),)
    setting = outer_label(lr, momentum)
  else:
    raise ValueError(f"kind must be 'diloco' or 'decoupled', got {kind!r}")
  if inner_lr is not None:
    overrides += (("optim.learning_rate", inner_lr),)
    setting += inner_label(inner_lr)
  chosen, suffix = _optimizer_overrides(preset, muon_lr)
  overrides += chosen
  if restart:
    overrides += (("outer.momentum_restart", restart),)
    suffix += restart_label(restart)
  setting += suffix + period_label(period)
  # Each learner's batch is split over its DEVICES / M devices: below DEVICES sequences in
  # all, dp_batch devices (dp_batch / M each).
  devices = (("devices", dp_batch),) if dp_batch < DEVICES else ()
  return Run(f"{preset}{batch_tag(dp_batch, named_batch)} {kind} M={learners} {setting}",
             f"configs/{kind}.py:{CONFIG_PRESET.get(preset_of(preset), preset_of(preset))}",
             seed,
             overrides + extra, labels=(("model", preset), ("kind", kind), ("M", learners),
                                ("batch", batch), ("setting", setting)) + devices)


def stage_one(steps: int, learners=LEARNERS) -> list[Run]:
  """Seed 0: data-parallel (full and per-learner batch) and every method x M x setting."""
  runs = [dp(0, steps)] + [dp(0, steps, DP_BATCH // m) for m in learners if m > 1]
  for m in learners:
    runs += [diloco("diloco", m, outer, 0, steps) for outer in OUTER]
    runs += [diloco("decoupled", m, outer, 0, steps, receipt)
             for receipt in RECEIPTS for outer in OUTER]
  return runs
