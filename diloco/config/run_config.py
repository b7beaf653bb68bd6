"""The run's configuration: the groups composed, frozen and validated, and the cross-group rules.

Experiment files (`configs/*.py`) build an `ml_collections.ConfigDict` with
`base_config()`; `from_config_dict()` turns it into the frozen dataclasses below
after `validate()`, so every bad value fails at start with a message that names
the field and what it may be.

Each group lives beside the code it configures (`DataConfig` in diloco/train/data.py,
`SyncConfig` in diloco/sync/policy.py, ...); the groups whose owners are the runtimes (train,
learners, store, launch) are here. Each rule lives in one place (docs/architecture.md, "Where a
config rule lives"): a field's own rule is declared beside it (`setting(default, rule)`,
diloco/settings.py), a rule relating fields of one group is that group's `check` method, and a
rule across groups is in `_check_across_groups`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections

from diloco import documents
from diloco.artifacts import hf_import
from diloco.config.slurm_config import SlurmConfig
from diloco.errors import ConfigError
from diloco.learner import receipt as receipt_lib
from diloco.learner.receipt import ReceiptConfig
from diloco.model import presets as model_presets
from diloco.model.config import ModelConfig
from diloco.observe.tracking import LogConfig
from diloco.outer.merge import OuterConfig
from diloco.settings import (
  AT_LEAST_ONE,
  FRACTION,
  NON_NEGATIVE,
  POSITIVE,
  OneOf,
  Range,
  check_fields,
  frozen,
  require,
  setting,
)
from diloco.sync.policy import SyncConfig
from diloco.train.checkpoint import CheckpointConfig
from diloco.train.data import DataConfig
from diloco.train.mesh import MeshConfig
from diloco.train.optim import OptimConfig

# The config's own choices (the modules that act on them read the field's value).
EVAL_MODES = ("background", "process", "off")
JOIN_SCHEDULES = ("own", "cohort")
SIGTERM_ACTIONS = ("retire", "restart")
LAUNCH_PLATFORMS = ("auto", "cpu", "cuda", "tpu")


@frozen
class TrainConfig:
  """How long each learner trains and how often the global model is evaluated."""
  # Inner steps of each learner (of the single learner when data-parallel).
  steps: int = setting(100, AT_LEAST_ONE)
  # Sequences per step for the whole learner (split over data x fsdp).
  batch_size: int = setting(16, AT_LEAST_ONE)
  # Evaluate every this many steps (0 = only at the end), on `eval_batches` held-out batches.
  eval_every: int = setting(50, NON_NEGATIVE, "0 = only at the end")
  eval_batches: int = setting(4, AT_LEAST_ONE)
  # Where the global model is evaluated, never on the merge path: "background" (a thread of
  # the runtime: the syncer process's host in the multi-process runtime), "process" (the
  # multi-process runtime's own evaluator process, on its own devices, reading published
  # versions from the store: the choice for large models) or "off" (no global evaluation).
  eval_mode: str = setting("background", OneOf(EVAL_MODES))
  # Start from these parameters instead of a fresh init: an export (WORKDIR/export or a
  # workdir that has one), a data-parallel checkpoint (WORKDIR/checkpoints[/STEP]), a
  # durable run's checkpoint (WORKDIR/run_checkpoints[/STEP]) or hf:FOLDER, a Hugging Face
  # Gemma 3 folder, whose config also sets the model's shape and tokenizer. Fresh optimizer
  # state; a workdir that already holds a checkpoint resumes instead.
  init_from: str = ""


@frozen
class LearnersConfig:
  """Who trains: 0 learners is the data-parallel baseline (no syncer)."""
  # M: learners at the start; 0 = data-parallel over all devices.
  count: int = setting(0, NON_NEGATIVE, "0 = data-parallel")
  # Devices per learner group, e.g. "2,2,2,2"; empty splits all devices evenly over `count`.
  # Groups beyond `count` are spare capacity for learners added by the fault schedule.
  devices: str = ""
  # Every learner runs on all visible devices, one after another (time-shared). Only on the
  # virtual clock, where step times come from `speeds`: M learners on one accelerator.
  share_devices: bool = False
  # Step-time factor per learner group, e.g. "1,1,1.18,1.18" (empty: all 1).
  speeds: str = ""
  # Each step takes its nominal time times U(1 - j, 1 + j).
  step_jitter: float = setting(0.0, FRACTION)
  # Real-clock runtimes: every step lasts at least this long (times its speed factor), so a
  # small host paces like a bigger model and fault times in seconds mean the same anywhere.
  min_step_s: float = setting(0.0, Range(low=0, finite=True))
  # Virtual clock: step times come from `speeds`, interleaving is fixed by the seed.
  virtual_clock: bool = False
  # Virtual seconds of one step (times the learner's speed) and of one merge.
  virtual_step_s: float = setting(1.0, POSITIVE)
  virtual_sync_s: float = setting(0.1, NON_NEGATIVE)
  # Cooperative faults, ';'-separated: "kill:1@30+20" (learner 1 down at t=30 s for 20 s),
  # "add@40" (next spare device group joins), "retire:2@60" (learner 2 retires),
  # "nan:0@10" (learner 0's parameters turn NaN, so it fails and rejoins).
  faults: str = ""
  # A learner whose metrics turn NaN/Inf fails alone and rejoins from the global fragments;
  # after this many such failures it is retired instead.
  nonfinite_retries: int = setting(3, NON_NEGATIVE)
  # Where a learner with no progress of its own that joins running peers (one added mid-run,
  # or a restart with no checkpoint) starts its step count, hence its learning-rate schedule
  # and its share of train.steps: "own" at 0 (a warmup and a whole schedule of its own),
  # "cohort" at the median step of its live peers (their learning rate; it ends with them).
  join_schedule: str = setting("own", OneOf(JOIN_SCHEDULES))

  def device_counts(self) -> list[int]:
    """`devices` parsed: the device count of each learner group ([] when empty)."""
    return parse_ints(self.devices, "learners.devices")

  def speed_factors(self) -> list[float]:
    """`speeds` parsed: the step-time factor of each learner group ([] when empty)."""
    return parse_floats(self.speeds, "learners.speeds")

  def check(self) -> None:
    """Time-sharing needs the virtual clock; the lists match the number of learners and hold
    usable values."""
    require(not self.share_devices or self.virtual_clock, "learners.share_devices",
            "needs learners.virtual_clock=True (time-shared learners have no wall-clock speed)")
    require(not (self.share_devices and self.devices), "learners.share_devices",
            f"excludes learners.devices={self.devices!r} (every learner uses all devices)")
    devices, speeds = self.device_counts(), self.speed_factors()
    require(all(x >= 1 for x in devices), "learners.devices", "counts must be >= 1")
    require(all(x > 0 for x in speeds), "learners.speeds", "factors must be > 0")
    if self.count:
      require(not devices or len(devices) >= self.count, "learners.devices",
              f"lists {len(devices)} groups, fewer than learners.count={self.count}")
      require(not speeds or len(speeds) >= max(self.count, len(devices)), "learners.speeds",
              f"needs one factor per learner group, got {len(speeds)}")


@frozen
class StoreConfig:
  """The store of the multi-process runtime (docs/design.md 3.1) and its emulated WAN links."""
  # A local path or an object-store URL (gs://bucket/run); empty: WORKDIR/store.
  root: str = ""
  # How often readers look for new entries, and learners write their heartbeat.
  poll_s: float = setting(0.05, POSITIVE)
  heartbeat_every_s: float = setting(0.2, POSITIVE)
  # Emulated link per learner, comma-separated (one value applies to all); 0 = unlimited.
  wan_mbps: str = ""
  wan_latency_ms: str = ""
  # A learner without a checkpoint of its own starts from a healthy peer's AdamW state.
  peer_optimizer: bool = False
  # How long a starting learner waits for the syncer's first published fragments, and the
  # initial learners (of either runtime) for each other to take their first step together.
  join_timeout_s: float = setting(300.0, POSITIVE)
  # What a learner does on SIGTERM. "retire": flush, checkpoint, tell the syncer it left for
  # good, exit 0. "restart" (preemption, node drains under Kubernetes): flush, checkpoint,
  # exit 143 so that its supervisor starts it again; the syncer times it out meanwhile.
  on_sigterm: str = setting("retire", OneOf(SIGTERM_ACTIONS))
  # The syncer's lease on the store (one syncer per store): a second syncer waits until the
  # holder has not renewed it for this long (a quarter more for clock skew between hosts),
  # or takes it at once when the holder exited cleanly or died on the same host.
  lease_s: float = setting(10.0, POSITIVE)

  def wan_values(self, field: str) -> list[float]:
    """`wan_mbps` or `wan_latency_ms` parsed: a value per learner ([] when empty)."""
    return parse_floats(getattr(self, field), f"store.{field}")

  def check(self) -> None:
    """The emulated links are lists of numbers >= 0."""
    for field in ("wan_mbps", "wan_latency_ms"):
      require(all(v >= 0 for v in self.wan_values(field)), f"store.{field}",
              f"values must be >= 0, got {getattr(self, field)!r}")


@frozen
class LaunchConfig:
  """The local launcher (`--role=launch`): processes, restarts and the real chaos schedule."""
  # Where learner processes run: auto | cpu | cuda | tpu. auto follows JAX_PLATFORMS if set,
  # else the GPUs `nvidia-smi -L` lists, else a TPU VM's chips, else the CPU. The syncer
  # always runs on the CPU (docs/scale_out.md).
  platform: str = setting("auto", OneOf(LAUNCH_PLATFORMS))
  # Devices of each learner (learners.devices overrides per learner): emulated CPU devices
  # on cpu; on cuda/tpu that many of the host's GPUs/chips, in disjoint contiguous groups.
  devices_per_learner: int = setting(2, AT_LEAST_ONE)
  # Processes per learner: >1 rehearses a multi-host learner (one `jax.distributed` world of
  # that many processes, each with its share of the learner's devices; host 0 talks to the
  # store). When one of them dies, the launcher stops the others and restarts them together.
  hosts_per_learner: int = setting(1, AT_LEAST_ONE)
  # Learners that may ever exist (data shards); 0: learners.count plus the schedule's adds.
  max_learners: int = setting(0, NON_NEGATIVE)
  # Restart a dead process after this long, doubling on each fast failure up to the max.
  restart_backoff_s: float = setting(1.0, POSITIVE)
  max_backoff_s: float = setting(20.0, POSITIVE)
  # A process that dies this many times in a row, each within a minute, aborts the run.
  max_fast_failures: int = setting(5, AT_LEAST_ONE)
  # Real faults, ';'-separated, at T seconds after every initial learner has taken a step
  # (M may be '*': a random live learner, drawn from the seed):
  # "kill:M@T" SIGKILL (restarted), "stop:M@T+D" SIGSTOP for D s then SIGCONT,
  # "kill_syncer@T", "add@T" a new learner joins, "retire:M@T" SIGTERM, leaves cleanly.
  chaos: str = ""
  # Random faults drawn from the seed in [chaos_start_s, chaos_end_s], on top of `chaos`.
  chaos_faults: int = setting(0, NON_NEGATIVE)
  chaos_start_s: float = setting(10.0, NON_NEGATIVE)
  chaos_end_s: float = setting(60.0, NON_NEGATIVE)
  # The whole run is stopped (and fails) after this many seconds.
  timeout_s: float = setting(3600.0, POSITIVE)
  # On SIGTERM/SIGINT the launcher forwards the signal to every process, waits this long for
  # them to exit (learners checkpoint first), then SIGKILLs what is left.
  stop_timeout_s: float = setting(60.0, POSITIVE)

  def check(self) -> None:
    """The backoff and the chaos window are ordered."""
    require(self.restart_backoff_s <= self.max_backoff_s, "launch.restart_backoff_s",
            f"must be <= launch.max_backoff_s={self.max_backoff_s}, got {self.restart_backoff_s}")
    require(self.chaos_start_s <= self.chaos_end_s, "launch.chaos_start_s/chaos_end_s",
            "must satisfy 0 <= start <= end")


@frozen
class Config:
  model: ModelConfig
  data: DataConfig
  mesh: MeshConfig
  optim: OptimConfig
  train: TrainConfig
  checkpoint: CheckpointConfig
  log: LogConfig
  sync: SyncConfig = SyncConfig()
  receipt: ReceiptConfig = ReceiptConfig()
  outer: OuterConfig = OuterConfig()
  learners: LearnersConfig = LearnersConfig()
  store: StoreConfig = StoreConfig()
  launch: LaunchConfig = LaunchConfig()
  slurm: SlurmConfig = SlurmConfig()
  # Seeds parameters, data order, jitter and fault draws.
  seed: int = 0


_GROUPS = {
    "model": ModelConfig, "data": DataConfig, "mesh": MeshConfig, "optim": OptimConfig,
    "train": TrainConfig, "checkpoint": CheckpointConfig, "log": LogConfig,
    "sync": SyncConfig, "receipt": ReceiptConfig, "outer": OuterConfig, "learners": LearnersConfig,
    "store": StoreConfig, "launch": LaunchConfig, "slurm": SlurmConfig,
}
GROUPS = _GROUPS  # read by the command line's help (diloco/cli/config_flags.py)
# `sync.quorum` = ALL_LEARNERS: every live learner (K = M), following learners.count.
ALL_LEARNERS = 0


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
  a shipped one (`decoupled:tiny`, see `diloco.config.files`).

  The same syntax as `--config=`, for scripts and notebooks that do not parse flags.
  """
  from diloco.config import files as config_files  # pylint: disable=import-outside-toplevel
  return config_files.load(spec)


def from_config_dict(cfg: ml_collections.ConfigDict | dict[str, Any]) -> Config:
  """Validated frozen Config from a ConfigDict (or a plain nested dict)."""
  raw = cfg.to_dict() if isinstance(cfg, ml_collections.ConfigDict) else cfg
  raw = dict(raw) if isinstance(raw, Mapping) else raw
  if not isinstance(raw, dict):
    raise ConfigError(f"the config must be an object of groups ({sorted(_GROUPS)}, seed), "
                      f"got {type(raw).__name__}")
  raw = _former_fields(raw)
  unknown = set(raw) - set(_GROUPS) - {"seed"}
  if unknown:
    raise ConfigError(f"unknown config groups {sorted(unknown)}; allowed: "
                      f"{sorted(_GROUPS) + ['seed']}")
  kwargs = {name: group_from_dict(name, raw.get(name, {})) for name in _GROUPS}
  seed = raw.get("seed", 0)
  if not isinstance(seed, int) or isinstance(seed, bool):
    raise ConfigError(f"seed: must be an integer, got {seed!r}")
  config = with_hf_start(Config(**kwargs, seed=seed))
  validate(config)
  return config


def _former_fields(raw: dict) -> dict:
  """A config of before the `receipt` group (a run's config.json of then: no such group)
  names its fields in `sync` (`sync.receipt` was `receipt.mode`): they are read into the
  group. In a config with the group they are unknown fields (`group_from_dict` says where
  each went)."""
  sync = raw.get("sync")
  if "receipt" in raw or not isinstance(sync, Mapping):
    return raw
  moved = {new: sync[old] for old, new in receipt_lib.FORMER_SYNC_FIELDS.items() if old in sync}
  if not moved:
    return raw
  sync = {k: v for k, v in sync.items() if k not in receipt_lib.FORMER_SYNC_FIELDS}
  return dict(raw, sync=sync, receipt=moved)


def with_hf_start(cfg: Config) -> Config:
  """`train.init_from=hf:FOLDER`: the model's shape and tokenizer come from the Hugging Face
  folder (`hf_import`), everything else (speed switches, parameter dtype, data, the rest of
  the run) from `cfg`. Any other config is returned as it is."""
  folder = hf_import.folder_of(cfg.train.init_from)
  if folder is None:
    return cfg
  model = hf_import.model_config(folder, cfg.model)
  tokenizer = hf_import.tokenizer_of(folder)
  data = cfg.data
  if tokenizer is not None and data.source != "array_record":  # shards carry their own
    data = dataclasses.replace(data, tokenizer=tokenizer)
  return dataclasses.replace(cfg, model=model, data=data)


def read_file(path: str, what: str = "--config_json") -> Config:
  """The validated Config of a JSON file (`--config_json`, a run's config.json): a
  DocumentError naming the file and the field when it is not JSON, not an object of groups,
  holds a value of another type or a non-finite number, or breaks a config rule."""
  doc = documents.read(path, f"{what}={path}")
  documents.non_finite(doc, f"{what}={path}")
  try:
    return from_config_dict(doc)
  except ConfigError as e:
    raise documents.from_config_error(e, f"{what}={path}") from None


def group_from_dict(name: str, values: dict[str, Any]) -> Any:
  """The group `name` (its defaults overridden by `values`), each value of its field's type
  (an int is taken for a float); not yet checked against the rules (`check_group`)."""
  cls = _GROUPS[name]
  if not isinstance(values, dict):
    raise ConfigError(f"{name}: must be an object of the group's fields, got {values!r}")
  values = dict(values)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  for key in values:
    if key not in fields:
      if name == "sync" and key in receipt_lib.FORMER_SYNC_FIELDS:
        raise ConfigError(f"unknown field sync.{key}: it is now "
                          f"receipt.{receipt_lib.FORMER_SYNC_FIELDS[key]}")
      raise ConfigError(f"unknown field {name}.{key}; allowed: {sorted(fields)}")
  for key, value in values.items():
    expected = type(getattr(cls(), key))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
      try:
        values[key] = float(value)
      except OverflowError:
        raise ConfigError(f"{name}.{key}: must be a finite number, got {value}") from None
    elif not isinstance(values[key], expected) or (
        expected is int and isinstance(value, bool)):
      raise ConfigError(f"{name}.{key} must be {expected.__name__}, got {value!r}")
  return cls(**values)


def check_group(name: str, group: Any) -> None:
  """ConfigError for the first rule of group `name` that `group` breaks: each field's own
  rule, then the group's `check` (the rules across its fields)."""
  check_fields(name, group)
  if hasattr(group, "check"):
    group.check()


def validate_data(d: DataConfig) -> None:
  """The `data` group's checks, also run by scripts/prepare_data.py on its flags."""
  check_group("data", d)


def validate(cfg: Config) -> None:
  """Raises ConfigError naming the first invalid field. Device-free checks only."""
  for name in _GROUPS:
    check_group(name, getattr(cfg, name))
  _check_across_groups(cfg)


def _check_across_groups(cfg: Config) -> None:
  """The rules that relate fields of different groups."""
  s, lc, st, la = cfg.sync, cfg.learners, cfg.store, cfg.launch
  devices = lc.device_counts()
  if lc.count:
    groups = max(lc.count, len(devices))
    require(s.quorum <= groups, "sync.quorum",
            f"must be <= the number of learners ({groups}), or 0 for all of them, got {s.quorum}")
  require(st.heartbeat_every_s < s.heartbeat_timeout_s, "store.heartbeat_every_s",
          f"must be below sync.heartbeat_timeout_s={s.heartbeat_timeout_s}")
  for size in devices + [la.devices_per_learner]:
    require(size % la.hosts_per_learner == 0, "launch.hosts_per_learner",
            f"must divide every learner's device count, got {la.hosts_per_learner} for {size}")


def check_in_process_eval(cfg: Config, runtime: str) -> None:
  """`train.eval_mode="process"` needs the multi-process runtime's evaluator process."""
  require(cfg.train.eval_mode != "process", "train.eval_mode",
          f"'process' is the multi-process runtime's (--role=launch); the {runtime} evaluates "
          "in its own process: use 'background' or 'off'")


def parse_floats(text: str, field: str) -> list[float]:
  """Comma-separated numbers of a config string field ("" gives []): the one parser of the
  config's lists (`learners.devices`, `learners.speeds`, `store.wan_*`)."""
  try:
    return [float(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise ConfigError(f"{field}: expected comma-separated numbers, got {text!r}") from None


def parse_ints(text: str, field: str) -> list[int]:
  """Comma-separated whole numbers of a config string field ("" gives [])."""
  values = parse_floats(text, field)
  require(all(v.is_integer() for v in values), field,
          f"expected comma-separated whole numbers, got {text!r}")
  return [int(v) for v in values]


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
