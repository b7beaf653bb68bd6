"""Using a trained run: `diloco.cli.sample`, `diloco.cli.evaluate`, the portable export and its
safetensors copy. The runs are made directly (a random tiny model exported with the run's
config), so that no training is needed."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import runtime_configs
from flax import nnx

from diloco import fragments
from diloco.artifacts import export, trained
from diloco.cli import evaluate, export_model, sample
from diloco.model import registry
from diloco.train import data as data_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOS = 256


def _corpus(root):
  os.makedirs(root, exist_ok=True)
  for d in range(24):
    with open(os.path.join(root, f"doc{d:02d}.txt"), "w") as f:
      f.write("".join(f"line {i} of document {d}: the syncer merged {d * i} fragments.\n"
                      for i in range(12)))
  return str(root)


def _make_run(workdir, cfg, seed=0, scale=1.0):
  """A workdir as a finished run leaves it (config.json, export/) with a random model."""
  with nnx.use_eager_sharding(False):
    model = registry.build(cfg.model, nnx.Rngs(seed))
  params = jax.tree.map(lambda v: np.asarray(v) * scale, nnx.to_pure_dict(nnx.state(model)))
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(dataclasses.asdict(cfg), f)
  export.save(workdir, params, model=cfg.model, data=cfg.data, seed=cfg.seed, step=3,
              runtime="data_parallel")
  return params


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp("use_model")
  cfg = runtime_configs.load("dp.py:tiny", data__source="text", data__path=_corpus(root / "corpus"),
                        data__eval_fraction=0.3, data__seq_len=32)
  workdir = str(root / "run")
  return workdir, cfg, _make_run(workdir, cfg)


def _optax_loss(cfg, params, token_batches):
  """Independent reference: the model's logits, then optax's cross-entropy, meaned in NumPy."""
  with nnx.use_eager_sharding(False):
    graphdef, _ = nnx.split(registry.build(cfg.model, nnx.Rngs(0)))
  forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)[0])
  losses = []
  for batch in token_batches:
    logits = forward(params, jnp.asarray(batch[:, :-1]))
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(batch[:, 1:]))
    losses.append(np.asarray(ce, np.float64).ravel())
  return float(np.concatenate(losses).mean())


def _json_line(capsys):
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_score_equals_an_optax_cross_entropy_of_the_same_batches(run, capsys, tmp_path):
  workdir, cfg, params = run
  evaluate.main(["evaluate", f"--workdir={workdir}", "--batch_size=4", "--num_batches=3",
                 "--json"])
  got = _json_line(capsys)
  windows = data_lib.split_windows(cfg.data, "eval")
  rows = np.stack([np.asarray(windows[i]) for i in range(12)])
  want = _optax_loss(cfg, params, [rows[:4], rows[4:8], rows[8:]])
  assert got["loss"] == pytest.approx(want, rel=1e-5)
  assert got["perplexity"] == pytest.approx(np.exp(want), rel=1e-5)
  assert (got["tokens"], got["windows"], got["split"]) == (12 * 32, 12, "eval")
  # Every window of the train split, in a last batch shorter than the others, at another
  # length, from a source given on the command line.
  evaluate.main(["evaluate", f"--workdir={workdir}", f"--data=text:{cfg.data.path}",
                 "--split=train", "--seq_len=16", "--batch_size=64", "--num_batches=0", "--json"])
  got = _json_line(capsys)
  data16 = dataclasses.replace(cfg.data, seq_len=16)
  train = data_lib.split_windows(data16, "train")
  rows = np.stack([np.asarray(train[i]) for i in range(len(train))])
  assert got["windows"] == len(train) and len(train) % 64
  batches = [rows[i:i + 64] for i in range(0, len(rows), 64)]
  assert got["loss"] == pytest.approx(_optax_loss(cfg, params, batches), rel=1e-5)


def test_score_of_a_checkpoint_step(run, capsys, tmp_path):
  import orbax.checkpoint as ocp
  workdir, cfg, params = run
  other = str(tmp_path / "run")
  shutil.copytree(workdir, other)
  halved = jax.tree.map(lambda v: v * 0.5, params)
  ocp.PyTreeCheckpointer().save(os.path.join(other, "checkpoints", "2", "state"),
                                {"params": halved, "step": np.int64(2)})
  evaluate.main(["evaluate", f"--workdir={other}", "--step=2", "--batch_size=4",
                 "--num_batches=1", "--json"])
  got = _json_line(capsys)
  windows = data_lib.split_windows(cfg.data, "eval")
  rows = np.stack([np.asarray(windows[i]) for i in range(4)])
  assert got["loss"] == pytest.approx(_optax_loss(cfg, halved, [rows]), rel=1e-5)
  assert "checkpoints/2/state" in got["source"]
  with pytest.raises(SystemExit, match=r"--step: .* has no checkpoint 5 \(checkpoints: "
                                       r"checkpoints/ steps \[2\]\)"):
    evaluate.main(["evaluate", f"--workdir={other}", "--step=5"])
  shutil.rmtree(os.path.join(other, "export"))
  with pytest.raises(SystemExit, match=r"holds no export .*the run has not finished.*"
                                       r"--step=N .*checkpoints/ steps \[2\]"):
    sample.main(["sample", f"--workdir={other}", "--prompt=a"])


def _greedy_reference(cfg, params, prompt, steps, vocab_limit):
  """Uncached greedy decoding: the whole sequence through the model at every step."""
  with nnx.use_eager_sharding(False):
    graphdef, _ = nnx.split(registry.build(cfg.model, nnx.Rngs(0)))
  forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)[0])
  seq = np.zeros((1, len(prompt) + steps), np.int32)
  seq[0, :len(prompt)] = prompt
  for t in range(len(prompt), seq.shape[1]):
    logits = np.asarray(forward(params, jnp.asarray(seq)))[0, t - 1, :vocab_limit]
    seq[0, t] = logits.argmax()
  return seq[0, len(prompt):]


def test_sample_greedy_matches_the_uncached_reference_and_seeds_repeat(run, capsys):
  workdir, cfg, params = run
  sample.main(["sample", f"--workdir={workdir}", "--prompt=line 3", "--max_tokens=12",
               "--temperature=0", "--nostop_at_boundary"])
  got = capsys.readouterr().out.rstrip("\n")
  ids = _greedy_reference(cfg, params, [BOS, *b"line 3"], 12, vocab_limit=258)
  want = "line 3" + bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")
  assert got == want
  args = ["sample", f"--workdir={workdir}", "--prompt=line", "--max_tokens=8",
          "--temperature=1.0", "--top_k=50", "--num_samples=2"]
  sample.main(args + ["--seed=4"])
  first = capsys.readouterr().out
  sample.main(args + ["--seed=4"])
  assert capsys.readouterr().out == first
  assert first.count("--- sample ") == 2


@pytest.mark.parametrize("module,args,message", [
    (sample, ["--workdir={missing}", "--prompt=a"], "--workdir: '.*missing' is not a directory"),
    (sample, ["--workdir={empty}", "--prompt=a"], "--workdir: .* holds no export .* and no "
                                                  "checkpoint"),
    (sample, ["--workdir={run}", "--prompt="], "--prompt: is empty"),
    (sample, ["--workdir={run}", "--prompt_ids=5,999"], "--prompt_ids: token id 999 is outside "
                                                        r"the model's vocabulary \[0, 384\)"),
    (sample, ["--workdir={run}", "--prompt_ids=5,x"], "--prompt_ids: must be comma-separated"),
    (sample, ["--workdir={run}", "--prompt=a", "--max_tokens=0"], "--max_tokens: must be in"),
    (sample, ["--workdir={run}", "--prompt=a", "--temperature=-1"],
     "--temperature: must be >= 0"),
    (sample, ["--workdir={run}", "--prompt=a", "--top_k=-2"], "--top_k: must be in"),
    (sample, ["--workdir={run}", "--prompt=a", "--temperature=nan"],  # the rule of every flag
     "--temperature: must be a finite number, got nan"),
    (sample, ["--workdir={run}", "--prompt=a", "--temperature=inf"], "--temperature: must be a "),
    (sample, ["--workdir={run}", "--prompt=a", f"--max_tokens={2**21}"],
     r"--max_tokens: must be in \[1, 1048576\]"),
    (sample, ["--workdir={run}", "--prompt=a", f"--max_tokens={10**12}"],  # every flag's rule
     r"--max_tokens: must be at most 2147483647 in size"),
    (sample, ["--workdir={run}", "--prompt=a", f"--num_samples={10**6}"],
     r"--num_samples: must be in \[1, 4096\]"),
    (sample, ["--workdir={run}", "--prompt=a", "--max_tokens=many"], "flag --max_tokens=many"),
    (evaluate, ["--workdir={missing}"], "--workdir: '.*missing' is not a directory"),
    (evaluate, ["--workdir={empty}"], "--workdir: .* holds no export"),
    (evaluate, ["--workdir={run}", "--data=nope:x"], "--data: source 'nope' is not one of"),
    (evaluate, ["--workdir={run}", "--data=jsonl"], "--data: source 'jsonl' needs a path"),
    (evaluate, ["--workdir={run}", "--data=text:{missing}"], "--data: no directory or files"),
    (evaluate, ["--workdir={run}", "--batch_size=0"], "--batch_size: must be >= 1"),
    (evaluate, ["--workdir={run}", "--num_batches=-1"], "--num_batches: must be >= 0"),
    (evaluate, ["--workdir={run}", "--seq_len=1"], "--seq_len: must be >= 2"),
    (export_model, ["--workdir={empty}", "--format=safetensors"], "--workdir: .* holds no export"),
])
def test_bad_input_fails_in_one_line_naming_the_flag(run, tmp_path, module, args, message):
  os.makedirs(tmp_path / "empty")
  paths = {"missing": str(tmp_path / "missing"), "empty": str(tmp_path / "empty"),
           "run": run[0]}
  with pytest.raises(SystemExit) as e:
    module.main(["prog"] + [a.format(**paths) for a in args])
  text = str(e.value.code)
  assert "\n" not in text and text.startswith("prog: error: "), text
  assert re.search(message, text), text


@pytest.mark.slow
def test_the_commands_exit_1_with_one_line_on_stderr(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO)
  for module in ("diloco.cli.sample", "diloco.cli.evaluate"):
    done = subprocess.run([sys.executable, "-m", module, f"--workdir={tmp_path / 'none'}",
                           "--prompt=a" if module.endswith("sample") else "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--workdir: " in lines[0] and "is not a directory" in lines[0], \
        done.stderr


def _word_tokenizer(directory):
  """A word-level tokenizer.json with its tokenizer_config.json naming BOS and EOS."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  words = ["<unk>", "<eos>", "<bos>", "the", "syncer", "merged", "line", "of", "document",
           "fragments", "."]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  os.makedirs(directory)
  tok.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<bos>", "eos_token": "<eos>"}, f)
  return os.path.join(directory, "tokenizer.json")


def test_export_is_self_contained_and_loads_from_a_relative_path(run, tmp_path, monkeypatch,
                                                                  capsys):
  _, base, _ = run
  tokenizer = _word_tokenizer(str(tmp_path / "tok"))
  cfg = dataclasses.replace(base, data=dataclasses.replace(base.data, tokenizer=tokenizer))
  params = _make_run(str(tmp_path / "run"), cfg, seed=1)
  folder = tmp_path / "run" / "export"
  with open(folder / "export.json") as f:
    meta = json.load(f)
  assert meta["data"]["tokenizer"] == "tokenizer.json"
  assert meta["data"]["tokenizer_source"] == tokenizer
  assert sorted(os.listdir(folder)) == ["export.json", "params", "tokenizer.json",
                                        "tokenizer_config.json"]
  # The run's tokenizer and workdir are gone; the export folder alone, moved, still works.
  shutil.rmtree(tmp_path / "tok")
  os.makedirs(tmp_path / "elsewhere")
  shutil.move(str(folder), str(tmp_path / "elsewhere" / "model"))
  shutil.rmtree(tmp_path / "run")
  monkeypatch.chdir(tmp_path)
  loaded, meta = export.load("elsewhere/model")  # relative: Orbax alone refuses it
  for k, v in fragments.flatten_tree(params).items():
    np.testing.assert_array_equal(fragments.flatten_tree(loaded)[k], v)
  capsys.readouterr()
  model = trained.load("elsewhere/model")
  assert (model.tokenizer.bos_id, model.tokenizer.eos_id) == (2, 1)  # from tokenizer_config
  assert model.tokenizer.encode(b"the syncer merged").tolist() == [3, 4, 5]
  sample.main(["sample", "--workdir=elsewhere/model", "--prompt=the syncer", "--max_tokens=3",
               "--temperature=0"])
  # Greedy from the copied tokenizer's BOS; the decoded words come back through it too.
  out = capsys.readouterr().out.strip()
  assert out.startswith("the syncer") and len(out.split()) > 2, out


def test_safetensors_hold_the_exported_tensors(run, tmp_path, capsys):
  from safetensors.numpy import load_file
  workdir, cfg, params = run
  export_model.main(["diloco export", f"--workdir={workdir}", "--format=safetensors"])
  assert "model.safetensors" in capsys.readouterr().out
  orbax, meta = export.load(workdir)
  want = fragments.flatten_tree(orbax)
  for folder in (os.path.join(workdir, "export"), None):
    if folder is None:  # the same files, written by the end-of-run export itself
      folder = os.path.join(export.save(str(tmp_path / "again"), params, model=cfg.model,
                                        data=cfg.data, seed=cfg.seed, step=3,
                                        runtime="data_parallel", safetensors=True))
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    assert sorted(tensors) == sorted(want)
    assert "layers/0/attn/q_DNH" in tensors
    for k, v in want.items():
      assert tensors[k].dtype == v.dtype
      np.testing.assert_array_equal(tensors[k], v)
    with open(os.path.join(folder, "config.json")) as f:
      config = json.load(f)
    assert config["model"] == dataclasses.asdict(cfg.model) == meta["model"]
    assert (config["vocab_size"], config["tokenizer"]) == (384, "byte")
    assert config["tensors"]["embedder/embedding"] == {"shape": [384, 64], "dtype": "float32"}
  # An export written again without them drops the old copies, which would no longer match.
  again = export.save(str(tmp_path / "again"), params, model=cfg.model, data=cfg.data,
                      seed=cfg.seed, step=4, runtime="data_parallel")
  assert sorted(os.listdir(again)) == ["export.json", "params"]


def test_export_copies_the_tokenizer_that_prepared_shards_name(tmp_path):
  from diloco.train.data import DataConfig
  shards = tmp_path / "shards"
  tokenizer = _word_tokenizer(str(shards))
  with open(shards / "meta.json", "w") as f:
    json.dump({"tokenizer": "hf_tokenizers", "tokenizer_model": "tokenizer.json"}, f)
  folder = tmp_path / "export"
  os.makedirs(folder)
  data = DataConfig(source="array_record", path=str(shards))
  assert export._copy_tokenizer(data, str(folder)) == ("tokenizer.json", tokenizer)
  with open(tokenizer, "rb") as a, open(folder / "tokenizer.json", "rb") as b:
    assert a.read() == b.read()
  assert os.path.isfile(folder / "tokenizer_config.json")
  # An export.json naming a tokenizer that is neither in the folder nor at its path.
  with pytest.raises(export.ConfigError, match="tokenizer 'gone.json' is neither in the "
                                               "export folder nor at that path"):
    export.tokenizer_spec(str(folder), {"data": {"tokenizer": "gone.json"}})
  assert export.tokenizer_spec(str(folder), {"data": {"tokenizer": "tokenizer.json"}}) == \
      str(folder / "tokenizer.json")
  assert export.tokenizer_spec(str(folder), {"data": {"tokenizer": tokenizer}}) == tokenizer
