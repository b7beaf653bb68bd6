"""Export of a run's final global parameters, and `train.init_from`.

Every run ends by writing its final global parameters (the syncer's G, or the data-parallel
parameters) to WORKDIR/export:

  export/
    export.json   {"format": "diloco-export/1", "step", "runtime", "model": {ModelConfig},
                   "seed", "data": {"tokenizer", "seq_len"}, "eval/loss", "num_params"}
    params/       an Orbax checkpoint (`orbax.checkpoint.v1.save`) of the parameters as a
                  nested dict, e.g. params["layers"]["0"]["attn"]["q_DNH"]; the same JSON is
                  its custom metadata

`load(path)` reads it back (NumPy arrays, or arrays with the shardings of an abstract target);
`export.json` is written last, so a directory without it is an unfinished export.
`load_init(path, abstract)` is what `train.init_from` uses: an export, a data-parallel or
learner checkpoint (WORKDIR/checkpoints[/STEP]) or a durable run's checkpoint
(WORKDIR/run_checkpoints[/STEP]), shape-checked tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
from absl import logging

from diloco import fragments as fragments_lib
from diloco.errors import ConfigError

PyTree = Any
EXPORT_DIR = "export"
META_FILE = "export.json"
PARAMS_DIR = "params"
FORMAT = "diloco-export/1"


def save(workdir: str, params: PyTree, cfg, *, step: int, runtime: str,
         extra: dict | None = None) -> str:
  """Writes `params` (nested dict of NumPy or jax arrays) to WORKDIR/export; returns its path."""
  from orbax.checkpoint import v1 as ocp_v1  # pylint: disable=import-outside-toplevel
  path = os.path.join(os.path.abspath(workdir), EXPORT_DIR)
  os.makedirs(path, exist_ok=True)
  meta_path = os.path.join(path, META_FILE)
  if os.path.exists(meta_path):
    os.remove(meta_path)  # an export being replaced is incomplete until the new JSON lands
  flat = fragments_lib.flatten_tree(params)
  meta = {"format": FORMAT, "step": int(step), "runtime": runtime,
          "model": dataclasses.asdict(cfg.model), "seed": cfg.seed,
          "data": {"tokenizer": cfg.data.tokenizer, "seq_len": cfg.data.seq_len},
          "num_params": int(sum(np.prod(v.shape) for v in flat.values()))}
  meta.update(extra or {})
  ocp_v1.save(os.path.join(path, PARAMS_DIR), params, overwrite=True, custom_metadata=meta)
  tmp = meta_path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=2)
  os.replace(tmp, meta_path)
  logging.info("exported %d parameters at step %d to %s", meta["num_params"], step, path)
  print(f"exported the final parameters to {path}", flush=True)
  return path


def export_dir(path: str) -> str | None:
  """The export directory `path` names (itself, or WORKDIR/export), else None."""
  for candidate in (path, os.path.join(path, EXPORT_DIR)):
    if os.path.isfile(os.path.join(candidate, META_FILE)):
      return candidate
  return None


def load(path: str, abstract: PyTree | None = None) -> tuple[PyTree, dict]:
  """(params, metadata) of the export at `path` (an export directory or a workdir).

  With `abstract` (ShapeDtypeStructs, with shardings) the parameters are shape-checked and
  loaded onto those shardings; without, they are NumPy arrays.
  """
  from orbax.checkpoint import v1 as ocp_v1  # pylint: disable=import-outside-toplevel
  found = export_dir(path)
  if found is None:
    raise ConfigError(f"{path!r} is not an export: no {META_FILE} there or in "
                      f"{os.path.join(path, EXPORT_DIR)}")
  with open(os.path.join(found, META_FILE), encoding="utf-8") as f:
    meta = json.load(f)
  if meta.get("format") != FORMAT:
    raise ConfigError(f"{found}/{META_FILE}: format {meta.get('format')!r}, expected {FORMAT!r}")
  params_path = os.path.join(found, PARAMS_DIR)
  saved = ocp_v1.metadata(params_path).metadata
  if abstract is not None:
    check_shapes(saved, abstract, f"export {found}")
  # NumPy targets: read on the host whatever devices wrote it (a data-parallel export holds
  # sharded jax.Arrays, whose device layout need not exist here).
  params = ocp_v1.load(params_path, jax.tree.map(lambda m: np.empty(m.shape, m.dtype), saved))
  if abstract is None:
    return params, meta
  targets = fragments_lib.flatten_tree(abstract)
  flat = {k: jax.device_put(np.asarray(v, targets[k].dtype), getattr(targets[k], "sharding", None))
          for k, v in fragments_lib.flatten_tree(params).items()}
  return fragments_lib.unflatten_tree(flat), meta


def check_shapes(loaded: PyTree, abstract: PyTree, source: str) -> None:
  """ConfigError naming the first tensor whose presence or shape differs from the model's."""
  got = {k: tuple(v.shape) for k, v in fragments_lib.flatten_tree(loaded).items()}
  want = {k: tuple(v.shape) for k, v in fragments_lib.flatten_tree(abstract).items()}
  missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
  if missing:
    raise ConfigError(f"train.init_from: {source} has no tensor {missing[0]!r} that this model "
                      f"has ({len(missing)} missing); model.arch or model fields differ")
  if extra:
    raise ConfigError(f"train.init_from: {source} has tensor {extra[0]!r} that this model lacks "
                      f"({len(extra)} extra); model.arch or model fields differ")
  for k in sorted(want, key=fragments_lib.path_sort_key):
    if got[k] != want[k]:
      raise ConfigError(f"train.init_from: tensor {k!r} has shape {got[k]} in {source} but "
                        f"{want[k]} in this model; the model config differs")


def _checkpoint_item(path: str) -> tuple[str, str] | None:
  """(item directory, kind) of an Orbax step directory holding train state or run params."""
  for item, kind in (("state", "train state"), ("params", "run checkpoint")):
    if os.path.isdir(os.path.join(path, item)):
      return os.path.join(path, item), kind
  return None


def _latest_step_dir(manager_dir: str) -> str | None:
  # Orbax writes a step into a tmp directory and renames it to the bare number on commit.
  steps = [int(d) for d in os.listdir(manager_dir) if d.isdigit()]
  return os.path.join(manager_dir, str(max(steps))) if steps else None


def _resolve_checkpoint(path: str) -> tuple[str, str] | None:
  candidates = [path]
  for sub in ("run_checkpoints", "checkpoints"):
    candidates.append(os.path.join(path, sub))
  for candidate in candidates:
    if not os.path.isdir(candidate):
      continue
    item = _checkpoint_item(candidate)
    if item is not None:
      return item
    step_dir = _latest_step_dir(candidate)
    if step_dir is not None and _checkpoint_item(step_dir) is not None:
      return _checkpoint_item(step_dir)
  return None


def load_init(path: str, abstract: PyTree) -> PyTree:
  """NumPy parameters for `train.init_from=path`, checked against `abstract` and cast to its
  dtypes: an export, or the parameters of a train-state or durable-run checkpoint."""
  if not path or not os.path.exists(path):
    raise ConfigError(f"train.init_from: {path!r} does not exist")
  path = os.path.abspath(path)  # Orbax reads a relative checkpoint path's metadata wrongly
  if export_dir(path) is not None:
    params, meta = load(path)
    source = f"export {export_dir(path)} (step {meta.get('step')})"
  else:
    found = _resolve_checkpoint(path)
    if found is None:
      raise ConfigError(f"train.init_from: {path!r} holds no export ({META_FILE}) and no "
                        "committed Orbax checkpoint (checkpoints/ or run_checkpoints/)")
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    item, kind = found
    # As NumPy on the host: the checkpoint's own device layout may not exist here.
    checkpointer = ocp.PyTreeCheckpointer()
    metadata = checkpointer.metadata(item)
    metadata = getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)
    tree = checkpointer.restore(item, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    params = tree["params"] if kind == "train state" else tree
    source = f"{kind} {item}"
  params = jax.tree.map(np.asarray, params)
  check_shapes(params, abstract, source)
  dtypes = {k: v.dtype for k, v in fragments_lib.flatten_tree(abstract).items()}
  flat = {k: np.asarray(v, dtypes[k]) for k, v in fragments_lib.flatten_tree(params).items()}
  logging.info("train.init_from: %d tensors from %s", len(flat), source)
  print(f"initialised from {source}", flush=True)
  return fragments_lib.unflatten_tree(flat)
