"""The Hugging Face export of a SentencePiece run's tokenizer: transformers' AutoTokenizer gives
exactly the ids training gave (BOS, then sentencepiece's ids) and decodes as sentencepiece does,
for unigram and BPE models with and without byte fallback; a model it cannot match is refused
in one line, its weights still written."""

import dataclasses
import json
import os
import sysconfig

import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.artifacts import export, hf_format, hf_tokenizer
from diloco.model import presets, registry
from diloco.train import data as data_lib
from diloco.train import tokenizers

# Trainer settings of each model: both algorithms, with and without byte fallback, Gemma's
# layout (ids, no dummy prefix, user-defined and extra control pieces) and one without BOS.
MODELS = {
    "unigram": {"model_type": "unigram", "remove_extra_whitespaces": False},
    "unigram_bytes": {"model_type": "unigram", "byte_fallback": True,
                      "remove_extra_whitespaces": False},
    "bpe": {"model_type": "bpe", "remove_extra_whitespaces": False},
    "bpe_gemma": {"model_type": "bpe", "byte_fallback": True, "remove_extra_whitespaces": False,
                  "add_dummy_prefix": False, "pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3,
                  "user_defined_symbols": ["<start_of_turn>", "<end_of_turn>", "\n\n", "▁▁"],
                  "control_symbols": ["<mask>"]},
    "unigram_no_bos": {"model_type": "unigram", "bos_id": -1, "eos_id": 1, "unk_id": 0,
                       "user_defined_symbols": ["<x>"], "remove_extra_whitespaces": False,
                       "add_dummy_prefix": False},
}
VOCAB = 640
# Pieces of text that tokenizers treat specially: specials' and byte pieces' names, user-defined
# pieces, "▁" typed in, whitespace runs, characters outside a small vocabulary.
_WORDS = ["<s>", "</s>", "<unk>", "<pad>", "<mask>", "<0x41>", "<start_of_turn>", "<x>", "\n\n",
          "▁", "▁▁", " ", "  ", "\t", "\r\n", "def ", "é", "日本", "🙂", "\x00"]
_TEXTS = st.lists(st.one_of(st.text(st.characters(codec="utf-8"), max_size=10),
                            st.sampled_from(_WORDS)), max_size=10).map("".join)


def _lines():
  """About 220 KB of Python's own source: code, prose, punctuation."""
  lib = sysconfig.get_paths()["stdlib"]
  names = ["textwrap.py", "argparse.py", "json/__init__.py", "string.py", "difflib.py"]
  return "\n".join(open(os.path.join(lib, n), encoding="utf-8").read()
                   for n in names).splitlines()


def _train(prefix, **settings_):
  import sentencepiece as spm
  options = {"vocab_size": VOCAB, "character_coverage": 1.0,
             "normalization_rule_name": "identity", "minloglevel": 2}
  options.update(settings_)
  spm.SentencePieceTrainer.train(sentence_iterator=iter(_lines()), model_prefix=str(prefix),
                                 **options)
  return str(prefix) + ".model"


def _export_run(workdir, model_path):
  """A run's export whose data.tokenizer is `model_path` (copied into the export folder)."""
  cfg = dataclasses.replace(presets.get("tiny"), vocab_size=VOCAB)
  with nnx.use_eager_sharding(False):
    model = registry.build(cfg, nnx.Rngs(0))
  data = dataclasses.replace(data_lib.DataConfig(), tokenizer=model_path, seq_len=64)
  export.save(str(workdir), nnx.to_pure_dict(nnx.state(model)), model=cfg, data=data, seed=0,
              step=1, runtime="data_parallel")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """{model name: (the run's SentencePieceTokenizer, the HF folder, the files written)}."""
  root = tmp_path_factory.mktemp("spm")
  out = {}
  for name, settings_ in MODELS.items():
    path = _train(root / name, **settings_)
    _export_run(root / f"{name}_run", path)
    files = hf_format.write(str(root / f"{name}_run"), str(root / f"{name}_hf"))
    out[name] = (tokenizers.SentencePieceTokenizer(path), root / f"{name}_hf", files)
  return out


def _framed(tok, text):
  """The ids training gives `text` as a document: BOS (or EOS where there is none), then its
  pieces (diloco.train.data)."""
  return [tok.bos_id] + [int(i) for i in tok.encode(text.encode("utf-8"))]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_folder_holds_the_tokenizer_and_its_specials(exported, name):
  from transformers import AutoTokenizer
  ours, folder, files = exported[name]
  for f in (hf_tokenizer.TOKENIZER_FILE, hf_tokenizer.TOKENIZER_CONFIG_FILE,
            hf_tokenizer.MODEL_FILE):
    assert f in files and (folder / f).is_file()
  theirs = AutoTokenizer.from_pretrained(str(folder))
  assert theirs.bos_token_id == ours.bos_id  # the separator: EOS for the model without BOS
  assert theirs.eos_token_id == ours.eos_id
  assert theirs.pad_token_id == (ours.pad_id if ours.pad_id >= 0 else None)
  config = json.loads((folder / "config.json").read_text())
  assert (config["bos_token_id"], config["eos_token_id"]) == (ours.bos_id, ours.eos_id)
  for text in hf_tokenizer.probes(ours.path):  # what the export checked, checked again
    assert theirs(text).input_ids == _framed(ours, text), text


@pytest.mark.parametrize("name", sorted(MODELS))
def test_transformers_gives_the_runs_ids_and_decodes_alike(exported, name):
  from transformers import AutoTokenizer
  ours, folder, _ = exported[name]
  theirs = AutoTokenizer.from_pretrained(str(folder), model_max_length=10**9)

  @settings(max_examples=60, deadline=None, database=None)
  @given(_TEXTS)
  def check(text):
    ids = _framed(ours, text)
    assert theirs(text).input_ids == ids
    assert theirs(text, add_special_tokens=False).input_ids == ids[1:]
    assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    if name == "bpe_gemma" and "▁" not in text:  # byte fallback, no dummy prefix, no
      # normalising: the text comes back ("▁" typed in is a space to sentencepiece too)
      assert theirs.decode(ids, skip_special_tokens=True) == text

  check()


def test_a_model_transformers_cannot_match_is_refused_in_one_line(tmp_path, capsys):
  # sentencepiece's default character map (nmt_nfkc) joins halfwidth Hangul jamo that are not
  # one grapheme; transformers' character map reads one grapheme at a time, so their ids part.
  path = _train(tmp_path / "nfkc", model_type="bpe", byte_fallback=True,
                normalization_rule_name="nmt_nfkc")
  _export_run(tmp_path / "run", path)
  files = hf_format.write(str(tmp_path / "run"), str(tmp_path / "hf"))
  lines = [line for line in capsys.readouterr().out.splitlines() if "tokenizer" in line]
  assert len(lines) == 1 and lines[0].startswith("tokenizer not written: ")
  assert "is not matched by transformers: probe " in lines[0]
  assert not [f for f in os.listdir(tmp_path / "hf") if f.startswith("tokenizer")]
  assert not [f for f in files if f.startswith("tokenizer")]
  assert hf_format.WEIGHTS_FILE in files and not [  # no staging folder left behind
      f for f in os.listdir(tmp_path / "hf") if f.startswith(".") and f != hf_format.MANIFEST]


def test_any_difference_on_a_probe_refuses(exported, tmp_path, monkeypatch):
  # Forced: a probe that sentencepiece reads one token longer than transformers does.
  ours = exported["bpe"][0]
  real = ours.encode
  monkeypatch.setattr(ours, "encode", lambda data: list(real(data)) + (
      [5] if data == b"hello world" else []))
  note = hf_tokenizer.write_sentencepiece(ours, str(tmp_path), 64)
  assert note and "\n" not in note
  assert "probe 'hello world' gives ids [] there where sentencepiece gives [5]" in note
  assert os.listdir(tmp_path) == []


def test_without_transformers_nothing_is_written(exported, tmp_path, monkeypatch):
  import sys
  monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
  note = hf_tokenizer.write_sentencepiece(exported["bpe"][0], str(tmp_path), 64)
  assert note.startswith("tokenizer not written: ") and "needs transformers" in note
  assert os.listdir(tmp_path) == []
