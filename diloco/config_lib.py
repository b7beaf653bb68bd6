"""Frozen, validated configuration: the library never reads a raw ConfigDict.

Experiment files (`configs/*.py`) build an `ml_collections.ConfigDict` with
`base_config()`; `from_config_dict()` turns it into the frozen dataclasses below
after `validate()`, so every bad value fails at start with a message that names
the field and what it may be.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import ml_collections

from diloco.errors import ConfigError
from diloco.model import presets as model_presets
from diloco.model.config import ATTENTION_IMPLS, REMAT_POLICIES, ModelConfig
from diloco.train import storage


def _frozen(cls):
  return dataclasses.dataclass(frozen=True, kw_only=True, slots=True)(cls)


@_frozen
class DataConfig:
  """Where tokens come from. `source`: stdlib | text | jsonl | parquet | datasets | array_record."""
  source: str = "stdlib"
  # Directory or glob of text files (text), jsonl or parquet files, a Hugging Face
  # save_to_disk or cache directory (datasets), or prepared shards (array_record).
  path: str = ""
  # "byte", a SentencePiece .model file (e.g. Gemma's or one written by
  # scripts/prepare_data.py), a Hugging Face tokenizer.json, or a directory holding one.
  tokenizer: str = "byte"
  # The text field of jsonl records, or the text column of parquet and datasets sources.
  text_key: str = "text"
  # The split of a DatasetDict directory or of a datasets cache (source=datasets).
  split: str = "train"
  seq_len: int = 128
  # Cap on the corpus size read into memory for text sources (0 = no cap).
  max_bytes: int = 8_000_000
  # Fraction of documents held out for evaluation (chosen by a hash of the name).
  eval_fraction: float = 0.02
  prefetch: int = 4


@_frozen
class MeshConfig:
  """Learner mesh axis sizes; exactly one may be -1 (fill with the rest)."""
  # Data parallelism: replicated parameters, the batch split.
  data: int = -1
  # Fully sharded data parallelism: parameters and the batch split.
  fsdp: int = 1
  # Tensor parallelism: MLP, heads and vocabulary split.
  tensor: int = 1


@_frozen
class OptimConfig:
  """Inner AdamW with linear warmup then cosine decay."""
  # Peak learning rate, reached after `warmup_steps`.
  learning_rate: float = 3e-3
  warmup_steps: int = 20
  # 0 means decay over all training steps.
  decay_steps: int = 0
  # The final learning rate as a fraction of the peak.
  end_lr_fraction: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  # Clip the global gradient norm to this (0 = no clipping).
  grad_clip_norm: float = 1.0
  # Weight of the z-loss (log^2 of the softmax normaliser) that keeps logits small.
  z_loss_weight: float = 1e-4


@_frozen
class TrainConfig:
  """How long each learner trains and how often the global model is evaluated."""
  # Inner steps of each learner (of the single learner when data-parallel).
  steps: int = 100
  # Sequences per step for the whole learner (split over data x fsdp).
  batch_size: int = 16
  # Evaluate every this many steps (0 = only at the end), on `eval_batches` held-out batches.
  eval_every: int = 50
  eval_batches: int = 4
  # Where the global model is evaluated, never on the merge path: "background" (a thread of
  # the runtime: the syncer process's host in the multi-process runtime), "process" (the
  # multi-process runtime's own evaluator process, on its own devices, reading published
  # versions from the store: the choice for large models) or "off" (no global evaluation).
  eval_mode: str = "background"
  # Start from these parameters instead of a fresh init: an export (WORKDIR/export or a
  # workdir that has one), a data-parallel checkpoint (WORKDIR/checkpoints[/STEP]) or a
  # durable run's checkpoint (WORKDIR/run_checkpoints[/STEP]). Fresh optimizer state; a
  # workdir that already holds a checkpoint resumes instead.
  init_from: str = ""


@_frozen
class CheckpointConfig:
  """When runs save what they need to resume."""
  # Learner train-state checkpoints every this many steps (data-parallel runs, learner
  # processes); 0 disables them.
  every_steps: int = 50
  # Single-controller Decoupled DiLoCo: checkpoint the syncer (G, momentum, versions, registry)
  # and the learners' resume points every this many merged rounds, and at the end, so that
  # rerunning the command resumes (diloco/runtime/checkpoint.py); 0 disables them.
  every_rounds: int = 0
  # Both kinds keep the newest `max_to_keep` checkpoints.
  max_to_keep: int = 2
  # Write checkpoints in the background while training goes on.
  async_save: bool = True


@_frozen
class LogConfig:
  # Scalars to WORKDIR/tensorboard/<writer> (learner_<m>, syncer, dp) besides metrics.jsonl.
  tensorboard: bool = True
  progress_every_s: float = 5.0
  # Weights & Biases (pip install 'diloco[wandb]'): one run per process, files in WORKDIR/wandb.
  wandb: bool = False
  wandb_project: str = "diloco"
  # Empty: your default entity.
  wandb_entity: str = ""
  # Runs of one experiment are grouped; empty: the workdir's name.
  wandb_group: str = ""
  # offline (default: no network or account needed; `wandb sync` uploads later) | online |
  # disabled.
  wandb_mode: str = "offline"


@_frozen
class SyncConfig:
  """Fragments, schedule, quorum and receipt rules of the outer loop (DESIGN.md 2.2-2.4)."""
  # P: the parameters are split into this many fragments, each synchronised on its own.
  num_fragments: int = 24
  # H: each fragment is due every `period` local steps, at offset p * H // P.
  period: int = 24
  # How tensors are packed into fragments: balanced | layer | tensor (diloco/fragments.py).
  scheme: str = "balanced"
  # Bounded overlap: a learner applies the merge of a delivery tau steps after making it.
  tau: int = 2
  # K: a round merges once this many fresh deliveries of its fragment arrived (capped by the
  # learners alive); 0 means all learners (K = M, synchronous), however many there are.
  quorum: int = 1
  # Grace-window gain: after quorum a round keeps admitting deliveries for up to
  # gamma * (the slack that tau leaves); 0 closes it at quorum.
  gamma: float = 0.8
  # A learner silent for longer is dead: rounds stop waiting for it.
  heartbeat_timeout_s: float = 30.0
  # Deliveries whose base is more than this many versions behind are rejected.
  max_staleness: int = 8
  # Receipt: theta = alpha * theta + (1 - alpha) * G; 0 overwrites (the default).
  mixing_alpha: float = 0.0
  # Zero the AdamW moments of a fragment's tensors when its merged values arrive.
  reset_moments: bool = False
  # A learner whose round is not merged tau steps after its delivery waits for it (False:
  # it trains on and applies the merge when it comes).
  block_on_late_round: bool = True
  # Deliveries a learner may have on their way (copied off its devices, not yet uploaded)
  # before its next delivery waits for the oldest: bounds the host and device memory a slow
  # link can pin. The wait is recorded as "wait" activity (not useful time).
  send_queue: int = 8


@_frozen
class OuterConfig:
  """The syncer's merge and Nesterov outer step (DESIGN.md 2.4)."""
  # Outer SGD with Nesterov momentum on the merged outer gradient.
  learning_rate: float = 0.7
  momentum: float = 0.9
  # Merge weight of a delivery: tokens2_per_step (tokens^2 / steps) | tokens | uniform.
  weights: str = "tokens2_per_step"
  # rda (radial-directional averaging of non-embedding tensors) | mean (weighted mean).
  merge: str = "rda"
  # Outer gradient of a delivery: syncer (current G - theta) | base (G at its base - theta).
  anchor: str = "syncer"
  # What a stale delivery (base older than the fragment's current version) counts for. Both
  # count it toward the quorum with its token weight. "paper": its outer gradient is anchored
  # at the current G (DESIGN 2.4). "rebase": it is the learner's own progress G_base - theta,
  # scaled by 1 / (1 + staleness), so it no longer undoes the rounds it missed.
  stale: str = "paper"
  # 0 sends float32 values; 16 / 8 / 4 / 2 / 1 send a quantised delta from the base version
  # (bf16; int8, int4, int2 max-abs codes per block; 1 = sign times the block's mean |x|).
  quantize_bits: int = 0
  quantize_block: int = 128
  error_feedback: bool = False


JOIN_SCHEDULES = ("own", "cohort")


@_frozen
class LearnersConfig:
  """Who trains: 0 learners is the data-parallel baseline (no syncer)."""
  # M: learners at the start; 0 = data-parallel over all devices.
  count: int = 0
  # Devices per learner group, e.g. "2,2,2,2"; empty splits all devices evenly over `count`.
  # Groups beyond `count` are spare capacity for learners added by the fault schedule.
  devices: str = ""
  # Step-time factor per learner group, e.g. "1,1,1.18,1.18" (empty: all 1).
  speeds: str = ""
  # Each step takes its nominal time times U(1 - j, 1 + j).
  step_jitter: float = 0.0
  # Real-clock runtimes: every step lasts at least this long (times its speed factor), so a
  # small host paces like a bigger model and fault times in seconds mean the same anywhere.
  min_step_s: float = 0.0
  # Virtual clock: step times come from `speeds`, interleaving is fixed by the seed.
  virtual_clock: bool = False
  # Virtual seconds of one step (times the learner's speed) and of one merge.
  virtual_step_s: float = 1.0
  virtual_sync_s: float = 0.1
  # Cooperative faults, ';'-separated: "down:1@30+20" (learner 1 down at t=30 s for 20 s),
  # "add@40" (next spare device group joins), "remove:2@60" (learner 2 retires),
  # "nan:0@10" (learner 0's parameters turn NaN, so it fails and rejoins).
  faults: str = ""
  # A learner whose metrics turn NaN/Inf fails alone and rejoins from the global fragments;
  # after this many such failures it is retired instead.
  nonfinite_retries: int = 3
  # Where a learner with no progress of its own that joins running peers (one added mid-run,
  # or a restart with no checkpoint) starts its step count, hence its learning-rate schedule
  # and its share of train.steps: "own" at 0 (a warmup and a whole schedule of its own),
  # "cohort" at the median step of its live peers (their learning rate; it ends with them).
  join_schedule: str = "own"


@_frozen
class StoreConfig:
  """The store of the multi-process runtime (DESIGN.md 3.1) and its emulated WAN links."""
  # A local path or an object-store URL (gs://bucket/run); empty: WORKDIR/store.
  root: str = ""
  # How often readers look for new entries, and learners write their heartbeat.
  poll_s: float = 0.05
  heartbeat_every_s: float = 0.2
  # Emulated link per learner, comma-separated (one value applies to all); 0 = unlimited.
  wan_mbps: str = ""
  wan_latency_ms: str = ""
  # A learner without a checkpoint of its own starts from a healthy peer's AdamW state.
  peer_optimizer: bool = False
  # How long a starting learner waits for the syncer's first published fragments, and the
  # initial learners (of either runtime) for each other to take their first step together.
  join_timeout_s: float = 300.0
  # What a learner does on SIGTERM. "retire": flush, checkpoint, tell the syncer it left for
  # good, exit 0. "restart" (preemption, node drains under Kubernetes): flush, checkpoint,
  # exit 143 so that its supervisor starts it again; the syncer times it out meanwhile.
  on_sigterm: str = "retire"
  # The syncer's lease on the store (one syncer per store): a second syncer waits until the
  # holder has not renewed it for this long (a quarter more for clock skew between hosts),
  # or takes it at once when the holder exited cleanly or died on the same host.
  lease_s: float = 10.0


@_frozen
class LaunchConfig:
  """The local launcher (`--role=launch`): processes, restarts and the real chaos schedule."""
  # Where learner processes run: auto | cpu | cuda | tpu. auto follows JAX_PLATFORMS if set,
  # else the GPUs `nvidia-smi -L` lists, else a TPU VM's chips, else the CPU. The syncer
  # always runs on the CPU (docs/scale_out.md).
  platform: str = "auto"
  # Devices of each learner (learners.devices overrides per learner): emulated CPU devices
  # on cpu; on cuda/tpu that many of the host's GPUs/chips, in disjoint contiguous groups.
  devices_per_learner: int = 2
  # Processes per learner: >1 rehearses a multi-host learner (one `jax.distributed` world of
  # that many processes, each with its share of the learner's devices; host 0 talks to the
  # store). When one of them dies, the launcher stops the others and restarts them together.
  hosts_per_learner: int = 1
  # Learners that may ever exist (data shards); 0: learners.count plus the schedule's adds.
  max_learners: int = 0
  # Restart a dead process after this long, doubling on each fast failure up to the max.
  restart_backoff_s: float = 1.0
  max_backoff_s: float = 20.0
  # A process that dies this many times in a row, each within a minute, aborts the run.
  max_fast_failures: int = 5
  # Real faults, ';'-separated, at T seconds after every initial learner has taken a step
  # (M may be '*': a random live learner, drawn from the seed):
  # "kill:M@T" SIGKILL (restarted), "stop:M@T+D" SIGSTOP for D s then SIGCONT,
  # "kill_syncer@T", "add@T" a new learner joins, "retire:M@T" SIGTERM, leaves cleanly.
  chaos: str = ""
  # Random faults drawn from the seed in [chaos_start_s, chaos_end_s], on top of `chaos`.
  chaos_faults: int = 0
  chaos_start_s: float = 10.0
  chaos_end_s: float = 60.0
  # The whole run is stopped (and fails) after this many seconds.
  timeout_s: float = 3600.0
  # On SIGTERM/SIGINT the launcher forwards the signal to every process, waits this long for
  # them to exit (learners checkpoint first), then SIGKILLs what is left.
  stop_timeout_s: float = 60.0


@_frozen
class Config:
  model: ModelConfig
  data: DataConfig
  mesh: MeshConfig
  optim: OptimConfig
  train: TrainConfig
  checkpoint: CheckpointConfig
  log: LogConfig
  sync: SyncConfig = SyncConfig()
  outer: OuterConfig = OuterConfig()
  learners: LearnersConfig = LearnersConfig()
  store: StoreConfig = StoreConfig()
  launch: LaunchConfig = LaunchConfig()
  # Seeds parameters, data order, jitter and fault draws.
  seed: int = 0


_GROUPS = {
    "model": ModelConfig, "data": DataConfig, "mesh": MeshConfig, "optim": OptimConfig,
    "train": TrainConfig, "checkpoint": CheckpointConfig, "log": LogConfig,
    "sync": SyncConfig, "outer": OuterConfig, "learners": LearnersConfig,
    "store": StoreConfig, "launch": LaunchConfig,
}
GROUPS = _GROUPS  # read by the command line's help (diloco/config_cli.py)
# `sync.quorum` = ALL_LEARNERS: every live learner (K = M), following learners.count.
ALL_LEARNERS = 0
DATA_SOURCES = ("stdlib", "text", "jsonl", "parquet", "datasets", "array_record")
DTYPES = ("float32", "bfloat16")
LAUNCH_PLATFORMS = ("auto", "cpu", "cuda", "tpu")


def base_config(model_preset: str) -> ml_collections.ConfigDict:
  """The default ConfigDict with the model fields filled from a preset."""
  model = model_presets.get(model_preset)
  groups = {name: dataclasses.asdict(cls()) for name, cls in _GROUPS.items()}
  groups["model"] = dataclasses.asdict(model)
  cfg = ml_collections.ConfigDict({k: ml_collections.ConfigDict(v) for k, v in groups.items()})
  cfg.seed = 0
  return cfg


def load(spec: str) -> ml_collections.ConfigDict:
  """`get_config(preset)` of a config file given as `path/to/file.py[:preset]` or by the name of
  a shipped one (`decoupled:tiny`, see `diloco.config_files`).

  The same syntax as `--config=`, for scripts and notebooks that do not parse flags.
  """
  from diloco import config_files  # pylint: disable=import-outside-toplevel
  return config_files.load(spec)


def from_config_dict(cfg: ml_collections.ConfigDict | dict[str, Any]) -> Config:
  """Validated frozen Config from a ConfigDict (or a plain nested dict)."""
  raw = cfg.to_dict() if isinstance(cfg, ml_collections.ConfigDict) else dict(cfg)
  unknown = set(raw) - set(_GROUPS) - {"seed"}
  if unknown:
    raise ConfigError(f"unknown config groups {sorted(unknown)}; allowed: "
                      f"{sorted(_GROUPS) + ['seed']}")
  kwargs: dict[str, Any] = {}
  for name, cls in _GROUPS.items():
    values = dict(raw.get(name, {}))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in values:
      if key not in fields:
        raise ConfigError(f"unknown field {name}.{key}; allowed: {sorted(fields)}")
    for key, value in values.items():
      expected = type(getattr(cls(), key))
      if expected is float and isinstance(value, int) and not isinstance(value, bool):
        values[key] = float(value)
      elif not isinstance(values[key], expected) or (
          expected is int and isinstance(value, bool)):
        raise ConfigError(f"{name}.{key} must be {expected.__name__}, got {value!r}")
    kwargs[name] = cls(**values)
  config = Config(**kwargs, seed=int(raw.get("seed", 0)))
  validate(config)
  return config


def _check(ok: bool, field: str, message: str) -> None:
  if not ok:
    raise ConfigError(f"{field}: {message}")


def validate_data(d: DataConfig) -> None:
  """The `data` group's checks, also run by scripts/prepare_data.py on its flags."""
  _check(d.source in DATA_SOURCES, "data.source",
         f"must be one of {DATA_SOURCES}, got {d.source!r}")
  _check(d.seq_len >= 2, "data.seq_len", f"must be >= 2, got {d.seq_len}")
  _check(0 < d.eval_fraction < 1, "data.eval_fraction", f"must be in (0, 1), got {d.eval_fraction}")
  _check(d.max_bytes >= 0, "data.max_bytes", "must be >= 0 (0 = no cap)")
  _check(d.prefetch >= 0, "data.prefetch", "must be >= 0")
  if d.source != "stdlib":
    _check(bool(d.path), "data.path", f"is required when data.source={d.source!r}")
    # Names only (a directory, a glob's matches), local or gs://...: nothing is read here.
    _check(storage.matches(d.path), "data.path", f"no directory or files match {d.path!r}")
  _check(bool(d.text_key), "data.text_key", "must name the text field or column")
  _check(bool(d.split), "data.split", "must name a split, e.g. 'train'")
  if d.tokenizer != "byte":
    _check(d.source != "array_record", "data.tokenizer",
           "array_record shards are already tokenised; leave data.tokenizer='byte' "
           "(the shards' meta.json names their tokenizer)")
    _check(os.path.exists(d.tokenizer), "data.tokenizer",
           "must be 'byte' or an existing SentencePiece .model file, tokenizer.json or "
           f"directory with one, got {d.tokenizer!r} (no such file)")


def validate(cfg: Config) -> None:
  """Raises ConfigError naming the first invalid field. Device-free checks only."""
  m = cfg.model
  for field in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "mlp_dim", "sliding_window"):
    _check(getattr(m, field) >= 1, f"model.{field}", f"must be >= 1, got {getattr(m, field)}")
  _check(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads",
         f"must divide model.num_heads={m.num_heads}, got {m.num_kv_heads}")
  _check(bool(m.attention_pattern) and set(m.attention_pattern) <= {"L", "G"},
         "model.attention_pattern", f"must be a string of L and G, got {m.attention_pattern!r}")
  _check(m.final_logit_softcap >= 0, "model.final_logit_softcap", "must be >= 0 (0 = off)")
  _check(m.query_pre_attn_scalar >= 0, "model.query_pre_attn_scalar", "must be >= 0")
  _check(m.num_experts >= 0, "model.num_experts", "must be >= 0 (0 = dense)")
  if m.num_experts:
    _check(1 <= m.experts_per_token <= m.num_experts, "model.experts_per_token",
           f"must be in [1, num_experts={m.num_experts}], got {m.experts_per_token}")
    _check(m.expert_mlp_dim >= 1, "model.expert_mlp_dim", "must be >= 1 for an MoE model")
    _check(m.capacity_factor > 0, "model.capacity_factor", "must be > 0")
    _check(m.moe_aux_loss_weight >= 0, "model.moe_aux_loss_weight", "must be >= 0")
  for field in ("dtype", "param_dtype"):
    _check(getattr(m, field) in DTYPES, f"model.{field}",
           f"must be one of {DTYPES}, got {getattr(m, field)!r}")
  _check(m.remat in REMAT_POLICIES, "model.remat",
         f"must be one of {REMAT_POLICIES}, got {m.remat!r}")
  _check(m.loss_chunk >= 0, "model.loss_chunk",
         f"must be >= 0 (0 = the whole sequence at once), got {m.loss_chunk}")
  _check(m.attention_impl in ATTENTION_IMPLS, "model.attention_impl",
         f"must be one of {ATTENTION_IMPLS}, got {m.attention_impl!r}")
  if m.attention_impl == "cudnn":
    _check(m.dtype == "bfloat16", "model.attention_impl",
           f"'cudnn' needs model.dtype='bfloat16', got {m.dtype!r} (use 'auto' or 'xla')")

  validate_data(cfg.data)

  mesh = cfg.mesh
  sizes = {"mesh.data": mesh.data, "mesh.fsdp": mesh.fsdp, "mesh.tensor": mesh.tensor}
  for field, size in sizes.items():
    _check(size == -1 or size >= 1, field, f"must be -1 (fill) or >= 1, got {size}")
  _check(list(sizes.values()).count(-1) <= 1, "mesh", "at most one axis may be -1")

  o = cfg.optim
  for field in ("learning_rate", "eps", "weight_decay", "grad_clip_norm", "z_loss_weight"):
    _check(getattr(o, field) >= 0, f"optim.{field}", f"must be >= 0, got {getattr(o, field)}")
  _check(o.learning_rate > 0, "optim.learning_rate", "must be > 0")
  _check(o.warmup_steps >= 0 and o.decay_steps >= 0, "optim.warmup_steps/decay_steps",
         "must be >= 0")
  _check(0 <= o.end_lr_fraction <= 1, "optim.end_lr_fraction", "must be in [0, 1]")
  _check(0 <= o.b1 < 1 and 0 <= o.b2 < 1, "optim.b1/b2", "must be in [0, 1)")

  t = cfg.train
  _check(t.steps >= 1, "train.steps", f"must be >= 1, got {t.steps}")
  _check(t.batch_size >= 1, "train.batch_size", f"must be >= 1, got {t.batch_size}")
  _check(t.eval_every >= 0, "train.eval_every", "must be >= 0 (0 = only at the end)")
  _check(t.eval_batches >= 1, "train.eval_batches", "must be >= 1")
  _check(t.eval_mode in EVAL_MODES, "train.eval_mode",
         f"must be one of {EVAL_MODES}, got {t.eval_mode!r}")
  _check(cfg.checkpoint.every_steps >= 0, "checkpoint.every_steps", "must be >= 0 (0 = off)")
  _check(cfg.checkpoint.every_rounds >= 0, "checkpoint.every_rounds", "must be >= 0 (0 = off)")
  _check(cfg.checkpoint.max_to_keep >= 1, "checkpoint.max_to_keep", "must be >= 1")
  _check(cfg.log.progress_every_s > 0, "log.progress_every_s", "must be > 0")
  _validate_diloco(cfg)


FRAGMENT_SCHEMES = ("balanced", "layer", "tensor")
EVAL_MODES = ("background", "process", "off")
WEIGHT_SCHEMES = ("tokens2_per_step", "uniform", "tokens")
MERGE_METHODS = ("rda", "mean")
ANCHORS = ("syncer", "base")
STALE_RULES = ("paper", "rebase")
QUANTIZE_BITS = (0, 16, 8, 4, 2, 1)


def check_in_process_eval(cfg: Config, runtime: str) -> None:
  """`train.eval_mode="process"` needs the multi-process runtime's evaluator process."""
  _check(cfg.train.eval_mode != "process", "train.eval_mode",
         f"'process' is the multi-process runtime's (--role=launch); the {runtime} evaluates "
         "in its own process: use 'background' or 'off'")


def parse_floats(text: str, field: str) -> list[float]:
  """Comma-separated numbers of a config string field ("" gives [])."""
  try:
    return [float(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise ConfigError(f"{field}: expected comma-separated numbers, got {text!r}") from None


def parse_events(text: str, patterns: dict, field: str, expected: str) -> list[tuple[str, Any]]:
  """(kind, regex match) of each ';'-separated event of a schedule string (spaces ignored);
  ConfigError naming `field` and the `expected` grammar on an event no pattern matches."""
  events = []
  for raw in text.split(";"):
    item = raw.strip().replace(" ", "")
    if not item:
      continue
    for kind, pattern in patterns.items():
      m = pattern.match(item)
      if m is not None:
        events.append((kind, m))
        break
    else:
      raise ConfigError(f"{field}: cannot parse {item!r}; expected {expected}")
  return events


def _validate_diloco(cfg: Config) -> None:
  s, o, lc = cfg.sync, cfg.outer, cfg.learners
  for field in ("num_fragments", "period"):
    _check(getattr(s, field) >= 1, f"sync.{field}", f"must be >= 1, got {getattr(s, field)}")
  _check(s.quorum >= 0, "sync.quorum", f"must be >= 1, or 0 for all learners, got {s.quorum}")
  _check(s.tau >= 0, "sync.tau", f"must be >= 0, got {s.tau}")
  # A learner applies the result of a delivery tau steps later; with H <= tau its next delivery
  # of the same fragment would come first and it could never apply a merged version.
  _check(s.period > s.tau, "sync.period",
         f"must be greater than sync.tau={s.tau} (DESIGN 2.3), got {s.period}")
  _check(s.scheme in FRAGMENT_SCHEMES, "sync.scheme",
         f"must be one of {FRAGMENT_SCHEMES}, got {s.scheme!r}")
  _check(s.gamma >= 0, "sync.gamma", f"must be >= 0 (0 disables grace), got {s.gamma}")
  _check(s.heartbeat_timeout_s > 0, "sync.heartbeat_timeout_s", "must be > 0")
  _check(s.max_staleness >= 0, "sync.max_staleness", "must be >= 0")
  _check(s.send_queue >= 1, "sync.send_queue", f"must be >= 1, got {s.send_queue}")
  _check(0 <= s.mixing_alpha < 1, "sync.mixing_alpha", "must be in [0, 1) (0 = overwrite)")
  _check(o.learning_rate > 0, "outer.learning_rate", f"must be > 0, got {o.learning_rate}")
  _check(0 <= o.momentum < 1, "outer.momentum", f"must be in [0, 1), got {o.momentum}")
  _check(o.weights in WEIGHT_SCHEMES, "outer.weights",
         f"must be one of {WEIGHT_SCHEMES}, got {o.weights!r}")
  _check(o.merge in MERGE_METHODS, "outer.merge",
         f"must be one of {MERGE_METHODS}, got {o.merge!r}")
  _check(o.anchor in ANCHORS, "outer.anchor", f"must be one of {ANCHORS}, got {o.anchor!r}")
  _check(o.stale in STALE_RULES, "outer.stale",
         f"must be one of {STALE_RULES}, got {o.stale!r}")
  _check(o.quantize_bits in QUANTIZE_BITS, "outer.quantize_bits",
         f"must be one of {QUANTIZE_BITS} (0 = float32 values), got {o.quantize_bits}")
  _check(o.quantize_block >= 1, "outer.quantize_block", "must be >= 1")
  _check(lc.count >= 0, "learners.count", f"must be >= 0 (0 = data-parallel), got {lc.count}")
  _check(lc.nonfinite_retries >= 0, "learners.nonfinite_retries", "must be >= 0")
  _check(lc.join_schedule in JOIN_SCHEDULES, "learners.join_schedule",
         f"must be one of {JOIN_SCHEDULES}, got {lc.join_schedule!r}")
  _check(lc.step_jitter >= 0 and lc.step_jitter < 1, "learners.step_jitter", "must be in [0, 1)")
  _check(lc.min_step_s >= 0 and math.isfinite(lc.min_step_s), "learners.min_step_s",
         "must be a finite number of seconds >= 0")
  _check(lc.virtual_step_s > 0 and lc.virtual_sync_s >= 0, "learners.virtual_step_s/sync_s",
         "must be > 0 and >= 0")
  devices = [int(x) for x in parse_floats(lc.devices, "learners.devices")]
  speeds = parse_floats(lc.speeds, "learners.speeds")
  if lc.count:
    _check(not devices or len(devices) >= lc.count, "learners.devices",
           f"lists {len(devices)} groups, fewer than learners.count={lc.count}")
    _check(not speeds or len(speeds) >= max(lc.count, len(devices)), "learners.speeds",
           f"needs one factor per learner group, got {len(speeds)}")
    _check(all(x > 0 for x in speeds), "learners.speeds", "factors must be > 0")
    _check(s.quorum <= max(lc.count, len(devices)), "sync.quorum",
           f"must be <= the number of learners ({max(lc.count, len(devices))}), or 0 for all "
           f"of them, got {s.quorum}")
  st, la = cfg.store, cfg.launch
  _check(st.poll_s > 0 and st.heartbeat_every_s > 0, "store.poll_s/heartbeat_every_s",
         "must be > 0")
  _check(st.heartbeat_every_s < s.heartbeat_timeout_s, "store.heartbeat_every_s",
         f"must be below sync.heartbeat_timeout_s={s.heartbeat_timeout_s}")
  _check(st.join_timeout_s > 0, "store.join_timeout_s", "must be > 0")
  _check(st.lease_s > 0, "store.lease_s", "must be > 0")
  _check(st.on_sigterm in ("retire", "restart"), "store.on_sigterm",
         f"must be 'retire' or 'restart', got {st.on_sigterm!r}")
  for field in ("wan_mbps", "wan_latency_ms"):
    _check(all(v >= 0 for v in parse_floats(getattr(st, field), f"store.{field}")),
           f"store.{field}", "values must be >= 0")
  _check(la.devices_per_learner >= 1, "launch.devices_per_learner", "must be >= 1")
  _check(la.hosts_per_learner >= 1, "launch.hosts_per_learner", "must be >= 1")
  for size in devices + [la.devices_per_learner]:
    _check(size % la.hosts_per_learner == 0, "launch.hosts_per_learner",
           f"must divide every learner's device count, got {la.hosts_per_learner} for {size}")
  _check(la.max_learners >= 0, "launch.max_learners", "must be >= 0")
  _check(0 < la.restart_backoff_s <= la.max_backoff_s, "launch.restart_backoff_s",
         "must be > 0 and <= launch.max_backoff_s")
  _check(la.max_fast_failures >= 1, "launch.max_fast_failures", "must be >= 1")
  _check(la.chaos_faults >= 0, "launch.chaos_faults", "must be >= 0")
  _check(0 <= la.chaos_start_s <= la.chaos_end_s, "launch.chaos_start_s/chaos_end_s",
         "must satisfy 0 <= start <= end")
  _check(la.timeout_s > 0, "launch.timeout_s", "must be > 0")
  _check(la.platform in LAUNCH_PLATFORMS, "launch.platform",
         f"must be one of {LAUNCH_PLATFORMS}, got {la.platform!r}")
  _check(la.stop_timeout_s > 0, "launch.stop_timeout_s", "must be > 0")
