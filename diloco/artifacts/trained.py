"""A run's trained model, ready to use: parameters, model config and tokenizer in one place.

`load(workdir)` reads the run's final export (WORKDIR/export, or an export folder itself);
`load(workdir, step=N)` reads checkpoint N of the run instead (WORKDIR/run_checkpoints/N of a
Decoupled DiLoCo run, else WORKDIR/checkpoints/N of a data-parallel one), with the model and
tokenizer of WORKDIR/config.json. Used by `diloco.cli.sample` and `diloco.cli.evaluate`;
every failure is a one-line ConfigError naming the flag, or a
DocumentError naming the file and the field. Every document is checked, and its model fields
against the saved tensors, before a model is built; a model that names code to import
(`model.module`) is built only with `trust_code` (`--trust_export_code`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from flax import nnx

from diloco import documents
from diloco import fragments as fragments_lib
from diloco.artifacts import export
from diloco.documents import Field
from diloco.errors import ConfigError
from diloco.model.config import ModelConfig
from diloco.train import tokenizers
from diloco.train.data import DataConfig

RUN_CONFIG = "config.json"


@dataclasses.dataclass
class Trained:
  """What `load` returns. `params`: nested dict of NumPy arrays (int keys for layers)."""
  model: nnx.Module
  cfg: ModelConfig
  params: dict
  tokenizer: Any
  tokenizer_spec: str
  source: str
  meta: dict  # export.json, or the run's config.json for a checkpoint


def model_config(fields: dict, where: str) -> ModelConfig:
  """The ModelConfig of saved fields (checked as `export.read_model` does), for inference: no
  remat, and an attention that every backend has (the parameters do not depend on either)."""
  cfg = export.read_model(fields, where)
  # cuDNN exists only on GPUs, splash runs only in Pallas' (slow) interpreter off TPU: "auto"
  # picks either where it runs.
  impl = "auto" if cfg.attention_impl in ("cudnn", "splash") else cfg.attention_impl
  return dataclasses.replace(cfg, remat="none", attention_impl=impl)


@dataclasses.dataclass(frozen=True)
class RunDocument:
  """What a run's config.json says about its model and data (the groups a trained model needs;
  the others are the training's, checked by `diloco.config.run_config.read_file`)."""
  model: ModelConfig
  data: DataConfig
  raw: dict


def read_run_config(path: str) -> RunDocument:
  """A run's config.json: an object whose `model` and `data` groups (`data` may be absent: the
  defaults) hold fields of their types under the config's rules (not the data rules that look
  at `data.path`: a run's data may have moved since)."""
  doc = documents.obj(documents.read(path), path)
  documents.fields(doc, {"model": dict, "data": Field(dict, required=False)}, path)
  model = export.read_model(doc["model"], path)
  data = documents.group(DataConfig, "data", doc.get("data", {}), path, across=False)
  return RunDocument(model, data, doc)


def _no_export_message(workdir: str) -> str:
  steps = export.checkpoint_steps(workdir)
  if not steps:
    return (f"--workdir: {workdir!r} holds no export ({export.EXPORT_DIR}/{export.META_FILE}) "
            "and no checkpoint; is it a run's workdir, and did the run finish?")
  listed = "; ".join(f"{sub}/ steps {s}" for sub, s in steps.items())
  return (f"--workdir: {workdir!r} holds no export ({export.EXPORT_DIR}/{export.META_FILE}: "
          f"the run has not finished); pass --step=N to use a checkpoint ({listed})")


def _checkpoint_dir(workdir: str, step: int) -> str:
  steps = export.checkpoint_steps(workdir)
  for sub, found in steps.items():
    if step in found:
      return os.path.join(workdir, sub, str(step))
  listed = "; ".join(f"{sub}/ steps {s}" for sub, s in steps.items()) or "none"
  raise ConfigError(f"--step: {workdir!r} has no checkpoint {step} (checkpoints: {listed})")


def _tokenizer_from_run(workdir: str, data: DataConfig) -> str:
  if data.source == "array_record":
    shards = os.path.join(data.path, "meta.json")
    shard_meta = documents.obj(documents.read(shards), shards)
    name = documents.fields(shard_meta, {"tokenizer_model": Field((str, type(None)), False)},
                            shards).get("tokenizer_model")
    return os.path.join(data.path, name) if name else "byte"
  spec = data.tokenizer
  if spec == "byte" or os.path.exists(spec):
    return spec
  beside = os.path.join(workdir, spec)
  if os.path.exists(beside):
    return beside
  raise ConfigError(f"--step: the run's tokenizer {spec!r} (config.json data.tokenizer) does "
                    "not exist from here; run from the directory the run ran in")


def load(workdir: str, step: int | None = None, *, trust_code: bool = False) -> Trained:
  """The model of the export in `workdir` (or of its checkpoint `step`), built on the host.
  `trust_code`: build a model whose config names code to import (`model.module`)."""
  if not workdir:
    raise ConfigError("--workdir is required: a run's workdir or an export folder")
  if not os.path.isdir(workdir):
    raise ConfigError(f"--workdir: {workdir!r} is not a directory")
  workdir = os.path.abspath(workdir)
  if step is None:
    found = export.export_dir(workdir)
    if found is None:
      raise ConfigError(_no_export_message(workdir))
    meta_file = os.path.join(found, export.META_FILE)
    export.refuse_code(export.read_model(export.read_meta(found)["model"], meta_file),
                       meta_file, trust_code)
    params, meta = export.load(found)
    cfg = model_config(meta["model"], meta_file)
    spec = export.tokenizer_spec(found, meta)
    source = f"export {found} (step {meta.get('step')})"
  else:
    if step < 0:
      raise ConfigError(f"--step: must be >= 0, got {step}")
    config_path = os.path.join(workdir, RUN_CONFIG)
    if not os.path.isfile(config_path):
      raise ConfigError(f"--step: {workdir!r} has no config.json (a checkpoint needs the run's "
                        "model config)")
    run = read_run_config(config_path)
    export.refuse_code(run.model, config_path, trust_code)
    meta = run.raw
    cfg = model_config(meta["model"], config_path)
    params, source = export.read_params(
        _checkpoint_dir(workdir, step), "--step",
        check=lambda saved: export.check_size(cfg, saved, config_path))
    export.check_size(cfg, params, config_path)
    spec = _tokenizer_from_run(workdir, run.data)
  return Trained(build(cfg, params, source), cfg, params, tokenizers.make(spec), spec, source,
                 meta)


def build(cfg: ModelConfig, params: dict, source: str) -> nnx.Module:
  """The model of `cfg` holding `params` (shape-checked against the model's own)."""
  from diloco.train import state  # pylint: disable=import-outside-toplevel
  graphdef, abstract = state.abstract_params(cfg)
  export.check_shapes(params, nnx.to_pure_dict(abstract), source, what="--workdir")
  flat = fragments_lib.flatten_tree(params)
  return nnx.merge(graphdef, fragments_lib.unflatten_tree(flat))
