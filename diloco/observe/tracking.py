"""Experiment trackers behind one interface: TensorBoard (default) and Weights & Biases.

`MetricWriter` (diloco/observe/metrics.py) always appends JSON lines and forwards every record
to the trackers that `open_trackers(cfg.log, ...)` returns. A tracker only enqueues: tensorboardX
writes its event files on its own thread and wandb hands records to its service process, so a
learner's step never waits on disk or network.

Layout (the same in both runtimes and in the data-parallel loop):
  WORKDIR/tensorboard/<name>/   one TensorBoard run per writer: `syncer` (global eval/*,
                                outer/*, accounting/*), `dp`, `learner_<m>` (train/*)
  WORKDIR/wandb/                wandb files; one wandb run per process (group = the workdir's
                                name), keys namespaced `learner_<m>/train/loss`, `eval/loss`
The resolved config goes to TensorBoard as hparams plus a `config` text, and to wandb as the
run's config.
"""

from __future__ import annotations

import importlib.abc
import json
import math
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any, Protocol

from absl import logging

from diloco import settings
from diloco.errors import ConfigError
from diloco.settings import POSITIVE, OneOf, frozen, require, setting

TENSORBOARD_DIR = "tensorboard"
WANDB_MODES = ("offline", "online", "disabled")


@frozen
class LogConfig:
  # Scalars to WORKDIR/tensorboard/<writer> (learner_<m>, syncer, dp) besides metrics.jsonl.
  tensorboard: bool = True
  progress_every_s: float = setting(5.0, POSITIVE)
  # Weights & Biases (pip install 'diloco[wandb]'): one run per process, files in WORKDIR/wandb.
  wandb: bool = False
  wandb_project: str = "diloco"
  # Empty: your default entity.
  wandb_entity: str = ""
  # Runs of one experiment are grouped; empty: the workdir's name.
  wandb_group: str = ""
  # offline (default: no network or account needed; `wandb sync` uploads later) | online |
  # disabled.
  wandb_mode: str = setting("offline", OneOf(WANDB_MODES))
  # A module or .py file whose HOOKS (a list of diloco.Hook) every process of the run runs
  # (diloco/observe/hooks.py); empty: none. Code that runs: name only files you trust.
  hooks: str = ""

  def check(self) -> None:
    """A wandb run needs a project."""
    require(not self.wandb or bool(self.wandb_project), "log.wandb_project",
            "must be set when log.wandb=True")


class Tracker(Protocol):
  """Where scalars go besides metrics.jsonl. `name` is the writer's namespace (e.g. learner_0)."""

  def scalars(self, name: str, step: int, values: Mapping[str, float]) -> None:
    ...

  def hparams(self, config: Mapping[str, Any]) -> None:
    ...

  def close(self) -> None:
    ...


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """`{"model.embed_dim": 64, ...}`: nested config flattened to scalar hyperparameters."""
  out: dict[str, Any] = {}
  for key, value in config.items():
    if isinstance(value, Mapping):
      out.update(flat_config(value, f"{prefix}{key}."))
    elif isinstance(value, (bool, int, float, str)):
      out[f"{prefix}{key}"] = value
    else:
      out[f"{prefix}{key}"] = str(value)
  return out


class _TorchUnwanted(importlib.abc.MetaPathFinder):
  """Fails `import torch` in one thread: the thread that imports tensorboardX, meanwhile."""

  def __init__(self):
    self.thread = threading.get_ident()

  def find_spec(self, fullname, path=None, target=None):
    """Raises for torch in the importing thread; else None (the next finder looks)."""
    del path, target
    if fullname == "torch" and threading.get_ident() == self.thread:
      raise ModuleNotFoundError("tensorboardX's scalars need no torch", name=fullname)


def _summary_writer():
  """tensorboardX's SummaryWriter, imported without torch unless torch is loaded already.

  tensorboardX's writer imports torch, when installed, only to name a type in its annotations
  (NumPy's array without it); scalars, hyperparameters and text never use torch, whose import
  costs a process ~1.5 s of CPU.
  """
  if "torch" in sys.modules or "tensorboardX" in sys.modules:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    return SummaryWriter
  finder = _TorchUnwanted()
  sys.meta_path.insert(0, finder)
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  finally:
    sys.meta_path.remove(finder)
  return SummaryWriter


class TensorBoardTracker:
  """A tensorboardX SummaryWriter on WORKDIR/tensorboard/<name>."""

  def __init__(self, workdir: str, name: str, purge_step: int | None = None):
    SummaryWriter = _summary_writer()  # pylint: disable=invalid-name
    self.logdir = os.path.join(workdir, TENSORBOARD_DIR, name)
    # purge_step: a resumed run hides the previous session's events from that step on.
    self._writer = SummaryWriter(self.logdir, purge_step=purge_step, flush_secs=10)

  def scalars(self, name: str, step: int, values: Mapping[str, float]) -> None:
    del name  # one writer per name: the run directory is the namespace
    for key, value in values.items():
      self._writer.add_scalar(key, float(value), int(step))

  def hparams(self, config: Mapping[str, Any]) -> None:
    from tensorboardX.summary import hparams  # pylint: disable=import-outside-toplevel
    flat = flat_config(config)
    for summary in hparams(flat, {"eval/loss": math.nan}):
      self._writer.file_writer.add_summary(summary)
    self._writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```")

  def close(self) -> None:
    self._writer.close()


class _WandbRun:
  """The process's one wandb run, shared by its writers (the single controller has several)."""

  _lock = threading.Lock()
  _current: _WandbRun | None = None

  def __init__(self, run):
    self.run, self.users = run, 0
    self.defined: set[str] = set()
    self.lock = threading.Lock()

  @classmethod
  def acquire(cls, log, workdir: str, config: Mapping[str, Any] | None, role: str) -> _WandbRun:
    with cls._lock:
      if cls._current is None:
        try:
          import wandb  # pylint: disable=import-outside-toplevel
        except ImportError:
          raise ConfigError("log.wandb=True needs the wandb package: pip install "
                            "'diloco[wandb]'") from None
        workdir = os.path.abspath(workdir)
        os.makedirs(workdir, exist_ok=True)
        run = wandb.init(
            project=log.wandb_project, entity=log.wandb_entity or None,
            group=log.wandb_group or os.path.basename(workdir.rstrip("/")), name=role,
            job_type=role, mode=log.wandb_mode, dir=workdir,
            config=dict(config) if config is not None else None, reinit="create_new")
        cls._current = cls(run)
      cls._current.users += 1
      return cls._current

  def release(self) -> None:
    with _WandbRun._lock:
      self.users -= 1
      if self.users == 0:
        self.run.finish()
        _WandbRun._current = None


class WandbTracker:
  """Scalars of one writer in the process's wandb run, each namespace on its own step axis.

  Learners and the syncer log at their own (interleaved, non-monotonic) steps, so keys are
  logged with an explicit `<namespace>/step` axis (`define_metric`) instead of wandb's step.
  """

  def __init__(self, log, workdir: str, role: str, config: Mapping[str, Any] | None = None):
    self._shared = _WandbRun.acquire(log, workdir, config, role)

  def scalars(self, name: str, step: int, values: Mapping[str, float]) -> None:
    prefix = f"{name}/" if name else ""
    step_key = f"{prefix}step" if name else "step"
    row = {f"{prefix}{k}": float(v) for k, v in values.items()}
    shared = self._shared
    with shared.lock:
      for key in row:
        if key not in shared.defined:
          shared.defined.add(key)
          shared.run.define_metric(key, step_metric=step_key)
      shared.run.log(dict(row, **{step_key: int(step)}))

  def hparams(self, config: Mapping[str, Any]) -> None:
    self._shared.run.config.update(dict(config), allow_val_change=True)

  def close(self) -> None:
    self._shared.release()


def check(log) -> None:
  """ConfigErrors for the `log` fields that trackers read: the `log` group's own rules
  (`LogConfig`), rerun for a LogConfig that was built without validation."""
  settings.check_fields("log", log)
  log.check()


def open_trackers(log, workdir: str, name: str, *, role: str,
                  config: Mapping[str, Any] | None = None,
                  purge_step: int | None = None) -> list[Tracker]:
  """The trackers `log` (LogConfig) asks for, for the writer `name` of a process in `role`.

  `config`: the resolved config, logged as hyperparameters (give it to one writer per run).
  """
  check(log)
  trackers: list[Tracker] = []
  if log.tensorboard:
    trackers.append(TensorBoardTracker(workdir, name, purge_step))
  if log.wandb:
    trackers.append(WandbTracker(log, workdir, role, config))
  if config is not None:
    for tracker in trackers:
      try:
        tracker.hparams(config)
      except Exception as e:  # a tracker's hparams quirk never stops a run
        logging.warning("could not log hyperparameters to %s: %r", type(tracker).__name__, e)
  return trackers
