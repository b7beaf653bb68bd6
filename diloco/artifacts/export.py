"""Export of a run's final global parameters, and `train.init_from`.

Every run ends by writing its final global parameters (the syncer's G, or the data-parallel
parameters) to WORKDIR/export, a self-contained folder that can be moved or copied:

  export/
    export.json   {"format": "diloco-export/1", "step", "runtime", "model": {ModelConfig},
                   "seed", "data": {"tokenizer", "tokenizer_source", "seq_len"}, "eval/loss",
                   "num_params"}
    params/       an Orbax checkpoint (`orbax.checkpoint.v1.save`) of the parameters as a
                  nested dict, e.g. params["layers"]["0"]["attn"]["q_DNH"]; the same JSON is
                  its custom metadata
    tokenizer.*   a copy of the run's tokenizer file ("byte" needs none); `data.tokenizer`
                  names it relative to the export folder, `tokenizer_source` says where the
                  run read it
    model.safetensors, config.json   with `safetensors=True` (or `write_safetensors`): the
                  same tensors under their "/"-joined names, and the model's fields, for
                  readers outside JAX

`load(path)` reads it back (NumPy arrays, or arrays with the shardings of an abstract target);
`export.json` is written last, so a directory without it is an unfinished export.
`load_init(path, abstract)` is what `train.init_from` uses: an export, a data-parallel or
learner checkpoint (WORKDIR/checkpoints[/STEP]), a durable run's checkpoint
(WORKDIR/run_checkpoints[/STEP]) or a multi-process run's store (WORKDIR/store, sharded or
not: G from the newest committed version of every fragment), shape-checked tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging

from diloco import documents
from diloco import fragments as fragments_lib
from diloco.documents import Field
from diloco.errors import ConfigError, DocumentError
from diloco.model.config import ModelConfig
from diloco.train import checkpoint as checkpoint_lib
from diloco.train import storage, tokenizers

PyTree = Any
EXPORT_DIR = "export"
META_FILE = "export.json"
PARAMS_DIR = "params"
FORMAT = "diloco-export/1"
# The flag of every command that builds a model from a document that names code to import.
TRUST_FLAG = "--trust_export_code"
SAFETENSORS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
SAFETENSORS_FORMAT = "diloco-safetensors/1"
# Read by a `tokenizer.json` for its special tokens (`diloco.train.tokenizers`): copied along.
_TOKENIZER_COMPANIONS = (tokenizers.TOKENIZER_CONFIG_FILE,)
# Elements the saved parameters may list in all (4x the largest preset, gemma_9b): Orbax
# metadata claiming more is planted, and is refused before anything is allocated.
MAX_ELEMENTS = 4 * 10**10
# What `load` reads of export.json (other keys, e.g. "eval/loss", are the run's record).
_META_FIELDS = {"format": str, "step": int, "model": dict, "data": dict,
                "runtime": Field(str, required=False), "seed": Field(int, required=False),
                "num_params": Field(int, required=False)}
# The model fields that size the parameters: a saved model always states them.
_SIZE_FIELDS = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "mlp_dim")
_DATA_FIELDS = {"tokenizer": Field(str, required=False),
                "tokenizer_source": Field(str, required=False),
                "seq_len": Field(int, required=False)}


# (store path, its number of syncer shards) -> (flat global parameters, {fragment: version}):
# how a runtime that knows the multi-process store lets `train.init_from` name one.
StoreReader = Callable[[str, int], tuple[dict[str, np.ndarray], dict[int, int]]]
# `train.init_from=hf:FOLDER`: the folder's parameters and a description (`hf_import`, which
# reads exports too, so it lies above this module and comes in as this reader).
HF_PREFIX = "hf:"
HfReader = Callable[[str], tuple[PyTree, str]]


def save(workdir: str, params: PyTree, *, model, data, seed: int, step: int, runtime: str,
         extra: dict | None = None, safetensors: bool = False) -> str:
  """Writes `params` (nested dict of NumPy or jax arrays) to WORKDIR/export; returns its path.

  The run's `model` group (ModelConfig) and seed are recorded, and its `data` group's tokenizer
  copied beside the parameters. `safetensors`: also write model.safetensors and config.json
  (`write_safetensors`).
  """
  from orbax.checkpoint import v1 as ocp_v1  # pylint: disable=import-outside-toplevel
  path = os.path.join(os.path.abspath(workdir), EXPORT_DIR)
  refuse_non_finite(fragments_lib.flatten_tree(params), f"export of step {step}")
  os.makedirs(path, exist_ok=True)
  meta_path = os.path.join(path, META_FILE)
  if os.path.exists(meta_path):
    os.remove(meta_path)  # an export being replaced is incomplete until the new JSON lands
  flat = fragments_lib.flatten_tree(params)
  tokenizer, tokenizer_source = _copy_tokenizer(data, path)
  meta = {"format": FORMAT, "step": int(step), "runtime": runtime,
          "model": dataclasses.asdict(model), "seed": seed,
          "data": {"tokenizer": tokenizer, "tokenizer_source": tokenizer_source,
                   "seq_len": data.seq_len},
          "num_params": int(sum(np.prod(v.shape) for v in flat.values()))}
  meta.update(extra or {})
  ocp_v1.save(os.path.join(path, PARAMS_DIR), params, overwrite=True, custom_metadata=meta)
  if safetensors:
    write_safetensors(path, params, meta)
  else:  # a replaced export's copies would no longer match its parameters
    for stale in (SAFETENSORS_FILE, CONFIG_FILE):
      if os.path.exists(os.path.join(path, stale)):
        os.remove(os.path.join(path, stale))
  tmp = meta_path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=2)
  os.replace(tmp, meta_path)
  logging.info("exported %d parameters at step %d to %s", meta["num_params"], step, path)
  print(f"exported the final parameters to {path}", flush=True)
  return path


def refuse_non_finite(flat: dict, what: str) -> None:
  """ConfigError naming the first parameter that holds a NaN or an infinity: a model that
  diverged is neither exported nor trained from (a checkpoint refuses it the same way)."""
  for name, value in flat.items():
    array = np.asarray(value)
    if np.issubdtype(array.dtype, np.inexact) or array.dtype.kind == "V":
      array = array.astype(np.float32)
    if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
      raise ConfigError(f"{what}: parameter {name} holds NaN or Inf; refused (the model "
                        "diverged: resume from a checkpoint with a lower learning rate)")


def _run_tokenizer_file(data_cfg) -> str | None:
  """The tokenizer file a run read (None for the byte tokenizer): `data.tokenizer`, or for
  pre-tokenised shards the `tokenizer_model` their meta.json names."""
  if data_cfg.source == "array_record":
    meta_file = storage.join(data_cfg.path, "meta.json")
    name = documents.fields(documents.obj(storage.read_json(meta_file), meta_file),
                            {"tokenizer_model": Field((str, type(None)), required=False)},
                            meta_file).get("tokenizer_model")
    return storage.join(data_cfg.path, name) if name else None
  if data_cfg.tokenizer == "byte":
    return None
  return tokenizers.resolve(data_cfg.tokenizer)


def _copy_tokenizer(data_cfg, path: str) -> tuple[str, str]:
  """(the name export.json gives the tokenizer, where the run read it): "byte", or the file's
  name after copying it (and a `tokenizer_config.json` beside it) into the export folder.
  A tokenizer that cannot be read any more keeps its original path, with a warning: the
  parameters are worth more than a self-contained folder."""
  try:
    source = _run_tokenizer_file(data_cfg)
    if source is None:
      return "byte", "byte"
    name = os.path.basename(source)
    for src, dst in [(source, name)] + [
        (storage.join(storage.dirname(source), c), c) for c in _TOKENIZER_COMPANIONS]:
      if src != source and not storage.isfile(src):
        continue
      with storage.open_file(src, "rb") as fin, open(os.path.join(path, dst), "wb") as fout:
        shutil.copyfileobj(fin, fout)
    return name, source
  except (OSError, ConfigError, KeyError) as e:
    logging.warning("export: could not copy the tokenizer into %s (%s); export.json names "
                    "it by its original path", path, e)
    return data_cfg.tokenizer, data_cfg.tokenizer


def tokenizer_spec(found: str, meta: dict) -> str:
  """The `data.tokenizer` value that loads the tokenizer of the export at `found`: "byte", the
  copy in the export folder, or (an export written before copies) the path the run used."""
  name = meta["data"].get("tokenizer", "byte")
  if name == "byte":
    return name
  for candidate in (os.path.join(found, name), name):
    if os.path.exists(candidate):
      return candidate
  raise ConfigError(f"{found}/{META_FILE}: tokenizer {name!r} is neither in the export folder "
                    "nor at that path; copy the run's tokenizer file into the export folder")


def write_safetensors(path: str, params: PyTree, meta: dict) -> tuple[str, str]:
  """Writes PATH/model.safetensors (every tensor under its "/"-joined name, e.g.
  "layers/0/attn/q_DNH") and PATH/config.json (the model's fields, the vocabulary and the
  tokenizer file's name), readable without JAX. Returns their paths."""
  from safetensors import numpy as st_numpy  # pylint: disable=import-outside-toplevel
  flat = {k: np.ascontiguousarray(np.asarray(v))
          for k, v in fragments_lib.flatten_tree(params).items()}
  config = {"format": SAFETENSORS_FORMAT, "model": meta["model"],
            "vocab_size": meta["model"]["vocab_size"],
            "tokenizer": meta.get("data", {}).get("tokenizer", "byte"),
            "step": meta.get("step"), "num_params": meta.get("num_params"),
            "tensors": {k: {"shape": list(flat[k].shape), "dtype": str(flat[k].dtype)}
                        for k in sorted(flat, key=fragments_lib.path_sort_key)}}
  tensors_path = os.path.join(path, SAFETENSORS_FILE)
  config_path = os.path.join(path, CONFIG_FILE)
  try:
    st_numpy.save_file(flat, tensors_path, metadata={"format": SAFETENSORS_FORMAT})
  except (TypeError, ValueError) as e:  # e.g. a dtype safetensors has no code for
    raise ConfigError(f"{tensors_path}: cannot write the parameters as safetensors ({e})") from None
  with open(config_path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  os.replace(config_path + ".tmp", config_path)
  return tensors_path, config_path


def export_dir(path: str) -> str | None:
  """The export directory `path` names (itself, or WORKDIR/export), else None."""
  for candidate in (path, os.path.join(path, EXPORT_DIR)):
    if os.path.isfile(os.path.join(candidate, META_FILE)):
      return candidate
  return None


def read_model(fields: dict, file: str) -> ModelConfig:
  """The ModelConfig of a document's `model` object: the fields that size the parameters
  present, every field known and of its type, under the model's own rules (a model training
  would refuse is refused here too)."""
  documents.fields(documents.obj(fields, file, "model"), {k: int for k in _SIZE_FIELDS}, file,
                   prefix="model.")
  return documents.group(ModelConfig, "model", fields, file)


def read_meta(found: str) -> dict:
  """export.json of the export folder `found`, checked: the format, the fields `load` and its
  callers read (of their types) and the model config (`read_model`)."""
  file = os.path.join(found, META_FILE)
  meta = documents.obj(documents.read(file), file)
  if meta.get("format") != FORMAT:
    raise DocumentError(file, "format", f"is {documents.show(meta.get('format'))}, expected "
                        f"{FORMAT!r}")
  documents.fields(meta, _META_FIELDS, file)
  documents.fields(meta["data"], _DATA_FIELDS, file, prefix="data.")
  read_model(meta["model"], file)
  return meta


def refuse_code(cfg: ModelConfig, file: str, trust_code: bool) -> None:
  """DocumentError unless the model of the document `file` names no code (`model.module`, a
  module or .py file that building the model imports, i.e. runs) or the user passed
  `--trust_export_code`: a folder someone else wrote is data, and data does not run code."""
  if cfg.module and not trust_code:
    raise DocumentError(file, "model.module", f"names code to import ({documents.show(cfg.module)}"
                        f"), which building this model runs; pass {TRUST_FLAG} only if you "
                        "trust whoever wrote this file")


def _params_dir(found: str) -> str:
  path = os.path.join(found, PARAMS_DIR)
  if not os.path.isdir(path):
    what = "is not a directory" if os.path.exists(path) else "is missing"
    raise DocumentError(path, "", f"{what}; an export holds its parameters there (an Orbax "
                        "checkpoint)")
  return path


def _saved_shapes(params_path: str) -> PyTree:
  """The Orbax metadata (shapes and dtypes) of the saved parameters: read before any array."""
  from orbax.checkpoint import v1 as ocp_v1  # pylint: disable=import-outside-toplevel
  try:
    return ocp_v1.metadata(params_path).metadata
  except Exception as e:  # pylint: disable=broad-except  (whatever Orbax makes of a bad folder)
    raise DocumentError(params_path, "", "is not a readable Orbax checkpoint "
                        f"({type(e).__name__}: {documents.show(str(e), 160)})") from None


def check_size(cfg: ModelConfig, saved: PyTree, file: str) -> None:
  """DocumentError when the model fields ask for more parameters (or tensors) than the saved
  ones hold, before a model (even an abstract one) is built: e.g. `num_layers: 1000000`
  beside the tensors of two layers. For the transformer, its embedding, and each layer's
  attention, MLP and four tensors at least, give the bound; another architecture is checked
  tensor by tensor once built."""
  flat = fragments_lib.flatten_tree(saved)
  held = sum(math.prod(tuple(v.shape)) for v in flat.values())
  if cfg.arch != "transformer":
    return
  if cfg.num_layers * 4 + 1 > len(flat):
    raise DocumentError(file, "model.num_layers", f"is {cfg.num_layers}, but the saved "
                        f"parameters hold {len(flat)} tensors; the fields were changed after "
                        "the parameters were saved")
  d = cfg.embed_dim
  attention = d * cfg.head_dim * 2 * (cfg.num_heads + cfg.num_kv_heads)
  mlp = (cfg.num_experts * (3 * d * cfg.expert_mlp_dim + d) if cfg.num_experts
         else 3 * d * cfg.mlp_dim)
  least = cfg.vocab_size * d + cfg.num_layers * (attention + mlp)
  if least > held:
    raise DocumentError(file, "model", f"its fields give a model of at least {least} "
                        f"parameters, but the saved tensors hold {held}; the fields were "
                        "changed after the parameters were saved")


def load(path: str, abstract: PyTree | None = None,
         check: Callable[[PyTree], None] | None = None) -> tuple[PyTree, dict]:
  """(params, metadata) of the export at `path` (an export directory or a workdir).

  export.json is checked (`read_meta`) and the model fields against the saved tensors'
  shapes (`check_size`) before any array is read. Nothing here imports the export's
  `model.module`: a caller that builds its model checks `refuse_code` first. With `abstract`
  (ShapeDtypeStructs, with shardings) the parameters are shape-checked and loaded onto those
  shardings; without, they are NumPy arrays.
  """
  from orbax.checkpoint import v1 as ocp_v1  # pylint: disable=import-outside-toplevel
  found = export_dir(os.path.abspath(path))  # Orbax refuses a relative checkpoint path
  if found is None:
    raise ConfigError(f"{path!r} is not an export: no {META_FILE} there or in "
                      f"{os.path.join(path, EXPORT_DIR)}")
  meta = read_meta(found)
  params_path = _params_dir(found)
  saved = _saved_shapes(params_path)
  meta_file = os.path.join(found, META_FILE)
  bound_size(saved, params_path)
  check_size(read_model(meta["model"], meta_file), saved, meta_file)
  if check is not None:
    check(saved)
  if abstract is not None:
    check_shapes(saved, abstract, f"export {found}")
  # NumPy targets: read on the host whatever devices wrote it (a data-parallel export holds
  # sharded jax.Arrays, whose device layout need not exist here).
  try:
    params = ocp_v1.load(params_path,
                         jax.tree.map(lambda m: np.empty(m.shape, m.dtype), saved))
  except Exception as e:  # pylint: disable=broad-except  (a torn or tampered checkpoint)
    raise DocumentError(params_path, "", "cannot be read as the parameters its metadata "
                        f"lists ({type(e).__name__}: {documents.show(str(e), 160)})") from None
  if abstract is None:
    return params, meta
  targets = fragments_lib.flatten_tree(abstract)
  flat = {k: jax.device_put(np.asarray(v, targets[k].dtype), getattr(targets[k], "sharding", None))
          for k, v in fragments_lib.flatten_tree(params).items()}
  return fragments_lib.unflatten_tree(flat), meta


def check_shapes(loaded: PyTree, abstract: PyTree, source: str,
                 what: str = "train.init_from") -> None:
  """ConfigError naming the first tensor whose presence or shape differs from the model's."""
  got = {k: tuple(v.shape) for k, v in fragments_lib.flatten_tree(loaded).items()}
  want = {k: tuple(v.shape) for k, v in fragments_lib.flatten_tree(abstract).items()}
  missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
  if missing:
    raise ConfigError(f"{what}: {source} has no tensor {missing[0]!r} that this model "
                      f"has ({len(missing)} missing); model.arch or model fields differ")
  if extra:
    raise ConfigError(f"{what}: {source} has tensor {extra[0]!r} that this model lacks "
                      f"({len(extra)} extra); model.arch or model fields differ")
  for k in sorted(want, key=fragments_lib.path_sort_key):
    if got[k] != want[k]:
      raise ConfigError(f"{what}: tensor {k!r} has shape {got[k]} in {source} but "
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


def checkpoint_steps(workdir: str) -> dict[str, list[int]]:
  """The committed steps of each checkpoint directory of a run, e.g. {"run_checkpoints": [1]}."""
  found = {}
  for sub in ("run_checkpoints", "checkpoints"):
    directory = os.path.join(workdir, sub)
    if os.path.isdir(directory):
      steps = sorted(int(d) for d in os.listdir(directory) if d.isdigit()
                     and _checkpoint_item(os.path.join(directory, d)) is not None)
      if steps:
        found[sub] = steps
  return found


def store_shards(path: str) -> int:
  """How many syncer shards the multi-process store at `path` has (1: the unsharded layout,
  `merged/` at its root; S: `shards/s0` ... `shards/s{S-1}`, docs/design.md 3.1); 0 if `path`
  is no store. The `merged/` folder, not its `index.json`, marks a store: the commit markers
  in it are the durable record, and the reader of G does without a damaged index."""
  if os.path.isdir(os.path.join(path, "merged")):
    return 1
  count = 0
  while os.path.isdir(os.path.join(path, "shards", f"s{count}", "merged")):
    count += 1
  return count


def read_params(path: str, what: str = "train.init_from",
                read_store: StoreReader | None = None,
                check: Callable[[PyTree], None] | None = None,
                read_hf: HfReader | None = None) -> tuple[PyTree, str]:
  """(NumPy parameters, a description of their source) of an export, of a Hugging Face folder
  (`hf:FOLDER`, read by `read_hf`: `hf_import.read_folder`), of a multi-process run's
  store (G from every syncer shard's newest committed versions, read by `read_store`: the
  store belongs to the multi-process runtime, above this layer), or of a train-state or
  durable-run checkpoint (a step directory, or the newest step under WORKDIR/[run_]checkpoints).
  Errors name the flag or field `what`. `check` sees a checkpoint's or an export's saved
  shapes (Orbax metadata) before any array is read."""
  if (path or "").startswith(HF_PREFIX):  # a Hugging Face folder: `hf_import`, above export
    if read_hf is None:
      raise ConfigError(f"{what}: {path!r} is a Hugging Face folder; give an export or a "
                        "checkpoint here")
    return read_hf(path[len(HF_PREFIX):])
  if not path or not os.path.exists(path):
    raise ConfigError(f"{what}: {path!r} does not exist")
  path = os.path.abspath(path)  # Orbax reads a relative checkpoint path's metadata wrongly
  shards = store_shards(path)
  if shards:  # a multi-process run's store: G assembled from every shard's newest versions
    if read_store is None:
      raise ConfigError(f"{what}: {path!r} is a multi-process run's store; give an export or "
                        "a checkpoint here")
    flat, index = read_store(path, shards)
    versions = ", ".join(f"{p}:v{v}" for p, v in sorted(index.items()))
    return (fragments_lib.unflatten_tree(flat),
            f"store {path} ({shards} syncer shard(s); fragment versions {versions})")
  if export_dir(path) is not None:
    params, meta = load(path, check=check)
    return params, f"export {export_dir(path)} (step {meta.get('step')})"
  found = _resolve_checkpoint(path)
  if found is None:
    raise ConfigError(f"{what}: {path!r} holds no export ({META_FILE}) and no "
                      "committed Orbax checkpoint (checkpoints/ or run_checkpoints/)")
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  item, kind = found
  # As NumPy on the host: the checkpoint's own device layout may not exist here.
  metadata = checkpoint_lib.saved_tree(item)
  saved = metadata.get("params") if kind == "train state" and isinstance(metadata, dict) else (
      metadata)
  where = f"{item}/params" if kind == "train state" else item
  if not isinstance(saved, dict):
    raise DocumentError(where, "", "holds no tree of parameters")
  bound_size(saved, where)
  if check is not None:
    check(saved)  # the caller's shapes, before any array is read
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)
  try:
    tree = ocp.PyTreeCheckpointer().restore(
        item, args=ocp.args.PyTreeRestore(restore_args=restore_args))
  except Exception as e:  # noqa: BLE001  (a torn or tampered checkpoint)
    raise DocumentError(item, "", "cannot be read as the arrays its metadata lists "
                        f"({type(e).__name__}: {documents.show(str(e), 160)})") from None
  params = jax.tree.map(np.asarray, tree["params"] if kind == "train state" else tree)
  checkpoint_lib.check_finite(params, where)
  return params, f"{kind} {item}"


def bound_size(saved: PyTree, file: str) -> None:
  """DocumentError when the Orbax metadata of saved parameters lists more than `MAX_ELEMENTS`
  elements (a planted metadata claiming a huge array), before anything is allocated."""
  total = 0
  for k, v in fragments_lib.flatten_tree(saved).items():
    shape = getattr(v, "shape", None)
    if not (isinstance(shape, tuple) and all(isinstance(d, int) and d >= 0 for d in shape)):
      raise DocumentError(file, k, f"has no shape in its metadata ({documents.show(v)})")
    total += math.prod(shape)
    if total > MAX_ELEMENTS:
      raise DocumentError(file, k, f"the saved parameters list more than {MAX_ELEMENTS} "
                          "elements; not parameters of a model diloco builds")


def load_init(path: str, abstract: PyTree, read_store: StoreReader | None = None,
              read_hf: HfReader | None = None) -> PyTree:
  """NumPy parameters for `train.init_from=path`, checked against `abstract` and cast to its
  dtypes: an export, a multi-process run's store (through `read_store`), a Hugging Face
  folder (`hf:FOLDER`, through `read_hf`), or the parameters of a train-state or durable-run
  checkpoint."""
  params, source = read_params(
      path, read_store=read_store, check=lambda saved: check_shapes(saved, abstract, path),
      read_hf=read_hf)
  check_shapes(params, abstract, source)
  dtypes = {k: v.dtype for k, v in fragments_lib.flatten_tree(abstract).items()}
  flat = {k: np.asarray(v, dtypes[k]) for k, v in fragments_lib.flatten_tree(params).items()}
  refuse_non_finite(flat, f"train.init_from={path!r}")
  logging.info("train.init_from: %d tensors from %s", len(flat), source)
  print(f"initialised from {source}", flush=True)
  return fragments_lib.unflatten_tree(flat)
