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
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from diloco import documents
from diloco import fragments as fragments_lib
from diloco.errors import ConfigError, DocumentError
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
              expect_meta: dict | None = None,
              counts: tuple[str, ...] = ()) -> tuple[PyTree, dict]:
    """Restores `step` into `abstract_state`'s shardings and advances `data_iter` in place.

    The meta is a document read back from disk (`check_meta`: an object holding every key of
    `expect_meta`, each of its kind, and `counts` as whole numbers >= 0); `expect_meta`
    entries must equal the saved ones (e.g. the model config), so a checkpoint of another
    model fails with a readable error, not a shape mismatch. A "model" entry is compared
    without its speed switches (`model.config.layout`). The saved parameters' shapes and
    dtypes are compared with `abstract_state`'s before any array is read, and a restored
    state holding NaN or infinity is refused. Every failure: a DocumentError naming the file.
    """
    file = f"{self.directory}/{step}/meta"
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # noqa: BLE001  (Orbax's errors on a bad file)
      raise DocumentError(file, "", f"is not JSON ({documents.show(str(e), 120)})") from None
    meta = check_meta(meta, file, expect_meta or {}, counts)
    compare_meta(meta, expect_meta or {}, f"{self.directory}/{step}")
    item = os.path.join(self.directory, str(step), "state")
    if isinstance(abstract_state, dict) and "params" in abstract_state:
      check_saved(saved_tree(item).get("params"), abstract_state["params"], f"{item}/params")
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=grain.checkpoint.CheckpointRestore(data_iter)))
    check_finite(restored.state, item)
    return restored.state, meta

  def restore_state(self, step: int, abstract_state: PyTree) -> PyTree:
    """Only the train state of `step` (e.g. a peer's AdamW moments), not its data position."""
    return self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state))).state

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def check_meta(meta: Any, file: str, expect: dict, counts: tuple[str, ...] = ()) -> dict:
  """A checkpoint's meta, typed: an object with every key of `expect` (an object where the
  expected value is one, else of the expected value's kind) and `counts` whole numbers >= 0."""
  meta = documents.obj(meta, file)
  for key, expected in expect.items():
    if key not in meta:
      raise DocumentError(file, key, "is missing")
    kind = dict if isinstance(expected, dict) else type(expected)
    if kind in (dict, list, str, int, float, bool):
      documents.value(meta[key], kind, file, key)
  for key in counts:
    if documents.fields(meta, {key: int}, file)[key] < 0:
      raise DocumentError(file, key, f"must be >= 0, got {meta[key]}")
  return meta


def compare_meta(meta: dict, expect: dict, checkpoint: str) -> None:
  """ConfigError naming the first `expect` entry (a model field: without its speed switches)
  that differs from the checkpoint's: a checkpoint of another model or data."""
  for key, expected in expect.items():
    saved = meta.get(key)
    if key == "model" and isinstance(saved, dict) and isinstance(expected, dict):
      saved, expected = model_config.layout(saved), model_config.layout(expected)
    if saved != expected:
      name = key
      if isinstance(saved, dict) and isinstance(expected, dict):  # name the first field
        field = next(k for k in sorted(set(saved) | set(expected))
                     if saved.get(k) != expected.get(k))
        name, saved, expected = f"{key}.{field}", saved.get(field), expected.get(field)
      raise ConfigError(f"checkpoint {checkpoint} was written with {name}={saved!r}, but "
                        f"this run has {name}={expected!r}; use a fresh --workdir or the "
                        "original config")


def saved_tree(item: str) -> Any:
  """The Orbax metadata tree (shapes and dtypes) of a saved item: read before any array."""
  try:
    metadata = ocp.PyTreeCheckpointer().metadata(item)
  except Exception as e:  # noqa: BLE001  (whatever Orbax makes of a bad folder)
    raise DocumentError(item, "", "is not a readable Orbax checkpoint "
                        f"({type(e).__name__}: {documents.show(str(e), 160)})") from None
  return getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)


def check_saved(saved: Any, abstract: PyTree, file: str) -> None:
  """DocumentError naming the first tensor that `saved` (Orbax metadata) lacks, adds, or holds
  with another shape or dtype than `abstract`; nothing is read."""
  if not isinstance(saved, dict):
    raise DocumentError(file, "", "holds no tree of parameters")
  got = fragments_lib.flatten_tree(saved)
  want = fragments_lib.flatten_tree(abstract)
  for k in sorted(set(got) | set(want)):
    if k not in got or k not in want:
      raise DocumentError(file, k, "is missing" if k not in got else "is not a parameter of "
                          "this model")
    shape, dtype = tuple(getattr(got[k], "shape", ()) or ()), getattr(got[k], "dtype", None)
    if shape != tuple(want[k].shape) or np.dtype(dtype) != np.dtype(want[k].dtype):
      raise DocumentError(file, k, f"is {dtype}{list(shape)}, this model's is "
                          f"{np.dtype(want[k].dtype)}{list(want[k].shape)}")


def check_finite(tree: PyTree, file: str) -> None:
  """DocumentError naming the first floating tensor of `tree` holding NaN or infinity."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and not bool(
        jnp.all(jnp.isfinite(leaf))):
      raise DocumentError(file, jax.tree_util.keystr(path), "values are not finite")
