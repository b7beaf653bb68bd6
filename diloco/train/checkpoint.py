"""Orbax checkpoints of a learner: train state, Grain iterator position and metadata.

Saves are asynchronous (Orbax copies device arrays to host, then writes in the
background), so the training loop does not wait on disk; `close()` waits for the last
save. Each step directory is complete only once Orbax commits it, and
`latest_step()` only sees committed steps.
"""

from __future__ import annotations

import os
from typing import Any

import grain
import orbax.checkpoint as ocp

from diloco.errors import ConfigError
from diloco.model import config as model_config
from diloco.settings import AT_LEAST_ONE, NON_NEGATIVE, frozen, setting

PyTree = Any


@frozen
class CheckpointConfig:
  """When runs save what they need to resume."""
  # Learner train-state checkpoints every this many steps (data-parallel runs, learner
  # processes); 0 disables them.
  every_steps: int = setting(50, NON_NEGATIVE, "0 = off")
  # Single-controller Decoupled DiLoCo: checkpoint the syncer (G, momentum, versions, registry)
  # and the learners' resume points every this many merged rounds, and at the end, so that
  # rerunning the command resumes (diloco/runtime/run_checkpoint.py); 0 disables them.
  every_rounds: int = setting(0, NON_NEGATIVE, "0 = off")
  # Both kinds keep the newest `max_to_keep` checkpoints.
  max_to_keep: int = setting(2, AT_LEAST_ONE)
  # Write checkpoints in the background while training goes on.
  async_save: bool = True


class Checkpointer:
  """A CheckpointManager over `Composite(state, data, meta)`."""

  def __init__(self, directory: str, cfg: CheckpointConfig):
    # A local path or an object-store URL (gs://...): Orbax handles both.
    directory = str(directory)
    self.directory = directory if "://" in directory else os.path.abspath(directory)
    # Step directories are created before `save` returns, not on a background thread: that
    # path registers a process-wide Orbax "contract" of signals that every other Orbax save of
    # the process then waits for, and the multi-process store's own saves (another thread)
    # waited out Orbax's 5-minute timeout on it in a multi-host learner.
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=cfg.max_to_keep, enable_async_checkpointing=cfg.async_save,
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
            create=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: PyTree, data_iter, meta: dict) -> None:
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iter),
        meta=ocp.args.JsonSave(meta)), force=True)

  def restore(self, step: int, abstract_state: PyTree, data_iter,
              expect_meta: dict | None = None) -> tuple[PyTree, dict]:
    """Restores `step` into `abstract_state`'s shardings and advances `data_iter` in place.

    `expect_meta` entries must equal the saved ones (e.g. the model config), so a
    checkpoint of another model fails with a readable error, not a shape mismatch. A "model"
    entry is compared without its speed switches (`model.config.layout`).
    """
    meta = self._manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore())).meta
    for key, expected in (expect_meta or {}).items():
      saved = meta.get(key)
      if key == "model" and isinstance(saved, dict) and isinstance(expected, dict):
        saved, expected = model_config.layout(saved), model_config.layout(expected)
      if saved != expected:
        name = key
        if isinstance(saved, dict) and isinstance(expected, dict):  # name the first field
          field = next(k for k in sorted(set(saved) | set(expected))
                       if saved.get(k) != expected.get(k))
          name, saved, expected = f"{key}.{field}", saved.get(field), expected.get(field)
        raise ConfigError(f"checkpoint {self.directory}/{step} was written with {name}="
                          f"{saved!r}, but this run has {name}={expected!r}; use a "
                          "fresh --workdir or the original config")
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=grain.checkpoint.CheckpointRestore(data_iter)))
    return restored.state, meta

  def restore_state(self, step: int, abstract_state: PyTree) -> PyTree:
    """Only the train state of `step` (e.g. a peer's AdamW moments), not its data position."""
    return self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state))).state

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
