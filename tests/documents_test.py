"""Documents read back from disk (docs/decisions/store_and_trust.md "Documents read back from disk"): an export's
export.json and params/, a run's config.json and `--config_json`, a run checkpoint's meta, a
tokenizer's tokenizer_config.json.

Property tests mutate a valid document (type swaps, missing and extra keys, NaN and infinities,
huge integers, wrong nesting, truncated text) and require a valid object or a DocumentError /
ConfigError, never another exception; the issue's examples then run through the real commands
and must end in one line that names the file and the field.
"""

import copy
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import runtime_configs
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco import documents
from diloco.artifacts import export, trained
from diloco.cli import evaluate, export_model, sample
from diloco.config import run_config
from diloco.errors import ConfigError, DocumentError
from diloco.model import registry
from diloco.runtime import run_checkpoint
from diloco.train import tokenizers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROPERTY = settings(max_examples=60, deadline=5000, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

# JSON values a mutation puts in place of another: every type, NaN and infinities, integers
# far past any size, deep nesting.
_HUGE = st.sampled_from([10**6, 10**9, 2**63, 10**30, -1, 0, -(10**9)])
_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), _HUGE,
                  st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
_JSON = st.recursive(_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                    st.dictionaries(st.text(max_size=6), inner,
                                                                    max_size=3)),
                     max_leaves=8)


def _paths(doc, prefix=()):
  """Every key path of the nested objects and lists of `doc`."""
  out = []
  items = doc.items() if isinstance(doc, dict) else (
      enumerate(doc) if isinstance(doc, list) else ())
  for key, value in items:
    out.append(prefix + (key,))
    out += _paths(value, prefix + (key,))
  return out


@st.composite
def _mutated(draw, valid):
  """The JSON text of `valid` after one to three mutations, or a truncation of it."""
  doc = copy.deepcopy(valid)
  for _ in range(draw(st.integers(1, 3))):
    paths = _paths(doc)
    op = draw(st.sampled_from(["replace", "delete", "add", "wrap", "whole"]))
    if op == "whole" or not paths:
      doc = draw(_JSON)
      continue
    path = draw(st.sampled_from(paths))
    parent = doc
    for key in path[:-1]:
      parent = parent[key]
    key = path[-1]
    if op == "replace":
      parent[key] = draw(_JSON)
    elif op == "delete":
      del parent[key]
    elif op == "add" and isinstance(parent, dict):
      parent[draw(st.text(max_size=8))] = draw(_JSON)
    elif op == "wrap":
      parent[key] = [parent[key]] if draw(st.booleans()) else {"value": parent[key]}
  text = json.dumps(doc)
  if draw(st.booleans()) and draw(st.booleans()):
    text = text[:draw(st.integers(0, max(0, len(text) - 1)))]
  return text


def _write(path, text):
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A finished run's workdir (config.json, export/) holding a random tiny model."""
  root = tmp_path_factory.mktemp("documents")
  cfg = runtime_configs.load("dp.py:tiny")
  with nnx.use_eager_sharding(False):
    model = registry.build(cfg.model, nnx.Rngs(0))
  params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  workdir = str(root / "run")
  os.makedirs(workdir)
  _write(os.path.join(workdir, "config.json"), json.dumps(dataclasses.asdict(cfg)))
  export.save(workdir, params, model=cfg.model, data=cfg.data, seed=cfg.seed, step=3,
              runtime="data_parallel", extra={"eval/loss": float("nan")})
  return workdir, cfg


@pytest.fixture
def copy_of(run, tmp_path):
  """A fresh copy of the run to tamper with."""
  workdir = str(tmp_path / "run")
  shutil.copytree(run[0], workdir)
  return workdir


def _read(path):
  with open(path, encoding="utf-8") as f:
    return json.load(f)


# -- property tests: a valid object or one clear error, whatever the mutation ----------------

def test_the_readers_take_the_documents_their_writers_wrote(run):
  workdir, cfg = run
  meta = export.read_meta(os.path.join(workdir, "export"))
  assert math.isnan(meta["eval/loss"])  # a logged loss may be NaN; a field a reader uses not
  assert export.read_model(meta["model"], "export.json") == cfg.model
  assert trained.read_run_config(os.path.join(workdir, "config.json")).data == cfg.data
  assert run_config.read_file(os.path.join(workdir, "config.json")) == cfg


@PROPERTY
@given(data=st.data())
def test_mutated_export_json_loads_or_fails_in_one_clear_error(run, data):
  workdir = run[0]
  found = os.path.join(workdir, "export")
  meta_path = os.path.join(found, export.META_FILE)
  valid = _read(meta_path)
  original = json.dumps(valid)
  try:
    _write(meta_path, data.draw(_mutated(valid)))
    try:
      params, meta = export.load(found)
    except ConfigError:
      return
    assert meta["format"] == export.FORMAT and isinstance(meta["model"], dict)
    trained.build(trained.model_config(meta["model"], meta_path), params, "export")
  except ConfigError:
    pass
  finally:
    _write(meta_path, original)


@PROPERTY
@given(data=st.data())
def test_mutated_run_config_reads_or_fails_in_one_clear_error(run, tmp_path_factory, data):
  path = str(tmp_path_factory.mktemp("config") / "config.json")
  _write(path, data.draw(_mutated(_read(os.path.join(run[0], "config.json")))))
  for read in (run_config.read_file, trained.read_run_config):
    try:
      read(path)
    except ConfigError:
      pass


def _valid_meta(cfg):
  return {"syncer": {"rounds": 0}, "versions": [0, 0], "rounds": 0, "clock": 1.5,
          "initial_loss": 5.5, "finished": False, "identity": run_checkpoint.identity(cfg),
          "lengths": {"tape.jsonl": 0, "activity.jsonl": 0, "metrics.jsonl": 0},
          "slots": [{"index": 0, "status": "up", "incarnation": 0, "local_step": 4,
                     "data_state": None, "merged_step": 3}]}


@PROPERTY
@given(data=st.data())
def test_mutated_checkpoint_meta_passes_or_fails_in_one_clear_error(data):
  cfg = runtime_configs.load("decoupled.py:tiny")
  text = data.draw(_mutated(_valid_meta(cfg)))
  try:
    meta = run_checkpoint.check_meta(documents.parse(text, "meta"), "meta")
    run_checkpoint.check_resumable(run_checkpoint.Snapshot({}, {}, meta), cfg, "w")
  except ConfigError:
    pass


@PROPERTY
@given(data=st.data())
def test_mutated_tokenizer_config_reads_or_fails_in_one_clear_error(tmp_path_factory, data):
  path = str(tmp_path_factory.mktemp("tok") / "tokenizer_config.json")
  _write(path, data.draw(_mutated({"bos_token": "<s>", "eos_token": {"content": "</s>"},
                                   "pad_token": None})))
  try:
    tokens = tokenizers.HuggingFaceTokenizer._configured_tokens(path)
  except ConfigError:
    return
  assert all(isinstance(v, str) for v in tokens.values())


def test_documents_refuse_what_json_alone_lets_through(tmp_path):
  path = str(tmp_path / "d.json")
  for text, field, detail in [
      ("[1, 2", "", "is not JSON"), ("\xff".encode("latin-1"), "", "is not JSON"),
      ("[" * 100_000, "", "is not JSON"), ("1" * 5000, "", "is not JSON")]:
    with open(path, "wb") as f:
      f.write(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(DocumentError, match=detail) as e:
      documents.read(path)
    assert (e.value.file, e.value.field) == (path, field)
  for v, kind, message in [(True, int, "must be an integer, got True"),
                           ("2", int, "must be an integer, got '2'"),
                           (float("inf"), float, "must be a finite number"),
                           (10**400, float, "must be a finite number"),
                           (1, str, "must be a string, got 1")]:
    with pytest.raises(DocumentError, match=message):
      documents.value(v, kind, "f", "x")
  assert documents.value(2, float, "f", "x") == 2.0
  assert documents.value(False, bool, "f", "x") is False


# -- the examples, through the real commands -------------------------------------------

def _one_line(excinfo, *names):
  """The command's exit message: one line, naming each of `names`, no traceback."""
  message = str(excinfo.value.code)
  assert "\n" not in message and "Traceback" not in message, message
  for name in names:
    assert name in message, (name, message)
  return message


def _edit_export(workdir, edit):
  path = os.path.join(workdir, "export", export.META_FILE)
  meta = _read(path)
  _write(path, edit(meta) if callable(edit) else edit)


def _set_model(**fields):
  return lambda meta: json.dumps(dict(meta, model=dict(meta["model"], **fields)))


_EXPORT_CASES = {
    "not JSON": ("{\"format\": ", "export.json", "is not JSON"),
    "a list": ("[1, 2]", "export.json", "must be an object"),
    "no model": (lambda m: json.dumps({k: v for k, v in m.items() if k != "model"}),
                 "export.json", "model: is missing"),
    "data a string": (lambda m: json.dumps(dict(m, data="byte")), "export.json",
                      "data: must be an object"),
    "model without vocab_size": (
        lambda m: json.dumps(dict(m, model={k: v for k, v in m["model"].items()
                                            if k != "vocab_size"})),
        "export.json", "model.vocab_size: is missing"),
    "num_layers a string": (_set_model(num_layers="2"), "export.json",
                            "model.num_layers: must be an integer, got '2'"),
    "num_layers true": (_set_model(num_layers=True), "export.json", "model.num_layers"),
    "attention_pattern XQ": (_set_model(attention_pattern="XQ"), "export.json",
                             "model.attention_pattern: must be a string of L and G"),
    "num_layers 10**6": (_set_model(num_layers=10**6), "export.json", "model.num_layers"),
    "mlp_dim 10**9": (_set_model(mlp_dim=10**9), "export.json", "at least"),
    "rope_base inf": (lambda m: json.dumps(dict(m, model=dict(m["model"]))).replace(
        '"rope_base_local": 10000.0', '"rope_base_local": Infinity'), "export.json",
        "model.rope_base_local: must be a finite number"),
    "unknown model field": (_set_model(colour="red"), "export.json", "model.colour"),
}


@pytest.mark.parametrize("case", list(_EXPORT_CASES))
def test_a_tampered_export_json_is_one_line_from_every_command(copy_of, case):
  edit, *names = _EXPORT_CASES[case]
  _edit_export(copy_of, edit)
  for command, argv in ((sample.main, ["--prompt=a", "--max_tokens=1"]),
                        (evaluate.main, ["--num_batches=1"]),
                        (export_model.main, ["--format=safetensors"])):
    with pytest.raises(SystemExit) as e:
      command(["diloco", f"--workdir={copy_of}", *argv])
    _one_line(e, *names)


@pytest.mark.parametrize("make", ["missing", "a file", "empty"])
def test_params_missing_or_a_plain_file_is_named(copy_of, make):
  params = os.path.join(copy_of, "export", export.PARAMS_DIR)
  shutil.rmtree(params)
  if make == "a file":
    _write(params, "not a checkpoint")
  elif make == "empty":
    os.makedirs(params)
  for command, argv in ((sample.main, ["--prompt=a"]), (export_model.main, ["--format=safetensors"])):
    with pytest.raises(SystemExit) as e:
      command(["diloco", f"--workdir={copy_of}", *argv])
    _one_line(e, params)


def test_model_module_runs_only_with_the_flag(copy_of, tmp_path):
  marker = str(tmp_path / "ran")
  code = str(tmp_path / "planted.py")
  _write(code, f"open({marker!r}, 'w').close()\n")
  _edit_export(copy_of, _set_model(module=code))
  for command, argv in ((sample.main, ["--prompt=a", "--max_tokens=1"]),
                        (evaluate.main, ["--num_batches=1"]), (export_model.main, ["--format=safetensors"])):
    with pytest.raises(SystemExit) as e:
      command(["diloco", f"--workdir={copy_of}", *argv])
    _one_line(e, "export.json", "model.module", "--trust_export_code")
  assert not os.path.exists(marker)
  # A run's config.json is read by `--step`, and refused the same way.
  config = os.path.join(copy_of, "config.json")
  raw = _read(config)
  _write(config, json.dumps(dict(raw, model=dict(raw["model"], module=code))))
  with pytest.raises(SystemExit) as e:
    sample.main(["diloco", f"--workdir={copy_of}", "--prompt=a", "--step=1"])
  _one_line(e, "config.json", "model.module", "--trust_export_code")
  assert not os.path.exists(marker)
  sample.main(["diloco", f"--workdir={copy_of}", "--prompt=a", "--max_tokens=1",
               "--trust_export_code"])
  assert os.path.exists(marker)


_RUN_CONFIG_CASES = {
    "a list": ("[]", "must be an object"),
    "not JSON": ("{\"model\"", "is not JSON"),
    "no model": (lambda c: json.dumps({k: v for k, v in c.items() if k != "model"}),
                 "model: is missing"),
    "seq_len a string": (lambda c: json.dumps(dict(c, data=dict(c["data"], seq_len="32"))),
                         "data.seq_len: must be an integer, got '32'"),
}


@pytest.mark.parametrize("case", list(_RUN_CONFIG_CASES))
def test_a_tampered_run_config_is_one_line_from_evaluate_and_sample_step(copy_of, case):
  edit, detail = _RUN_CONFIG_CASES[case]
  path = os.path.join(copy_of, "config.json")
  _write(path, edit(_read(path)) if callable(edit) else edit)
  for command, argv in ((evaluate.main, ["--num_batches=1"]),
                        (sample.main, ["--prompt=a", "--step=1"])):
    with pytest.raises(SystemExit) as e:
      command(["diloco", f"--workdir={copy_of}", *argv])
    _one_line(e, "config.json", detail)


@pytest.mark.parametrize("doc, names", [
    ("[]", ["must be an object of groups"]),
    ('{"train": 5}', ["train", "must be an object"]),
    ('{"seed": "x"}', ["seed", "must be an integer"]),
    ('{"seed": true}', ["seed", "must be an integer"]),
    ('{"optim": {"learning_rate": Infinity}}', ["optim.learning_rate", "finite"]),
    ('{"outer": {"learning_rate": 1e999}}', ["outer.learning_rate", "finite"]),
    ('{"model": {"num_layers": "2"}}', ["model.num_layers", "must be int"]),
    ('{"model": {"nope": 1}}', ["model.nope"]),
    ('{"seed": 1', ["is not JSON"]),
])
def test_config_json_is_one_document_error(tmp_path, doc, names):
  path = str(tmp_path / "config.json")
  _write(path, doc)
  with pytest.raises(DocumentError) as e:
    run_config.read_file(path)
  assert f"--config_json={path}" in str(e.value)
  for name in names:
    assert name in str(e.value)


def test_config_json_through_the_training_command_is_one_line(tmp_path):
  path = str(tmp_path / "config.json")
  _write(path, '{"train": 5}')
  out = subprocess.run([sys.executable, "-m", "diloco.main", f"--config_json={path}",
                        f"--workdir={tmp_path / 'w'}"], capture_output=True, text=True,
                       cwd=REPO, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 1
  assert out.stderr.strip().splitlines() == [
      f"config error: --config_json={path}: train: must be an object of the group's fields, "
      "got 5"], out.stderr


def test_sample_through_a_subprocess_prints_one_line(copy_of):
  _edit_export(copy_of, _set_model(attention_pattern="XQ"))
  out = subprocess.run([sys.executable, "-m", "diloco.cli.sample", f"--workdir={copy_of}",
                        "--prompt=a"], capture_output=True, text=True, cwd=REPO, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 1 and "Traceback" not in out.stderr
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and "export.json: model.attention_pattern:" in lines[0], out.stderr


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A run checkpoint saved by the real RunCheckpointer, with a valid meta."""
  cfg = runtime_configs.load("decoupled.py:tiny")
  workdir = str(tmp_path_factory.mktemp("ckpt"))
  ckpt = run_checkpoint.RunCheckpointer(workdir, cfg)
  tensors = {"layers/0/w": np.ones((2, 2), np.float32)}
  ckpt.save(run_checkpoint.Snapshot(tensors, tensors, _valid_meta(cfg)))
  ckpt.close()
  return workdir, cfg


@pytest.mark.parametrize("case", ["no identity", "lengths a string", "a list", "not JSON",
                                  "slot index a string"])
def test_a_tampered_checkpoint_meta_is_one_document_error(checkpoint, tmp_path, case):
  source, cfg = checkpoint
  workdir = str(tmp_path / "w")
  shutil.copytree(source, workdir)
  path = os.path.join(workdir, run_checkpoint.DIRECTORY, "1", "meta", "metadata")  # Orbax's
  meta = _read(path)
  text = {"no identity": lambda: json.dumps({k: v for k, v in meta.items() if k != "identity"}),
          "lengths a string": lambda: json.dumps(dict(meta, lengths="0")),
          "a list": lambda: "[]", "not JSON": lambda: "{\"syncer\"",
          "slot index a string": lambda: json.dumps(
              dict(meta, slots=[dict(meta["slots"][0], index="0")]))}[case]()
  _write(path, text)
  ckpt = run_checkpoint.RunCheckpointer(workdir, cfg)
  try:
    with pytest.raises(DocumentError) as e:
      snapshot = ckpt.load()
      run_checkpoint.check_resumable(snapshot, cfg, workdir)
  finally:
    ckpt.close()
  assert "\n" not in str(e.value)
  assert os.path.join(run_checkpoint.DIRECTORY, "1") in e.value.file


def test_tokenizer_config_not_json_is_named(tmp_path):
  path = str(tmp_path / "tokenizer_config.json")
  _write(path, "{bos")
  with pytest.raises(DocumentError) as e:
    tokenizers.HuggingFaceTokenizer._configured_tokens(path)
  assert e.value.file == path and "is not JSON" in str(e.value)


def test_a_checkpoint_that_does_not_fit_the_runtime_is_refused_before_restoring():
  """`restore` checks the meta against the runtime first: a version per fragment, every
  tensor of the plan, slot indexes that exist (the syncer is never touched)."""
  from types import SimpleNamespace
  cfg = runtime_configs.load("decoupled.py:tiny")
  rt = SimpleNamespace(plan=SimpleNamespace(fragments=[["a"], ["b"]]), slots=[None], syncer=None)
  tensors = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
  meta = _valid_meta(cfg)
  for bad, field in [(dict(meta, versions=[0]), "versions"),
                     (dict(meta, slots=[dict(meta["slots"][0], index=3)]), "slots.0.index")]:
    with pytest.raises(DocumentError) as e:
      run_checkpoint.restore(rt, run_checkpoint.Snapshot(tensors, tensors, bad, "ckpt/1"))
    assert (e.value.file, e.value.field) == ("ckpt/1/meta", field)
  with pytest.raises(DocumentError) as e:
    run_checkpoint.restore(rt, run_checkpoint.Snapshot({"a": tensors["a"]}, tensors, meta,
                                                        "ckpt/1"))
  assert (e.value.file, e.value.field) == ("ckpt/1/params", "b")


# -- the tools' readers: compare, benchmarks, curves, ArrayRecord shards, `datasets` folders ---

def _readers():
  """(name, valid document, reader of a path) for every other document the tools read."""
  from diloco.cli import benchmarks, compare
  from diloco.observe import curves
  from diloco.train import corpus, data
  config = {"train": {"batch_size": 8, "eval_batches": 2, "init_from": ""},
            "data": {"seq_len": 64}, "learners": {"count": 2}}
  results = {"results": {"arc": {"acc,none": 0.5, "acc_stderr,none": 0.1}},
             "higher_is_better": {"arc": {"acc": True}}, "n-samples": {"arc": {"effective": 9}}}

  def in_folder(name):
    def read(path):
      folder = os.path.dirname(path)
      os.replace(path, os.path.join(folder, name))
      try:
        return reader_of[name](folder)
      finally:
        os.replace(os.path.join(folder, name), path)
    return read

  reader_of = {
      "meta.json": lambda folder: data.shard_paths(data.DataConfig(
          source="array_record", path=folder, seq_len=64), "train"),
      "dataset_dict.json": lambda folder: corpus.datasets_arrow_files(folder, "train"),
  }
  return [
      ("accounting.json", {"accounting/goodput": 0.9, "eval/loss": 2.5, "other": [1]},
       compare._accounting),
      ("config.json (compare)", config, lambda p: compare.eval_windows(os.path.dirname(p))),
      ("config.json (curves)", config, curves.run_shape),
      ("results.json", results, lambda p: benchmarks.lines(benchmarks.read_results(p))),
      ("meta.json", {"seq_len": 64, "vocab_size": 259, "shards": {"train": [], "eval": []}},
       in_folder("meta.json")),
      ("dataset_dict.json", {"splits": ["train"]}, in_folder("dataset_dict.json")),
  ]


READERS = _readers()


@pytest.mark.parametrize("name, valid, read", READERS, ids=[r[0] for r in READERS])
def test_every_tools_reader_takes_a_mutated_document_or_fails_in_one_line(
    tmp_path_factory, name, valid, read):
  folder = tmp_path_factory.mktemp("reader")
  path = str(folder / "doc.json")
  _write(path, json.dumps(valid))
  try:
    read(path)  # the valid document is read (or stops at what lies beyond it, one line)
  except ConfigError as e:
    assert "\n" not in str(e) and "doc.json" not in str(e), e

  @PROPERTY
  @given(text=_mutated(valid))
  def one_line(text):
    _write(path, text)
    try:
      read(path)
    except ConfigError as e:
      assert "\n" not in str(e), str(e)

  one_line()
