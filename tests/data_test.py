"""Corpus, tokenizers, per-learner shards, eval split, iterator state and prepared shards."""

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from diloco.config_lib import ConfigError, DataConfig
from diloco.train import data
from diloco.train import tokenizers

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
