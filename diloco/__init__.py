"""Decoupled DiLoCo in JAX: asynchronous, fault-tolerant, low-bandwidth LM pre-training.

The public API is `diloco.NAME` for the names of `diloco.api.__all__` (config groups,
`load_config`, `run`, `Hook`, `load_model`, `export_hf`, `evaluate_tasks`), resolved on first use so
that `import diloco` imports nothing heavy (docs/reference.md, "The public API").
"""

import importlib

_PUBLIC = frozenset((
    "Config", "ModelConfig", "DataConfig", "MeshConfig", "OptimConfig", "TrainConfig",
    "CheckpointConfig", "LogConfig", "SyncConfig", "ReceiptConfig", "OuterConfig",
    "LearnersConfig",
    "StoreConfig", "LaunchConfig", "SlurmConfig", "base_config", "load_config_dict",
    "load_config", "ALL_LEARNERS", "ConfigError",
    "run", "Hook", "HookView", "STOP", "load_model", "export_hf", "evaluate_tasks"))
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
  if name in _PUBLIC:
    return getattr(importlib.import_module("diloco.api"), name)
  raise AttributeError(f"module 'diloco' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | _PUBLIC)
