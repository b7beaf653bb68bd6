"""The Hugging Face export (`diloco export --format=hf`): transformers' Gemma 3 loads the folder
and computes this project's logits and greedy tokens, its tokenizer gives ByteTokenizer's ids,
and a model Gemma 3 cannot express is refused whole, writing nothing."""

import dataclasses
import json
import os
import random

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diloco import fragments
from diloco.artifacts import export, hf_format, trained
from diloco.cli import export_model
from diloco.errors import ConfigError
from diloco.model import decode, presets, registry
from diloco.train import data as data_lib
from diloco.train import tokenizers

# gemma_2b's kind of model (5 local : 1 global, head_dim 32, its own query scale, rope bases
# and soft-cap), reduced to run on a CPU in float32 with the reference attention.
GEMMA_SHAPED = dataclasses.replace(
    presets.get("gemma_2b"), vocab_size=384, embed_dim=64, num_layers=6, num_heads=4,
    num_kv_heads=2, head_dim=32, mlp_dim=128, sliding_window=16, query_pre_attn_scalar=48.0,
    rope_base_local=5_000.0, rope_base_global=200_000.0, final_logit_softcap=20.0,
    dtype="float32", remat="none", scan_layers=False, attention_impl="reference", loss_chunk=0)


def _reference(cfg):
  return dataclasses.replace(cfg, dtype="float32", attention_impl="reference", remat="none",
                             scan_layers=False)


def _make_export(workdir, cfg, seed=0, seq_len=64):
  """A run's export of a freshly initialised model whose norm scales are random (not the zero
  init), so that every norm matters. Returns the parameters."""
  with nnx.use_eager_sharding(False):
    model = registry.build(cfg, nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  flat = {k: (rng.normal(0.0, 0.5, v.shape).astype(v.dtype) if k.endswith("/scale")
              else np.asarray(v))
          for k, v in fragments.flatten_tree(nnx.to_pure_dict(nnx.state(model))).items()}
  params = fragments.unflatten_tree(flat)
  data = dataclasses.replace(data_lib.DataConfig(), seq_len=seq_len)
  export.save(str(workdir), params, model=cfg, data=data, seed=seed, step=1,
              runtime="data_parallel")
  return params


def _hf_model(path):
  import torch
  from transformers import AutoModelForCausalLM
  torch.set_num_threads(1)
  return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _hf_logits(path, tokens):
  import torch
  with torch.no_grad():
    return _hf_model(path)(torch.tensor(tokens)).logits.numpy()


def _logits(cfg, params, tokens):
  model = trained.build(_reference(cfg), params, "test")
  return np.asarray(model(jnp.asarray(tokens))[0])


def _close(got, want):
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, np.abs(want).max()))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """(workdir, cfg, params, the HF folder) of a tiny run's export."""
  workdir = tmp_path_factory.mktemp("tiny_run")
  cfg = presets.get("tiny")
  params = _make_export(workdir, cfg)
  out = workdir / "hf"
  hf_format.write(str(workdir), str(out))
  return workdir, cfg, params, out


@pytest.mark.torch
@pytest.mark.parametrize("name", ["tiny", "nano", "small", "gemma_shaped", "tiny_bf16"])
def test_transformers_computes_the_same_logits(name, tmp_path):
  cfg = {"gemma_shaped": GEMMA_SHAPED,
         "tiny_bf16": dataclasses.replace(presets.get("tiny"), param_dtype="bfloat16")}.get(
             name) or presets.get(name)
  params = _make_export(tmp_path, cfg, seed=3)
  hf_format.write(str(tmp_path), str(tmp_path / "hf"))
  config = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert config["model_type"] == "gemma3_text" and config["tie_word_embeddings"]
  assert config["dtype"] == cfg.param_dtype
  length = cfg.sliding_window + 16  # past the window: its edge is in every local layer
  tokens = np.random.default_rng(0).integers(0, 258, (2, length))
  _close(_hf_logits(tmp_path / "hf", tokens), _logits(cfg, params, tokens))


@pytest.mark.torch
def test_greedy_generation_gives_the_same_tokens(tiny):
  import torch
  _, cfg, params, out = tiny
  prompt = np.random.default_rng(1).integers(0, 256, (2, 20))
  new = cfg.sliding_window  # prompt and new tokens run past the window
  ours = decode.generate(trained.build(cfg, params, "test"), prompt, max_tokens=new)
  with torch.no_grad():
    theirs = _hf_model(out).generate(torch.tensor(prompt), attention_mask=torch.ones(2, 20),
                                     max_new_tokens=new, do_sample=False).numpy()[:, 20:]
  eos = tokenizers.ByteTokenizer.eos_id
  for row_ours, row_theirs in zip(ours, theirs):
    # transformers stops a row at EOS (and pads it after): compare up to there
    stop = next((i + 1 for i, t in enumerate(row_theirs) if t == eos), new)
    assert list(row_theirs[:stop]) == list(row_ours[:stop])


@pytest.mark.torch
def test_sharded_weights_load_and_give_the_same_logits(tiny, tmp_path):
  workdir, cfg, params, _ = tiny
  files = hf_format.write(str(workdir), str(tmp_path / "sharded"), max_shard_bytes=40_000)
  index = json.loads((tmp_path / "sharded" / hf_format.INDEX_FILE).read_text())
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 2 and shards == sorted(f for f in files if f.endswith(".safetensors"))
  assert not (tmp_path / "sharded" / hf_format.WEIGHTS_FILE).exists()
  tokens = np.arange(48)[None] % 258
  _close(_hf_logits(tmp_path / "sharded", tokens), _logits(cfg, params, tokens))


def _texts():
  """ASCII, multi-byte UTF-8, whitespace, the specials' names typed as text, and random mixes."""
  texts = ["", " ", "hello world", "  two  spaces\n\ttab\r\n", "héllo wörld", "日本語のテキスト",
           "emoji 🙂🚀 and ZWJ 👩‍👩‍👧", "<bos>not special<eos>", "a" * 300, "\x00\x7f\u00ff"]
  rng = random.Random(0)
  pools = [(0x20, 0x7e), (0x0, 0x1f), (0xa0, 0x24f), (0x3040, 0x30ff), (0x4e00, 0x4fff),
           (0x1f300, 0x1f64f)]
  for _ in range(200):
    texts.append("".join(chr(rng.randint(*rng.choice(pools))) for _ in range(rng.randint(0, 40))))
  return texts


@pytest.mark.torch
def test_the_tokenizer_gives_the_byte_tokenizers_ids(tiny):
  from transformers import AutoTokenizer
  out = tiny[3]
  theirs = AutoTokenizer.from_pretrained(str(out))
  ours = tokenizers.ByteTokenizer()
  read_back = tokenizers.make(str(out / hf_format.TOKENIZER_FILE))  # diloco's own reader too
  assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)
  for text in _texts():
    ids = [int(i) for i in ours.encode(text.encode("utf-8"))]
    assert theirs(text, add_special_tokens=False).input_ids == ids, text
    assert theirs(text).input_ids == [ours.bos_id] + ids, text  # BOS first, as in training
    if "<bos>" not in text and "<eos>" not in text:  # split_special_tokens is transformers'
      assert list(read_back.encode(text.encode("utf-8"))) == ids, text
    assert theirs.decode([ours.bos_id] + ids + [ours.eos_id], skip_special_tokens=True) == text
  assert theirs.decode([0xe6, 0x97]) == ours.decode([0xe6, 0x97])  # a cut character


@pytest.mark.parametrize("change, named", [
    ({"num_experts": 4, "experts_per_token": 2, "expert_mlp_dim": 64}, "model.num_experts=4"),
    ({"qk_norm": False}, "model.qk_norm=False"),
    ({"arch": "my_model"}, "model.arch='my_model'"),
    ({"head_dim": 15}, "model.head_dim=15"),
    ({"embed_dim": 66}, "model.embed_dim=66"),
    ({"query_pre_attn_scalar": 10.5}, "model.query_pre_attn_scalar=10.5"),
])
def test_each_difference_is_refused(change, named):
  cfg = dataclasses.replace(presets.get("tiny"), **change)
  assert [d for d in hf_format.differences(cfg) if named in d], hf_format.differences(cfg)
  with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
    hf_format.hf_config(cfg, {})
  with pytest.raises(ConfigError):
    hf_format.hf_tensors({}, cfg)


def test_one_error_names_all_differences():
  cfg = dataclasses.replace(presets.get("tiny_moe"), qk_norm=False, head_dim=15)
  assert not hf_format.differences(presets.get("small"))
  with pytest.raises(ConfigError) as e:
    hf_format.hf_config(cfg, {})
  for named in ("num_experts", "qk_norm", "head_dim"):
    assert named in str(e.value)


def _cli(*args):
  """(exit message or None) of `diloco export ARGS`."""
  try:
    export_model.main(["diloco export", *args])
  except SystemExit as e:
    return str(e.code)
  return None


def test_the_cli_refuses_an_moe_run_in_one_line_and_writes_nothing(tmp_path):
  _make_export(tmp_path, presets.get("tiny_moe"))
  message = _cli(f"--workdir={tmp_path}")
  assert message and "\n" not in message and message.startswith("diloco export: error: ")
  assert "model.num_experts=4" in message
  assert not (tmp_path / "hf").exists()
  assert sorted(os.listdir(tmp_path)) == ["export"]  # no temporary folder left either


@pytest.mark.parametrize("args, message", [
    (["--workdir={empty}"], "--workdir: .* holds no export"),
    (["--workdir={run}", "--format=onnx"], "--format: must be one of hf, safetensors"),
    (["--workdir={run}", "--max_shard_size=lots"], "--max_shard_size: 'lots' is not a size"),
    (["--workdir={run}", "--out={run}/export"], "--out: .* is the export folder itself"),
    (["--workdir={run}", "--format=safetensors", "--out={empty}"], "--out: --format=safe"),
])
def test_bad_input_stops_in_one_line_naming_the_flag(tiny, tmp_path, args, message):
  import re
  os.makedirs(tmp_path / "empty")
  paths = {"empty": str(tmp_path / "empty"), "run": str(tiny[0])}
  text = _cli(*[a.format(**paths) for a in args])
  assert text and "\n" not in text and re.search(message, text), text


def test_max_shard_size_parses_units():
  assert export_model.parse_size("5GB") == 5 * 10**9
  assert export_model.parse_size("2GiB") == 2 * 2**30
  assert export_model.parse_size("500kb") == 500_000
  assert export_model.parse_size("1000") == 1000


@pytest.mark.torch
def test_the_cli_exports_a_run_end_to_end(tmp_path, capsys):
  cfg = presets.get("nano")
  params = _make_export(tmp_path, cfg, seed=5, seq_len=48)
  assert _cli(f"--workdir={tmp_path}") is None
  assert "wrote a Hugging Face Gemma 3 folder" in capsys.readouterr().out
  out = tmp_path / "hf"
  config = json.loads((out / "config.json").read_text())
  assert config["max_position_embeddings"] == 48 and config["layer_types"] == [
      "sliding_attention", "full_attention"]
  tokens = np.arange(40)[None] * 7 % 258
  _close(_hf_logits(out, tokens), _logits(cfg, params, tokens))
  # a second export refuses the folder, unless told to replace it
  assert "pass --overwrite" in _cli(f"--workdir={tmp_path}")
  assert _cli(f"--workdir={tmp_path}", "--overwrite", "--max_shard_size=30KB") is None
  assert (out / hf_format.INDEX_FILE).exists() and not (out / hf_format.WEIGHTS_FILE).exists()
  assert sorted(os.listdir(tmp_path)) == ["export", "hf"]
  # --format=safetensors: into the export folder itself
  assert _cli(f"--workdir={tmp_path}", "--format=safetensors") is None
  assert (tmp_path / "export" / export.SAFETENSORS_FILE).is_file()


@pytest.mark.torch
def test_a_runs_tokenizer_json_is_copied_and_gives_its_ids(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import AutoTokenizer
  words = ["<unk>", "<eos>", "<bos>", "the", "syncer", "merged", "fragments", "."]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  os.makedirs(tmp_path / "tok")
  tok.save(str(tmp_path / "tok" / "tokenizer.json"))  # no tokenizer_config.json beside it
  cfg = presets.get("tiny")
  with nnx.use_eager_sharding(False):
    model = registry.build(cfg, nnx.Rngs(0))
  data = dataclasses.replace(data_lib.DataConfig(), tokenizer=str(tmp_path / "tok" /
                                                                  "tokenizer.json"))
  export.save(str(tmp_path / "run"), nnx.to_pure_dict(nnx.state(model)), model=cfg, data=data,
              seed=0, step=1, runtime="data_parallel")
  hf_format.write(str(tmp_path / "run"), str(tmp_path / "hf"))
  config = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert (config["bos_token_id"], config["eos_token_id"]) == (2, 1)
  theirs = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  ours = tokenizers.make(str(tmp_path / "hf" / "tokenizer.json"))
  text = "the syncer merged the fragments ."
  assert theirs(text, add_special_tokens=False).input_ids == list(ours.encode(text.encode()))
  assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)


def _tree(root):
  """{relative path: bytes} of every file under `root` (what an export must leave alone)."""
  found = {}
  for folder, _, files in os.walk(root):
    for name in files:
      path = os.path.join(folder, name)
      with open(path, "rb") as f:
        found[os.path.relpath(path, root)] = f.read()
  return found


@pytest.mark.parametrize("where", ["{run}", "{run}/export", "{run}/export/params", "{run}/logs",
                                   "{run}/store/x", "{parent}", "{store}", "{store}/deep"])
def test_export_never_writes_over_the_run_or_its_store(tmp_path, where):
  """`--out` that is, holds or lies inside the run (but for RUN/hf) or its store (config.json's
  store.root, outside the run here) is refused in one line, with --overwrite too: every file is
  left as it was."""
  run, store = tmp_path / "runs" / "a", tmp_path / "stores" / "a"
  _make_export(run, presets.get("tiny"))
  os.makedirs(run / "logs")
  (run / "logs" / "learner0.log").write_text("log\n")
  os.makedirs(store / "deep")
  (store / "deep" / "blob").write_bytes(b"\0\1")
  (run / "config.json").write_text(json.dumps({"store": {"root": str(store)}}))
  before = _tree(tmp_path)
  out = where.format(run=run, parent=tmp_path / "runs", store=store)
  message = _cli(f"--workdir={run}", f"--out={out}", "--overwrite")
  assert message and "\n" not in message and "--out: " in message, message
  assert _tree(tmp_path) == before


def test_overwrite_replaces_only_an_earlier_exports_folder_and_no_symlink(tmp_path):
  run = tmp_path / "run"
  _make_export(run, presets.get("tiny"))
  elsewhere = tmp_path / "mine"
  os.makedirs(elsewhere)
  (elsewhere / "notes.txt").write_text("keep me\n")
  assert "not empty; pass --overwrite" in _cli(f"--workdir={run}", f"--out={elsewhere}")
  message = _cli(f"--workdir={run}", f"--out={elsewhere}", "--overwrite")
  assert "was not written by diloco export" in message
  assert (elsewhere / "notes.txt").read_text() == "keep me\n"
  # A folder an export wrote is replaced; one with a file added by hand is not.
  out = tmp_path / "hf_out"
  assert _cli(f"--workdir={run}", f"--out={out}") is None
  listed = json.loads((out / hf_format.MANIFEST).read_text())["files"]
  assert set(listed) | {hf_format.MANIFEST} == set(os.listdir(out))
  assert _cli(f"--workdir={run}", f"--out={out}", "--overwrite") is None
  (out / "mine.txt").write_text("x")
  assert "holds files no export wrote (mine.txt)" in _cli(f"--workdir={run}", f"--out={out}",
                                                        "--overwrite")
  assert (out / "mine.txt").exists()
  # A symbolic link is neither followed nor replaced.
  link = tmp_path / "link"
  os.symlink(elsewhere, link)
  assert "is a symbolic link" in _cli(f"--workdir={run}", f"--out={link}", "--overwrite")
  assert os.path.islink(link) and (elsewhere / "notes.txt").exists()
  # A manifest that is not one is a one-line error naming it.
  (out / "mine.txt").unlink()
  (out / hf_format.MANIFEST).write_text('{"files": [1]}')
  assert "files[0]" in _cli(f"--workdir={run}", f"--out={out}", "--overwrite")


def test_a_diverged_model_is_neither_exported_nor_trained_from(tmp_path):
  cfg = presets.get("tiny")
  params = _make_export(tmp_path / "good", cfg)
  flat = fragments.flatten_tree(params)
  name = sorted(flat)[0]
  for bad in (np.nan, np.inf):
    broken = dict(flat, **{name: np.full_like(np.asarray(flat[name]), bad)})
    with pytest.raises(ConfigError, match=rf"export of step 1: parameter {name} holds NaN or "
                                          "Inf; refused"):
      export.save(str(tmp_path / "bad"), fragments.unflatten_tree(broken), model=cfg,
                  data=data_lib.DataConfig(), seed=0, step=1, runtime="data_parallel")
    assert not (tmp_path / "bad").exists()  # nothing written
  # A NaN written by another tool into a good export is refused by train.init_from.
  with pytest.raises(ConfigError, match=r"train.init_from=.*holds NaN or Inf"):
    export.refuse_non_finite({name: np.array([1.0, np.nan], dtype=jnp.bfloat16)},
                             f"train.init_from={str(tmp_path)!r}")
