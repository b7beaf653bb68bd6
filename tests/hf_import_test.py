"""Starting from a Hugging Face folder (`train.init_from=hf:FOLDER`, `diloco.artifacts.hf_import`).

Folders are made by transformers itself: a randomly initialised `Gemma3ForCausalLM` (every
weight random, norms included) saved with `save_pretrained`, in float32 and bfloat16, whole and
sharded. The imported model's logits are compared with transformers' on the same tokens; an
import exported again (`hf_format`) and imported once more is bit-identical; what does not map
or is damaged stops in one line naming the file and the field or tensor.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from diloco import fragments
from diloco.artifacts import export, hf_format, hf_import, trained
from diloco.config import run_config
from diloco.errors import ConfigError, DocumentError
from diloco.model.config import ModelConfig
from diloco.train import data as data_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The reference numerics (explicit attention, float32 compute) for the comparison.
BASE = ModelConfig(dtype="float32", attention_impl="reference")
# Small Gemma 3 shapes: a sliding-window pattern with a global layer, GQA, a query scale and
# soft-cap of their own, rope bases of their own.
SHAPES = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
              query_pre_attn_scalar=24, final_logit_softcapping=15.0,
              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                           "sliding_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 5e3},
                               "full_attention": {"rope_type": "default", "rope_theta": 2e5}},
              max_position_embeddings=128)


def _hf_folder(path, dtype="float32", seed=0, max_shard_size=None, **changes):
  """A random Gemma 3 causal LM saved by transformers; returns the folder."""
  import torch
  from transformers import Gemma3ForCausalLM, Gemma3TextConfig
  torch.manual_seed(seed)
  cfg = Gemma3TextConfig(**{**SHAPES, **changes}, dtype=dtype)
  model = Gemma3ForCausalLM(cfg)
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0.0, 0.3)
  model = model.to(getattr(torch, dtype))
  kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
  model.save_pretrained(str(path), **kwargs)
  return str(path)


def _hf_logits(folder, tokens):
  import torch
  from transformers import AutoModelForCausalLM
  torch.set_num_threads(1)
  model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


def _imported(folder):
  cfg = hf_import.model_config(folder, BASE)
  params, _ = hf_import.read_params(folder, cfg)
  return cfg, params


def _logits(cfg, params, tokens):
  flat = {k: np.asarray(v, np.float32) for k, v in fragments.flatten_tree(params).items()}
  model = trained.build(cfg, fragments.unflatten_tree(flat), "test")
  return np.asarray(model(jnp.asarray(tokens))[0])


@pytest.mark.torch
@pytest.mark.parametrize("dtype, shard", [("float32", None), ("bfloat16", None),
                                          ("float32", "40KB")])
def test_imported_logits_match_transformers(tmp_path, dtype, shard):
  folder = _hf_folder(tmp_path / "hf", dtype, max_shard_size=shard)
  if shard:
    assert os.path.exists(os.path.join(folder, hf_format.INDEX_FILE))
  cfg, params = _imported(folder)
  assert (cfg.attention_pattern, cfg.num_layers, cfg.sliding_window) == ("LLG", 4, 8)
  assert (cfg.rope_base_local, cfg.rope_base_global) == (5e3, 2e5)
  assert (cfg.query_pre_attn_scalar, cfg.final_logit_softcap) == (24.0, 15.0)
  assert {str(v.dtype) for v in fragments.flatten_tree(params).values()} == {dtype}
  tokens = np.random.default_rng(0).integers(0, 300, (2, 24))  # past the window of 8
  want = _hf_logits(folder, tokens)
  np.testing.assert_allclose(_logits(cfg, params, tokens), want, rtol=0,
                             atol=1e-4 * max(1.0, np.abs(want).max()))


@pytest.mark.torch
def test_import_export_import_is_bit_identical(tmp_path):
  folder = _hf_folder(tmp_path / "hf", "bfloat16", seed=1)
  cfg, params = _imported(folder)
  run = tmp_path / "run"
  export.save(str(run), params, model=cfg, data=data_lib.DataConfig(), seed=0, step=0,
              runtime="data_parallel")
  hf_format.write(str(run), str(tmp_path / "again"))
  cfg2, params2 = _imported(str(tmp_path / "again"))
  assert dataclasses.replace(cfg2, name=cfg.name) == cfg
  a, b = fragments.flatten_tree(params), fragments.flatten_tree(params2)
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


@pytest.mark.torch
def test_a_run_starts_every_learner_and_g_from_the_folder(tmp_path):
  """Decoupled, two learners on the virtual clock: the config takes the folder's model and
  the byte tokenizer its export wrote, G (which every learner starts from) is read from the
  folder, and the run trains and exports the folder's tensors."""
  folder = _hf_folder(tmp_path / "hf", vocab_size=258)
  with open(os.path.join(folder, hf_format.TOKENIZER_FILE), "w") as f:
    f.write(hf_format.byte_tokenizer_json())
  cfg = run_config.from_config_dict(run_config.load("configs/decoupled.py:tiny"))
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=f"hf:{folder}"))
  started = run_config.with_hf_start(cfg)
  assert started.model.num_layers == 4 and started.model.vocab_size == 258
  assert started.data.tokenizer == "byte"
  workdir = tmp_path / "run"
  out = subprocess.run(
      [sys.executable, "-m", "diloco.main", "--config=configs/decoupled.py:tiny",
       f"--workdir={workdir}", f"--config.train.init_from=hf:{folder}",
       "--config.learners.count=2", "--config.learners.virtual_clock=true",
       "--config.train.steps=12", "--config.sync.period=6", "--config.train.eval_every=6",
       "--config.train.batch_size=8"],
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"initialised from Hugging Face folder {folder}" in out.stdout
  written = json.loads((workdir / "config.json").read_text())
  assert written["model"]["num_layers"] == 4 and written["model"]["attention_pattern"] == "LLG"
  exported, _ = export.load(str(workdir))
  assert fragments.flatten_tree(exported).keys() == fragments.flatten_tree(
      _imported(folder)[1]).keys()


def _config(folder):
  with open(os.path.join(folder, "config.json")) as f:
    return json.load(f)


def _rewrite(folder, **changes):
  doc = _config(folder)
  doc.update(changes)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(doc, f)


@pytest.mark.torch
@pytest.mark.parametrize("changes, message", [
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
     "only Gemma3ForCausalLM (gemma3_text) maps"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "rope_theta": 1e4,
                                                "factor": 8.0},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     "rope_type='linear'"),
    ({"num_key_value_heads": 3}, "model.num_kv_heads: must divide model.num_heads=4"),
    ({"hidden_size": "64"}, "hidden_size: must be an integer"),
    ({"layer_types": ["sliding_attention"]}, "layer_types: must list 4"),
])
def test_what_does_not_map_is_refused_in_one_line(tmp_path, changes, message):
  folder = _hf_folder(tmp_path / "hf")
  _rewrite(folder, **changes)
  with pytest.raises(ConfigError) as e:
    _imported(folder)
  assert message in str(e.value) and "config.json" in str(e.value), e.value
  assert "\n" not in str(e.value)


@pytest.mark.torch
def test_damaged_weights_are_refused_naming_the_tensor(tmp_path):
  from safetensors import numpy as st_numpy
  folder = _hf_folder(tmp_path / "hf")
  path = os.path.join(folder, hf_format.WEIGHTS_FILE)
  tensors = st_numpy.load_file(path)
  _rewrite(folder, hidden_size=48)  # the config no longer matches the weights
  with pytest.raises(DocumentError, match=r"model.embed_tokens.weight: has shape \[300, 64\]"):
    _imported(folder)
  _rewrite(folder, hidden_size=64)
  missing = dict(tensors)
  del missing["model.layers.2.mlp.up_proj.weight"]
  st_numpy.save_file(missing, path)
  with pytest.raises(DocumentError, match="model.layers.2.mlp.up_proj.weight: is missing"):
    _imported(folder)
  st_numpy.save_file(dict(tensors, **{"model.extra.weight": np.zeros(3, np.float32)}), path)
  with pytest.raises(DocumentError, match="model.extra.weight: has no counterpart"):
    _imported(folder)
  with open(path, "r+b") as f:  # a header that claims more than the file holds
    f.write((10**9).to_bytes(8, "little"))
  with pytest.raises(DocumentError, match="is not a safetensors file"):
    _imported(folder)
  nan = dict(tensors)
  nan["model.norm.weight"] = np.full(64, np.nan, np.float32)
  st_numpy.save_file(nan, path)
  cfg, _ = _imported(folder)
  abstract = fragments.unflatten_tree(
      {k: np.zeros(v.shape, np.float32) for k, v in fragments.flatten_tree(
          _imported(folder)[1]).items()})
  with pytest.raises(ConfigError, match="final_norm/scale"):
    export.load_init(f"hf:{folder}", abstract, read_hf=hf_import.read_folder)
  assert cfg.embed_dim == 64


def test_a_missing_folder_or_weights_is_one_line(tmp_path):
  with pytest.raises(ConfigError, match="no such folder"):
    hf_import.model_config(str(tmp_path / "nope"), BASE)
  (tmp_path / "empty").mkdir()
  with pytest.raises(ConfigError, match="has no config.json"):
    hf_import.model_config(str(tmp_path / "empty"), BASE)
  assert hf_import.folder_of("hf:/a/b") == "/a/b" and hf_import.folder_of("/a/b") is None


def test_the_attention_pattern_is_the_shortest_cycle():
  s, f = "sliding_attention", "full_attention"
  assert hf_import.attention_pattern([s] * 5 + [f] + [s] * 2) == "LLLLLG"
  assert hf_import.attention_pattern([s, f, s, f]) == "LG"
  assert hf_import.attention_pattern([f, f]) == "G"
  assert hf_import.attention_pattern([s, s, f, s]) == "LLG"  # cyclic: layer 3 is L
