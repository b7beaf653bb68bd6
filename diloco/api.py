"""The public API: what a user's config file and script need, named by `import diloco`.

`diloco.NAME` resolves to these names (and the config groups) on first use, so importing the
package stays cheap and internal modules may move without breaking a user's code; the names
are pinned by `tests/api_test.py` and listed in docs/reference.md ("The public API").

    import diloco
    cfg = diloco.load_config("configs/decoupled.py:tiny", {"train.steps": 32})
    diloco.run(cfg, "runs/mine")
    diloco.export_hf("runs/mine")           # runs/mine/hf, for transformers
    model = diloco.load_model("runs/mine")  # the trained model, on this host
"""

from __future__ import annotations

from typing import Any

from diloco.config import run_config
from diloco.config.run_config import (
  ALL_LEARNERS,
  Config,
  LaunchConfig,
  LearnersConfig,
  StoreConfig,
  TrainConfig,
  base_config,
)
from diloco.config.slurm_config import SlurmConfig
from diloco.errors import ConfigError
from diloco.learner.receipt import ReceiptConfig
from diloco.model.config import ModelConfig
from diloco.observe.hooks import STOP, Hook, HookView
from diloco.observe.tracking import LogConfig
from diloco.outer.merge import OuterConfig
from diloco.sync.policy import SyncConfig
from diloco.train.checkpoint import CheckpointConfig
from diloco.train.data import DataConfig
from diloco.train.mesh import MeshConfig
from diloco.train.optim import OptimConfig

__all__ = [
    # The configuration: its groups, a config file's starting point, loading one.
    "Config", "ModelConfig", "DataConfig", "MeshConfig", "OptimConfig", "TrainConfig",
    "CheckpointConfig", "LogConfig", "SyncConfig", "ReceiptConfig", "OuterConfig", "LearnersConfig",
    "StoreConfig", "LaunchConfig", "SlurmConfig", "base_config", "load_config_dict",
    "load_config", "ALL_LEARNERS", "ConfigError",
    # Training, a researcher's hooks into it, and what a run leaves.
    "run", "Hook", "HookView", "STOP", "load_model", "export_hf", "evaluate_tasks",
]


def load_config_dict(spec: str):
  """The ConfigDict of a config file and preset, before validation: what a config file that
  builds on another one starts from (configs/diloco.py starts from configs/decoupled.py)."""
  return run_config.load(spec)


def load_config(spec: str, overrides: dict[str, Any] | None = None) -> Config:
  """The validated Config of a config file and preset (`configs/decoupled.py:tiny`, or a
  shipped name such as `decoupled:tiny`), with `overrides` as dotted fields
  (`{"train.steps": 32}`), as `--config.train.steps=32` would set them."""
  raw = run_config.load(spec)
  for dotted, value in (overrides or {}).items():
    group, _, field = dotted.partition(".")
    if group not in run_config.GROUPS or field not in raw[group]:
      raise ConfigError(f"unknown field {dotted!r}; fields are GROUP.FIELD of "
                        f"{sorted(run_config.GROUPS)}")
    try:
      raw[group][field] = value
    except (TypeError, ValueError) as e:  # ConfigDict keeps each field's type
      raise ConfigError(f"{dotted}: {e}") from None
  return run_config.from_config_dict(raw)


def run(cfg: Config, workdir: str, hooks=()) -> dict[str, float]:
  """Trains `cfg` in `workdir` in this process, as `python -m diloco.main` does (Decoupled
  DiLoCo when `learners.count` >= 1, else data-parallel); resumes a workdir that holds a
  checkpoint. `hooks`: `Hook`s run every N learner steps or syncer rounds (data-parallel has
  learner hooks only), besides those of `log.hooks`. Returns the final evaluation (and accounting) metrics."""
  from diloco.runtime import data_parallel, decoupled  # pylint: disable=import-outside-toplevel
  return (decoupled.run if cfg.learners.count else data_parallel.run)(cfg, workdir, hooks)


def load_model(path: str, step: int | None = None, *, trust_code: bool = False):
  """The trained model of a run's workdir or export folder (`step`: a checkpoint's instead),
  with its config and tokenizer: `diloco.artifacts.trained.Trained`."""
  from diloco.artifacts import trained  # pylint: disable=import-outside-toplevel
  return trained.load(path, step, trust_code=trust_code)


def export_hf(workdir: str, out: str | None = None, *, overwrite: bool = False) -> str:
  """Writes the run's export as a Hugging Face Gemma 3 folder (`diloco export --format=hf`;
  default `WORKDIR/hf`); returns the folder."""
  import os  # pylint: disable=import-outside-toplevel

  from diloco.artifacts import export, hf_format  # pylint: disable=import-outside-toplevel
  found = export.export_dir(os.path.abspath(workdir))
  if found is None:
    raise ConfigError(f"workdir: {workdir!r} holds no export ({export.EXPORT_DIR}/"
                      f"{export.META_FILE})")
  out = out or hf_format.default_out(found)
  hf_format.write(found, out, overwrite=overwrite)
  return out


def evaluate_tasks(workdir: str, tasks: str, *, include_path: str | None = None,
                   num_fewshot: int | None = None, limit: float | None = None,
                   batch_size: int = 8) -> dict:
  """Scores the run's model on lm-evaluation-harness tasks (`diloco evaluate --tasks`),
  writes WORKDIR/benchmarks/results.json and returns lm_eval's results."""
  from diloco.cli import benchmarks  # pylint: disable=import-outside-toplevel
  results, _ = benchmarks.evaluate(load_model(workdir), workdir, tasks=tasks,
                                   include_path=include_path, num_fewshot=num_fewshot,
                                   limit=limit, batch_size=batch_size, max_length=None)
  return results
