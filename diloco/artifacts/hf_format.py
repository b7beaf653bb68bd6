"""An export as a Hugging Face transformers folder: Gemma 3 (`Gemma3ForCausalLM`), exactly.

`write(export_folder, out_dir)` writes config.json, generation_config.json, the weights
(model.safetensors, or shards and model.safetensors.index.json) and the tokenizer where it is
exact (`hf_tokenizer`), so that `transformers.AutoModelForCausalLM.from_pretrained(out_dir)`
computes this project's logits. A model with any feature Gemma 3 lacks (`differences`) is
refused whole: never exported approximately. The folder appears at once (written beside it, then renamed).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

from diloco import documents
from diloco import fragments as fragments_lib
from diloco.artifacts import export, hf_tokenizer
from diloco.errors import ConfigError
from diloco.model.config import ModelConfig
from diloco.train import tokenizers

ARCHITECTURE = "Gemma3ForCausalLM"
MODEL_TYPE = "gemma3_text"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = tokenizers.TOKENIZER_CONFIG_FILE
# Without a known run length, Gemma 3's own default (the RoPE here does not depend on it).
_DEFAULT_MAX_POSITIONS = 131_072
# The byte tokenizer's specials, by the names Gemma's tokenizer gives them.
_BYTE_SPECIALS = {"<bos>": tokenizers.ByteTokenizer.bos_id,
                  "<eos>": tokenizers.ByteTokenizer.eos_id}
# Per-layer tensors: this project's name under layers/<i>/ -> (the HF name under
# model.layers.<i>., how the array becomes the torch Linear's (out, in) weight).
LAYER_TENSORS = {
    "pre_attn_norm/scale": ("input_layernorm.weight", "vector"),
    "post_attn_norm/scale": ("post_attention_layernorm.weight", "vector"),
    "pre_mlp_norm/scale": ("pre_feedforward_layernorm.weight", "vector"),
    "post_mlp_norm/scale": ("post_feedforward_layernorm.weight", "vector"),
    "attn/q_norm/scale": ("self_attn.q_norm.weight", "vector"),
    "attn/k_norm/scale": ("self_attn.k_norm.weight", "vector"),
    "attn/q_DNH": ("self_attn.q_proj.weight", "in_first"),
    "attn/k_DKH": ("self_attn.k_proj.weight", "in_first"),
    "attn/v_DKH": ("self_attn.v_proj.weight", "in_first"),
    "attn/o_NHD": ("self_attn.o_proj.weight", "out_last"),
    "mlp/gate_DF": ("mlp.gate_proj.weight", "in_first"),
    "mlp/up_DF": ("mlp.up_proj.weight", "in_first"),
    "mlp/down_FD": ("mlp.down_proj.weight", "in_first"),
}


def differences(cfg: ModelConfig) -> list[str]:
  """Every feature of `cfg` that Gemma 3 in transformers has no exact counterpart for (empty:
  the model exports exactly)."""
  out = []
  if cfg.arch != "transformer":
    out.append(f"model.arch={cfg.arch!r} is a registered custom model, not this transformer")
  if cfg.num_experts:
    out.append(f"model.num_experts={cfg.num_experts}: a mixture of experts (Gemma 3's MLP is "
               "dense)")
  if not cfg.qk_norm:
    out.append("model.qk_norm=False (Gemma 3 always norms queries and keys)")
  if cfg.head_dim % 2:
    out.append(f"model.head_dim={cfg.head_dim} is odd (RoPE rotates two equal halves)")
  if cfg.embed_dim % cfg.num_heads:
    out.append(f"model.embed_dim={cfg.embed_dim} is not a multiple of model.num_heads="
               f"{cfg.num_heads} (Gemma3TextConfig refuses that)")
  scalar = cfg.query_pre_attn_scalar
  if scalar and scalar != int(scalar):
    out.append(f"model.query_pre_attn_scalar={scalar} is not a whole number "
               "(Gemma3TextConfig's is an int)")
  return out


def refuse_differences(cfg: ModelConfig, where: str) -> None:
  """ConfigError listing all of `differences(cfg)`, if any."""
  found = differences(cfg)
  if found:
    raise ConfigError(f"{where}: the model has no exact Hugging Face Gemma 3 counterpart, so it "
                      f"is not exported: {'; '.join(found)}")


def special_ids(tokenizer) -> dict[str, int | None]:
  """bos/eos/pad token ids of a `diloco.train.tokenizers` tokenizer (None where it has none)."""
  ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
         "pad_token_id": tokenizer.pad_id}
  return {k: (int(v) if v is not None and v >= 0 else None) for k, v in ids.items()}


def hf_config(cfg: ModelConfig, meta: dict, tokenizer=None) -> dict:
  """The config.json of `cfg` as `Gemma3TextConfig` reads it (transformers 5.x names).

  `meta`: the export's export.json (the run's seq_len); `tokenizer`: the run's tokenizer, for
  the special ids (None: the byte tokenizer's when the run used it, else none)."""
  refuse_differences(cfg, "model")
  if tokenizer is None and meta.get("data", {}).get("tokenizer", "byte") == "byte":
    tokenizer = tokenizers.ByteTokenizer()
  ids = special_ids(tokenizer) if tokenizer is not None else {}
  ids = {k: (v if v is not None and v < cfg.vocab_size else None) for k, v in ids.items()}
  pattern = cfg.attention_pattern
  layer_types = ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
                 for i in range(cfg.num_layers)]
  seq_len = meta.get("data", {}).get("seq_len") or _DEFAULT_MAX_POSITIONS
  return {
      "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed_dim,
      "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "layer_types": layer_types,
      "sliding_window": cfg.sliding_window,
      "rope_parameters": {
          "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_base_local},
          "full_attention": {"rope_type": "default", "rope_theta": cfg.rope_base_global}},
      "query_pre_attn_scalar": int(cfg.query_pre_attn_scalar or cfg.head_dim),
      "final_logit_softcapping": cfg.final_logit_softcap or None,
      "attn_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh",
      "rms_norm_eps": 1e-6, "attention_bias": False, "attention_dropout": 0.0,
      "use_bidirectional_attention": False, "tie_word_embeddings": True,
      "max_position_embeddings": int(seq_len),
      "bos_token_id": ids.get("bos_token_id"), "eos_token_id": ids.get("eos_token_id"),
      "pad_token_id": ids.get("pad_token_id"),
      "dtype": cfg.param_dtype, "use_cache": True,
  }


def hf_tensors(params, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """{Gemma 3 tensor name: array} of this project's parameters (nested dict, e.g.
  params["layers"]["0"]["attn"]["q_DNH"]); the output head is the tied embedding, so no
  lm_head. The arrays keep their dtype."""
  refuse_differences(cfg, "model")
  flat = {k: np.asarray(v) for k, v in fragments_lib.flatten_tree(params).items()}

  def take(name: str) -> np.ndarray:
    if name not in flat:
      raise ConfigError(f"model: the parameters have no tensor {name!r}; they are not those "
                        "of this model config")
    return flat.pop(name)

  out = {"model.embed_tokens.weight": take("embedder/embedding"),
         "model.norm.weight": take("final_norm/scale")}
  for i in range(cfg.num_layers):
    for name, (hf_name, kind) in LAYER_TENSORS.items():
      array = take(f"layers/{i}/{name}")
      if kind == "in_first":  # (D, N, H) or (D, F): the input axis first
        array = array.reshape(array.shape[0], -1).T
      elif kind == "out_last":  # (N, H, D): the output axis last
        array = array.reshape(-1, array.shape[-1]).T
      out[f"model.layers.{i}.{hf_name}"] = np.ascontiguousarray(array)
  if flat:
    raise ConfigError(f"model: tensor {min(flat)!r} has no Gemma 3 counterpart "
                      f"({len(flat)} left over); the parameters are not this transformer's")
  return out


def shards(tensors: dict[str, np.ndarray], max_shard_bytes: int) -> list[list[str]]:
  """The tensor names of each weights file, in order: a file holds at most `max_shard_bytes`
  of tensors, except a single tensor larger than that, which is alone in its file."""
  groups, size = [[]], 0
  for name, tensor in tensors.items():
    nbytes = tensor.nbytes
    if groups[-1] and size + nbytes > max_shard_bytes:
      groups.append([])
      size = 0
    groups[-1].append(name)
    size += nbytes
  return groups


def write_weights(tensors: dict[str, np.ndarray], out_dir: str, max_shard_bytes: int) -> list[str]:
  """model.safetensors, or model-0000i-of-0000n.safetensors and the HF index when the tensors
  exceed `max_shard_bytes`. Returns the files written."""
  from safetensors import numpy as st_numpy  # pylint: disable=import-outside-toplevel
  groups = shards(tensors, max_shard_bytes)
  metadata = {"format": "pt"}  # what transformers expects of a PyTorch checkpoint
  if len(groups) == 1:
    st_numpy.save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata=metadata)
    return [WEIGHTS_FILE]
  names, weight_map = [], {}
  for i, group in enumerate(groups):
    name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
    st_numpy.save_file({k: tensors[k] for k in group}, os.path.join(out_dir, name),
                       metadata=metadata)
    weight_map.update({k: name for k in group})
    names.append(name)
  index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
           "weight_map": weight_map}
  _write_json(os.path.join(out_dir, INDEX_FILE), index)
  return names + [INDEX_FILE]


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's printable stand-in for each byte (the alphabet of the ByteLevel pre-tokenizer)."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
  table = {b: chr(b) for b in keep}
  extra = 0
  for b in range(256):
    if b not in table:
      table[b] = chr(256 + extra)
      extra += 1
  return table


def byte_tokenizer_json() -> str:
  """`ByteTokenizer` as a `tokenizers` JSON document: a byte-level BPE without merges whose
  ids are the bytes, <bos> and <eos> at ByteTokenizer's ids, BOS put before a text (as the
  training pipeline puts it before every document). The tokenizer_config.json beside it sets
  `split_special_tokens`, so that transformers never matches "<bos>" typed in a text: any text
  gives ByteTokenizer's ids (the JSON itself cannot say so)."""
  # pylint: disable=import-outside-toplevel
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
  vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  by_id = sorted(_BYTE_SPECIALS.items(), key=lambda item: item[1])  # added at 256, then 257
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in by_id])
  tok.post_processor = processors.TemplateProcessing(
      single="<bos> $A", pair="<bos> $A <bos> $B",
      special_tokens=[("<bos>", _BYTE_SPECIALS["<bos>"])])
  vocab_out = tok.get_vocab(with_added_tokens=True)
  if any(vocab_out.get(t) != i for t, i in _BYTE_SPECIALS.items()):
    raise AssertionError(f"the byte tokenizer's specials landed at {vocab_out}")
  return tok.to_str(pretty=True)


def _tokenizer_config(bos: str | None, eos: str | None, pad: str | None, max_len: int) -> dict:
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
            "clean_up_tokenization_spaces": False}
  config.update({k: v for k, v in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad))
                 if v is not None})
  return config


def write_tokenizer(meta: dict, tokenizer, out_dir: str) -> str | None:
  """The files of the run's `tokenizer` (export.json: `meta`) in `out_dir`; None, or the one
  line that says why none were written (a SentencePiece model is written only where
  transformers gives its ids exactly: `hf_tokenizer.write_sentencepiece`)."""
  max_len = int(meta.get("data", {}).get("seq_len") or _DEFAULT_MAX_POSITIONS)
  if isinstance(tokenizer, tokenizers.ByteTokenizer):
    with open(os.path.join(out_dir, TOKENIZER_FILE), "w", encoding="utf-8") as f:
      f.write(byte_tokenizer_json())
    config = _tokenizer_config("<bos>", "<eos>", None, max_len)
    config.update({"split_special_tokens": True, "add_bos_token": True})
    _write_json(os.path.join(out_dir, TOKENIZER_CONFIG_FILE), config)
    return None
  if isinstance(tokenizer, tokenizers.HuggingFaceTokenizer):
    shutil.copyfile(tokenizer.path, os.path.join(out_dir, TOKENIZER_FILE))
    beside = os.path.join(os.path.dirname(tokenizer.path), TOKENIZER_CONFIG_FILE)
    if os.path.isfile(beside):
      shutil.copyfile(beside, os.path.join(out_dir, TOKENIZER_CONFIG_FILE))
    else:  # the names of the specials the run used, so that AutoTokenizer finds them
      from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
      vocab = Tokenizer.from_file(tokenizer.path).get_vocab(with_added_tokens=True)
      names = {i: t for t, i in vocab.items()}
      _write_json(os.path.join(out_dir, TOKENIZER_CONFIG_FILE), _tokenizer_config(
          names.get(tokenizer.bos_id), names.get(tokenizer.eos_id), names.get(tokenizer.pad_id),
          max_len))
    return None
  return hf_tokenizer.write_sentencepiece(tokenizer, out_dir, max_len)


def _write_json(path: str, value) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=2)
    f.write("\n")


# Written last into every folder `write` makes: the files it wrote, so that `--overwrite`
# replaces an earlier export and nothing else.
MANIFEST = ".diloco-export.json"


def run_of(export_folder: str) -> str:
  """The run an export folder belongs to (WORKDIR for WORKDIR/export), else the folder."""
  parent, name = os.path.split(os.path.abspath(export_folder))
  return parent if name == export.EXPORT_DIR else os.path.abspath(export_folder)


def default_out(export_folder: str) -> str:
  """Where the Hugging Face folder goes by default, the one place inside a run it may go."""
  return os.path.join(run_of(export_folder), "hf")


def check_apart(out_dir: str, path: str, what: str) -> None:
  """ConfigError unless `out_dir` and `path` (say, the run) are apart: neither is the other or
  holds it, symbolic links resolved."""
  out, other = os.path.realpath(out_dir), os.path.realpath(path)
  if out == other or other.startswith(out + os.sep):
    raise ConfigError(f"--out: {out_dir!r} is or contains {what} {path!r}; write elsewhere")
  if out.startswith(other + os.sep):
    raise ConfigError(f"--out: {out_dir!r} lies inside {what} {path!r}; write elsewhere")


def check_out(out_dir: str, overwrite: bool) -> None:
  """ConfigError naming --out when it is a symbolic link or a file, or a non-empty folder
  without `overwrite`, or with files that no earlier export wrote (its manifest lists them):
  `--overwrite` replaces an export's folder, never anything else."""
  if os.path.islink(out_dir):
    raise ConfigError(f"--out: {out_dir!r} is a symbolic link; give the folder itself")
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ConfigError(f"--out: {out_dir!r} is a file, not a folder")
  present = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
  if not present:
    return
  if not overwrite:
    raise ConfigError(f"--out: {out_dir!r} is not empty; pass --overwrite to replace it")
  manifest = os.path.join(out_dir, MANIFEST)
  if MANIFEST not in present:
    raise ConfigError(f"--out: {out_dir!r} was not written by diloco export (no {MANIFEST}); "
                      "--overwrite replaces only an earlier export's folder")
  listed = documents.fields(documents.obj(documents.read(manifest), manifest),
                            {"files": list}, manifest)["files"]
  files = {documents.value(f, str, manifest, f"files[{i}]") for i, f in enumerate(listed)}
  stray = sorted(present - files - {MANIFEST})
  if stray:
    raise ConfigError(f"--out: {out_dir!r} holds files no export wrote ({', '.join(stray[:5])}"
                      f"{', ...' if len(stray) > 5 else ''}); --overwrite replaces only what "
                      "an export wrote")


def write(found: str, out_dir: str, max_shard_bytes: int = 5 * 10**9, *,
          trust_code: bool = False, overwrite: bool = False) -> list[str]:
  """Writes the export at `found` (an export folder or a run's workdir) to `out_dir` as a
  Hugging Face Gemma 3 folder; returns the files written (relative to `out_dir`).

  Refused (ConfigError, nothing written) when the model has `differences`, names code without
  `trust_code` (the folder is made for other readers: see `export.refuse_code`), or `out_dir`
  is a non-empty folder without `overwrite`."""
  where = export.export_dir(os.path.abspath(found))
  if where is None:
    raise ConfigError(f"--workdir: {found!r} holds no export "
                      f"({export.EXPORT_DIR}/{export.META_FILE})")
  meta_file = os.path.join(where, export.META_FILE)
  meta = export.read_meta(where)
  cfg = export.read_model(meta["model"], meta_file)
  export.refuse_code(cfg, meta_file, trust_code)
  refuse_differences(cfg, meta_file)
  out_dir = os.path.abspath(out_dir)
  run = run_of(where)
  if os.path.realpath(out_dir) != os.path.realpath(default_out(where)):
    check_apart(out_dir, run, "the run" if run != where else "the export folder")
  check_out(out_dir, overwrite)
  if max_shard_bytes < 1:
    raise ConfigError(f"--max_shard_size: must be at least 1 byte, got {max_shard_bytes}")
  tokenizer = tokenizers.make(export.tokenizer_spec(where, meta))
  params, meta = export.load(where)
  tensors = hf_tensors(params, cfg)
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out_dir)}.")
  try:
    written = write_weights(tensors, tmp, max_shard_bytes)
    config = hf_config(cfg, meta, tokenizer)
    _write_json(os.path.join(tmp, "config.json"), config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if config[k] is not None}
    _write_json(os.path.join(tmp, "generation_config.json"), generation)
    written += ["config.json", "generation_config.json"]
    note = write_tokenizer(meta, tokenizer, tmp)
    if note:
      print(note, flush=True)
    written += sorted(f for f in os.listdir(tmp) if f.startswith("tokenizer"))
    _write_json(os.path.join(tmp, MANIFEST), {"files": written})
    _replace_dir(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return written


def _replace_dir(tmp: str, out_dir: str) -> None:
  """Puts the finished folder `tmp` at `out_dir`, an old one there moved aside first."""
  old = None
  if os.path.exists(out_dir):
    old = tempfile.mkdtemp(dir=os.path.dirname(out_dir), prefix=".old.")
    os.rename(out_dir, os.path.join(old, "out"))
  os.rename(tmp, out_dir)
  os.chmod(out_dir, 0o755)  # mkdtemp made it private to the writer
  if old:
    shutil.rmtree(old, ignore_errors=True)
