"""Writes a small generated corpus in every record format, and tokenizers trained on it, offline.

  pip install -e ".[hf]" datasets   # pyarrow, tokenizers; datasets only to write the directory
  python scripts/make_example_corpus.py --out=runs/example

writes, from the same seeded documents (short stories about made-up towns, with
arithmetic the model can learn):
  OUT/corpus.jsonl             one {"id": ..., "text": ...} object a line;
  OUT/corpus.parquet           columns `id` and `text`;
  OUT/corpus_datasets/         a Hugging Face DatasetDict (`train`, `extra`) written by
                               `save_to_disk` (only with `datasets` installed);
  OUT/tokenizer.json           a byte-level BPE trained with Hugging Face `tokenizers`;
  OUT/tokenizer.model          a SentencePiece BPE, as a stand-in for a Gemma tokenizer.model.
Then train on any of them (docs/data.md), e.g.
  python -m diloco.main --config=configs/decoupled.py:tiny --workdir=runs/example_run \\
      --config.data.source=jsonl --config.data.path=runs/example/corpus.jsonl \\
      --config.data.tokenizer=runs/example/tokenizer.json --config.model.vocab_size=512
"""

from __future__ import annotations

import json
import os
import random

from absl import app, flags, logging

_OUT = flags.DEFINE_string("out", None, "Output directory (created).")
_DOCS = flags.DEFINE_integer("docs", 1500, "Number of documents.")
_VOCAB = flags.DEFINE_integer("vocab_size", 512, "Vocabulary size of both tokenizers.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the generated text.")
flags.mark_flag_as_required("out")

_TOWNS = ["Arlen", "Brisk", "Corvo", "Dunmere", "Elsby", "Fenwick", "Galt", "Harrow"]
_TRADES = ["baker", "smith", "weaver", "miller", "potter", "cooper", "tanner", "mason"]
_GOODS = {"baker": "loaves", "smith": "nails", "weaver": "cloths", "miller": "sacks",
          "potter": "jugs", "cooper": "barrels", "tanner": "hides", "mason": "stones"}
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def document(rng: random.Random, index: int) -> str:
  """One short story: facts that repeat within it, and sums that are always right."""
  town = rng.choice(_TOWNS)
  lines = [f"The town of {town}, record {index}."]
  for _ in range(rng.randint(3, 8)):
    trade = rng.choice(_TRADES)
    a, b = rng.randint(1, 49), rng.randint(1, 49)
    day = rng.choice(_DAYS)
    lines.append(f"On {day} the {trade} of {town} made {a} {_GOODS[trade]} and sold {b}.")
    lines.append(f"{a} + {b} = {a + b}, so the {trade} counted {a + b} {_GOODS[trade]} in all.")
  lines.append(f"That was the week in {town}.")
  return "\n".join(lines) + "\n"


def documents(num: int, seed: int) -> list[str]:
  rng = random.Random(seed)
  return [document(rng, i) for i in range(num)]


def write_records(texts: list[str], out: str) -> dict[str, str]:
  """The same documents as jsonl, parquet and (if `datasets` imports) a DatasetDict."""
  written = {"jsonl": os.path.join(out, "corpus.jsonl")}
  with open(written["jsonl"], "w", encoding="utf-8") as f:
    for i, text in enumerate(texts):
      f.write(json.dumps({"id": i, "text": text}) + "\n")
  try:
    import pyarrow as pa  # pylint: disable=import-outside-toplevel
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  except ImportError:
    logging.warning('pyarrow is not installed: no corpus.parquet (pip install -e ".[hf]")')
  else:
    written["parquet"] = os.path.join(out, "corpus.parquet")
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), written["parquet"])
  try:
    import datasets  # pylint: disable=import-outside-toplevel
  except ImportError:
    logging.warning("`datasets` is not installed: no corpus_datasets/ (pip install datasets)")
    return written
  datasets.disable_progress_bars()
  written["datasets"] = os.path.join(out, "corpus_datasets")
  cut = len(texts) * 9 // 10
  datasets.DatasetDict({
      "train": datasets.Dataset.from_dict({"id": list(range(cut)), "text": texts[:cut]}),
      "extra": datasets.Dataset.from_dict({"id": list(range(cut, len(texts))),
                                           "text": texts[cut:]}),
  }).save_to_disk(written["datasets"])
  return written


def train_hf_tokenizer(texts: list[str], path: str, vocab_size: int) -> None:
  """A GPT-2-style byte-level BPE (exact round trip) with <pad>, <bos>, <eos> specials."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<eos>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer)
  tok.save(path)


def train_sentencepiece(texts: list[str], prefix: str, vocab_size: int) -> None:
  """A SentencePiece BPE laid out as Gemma's (pad 0, eos 1, bos 2, unk 3, byte fallback)."""
  import sentencepiece as spm  # pylint: disable=import-outside-toplevel
  spm.SentencePieceTrainer.train(
      sentence_iterator=(line for t in texts for line in t.splitlines()), model_prefix=prefix,
      vocab_size=vocab_size, model_type="bpe", byte_fallback=True, character_coverage=1.0,
      pad_id=0, eos_id=1, bos_id=2, unk_id=3, remove_extra_whitespaces=False,
      normalization_rule_name="identity", minloglevel=2)


def make(out: str, num_docs: int = 1500, vocab_size: int = 512, seed: int = 0) -> dict:
  """Writes everything under `out`; returns the paths by kind."""
  os.makedirs(out, exist_ok=True)
  texts = documents(num_docs, seed)
  written = write_records(texts, out)
  written["tokenizer.json"] = os.path.join(out, "tokenizer.json")
  train_hf_tokenizer(texts, written["tokenizer.json"], vocab_size)
  train_sentencepiece(texts, os.path.join(out, "tokenizer"), vocab_size)
  written["tokenizer.model"] = os.path.join(out, "tokenizer.model")
  return written


def main(argv):
  del argv
  print(json.dumps(make(_OUT.value, _DOCS.value, _VOCAB.value, _SEED.value), indent=2))


if __name__ == "__main__":
  app.run(main)
