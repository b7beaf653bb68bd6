"""Corpus, tokenizers, per-learner shards, eval split, iterator state and prepared shards."""

import dataclasses
import glob
import importlib
import os
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
from script_import import import_script

from diloco.errors import ConfigError
from diloco.train import corpus as corpus_lib
from diloco.train import data, tokenizers
from diloco.train.data import DataConfig

REPO = os.path.dirname(os.path.dirname(__file__))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """60 documents whose every line is unique, so any window identifies its origin."""
  root = tmp_path_factory.mktemp("corpus")
  for d in range(60):
    lines = [f"doc{d:03d} line{i:03d}\n" for i in range(120)]  # 33 bytes hold a whole line
    (root / f"doc{d:03d}.txt").write_text("".join(lines))
  return str(root)


def _cfg(corpus, **kw):
  return DataConfig(source="text", path=corpus, seq_len=32, eval_fraction=0.2, **kw)


def _rows(ds, n):
  it = iter(ds)
  return [bytes(row.astype(np.uint8)) for _ in range(n) for row in next(it)]


def test_default_corpus_is_real_python_source():
  files = data.stdlib_files()
  assert len(files) > 100 and all(f.endswith(".py") for f in files)
  streams = data.split_tokens(DataConfig(seq_len=64, max_bytes=2_000_000))
  text = bytes(streams["train"][:200_000][streams["train"][:200_000] < 256].astype(np.uint8))
  assert b"def " in text and b"import " in text
  assert len(streams["eval"]) > 10_000


def _globbed(root):
  """The standard library's listing as it was first written: a recursive glob, filtered."""
  return sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                if "site-packages" not in f and "dist-packages" not in f)


def test_stdlib_listing_is_the_recursive_globs(tmp_path):
  assert data.stdlib_files() == _globbed(sysconfig.get_paths()["stdlib"])
  for name in ("a.py", "b.txt", ".hidden.py", "pkg/c.py", "pkg/sub/d.py", ".git/e.py",
               "site-packages/f.py", "my-dist-packages-g/h.py", "pkg/__pycache__/c.pyc",
               "dir.py/i.py", "real/j.py"):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x = 1\n")
  (tmp_path / "linked").symlink_to(tmp_path / "real", target_is_directory=True)
  root = str(tmp_path)
  assert list(corpus_lib._stdlib_files(root)) == _globbed(root)  # pylint: disable=protected-access
  assert os.path.join(root, "linked", "j.py") in _globbed(root)


def test_learner_shards_are_disjoint_and_cover_the_split(corpus):
  cfg = _cfg(corpus)
  windows = len(data.TokenWindows(data.split_tokens(cfg)["train"], cfg.seq_len + 1))
  shards = []
  for lid in range(4):
    ds = data.train_dataset(cfg, batch_size=1, learner_id=lid, num_learners=4, seed=3)
    shards.append(set(_rows(ds, windows // 4)))   # one epoch of each shard
  for i in range(4):
    for j in range(i + 1, 4):
      assert not shards[i] & shards[j]
  assert sum(len(s) for s in shards) == 4 * (windows // 4)


def test_shards_are_deterministic_and_seeded(corpus):
  cfg = _cfg(corpus)
  def make(seed):
    return data.train_dataset(cfg, batch_size=4, learner_id=1, num_learners=2,
                                           seed=seed)
  assert _rows(make(0), 5) == _rows(make(0), 5)
  assert _rows(make(0), 5) != _rows(make(1), 5)


def test_eval_split_is_never_trained_on(corpus):
  cfg = _cfg(corpus)
  streams = data.split_tokens(cfg)
  def as_text(t):
    return bytes(t[t < 256].astype(np.uint8)).decode()
  eval_docs = {line.split(" line")[0] for line in as_text(streams["eval"]).splitlines()}
  train_docs = {line.split(" line")[0] for line in as_text(streams["train"]).splitlines()}
  assert eval_docs and train_docs and not eval_docs & train_docs
  expected = {f"doc{d:03d}" for d in range(60)
              if data.is_eval_document(f"doc{d:03d}.txt", 0.2)}
  assert eval_docs == expected


def test_iterator_state_resumes_exactly(corpus):
  ds = data.train_dataset(_cfg(corpus), batch_size=3, learner_id=0, num_learners=1, seed=0)
  it = iter(ds)
  for _ in range(7):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(20)]  # crosses an epoch boundary
  resumed = iter(ds)
  resumed.set_state(state)
  for want in expected:
    np.testing.assert_array_equal(next(resumed), want)


def test_byte_tokenizer_round_trip():
  tok = tokenizers.ByteTokenizer()
  text = "héllo, wörld ✓\n"
  ids = tok.encode(text.encode())
  assert ids.max() < 256 and tok.decode(ids) == text
  assert tok.vocab_size == 258


def test_bad_paths_and_tiny_corpora_are_reported(tmp_path):
  with pytest.raises(ConfigError, match="data.path: no files found"):
    data.text_files(str(tmp_path / "missing*.txt"))
  (tmp_path / "a.txt").write_text("short")
  with pytest.raises(ConfigError, match="too few for data.seq_len"):
    data.split_tokens(DataConfig(source="text", path=str(tmp_path), seq_len=32))
  with pytest.raises(ConfigError, match="learner_id=3 must be in"):
    data.train_dataset(DataConfig(), batch_size=1, learner_id=3, num_learners=2)
  with pytest.raises(ConfigError, match="has no meta.json"):
    data.read_meta(str(tmp_path))


@pytest.mark.parametrize("tokenizer", ["byte", "sentencepiece"])
def test_prepare_data_shards_round_trip(corpus, tmp_path, tokenizer):
  out = tmp_path / "shards"
  proc = subprocess.run(
      [sys.executable, "scripts/prepare_data.py", f"--out={out}", "--source=text",
       f"--path={corpus}", f"--tokenizer={tokenizer}", "--vocab_size=300", "--seq_len=32",
       "--eval_fraction=0.2", "--shards=3"], capture_output=True, text=True, cwd=REPO,
      timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  meta = data.read_meta(str(out))
  assert meta["seq_len"] == 32 and len(meta["shards"]["train"]) == 3
  cfg = DataConfig(source="array_record", path=str(out), seq_len=32)
  assert data.vocab_size(cfg) == (300 if tokenizer == "sentencepiece" else 258)
  ds = data.train_dataset(cfg, batch_size=4, learner_id=0, num_learners=2, seed=0)
  batch = next(iter(ds))
  assert batch.shape == (4, 33) and batch.dtype == np.int32
  assert batch.max() < data.vocab_size(cfg)
  text_cfg = dataclasses.replace(_cfg(corpus))
  if tokenizer == "sentencepiece":
    tok = tokenizers.SentencePieceTokenizer(str(out / "tokenizer.model"))
    sample = "doc007 line003\ndoc007 line004"
    assert tok.decode(tok.encode(sample.encode())) == sample
    text_cfg = dataclasses.replace(text_cfg, tokenizer=str(out / "tokenizer.model"))
  # The shards hold exactly the windows of the text pipeline with the same tokenizer.
  windows = data.TokenWindows(data.split_tokens(text_cfg)["eval"], 33)
  evals = data.eval_batches(cfg, batch_size=2, num_batches=1)[0]
  np.testing.assert_array_equal(evals[0], windows[0])
  with pytest.raises(ConfigError, match="data.seq_len=16 does not match"):
    data.train_dataset(dataclasses.replace(cfg, seq_len=16), batch_size=1)


# --- Existing tokenizer files: SentencePiece models and Hugging Face tokenizer.json ---------

SAMPLE = "On Monday the baker of Arlen made 3 loaves.\n  12 + 4 = 16, naïve ✓\n"


def _lines(n=400):
  return [f"doc{d:03d} line{i:03d} the baker sold {d + i} loaves" for d in range(n // 10)
          for i in range(10)]


def _train_bpe_json(path, vocab_size=300, specials=("<pad>", "<bos>", "<eos>")):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(_lines(), trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(path))
  return str(path)


def _train_sentencepiece(prefix, **ids):
  import sentencepiece as spm
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(_lines()), model_prefix=str(prefix), vocab_size=400,
      model_type="bpe", byte_fallback=True, character_coverage=1.0,
      remove_extra_whitespaces=False, normalization_rule_name="identity", minloglevel=2, **ids)
  return str(prefix) + ".model"


def test_hf_tokenizer_json_round_trip_and_special_tokens(tmp_path):
  path = _train_bpe_json(tmp_path / "tokenizer.json")
  tok = tokenizers.make(path)
  assert isinstance(tok, tokenizers.HuggingFaceTokenizer)
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 300)
  ids = tok.encode(SAMPLE.encode())
  assert ids.dtype == np.int32 and 3 <= ids.min() and ids.max() < 300
  assert len(ids) < len(SAMPLE.encode())          # merges learned from the training lines
  assert tok.decode(ids) == SAMPLE                 # byte-level BPE: exact round trip
  assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == SAMPLE   # specials dropped, as SP does
  # A directory holding tokenizer.json resolves to it.
  assert tokenizers.make(str(tmp_path)).vocab_size == 300


def test_hf_tokenizer_specials_from_config_or_well_known_names(tmp_path):
  # GPT-2 style: a single <|endoftext|> separates documents (no BOS of its own).
  gpt2 = tmp_path / "gpt2"
  gpt2.mkdir()
  tok = tokenizers.make(_train_bpe_json(gpt2 / "tokenizer.json", specials=("<|endoftext|>",)))
  assert tok.bos_id == tok.eos_id == 0 and tok.pad_id == -1
  # transformers' tokenizer_config.json names the specials, in either of its two spellings.
  named = tmp_path / "named"
  named.mkdir()
  path = _train_bpe_json(named / "tokenizer.json", specials=("[A]", "[B]", "<bos>"))
  (named / "tokenizer_config.json").write_text(
      '{"bos_token": {"content": "[B]"}, "eos_token": "[A]"}')
  tok = tokenizers.HuggingFaceTokenizer(path)
  assert (tok.bos_id, tok.eos_id) == (1, 0)
  # WordPiece (BERT style): [CLS] and [SEP] by name; the normaliser lowercases.
  from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
  wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
  wp.normalizer = normalizers.BertNormalizer(lowercase=True)
  wp.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  wp.train_from_iterator(_lines(), trainers.WordPieceTrainer(
      vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"], show_progress=False))
  wp.save(str(tmp_path / "wordpiece.json"))
  tok = tokenizers.make(str(tmp_path / "wordpiece.json"))
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
  assert tok.decode(tok.encode(b"Doc001 LINE002 the baker")) == "doc001 line002 the baker"
  # No BOS or EOS at all: the pipeline could not separate documents.
  _train_bpe_json(tmp_path / "bare.json", specials=("<pad>",))
  with pytest.raises(ConfigError, match="data.tokenizer: .*bare.json.* has no BOS or EOS"):
    tokenizers.make(str(tmp_path / "bare.json"))


def test_sentencepiece_model_file_in_gemma_layout(tmp_path):
  path = _train_sentencepiece(tmp_path / "gemma", pad_id=0, eos_id=1, bos_id=2, unk_id=3)
  tok = tokenizers.make(path)
  assert isinstance(tok, tokenizers.SentencePieceTokenizer)
  assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.vocab_size) == (0, 1, 2, 400)
  ids = tok.encode(SAMPLE.encode())
  assert tok.decode(ids) == SAMPLE and tok.bos_id not in ids
  # A model without BOS separates documents with its EOS.
  no_bos = tokenizers.make(_train_sentencepiece(tmp_path / "nobos", bos_id=-1, eos_id=1,
                                                unk_id=0, pad_id=-1))
  assert no_bos.bos_id == no_bos.eos_id == 1 and no_bos.pad_id == -1
  (tmp_path / "dir").mkdir()
  (tmp_path / "dir" / "tokenizer.model").write_bytes(open(path, "rb").read())
  assert tokenizers.make(str(tmp_path / "dir")).bos_id == 2


def test_bad_tokenizer_files_name_the_field(tmp_path):
  with pytest.raises(ConfigError, match=r"data.tokenizer: .*nope.model.*\(no such file\)"):
    tokenizers.make(str(tmp_path / "nope.model"))
  with pytest.raises(ConfigError, match="data.tokenizer: directory .* has no tokenizer.json"):
    tokenizers.make(str(tmp_path))
  (tmp_path / "broken.json").write_text('{"version": "1.0", "model": 3}')
  with pytest.raises(ConfigError, match="data.tokenizer: .*broken.json.* is not a `tokenizers`"):
    tokenizers.make(str(tmp_path / "broken.json"))
  (tmp_path / "broken.model").write_bytes(b"\x00\x01 not a model")
  with pytest.raises(ConfigError, match="data.tokenizer: .*broken.model.* is not a SentencePiece"):
    tokenizers.make(str(tmp_path / "broken.model"))


def test_vocab_check_names_model_and_tokenizer(tiny_config, replace, tmp_path):
  from diloco.runtime import data_parallel
  path = _train_bpe_json(tmp_path / "tokenizer.json", vocab_size=300)
  assert tokenizers.make(path).vocab_size == 300
  cfg = replace(replace(tiny_config, "data", tokenizer=path), "model", vocab_size=299)
  with pytest.raises(ConfigError, match=r"model.vocab_size=299 is smaller than the tokenizer's "
                                        r"300 ids \(data.tokenizer='.*tokenizer.json'\); set "
                                        r"--config.model.vocab_size=300"):
    data_parallel.check_vocab(cfg)
  data_parallel.check_vocab(replace(cfg, "model", vocab_size=300))
  # The multi-process launcher checks before it starts any process.
  from configs import multiprocess
  from diloco.config import run_config
  from diloco.distributed import launcher
  mp = run_config.from_config_dict(multiprocess.get_config("tiny"))
  mp = replace(replace(mp, "data", tokenizer=path), "model", vocab_size=299)
  with pytest.raises(ConfigError, match=r"model.vocab_size=299 is smaller .* 300 ids"):
    launcher.run(mp, str(tmp_path / "mp"))
  assert not (tmp_path / "mp").exists()


# --- Record sources: jsonl, parquet, Hugging Face datasets directories ------------------------

def _doc(d):
  return "".join(f"doc{d:03d} line{i:03d}\n" for i in range(40))


DOCS = [_doc(d) for d in range(60)]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
  """The same 60 documents as jsonl (plain + gzip), parquet (2 files) and `datasets` dirs."""
  import gzip
  import json

  import datasets
  import pyarrow as pa
  import pyarrow.parquet as pq
  datasets.disable_progress_bars()
  root = tmp_path_factory.mktemp("records")
  (root / "jsonl").mkdir()
  rows = [{"id": d, "body": text} for d, text in enumerate(DOCS)]
  with open(root / "jsonl" / "a.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows[:30])
    f.write("\n")                                   # blank lines are skipped
  with gzip.open(root / "jsonl" / "b.jsonl.gz", "wt") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows[30:])
  (root / "jsonl" / "notes.txt").write_text("not a record")   # other files are ignored
  (root / "parquet").mkdir()
  pq.write_table(pa.table({"id": list(range(30)), "body": DOCS[:30]}),
                 root / "parquet" / "a.parquet")
  pq.write_table(pa.table({"id": list(range(30, 60)), "body": DOCS[30:]}),
                 root / "parquet" / "b.parquet", row_group_size=7)
  full = datasets.Dataset.from_dict({"id": list(range(60)), "body": DOCS})
  datasets.DatasetDict({"train": full, "test": full.select(range(5))}).save_to_disk(
      str(root / "dsdict"), num_shards={"train": 3, "test": 1})
  full.save_to_disk(str(root / "dataset"))
  # A `datasets` cache, as `load_dataset` leaves it (the json builder runs offline).
  offline = os.environ.get("HF_HUB_OFFLINE")
  os.environ["HF_HUB_OFFLINE"] = "1"
  try:
    datasets.load_dataset("json", data_files={"train": str(root / "jsonl" / "a.jsonl")},
                          cache_dir=str(root / "cache"))
  finally:
    if offline is None:
      del os.environ["HF_HUB_OFFLINE"]
    else:
      os.environ["HF_HUB_OFFLINE"] = offline
  return root


SOURCES = [("jsonl", "jsonl"), ("parquet", "parquet"), ("datasets", "dsdict"),
           ("datasets", "dataset")]


def _rcfg(records, source, sub, **kw):
  kw = {"text_key": "body", "seq_len": 32, "eval_fraction": 0.2, **kw}
  return DataConfig(source=source, path=str(records / sub), **kw)


def test_record_sources_give_the_same_token_streams(records):
  reference = data.split_tokens(_rcfg(records, "jsonl", "jsonl"))
  for source, sub in SOURCES[1:]:
    streams = data.split_tokens(_rcfg(records, source, sub))
    for split in ("train", "eval"):
      np.testing.assert_array_equal(streams[split], reference[split], err_msg=f"{source}/{sub}")
  # Single files and globs work too.
  one = data.split_tokens(_rcfg(records, "parquet", "parquet/*.parquet"))
  np.testing.assert_array_equal(one["train"], reference["train"])


@pytest.mark.parametrize("source,sub", SOURCES[:3])
def test_record_sources_hold_out_whole_documents_by_content(records, source, sub):
  cfg = _rcfg(records, source, sub)
  streams = data.split_tokens(cfg)
  tok = tokenizers.ByteTokenizer()
  def doc_names(tokens):
    return {line.split(" line")[0] for line in tok.decode(tokens).splitlines()}
  expected = {f"doc{d:03d}" for d in range(60) if data.is_eval_document(DOCS[d].encode(), 0.2)}
  assert 0 < len(expected) < 60
  assert doc_names(streams["eval"]) == expected
  assert doc_names(streams["train"]) == {f"doc{d:03d}" for d in range(60)} - expected
  # Documents are separated by BOS: one per document, each followed by the whole text.
  assert (streams["train"] == tok.bos_id).sum() == 60 - len(expected)


@pytest.mark.parametrize("source,sub", SOURCES[:3])
def test_record_sources_give_disjoint_learner_shards(records, source, sub):
  cfg = _rcfg(records, source, sub)
  windows = len(data.TokenWindows(data.split_tokens(cfg)["train"], cfg.seq_len + 1))
  shards = [set(_rows(data.train_dataset(cfg, batch_size=1, learner_id=i, num_learners=3,
                                          seed=1), windows // 3)) for i in range(3)]
  assert all(not shards[i] & shards[j] for i in range(3) for j in range(i + 1, 3))
  assert sum(len(s) for s in shards) == 3 * (windows // 3)
  evals = data.eval_batches(cfg, batch_size=2, num_batches=2)
  assert all(b.shape == (2, 33) for b in evals)
  assert not {bytes(r.astype(np.uint8)) for b in evals for r in b} & set().union(*shards)


def test_datasets_splits_and_cache_directories(records):
  test_split = data.split_tokens(_rcfg(records, "datasets", "dsdict", split="test"))
  full = data.split_tokens(_rcfg(records, "datasets", "dsdict"))
  assert len(test_split["train"]) + len(test_split["eval"]) < len(full["train"]) / 5
  from diloco.train import corpus
  with pytest.raises(ConfigError, match=r"data.split: 'validation' is not a split of .*"
                                        r"\['train', 'test'\]"):
    corpus.datasets_arrow_files(str(records / "dsdict"), "validation")
  # load_dataset's cache: found below the root, read like a save_to_disk directory.
  files = corpus.datasets_arrow_files(str(records / "cache"), "train")
  assert len(files) == 1 and files[0].endswith("json-train.arrow")
  cached = data.split_tokens(_rcfg(records, "datasets", "cache", eval_fraction=0.5))
  first_half = data.split_tokens(_rcfg(records, "jsonl", "jsonl/a.jsonl", eval_fraction=0.5))
  np.testing.assert_array_equal(cached["train"], first_half["train"])


def test_record_sources_with_a_tokenizer_file_round_trip(records, tmp_path):
  path = _train_bpe_json(tmp_path / "tokenizer.json")
  cfg = _rcfg(records, "parquet", "parquet", tokenizer=path)
  tok = tokenizers.make(path)
  streams = data.split_tokens(cfg)
  assert streams["train"].max() < tok.vocab_size
  docs = np.split(streams["train"], np.flatnonzero(streams["train"] == tok.bos_id))[1:]
  texts = [tok.decode(d) for d in docs]
  assert texts == [t for t in DOCS if not data.is_eval_document(t.encode(), 0.2)]
  assert data.vocab_size(cfg) == 300


def test_record_source_errors_name_the_field(records, tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  def split(source, path, **kw):
    return data.split_tokens(DataConfig(source=source, path=str(path), seq_len=8, **kw))
  with pytest.raises(ConfigError, match=r"data.text_key: .*a.jsonl:1 has no field 'text'; "
                                        r"it has \['body', 'id'\]"):
    split("jsonl", records / "jsonl")
  with pytest.raises(ConfigError, match=r"data.text_key: .*a.parquet has no column 'text'"):
    split("parquet", records / "parquet")
  with pytest.raises(ConfigError, match=r"data.text_key: .*data-00000-of-00003.arrow has no "
                                        r"column 'text'; it has \['id', 'body'\]"):
    split("datasets", records / "dsdict")
  with pytest.raises(ConfigError, match=r"data.text_key: column 'id' of .* is int64, not a str"):
    split("parquet", records / "parquet", text_key="id")
  with pytest.raises(ConfigError, match=r"data.text_key: field 'id' at .*:1 is a int, not a str"):
    split("jsonl", records / "jsonl", text_key="id")
  (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
  with pytest.raises(ConfigError, match=r"data.path: .*bad.jsonl:2 is not valid JSON"):
    split("jsonl", tmp_path / "bad.jsonl")
  (tmp_path / "list.jsonl").write_text('["text"]\n')
  with pytest.raises(ConfigError, match=r"data.path: .*list.jsonl:1 is a JSON list"):
    split("jsonl", tmp_path / "list.jsonl")
  pq.write_table(pa.table({"text": ["", None, ""]}), tmp_path / "empty.parquet")
  with pytest.raises(ConfigError, match=r"data.path: parquet corpus .* has no non-empty "
                                        r"documents in data.text_key='text'"):
    split("parquet", tmp_path / "empty.parquet")
  (tmp_path / "notparquet.parquet").write_text("hello")
  with pytest.raises(ConfigError, match=r"data.path: .*notparquet.parquet is not a parquet"):
    split("parquet", tmp_path / "notparquet.parquet")
  with pytest.raises(ConfigError, match=r"data.path: no files \(.parquet\) found"):
    split("parquet", records / "jsonl")
  with pytest.raises(ConfigError, match=r"data.path: .* holds no `datasets` directory"):
    split("datasets", records / "parquet")
  with pytest.raises(ConfigError, match=r"data.path: .* is not a directory"):
    split("datasets", records / "parquet" / "a.parquet")


def test_config_validation_of_record_sources(tiny_config, replace, records):
  from diloco.config import run_config
  with pytest.raises(ConfigError, match=r"data.path: is required when data.source='jsonl'"):
    run_config.validate(replace(tiny_config, "data", source="jsonl"))
  with pytest.raises(ConfigError, match=r"data.text_key: must name"):
    run_config.validate(replace(tiny_config, "data", source="jsonl",
                                path=str(records / "jsonl"), text_key=""))
  with pytest.raises(ConfigError, match=r"data.tokenizer: must be 'byte' or .* \(no such file\)"):
    run_config.validate(replace(tiny_config, "data", tokenizer="/nonexistent/tokenizer.json"))
  with pytest.raises(ConfigError, match=r"data.source: must be one of"):
    run_config.validate(replace(tiny_config, "data", source="hub"))
  run_config.validate(replace(tiny_config, "data", source="datasets",
                              path=str(records / "dsdict"), text_key="body", split="test"))


def test_prepare_data_reads_records_with_an_existing_tokenizer(records, tmp_path):
  (tmp_path / "tok").mkdir()
  path = _train_bpe_json(tmp_path / "tok" / "tokenizer.json")
  out = tmp_path / "shards"
  proc = subprocess.run(
      [sys.executable, "scripts/prepare_data.py", f"--out={out}", "--source=datasets",
       f"--path={records / 'dsdict'}", "--text_key=body", f"--tokenizer={tmp_path / 'tok'}",
       "--seq_len=32", "--eval_fraction=0.2", "--shards=2"], capture_output=True, text=True,
      cwd=REPO, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  meta = data.read_meta(str(out))
  assert (meta["tokenizer"], meta["vocab_size"], meta["bos_id"]) == ("hf_tokenizers", 300, 1)
  assert meta["tokenizer_model"] == "tokenizer.json" and (out / "tokenizer.json").is_file()
  cfg = DataConfig(source="array_record", path=str(out), seq_len=32)
  text_cfg = _rcfg(records, "datasets", "dsdict", tokenizer=path)
  windows = data.TokenWindows(data.split_tokens(text_cfg)["eval"], 33)
  np.testing.assert_array_equal(data.eval_batches(cfg, batch_size=1, num_batches=1)[0][0],
                                windows[0])
  bad = subprocess.run(
      [sys.executable, "scripts/prepare_data.py", f"--out={tmp_path / 'x'}", "--source=jsonl",
       f"--path={records / 'jsonl'}"], capture_output=True, text=True, cwd=REPO, timeout=120)
  assert bad.returncode != 0 and "data.text_key: " in bad.stderr and "has no field 'text'" in \
      bad.stderr


@pytest.mark.slow
def test_example_corpus_trains_from_the_cli(tmp_path):
  """The worked example of docs/data.md: generated jsonl + tokenizer.json, the real CLI."""
  made = import_script("make_example_corpus").make(str(tmp_path / "example"), num_docs=600)
  assert set(made) == {"jsonl", "parquet", "datasets", "tokenizer.json", "tokenizer.model"}
  workdir = tmp_path / "run"
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  proc = subprocess.run(
      [sys.executable, "-m", "diloco.main", "--config=configs/decoupled.py:tiny",
       f"--workdir={workdir}", "--config.data.source=jsonl", f"--config.data.path={made['jsonl']}",
       f"--config.data.tokenizer={made['tokenizer.json']}", "--config.model.vocab_size=512",
       "--config.train.steps=16", "--config.train.eval_every=8", "--config.learners.count=2"],
      capture_output=True, text=True, cwd=REPO, env=env, timeout=240)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  import json
  done = json.loads((workdir / "config.json").read_text())["data"]
  assert done["source"] == "jsonl" and done["tokenizer"] == made["tokenizer.json"]
  losses = [float(line.rsplit(" ", 1)[1]) for line in proc.stdout.splitlines()
            if "global eval/loss" in line]
  losses.append(json.loads((workdir / "accounting.json").read_text())["eval/loss"])  # the final
  assert len(losses) >= 3 and losses[0] > 6.0 and losses[-1] < losses[0] - 1.0


# --- Corpora behind URLs (gs:// in production; fsspec's memory:// here, offline) -----------

def _upload(local, url):
  """Copies a local directory tree to an fsspec URL; returns the URL."""
  import fsspec
  fs, inner = fsspec.core.url_to_fs(url)
  fs.put(str(local), inner, recursive=True)
  return url


@pytest.fixture
def opens(monkeypatch):
  """Counts files opened on fsspec's in-memory filesystem (listings are not opens)."""
  from fsspec.implementations.memory import MemoryFileSystem
  calls = []
  original = MemoryFileSystem._open

  def counting(self, path, *args, **kwargs):
    calls.append(path)
    return original(self, path, *args, **kwargs)

  monkeypatch.setattr(MemoryFileSystem, "_open", counting)
  return calls


def test_url_corpora_are_checked_by_listing_and_read_like_local_ones(corpus, records, opens,
                                                                     tmp_path):
  from diloco.config.run_config import validate_data
  url = _upload(corpus, f"memory://{tmp_path.name}/corpus")
  opens.clear()                                     # the upload wrote them
  for path in (url, url + "/doc00*.txt"):
    validate_data(_cfg(path))                       # what every process runs at start
  assert opens == []                                # names only: no file was read
  for path in ("memory://nowhere/corpus", url + "/*.nothing"):
    with pytest.raises(ConfigError, match="^data.path: no directory or files match"):
      validate_data(_cfg(path))
  with pytest.raises(ConfigError, match="^data.path: 'nosuch://x' is not a URL fsspec can open"):
    validate_data(_cfg("nosuch://x"))
  # The same documents, the same split (keyed by names relative to the corpus), same tokens.
  local, remote = data.split_tokens(_cfg(corpus)), data.split_tokens(_cfg(url))
  for split in ("train", "eval"):
    np.testing.assert_array_equal(remote[split], local[split])
  reference = data.split_tokens(_rcfg(records, "jsonl", "jsonl"))
  for source, sub in SOURCES:                       # jsonl (with .gz), parquet, datasets
    path = _upload(records / sub, f"memory://{tmp_path.name}/{sub}")
    streams = data.split_tokens(dataclasses.replace(_rcfg(records, source, sub), path=path))
    for split in ("train", "eval"):
      np.testing.assert_array_equal(streams[split], reference[split], err_msg=f"{source}/{sub}")


def test_array_record_shards_behind_urls(corpus, tmp_path, monkeypatch):
  from diloco.config.run_config import validate_data
  out = tmp_path / "shards"
  proc = subprocess.run(
      [sys.executable, "scripts/prepare_data.py", f"--out={out}", "--source=text",
       f"--path={corpus}", "--seq_len=32", "--eval_fraction=0.2", "--shards=2"],
      capture_output=True, text=True, cwd=REPO, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  url = _upload(out, f"memory://{tmp_path.name}/shards")
  cfg = DataConfig(source="array_record", path=url, seq_len=32)
  validate_data(cfg)
  assert data.vocab_size(cfg) == 258                # meta.json read through the URL
  # ArrayRecord's own reader opens local files and gs:// only: say so at start.
  with pytest.raises(ConfigError, match="ArrayRecord's reader opens local files and gs://"):
    data.shard_paths(cfg, "train")
  # gs:// on an install without gcsfs (no `gcs` extra; the tests have it, so it is hidden
  # here): a clear error naming the extra, not a crash.
  # The module (the package's `fsspec.registry` attribute is a read-only view of it).
  loaded = importlib.import_module("fsspec.registry")._registry  # noqa: SLF001
  monkeypatch.setitem(sys.modules, "gcsfs", None)  # `import gcsfs` raises ImportError
  for protocol in ("gs", "gcs"):  # forget a class fsspec already loaded
    monkeypatch.delitem(loaded, protocol, raising=False)
  with pytest.raises(ConfigError, match=r'pip install -e "\.\[gcs\]"'):
    validate_data(DataConfig(source="array_record", path="gs://bucket/shards", seq_len=32))


# --- prepare_data streams: parallel tokenisers, bounded memory, the same shards ------------

def _shard_windows(out, split):
  """Every window of a split's shards, in window order (window i is in shard i mod N)."""
  from array_record.python.array_record_module import ArrayRecordReader
  meta = data.read_meta(str(out))
  rows = []
  for name in meta["shards"][split]:
    reader = ArrayRecordReader(str(out / name))
    rows.append([np.frombuffer(r, np.int32) for r in reader.read_all()])
    reader.close()
  ordered = [rows[i % len(rows)][i // len(rows)] for i in range(sum(map(len, rows)))]
  return meta, ordered


@pytest.mark.parametrize("source", ["text", "jsonl"])
def test_streamed_shards_equal_the_in_memory_pipeline(corpus, records, tmp_path, source):
  """Many small chunks over two worker processes give the windows of the whole stream."""
  if source == "text":
    cfg, flags_ = _cfg(corpus), [f"--path={corpus}", "--source=text"]
  else:  # gzip and plain jsonl, tokenised by an existing SentencePiece model
    model = _train_sentencepiece(tmp_path / "sp")
    cfg = dataclasses.replace(_rcfg(records, "jsonl", "jsonl"), tokenizer=model)
    flags_ = [f"--path={records / 'jsonl'}", "--source=jsonl", "--text_key=body",
              f"--tokenizer={model}"]
  out = tmp_path / "shards"
  proc = subprocess.run(
      [sys.executable, "scripts/prepare_data.py", f"--out={out}", *flags_, "--seq_len=32",
       "--eval_fraction=0.2", "--shards=3", "--workers=2", "--chunk_mb=0.002"],
      capture_output=True, text=True, cwd=REPO, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  streams = data.split_tokens(cfg)                  # the reference: the whole corpus in memory
  for split in ("train", "eval"):
    meta, got = _shard_windows(out, split)
    windows = data.TokenWindows(streams[split], 33)
    assert meta["tokens"][split] == len(streams[split])
    assert len(got) == len(windows) > 0
    for i, row in enumerate(got):
      np.testing.assert_array_equal(row, windows[i])


def test_streaming_reads_a_bounded_number_of_chunks_ahead():
  """An endless corpus: the pipeline still yields, having read only `in_flight` chunks ahead."""
  import itertools

  from diloco.train import array_records
  pulled = []

  def endless():
    for i in itertools.count():
      pulled.append(i)
      yield f"doc{i}", f"document {i:06d}".encode().ljust(100, b".")  # 100 bytes each

  stream = array_records.tokenized(endless(), "byte", 0.2, workers=2, chunk_bytes=1000, in_flight=4)
  first = next(stream)
  assert len(pulled) <= 4 * 10                      # 4 chunks of 10 documents in flight
  assert sum(len(v) for v in first.values()) == 10 * 101  # 10 documents, each with its BOS
  for _ in range(20):
    next(stream)
  assert len(pulled) <= (21 + 4) * 10
  stream.close()                                    # stops the worker processes


def test_window_cutter_matches_the_whole_stream():
  from diloco.train import array_records
  rng = np.random.default_rng(0)
  stream = rng.integers(0, 258, size=5000).astype(np.int32)
  cutter, rows, start = array_records.WindowCutter(33), [], 0
  while start < len(stream):
    end = start + int(rng.integers(0, 120))
    rows.append(cutter.add(stream[start:end]))
    assert len(cutter.carry) < 33                   # never more than one window held back
    start = end
  got = np.concatenate(rows)
  expected = stream[:len(stream) // 33 * 33].reshape(-1, 33)  # NumPy oracle
  np.testing.assert_array_equal(got, expected)
  assert cutter.tokens == len(stream)


def test_an_eval_set_that_would_only_repeat_the_split_is_refused():
  """train.eval_batches=10**9 once built a list of 10**9 batches (a hang); cycling a short
  split a few times over stays allowed."""
  cfg = data.DataConfig(seq_len=64)
  windows = len(data.split_windows(cfg, "eval"))
  most = data.EVAL_REPEATS * windows // 8
  assert len(data.eval_batches(cfg, batch_size=8, num_batches=most)) == most
  with pytest.raises(ConfigError, match=rf"train.eval_batches: {10**9} batches of 8 sequences "
                                        rf"would repeat the eval split's {windows} windows"):
    data.eval_batches(cfg, batch_size=8, num_batches=10**9)


@pytest.mark.parametrize("name, content, message", [
    ("bad.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n', r"bad.jsonl:2 is not UTF-8"),
    ("surrogate.jsonl", b'{"text": "a"}\n{"text": "\\ud800"}\n',
     r"surrogate.jsonl:2: field 'text' holds a lone surrogate"),
    ("deep.jsonl", b"[" * 100_000 + b"\n", r"deep.jsonl:1 is not valid JSON"),
    ("cut.jsonl.gz", None, r"cut.jsonl.gz is cut short or not gzip after line"),
    ("notgzip.jsonl.gz", b'{"text": "plain"}\n', r"notgzip.jsonl.gz is cut short or not gzip"),
])
def test_a_bad_record_names_its_file_and_line_as_the_corpus_streams(tmp_path, name, content,
                                                                    message):
  import gzip
  if content is None:  # a gzipped corpus cut off half way
    whole = gzip.compress(b"".join(b'{"text": "line %d"}\n' % i for i in range(2000)))
    content = whole[:len(whole) // 2]
  (tmp_path / name).write_bytes(content)
  cfg = data.DataConfig(source="jsonl", path=str(tmp_path / name))
  with pytest.raises(ConfigError, match=message) as e:
    list(corpus_lib.documents(cfg))
  assert "\n" not in str(e.value)
