"""A Hugging Face transformers folder as a run's start: `train.init_from=hf:FOLDER`.

The inverse of `hf_format`: a Gemma 3 causal LM (`Gemma3ForCausalLM`, model type
`gemma3_text`) as `save_pretrained` writes it — config.json, model.safetensors or its shards
with model.safetensors.index.json, and a tokenizer — becomes this project's model config
(`model_config`), its parameters (`read_params`) and its tokenizer (`tokenizer_of`). Only what
maps exactly is taken: every feature of the folder's config that this transformer lacks is
listed in one refusal (`differences`), and so is an architecture other than Gemma 3's. The
weights are read by a reader of the safetensors format written here (NumPy's safetensors
backend has no bfloat16), which checks the header's dtypes, shapes and offsets against the file
before it reads a byte of data.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct

import ml_dtypes
import numpy as np

from diloco import documents
from diloco import fragments as fragments_lib
from diloco.artifacts import export, hf_format
from diloco.errors import ConfigError, DocumentError
from diloco.model.config import ModelConfig
from diloco.settings import check_fields

PREFIX = export.HF_PREFIX
CONFIG_FILE = "config.json"
# The transformers architectures this project's transformer is exactly (architecture: model
# type); every other one is refused, naming these.
ARCHITECTURES = {hf_format.ARCHITECTURE: hf_format.MODEL_TYPE}
# safetensors dtypes a parameter may have, as NumPy dtypes.
_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
           "F16": np.dtype(np.float16)}
# A safetensors header is a few kilobytes per tensor; anything near this is not a model's.
_MAX_HEADER_BYTES = 100 << 20
# Per-layer HF tensor -> (this project's name, how the torch Linear (out, in) weight becomes
# this project's array): the inverse of `hf_format.LAYER_TENSORS`.
_LAYER_TENSORS = {hf: (ours, kind) for ours, (hf, kind) in hf_format.LAYER_TENSORS.items()}


def folder_of(init_from: str) -> str | None:
  """The folder `train.init_from` names with the `hf:` prefix, None for any other source."""
  return init_from[len(PREFIX):] if init_from.startswith(PREFIX) else None


def _config_doc(folder: str) -> tuple[dict, str]:
  path = os.path.join(folder, CONFIG_FILE)
  if not os.path.isdir(folder):
    raise ConfigError(f"train.init_from: {PREFIX}{folder!r}: no such folder")
  if not os.path.isfile(path):
    raise ConfigError(f"train.init_from: {PREFIX}{folder!r} has no {CONFIG_FILE}; is it a "
                      "Hugging Face model folder (save_pretrained)?")
  return documents.obj(documents.read(path), path), path


def _rope_bases(doc: dict, file: str) -> tuple[float, float, list[str]]:
  """(local base, global base, what does not map) from transformers 5's `rope_parameters`
  per layer type, or 4's `rope_theta` / `rope_local_base_freq` / `rope_scaling`."""
  problems = []
  params = doc.get("rope_parameters")
  if isinstance(params, dict) and {"sliding_attention", "full_attention"} <= set(params):
    bases = []
    for kind in ("sliding_attention", "full_attention"):
      entry = documents.obj(params[kind], file, f"rope_parameters.{kind}")
      rope_type = entry.get("rope_type", "default")
      if rope_type != "default":
        problems.append(f"rope_parameters.{kind}.rope_type={rope_type!r} (only plain RoPE maps)")
      bases.append(documents.value(entry.get("rope_theta"), float, file,
                                   f"rope_parameters.{kind}.rope_theta"))
    return bases[0], bases[1], problems
  scaling = doc.get("rope_scaling")
  if scaling not in (None, {}) and not (isinstance(scaling, dict)
                                        and scaling.get("rope_type", "default") == "default"):
    problems.append(f"rope_scaling={documents.show(scaling)} (only plain RoPE maps)")
  local = documents.value(doc.get("rope_local_base_freq", 10_000.0), float, file,
                          "rope_local_base_freq")
  return local, documents.value(doc.get("rope_theta", 1_000_000.0), float, file,
                                "rope_theta"), problems


def attention_pattern(layer_types: list[str]) -> str:
  """The shortest L/G pattern whose cyclic repetition gives `layer_types` (this project's
  `model.attention_pattern`)."""
  letters = ["L" if t == "sliding_attention" else "G" for t in layer_types]
  for period in range(1, len(letters) + 1):
    if all(letters[i] == letters[i % period] for i in range(len(letters))):
      return "".join(letters[:period])
  return "".join(letters)


def differences(doc: dict, file: str) -> list[str]:
  """Every feature of a Gemma 3 config.json that this transformer has no exact counterpart
  for (empty: the folder maps exactly)."""
  out = []
  expected = {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
              "attn_logit_softcapping": None, "use_bidirectional_attention": False,
              "tie_word_embeddings": True}
  for key, want in expected.items():
    if key in doc and doc[key] != want:
      out.append(f"{key}={documents.show(doc[key])} (this transformer has {want!r})")
  eps = doc.get("rms_norm_eps", 1e-6)
  if not isinstance(eps, (int, float)) or isinstance(eps, bool) or abs(eps - 1e-6) > 1e-12:
    out.append(f"rms_norm_eps={documents.show(eps)} (this transformer's RMSNorm has 1e-6)")
  head_dim = doc.get("head_dim")
  if isinstance(head_dim, int) and head_dim % 2:
    out.append(f"head_dim={head_dim} is odd (RoPE rotates two equal halves)")
  out += _rope_bases(doc, file)[2]
  return out


def model_config(folder: str, base: ModelConfig) -> ModelConfig:
  """The model config.json of `folder` describes: its shape from the folder, its speed
  switches (dtype, remat, attention_impl, ...) and parameter dtype from `base`; ConfigError
  naming the file and field for anything that does not map."""
  doc, file = _config_doc(folder)
  architectures = doc.get("architectures") or []
  model_type = doc.get("model_type")
  known = ", ".join(f"{a} ({t})" for a, t in ARCHITECTURES.items())
  if (not isinstance(architectures, list) or len(architectures) != 1
      or ARCHITECTURES.get(architectures[0]) != model_type):
    raise DocumentError(file, "architectures", f"{documents.show(architectures)} with model_type "
                        f"{documents.show(model_type)}: only {known} maps onto this transformer")
  found = differences(doc, file)
  if found:
    raise DocumentError(file, "", "has no exact counterpart in this transformer, so it is not "
                        f"imported: {'; '.join(found)}")
  spec = {"vocab_size": int, "hidden_size": int, "intermediate_size": int,
          "num_hidden_layers": int, "num_attention_heads": int, "num_key_value_heads": int,
          "head_dim": int, "sliding_window": documents.Field((int, type(None)), required=False),
          "query_pre_attn_scalar": documents.Field(float, required=False),
          "final_logit_softcapping": documents.Field((float, type(None)), required=False),
          "layer_types": documents.Field(list, required=False)}
  got = documents.fields(doc, spec, file)
  layers = got["num_hidden_layers"]
  types = got.get("layer_types")
  if types is None:  # transformers 4: every `sliding_window_pattern`-th layer is global
    pattern_every = documents.value(doc.get("sliding_window_pattern", 6), int, file,
                                    "sliding_window_pattern")
    types = ["full_attention" if (i + 1) % max(pattern_every, 1) == 0 else
             "sliding_attention" for i in range(layers)]
  if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
    raise DocumentError(file, "layer_types", f"must list {layers} of 'sliding_attention' and "
                        f"'full_attention', got {documents.show(types)}")
  local, global_, _ = _rope_bases(doc, file)
  pattern = attention_pattern(types)
  fields = dict(
      vocab_size=got["vocab_size"], embed_dim=got["hidden_size"],
      mlp_dim=got["intermediate_size"], num_layers=layers,
      num_heads=got["num_attention_heads"], num_kv_heads=got["num_key_value_heads"],
      head_dim=got["head_dim"], attention_pattern=pattern,
      sliding_window=got.get("sliding_window") or base.sliding_window,
      rope_base_local=local, rope_base_global=global_, qk_norm=True,
      query_pre_attn_scalar=float(got.get("query_pre_attn_scalar") or 0.0),
      final_logit_softcap=float(got.get("final_logit_softcapping") or 0.0),
      num_experts=0, arch="transformer", module="",
      name=os.path.basename(os.path.normpath(folder)) or "custom",
      # Scanning goes over whole patterns: a depth the pattern does not divide is unrolled.
      scan_layers=base.scan_layers and layers % len(pattern) == 0)
  cfg = dataclasses.replace(base, **fields)
  try:
    check_fields("model", cfg)
    cfg.check()
  except ConfigError as e:
    raise DocumentError(file, "", f"describes a model this transformer refuses: {e}") from None
  return cfg


def tokenizer_of(folder: str) -> str | None:
  """`data.tokenizer` for the folder's tokenizer: "byte" when it is the byte tokenizer an
  export writes (`hf_format.byte_tokenizer_json`), the folder when it holds a tokenizer.json
  or tokenizer.model, None when it has none."""
  path = os.path.join(folder, hf_format.TOKENIZER_FILE)
  if os.path.isfile(path):
    try:
      with open(path, encoding="utf-8") as f:
        if json.load(f) == json.loads(hf_format.byte_tokenizer_json()):
          return "byte"
    except (OSError, ValueError, RecursionError):
      pass  # the tokenizer loader reports what is wrong with it, naming the file
    return folder
  return folder if os.path.isfile(os.path.join(folder, "tokenizer.model")) else None


def _weight_files(folder: str) -> list[str]:
  """The safetensors files of `folder`: the index's shards, or model.safetensors."""
  index = os.path.join(folder, hf_format.INDEX_FILE)
  if os.path.isfile(index):
    doc = documents.obj(documents.read(index), index)
    weight_map = documents.obj(doc.get("weight_map"), index, "weight_map")
    names = sorted(set(weight_map.values()))
    for name in names:
      if not isinstance(name, str) or os.path.basename(name) != name or not name.endswith(
          ".safetensors"):
        raise DocumentError(index, "weight_map", f"names {documents.show(name)}, not a "
                            ".safetensors file in the folder")
    return [os.path.join(folder, n) for n in names]
  single = os.path.join(folder, hf_format.WEIGHTS_FILE)
  if not os.path.isfile(single):
    raise ConfigError(f"train.init_from: {PREFIX}{folder!r} has neither "
                      f"{hf_format.WEIGHTS_FILE} nor {hf_format.INDEX_FILE}")
  return [single]


def read_safetensors(path: str, budget: int) -> dict[str, np.ndarray]:
  """The tensors of one safetensors file (as NumPy, bfloat16 through ml_dtypes); the header's
  dtypes, shapes and offsets are checked against the file and `budget` (elements left)
  before any data is read. DocumentError naming the file and tensor otherwise."""
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      head = f.read(8)
      (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
      if length is None or length > min(_MAX_HEADER_BYTES, size - 8):
        raise DocumentError(path, "", "is not a safetensors file (its header length does not "
                            "fit the file)")
      header = documents.obj(documents.parse(f.read(length), path), path)
      data_start = 8 + length
      out = {}
      for name, entry in header.items():
        if name == "__metadata__":
          continue
        entry = documents.obj(entry, path, name)
        dtype = _DTYPES.get(entry.get("dtype"))
        if dtype is None:
          raise DocumentError(path, name, f"has dtype {documents.show(entry.get('dtype'))}; "
                              f"parameters are one of {sorted(_DTYPES)}")
        shape = entry.get("shape")
        offsets = entry.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool)
                                                and d >= 0 for d in shape)):
          raise DocumentError(path, name, f"has shape {documents.show(shape)}")
        count = math.prod(shape)
        budget -= count
        if budget < 0:
          raise DocumentError(path, name, "the weights hold more elements than a model diloco "
                              "builds")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= size - data_start
                and offsets[1] - offsets[0] == count * dtype.itemsize):
          raise DocumentError(path, name, f"has data offsets {documents.show(offsets)} that do "
                              f"not fit its shape {shape} and the file")
        f.seek(data_start + offsets[0])
        out[name] = np.frombuffer(f.read(count * dtype.itemsize), dtype).reshape(shape)
      return out
  except OSError as e:
    raise DocumentError(path, "", f"cannot be read ({e.strerror or e})") from None


def read_params(folder: str, cfg: ModelConfig) -> tuple[dict, str]:
  """(this project's parameter tree, a description) of the folder's weights for `cfg`
  (`model_config` of the folder); DocumentError naming a missing, extra or misshapen tensor."""
  files = _weight_files(folder)
  tensors: dict[str, np.ndarray] = {}
  where: dict[str, str] = {}
  budget = export.MAX_ELEMENTS
  for path in files:
    found = read_safetensors(path, budget)
    budget -= sum(t.size for t in found.values())
    for name, t in found.items():
      if name in tensors:
        raise DocumentError(path, name, f"is also in {where[name]}")
      tensors[name], where[name] = t, path
  file = files[0] if len(files) == 1 else os.path.join(folder, hf_format.INDEX_FILE)
  expected = _expected_shapes(cfg)
  if "lm_head.weight" in tensors:  # a tied head saved anyway: it must be the embedding
    head = tensors.pop("lm_head.weight")
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None or head.shape != embed.shape or not np.array_equal(head, embed):
      raise DocumentError(file, "lm_head.weight", "differs from model.embed_tokens.weight; "
                          "this transformer's head is the tied embedding")
  flat = {}
  for hf_name, (ours, kind, shape) in expected.items():
    if hf_name not in tensors:
      raise DocumentError(file, hf_name, f"is missing (the config's model needs {len(expected)} "
                          "tensors)")
    array = tensors.pop(hf_name)
    if array.shape != shape:
      raise DocumentError(where[hf_name], hf_name, f"has shape {list(array.shape)}; the "
                          f"config's model needs {list(shape)}")
    flat[ours] = _ours(array, kind, ours, cfg)
  if tensors:
    raise DocumentError(where[min(tensors)], min(tensors), "has no counterpart in this "
                        f"transformer ({len(tensors)} such tensors)")
  return fragments_lib.unflatten_tree(flat), f"Hugging Face folder {folder}"


def read_folder(folder: str) -> tuple[dict, str]:
  """`read_params` for the model the folder describes (`export.HfReader`: its shapes are the
  folder's own, as the run's model is: `run_config.with_hf_start`)."""
  return read_params(folder, model_config(folder, ModelConfig()))


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[str, str, tuple[int, ...]]]:
  """HF name -> (this project's name, conversion, the HF tensor's shape) for `cfg`."""
  d, n, k, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  shapes = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
            "pre_feedforward_layernorm.weight": (d,), "post_feedforward_layernorm.weight": (d,),
            "self_attn.q_norm.weight": (h,), "self_attn.k_norm.weight": (h,),
            "self_attn.q_proj.weight": (n * h, d), "self_attn.k_proj.weight": (k * h, d),
            "self_attn.v_proj.weight": (k * h, d), "self_attn.o_proj.weight": (d, n * h),
            "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
            "mlp.down_proj.weight": (d, f)}
  out = {"model.embed_tokens.weight": ("embedder/embedding", "same", (cfg.vocab_size, d)),
         "model.norm.weight": ("final_norm/scale", "same", (d,))}
  for i in range(cfg.num_layers):
    for hf_name, (ours, kind) in _LAYER_TENSORS.items():
      out[f"model.layers.{i}.{hf_name}"] = (f"layers/{i}/{ours}", kind, shapes[hf_name])
  return out


def _ours(array: np.ndarray, kind: str, name: str, cfg: ModelConfig) -> np.ndarray:
  """A torch Linear's (out, in) weight as this project's array `name` (`hf_format.hf_tensors`
  inverted): q / k / v input-first with their heads split (D, heads, H), the MLP's
  input-first (D, F) / (F, D), o output-last (N, H, D)."""
  h = cfg.head_dim
  if kind == "in_first":
    t = array.T  # (in, out)
    if name.rsplit("/", 1)[-1] in ("q_DNH", "k_DKH", "v_DKH"):
      t = t.reshape(t.shape[0], -1, h)
    return np.ascontiguousarray(t)
  if kind == "out_last":
    return np.ascontiguousarray(array.T.reshape(-1, h, cfg.embed_dim))
  return np.ascontiguousarray(array)
