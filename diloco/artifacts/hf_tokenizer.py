"""A run's SentencePiece model as a transformers tokenizer, written only where it is exact.

`write_sentencepiece(tokenizer, out_dir, max_len)` converts the `.model` into a `tokenizers`
JSON document that follows the model's own settings (normaliser, dummy prefix, whitespace,
byte fallback, unigram or BPE), puts BOS before a text as the training pipeline puts it before
every document, loads the result with `transformers.AutoTokenizer` and compares its ids and
decoded text with sentencepiece's on a fixed set of probes. Any difference: nothing is written.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

from diloco.train.tokenizers import TOKENIZER_CONFIG_FILE

TOKENIZER_FILE = "tokenizer.json"
MODEL_FILE = "tokenizer.model"
# SentencePiece's piece types that matter here (sentencepiece_model.proto); the others are
# unknown (2), unused (5) and byte (6).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
_UNIGRAM, _BPE = 1, 2
# Texts every model is checked on: code, multi-byte UTF-8, emoji, whitespace runs, leading and
# trailing spaces, control characters, characters no small vocabulary holds, the empty text.
PROBES = (
    "", " ", "  ", "\n", "\t", "hello world", "Hello, World!", "  leading and trailing  ",
    "def f(x):\n    return x  # comment\n\n\tpass\r\n", "a  b   c    d\n\n\n\t\t \t",
    "x = {'k': [1, 2.5e-3]} if y >= 0 else None", "héllo wörld, ça va? Ærø ß",
    "日本語のテキスト、中文文本。한국어", "emoji 🙂🚀 and ZWJ 👩‍👩‍👧 flags 🇯🇵",
    "\x00\x01\x7f\u00a0\u200b\u2028\ufeff", "ｆｕｌｌ ｗｉｄｔｈ ①②③ ﬁ ㍿", "▁ already ▁escaped▁",
    "\U0010fffd\U000e0001 ꙮ 𝔘𝔫𝔦", "a" * 200, " " * 40 + "x", "end with newline\n",
    # where a character map joins characters that are not one grapheme (halfwidth Hangul
    # jamo), or a grapheme has several combining marks: `tokenizers` maps graphemes alone
    "ﾡﾷￋ ﾾﾤ ﾷￋﾮ", "e\u0301 a\u0301\u0302\u0303 ｶﾞ \u1100\u1161\u11a8",
)


def _proto(path: str):
  from sentencepiece import sentencepiece_model_pb2  # pylint: disable=import-outside-toplevel
  proto = sentencepiece_model_pb2.ModelProto()
  with open(path, "rb") as f:
    proto.ParseFromString(f.read())
  return proto


def _bpe_merges(pieces) -> list[tuple[str, str]]:
  """Every split of a normal piece into two normal pieces, best score first: SentencePiece's
  BPE joins the adjacent pair whose join is the best-scoring piece, as these ranks do."""
  normal = {p.piece: (p.score, i) for i, p in enumerate(pieces) if p.type == _NORMAL}
  ranked = []
  for piece, (score, i) in normal.items():
    for cut in range(1, len(piece)):
      left, right = piece[:cut], piece[cut:]
      if left in normal and right in normal:
        ranked.append((-score, i, left, right))
  return [(left, right) for _, _, left, right in sorted(ranked)]


def sentencepiece_tokenizer_json(model_path: str, bos_id: int) -> str:
  """The SentencePiece model at `model_path` as a `tokenizers` JSON document that puts the piece
  `bos_id` before a text. Its exactness is what `write_sentencepiece` checks."""
  # pylint: disable=import-outside-toplevel
  from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
  )
  proto = _proto(model_path)
  trainer, spec = proto.trainer_spec, proto.normalizer_spec
  if trainer.model_type not in (_UNIGRAM, _BPE):
    raise ValueError(f"model type {trainer.model_type} is neither unigram nor BPE")
  if trainer.treat_whitespace_as_suffix:
    raise ValueError("treat_whitespace_as_suffix is set (the space ends a piece)")
  pieces = list(proto.pieces)
  byte_fallback = trainer.byte_fallback
  if trainer.model_type == _UNIGRAM:
    # SentencePiece looks up only normal and user-defined pieces in the text; `tokenizers`
    # looks up every piece. Scored below any run of normal pieces spelling the same text, a
    # control, byte or unused piece is never chosen where its characters are in the vocabulary.
    normal = [p.score for p in pieces if p.type == _NORMAL]
    longest = max((len(p.piece) for p in pieces), default=1)
    floor = (longest + 1) * min(min(normal, default=-1.0), -1.0) - 10.0
    vocab = [(p.piece, p.score if p.type in (_NORMAL, _USER_DEFINED) else floor) for p in pieces]
    model = models.Unigram(vocab, unk_id=trainer.unk_id, byte_fallback=byte_fallback)
  else:
    model = models.BPE({p.piece: i for i, p in enumerate(pieces)}, _bpe_merges(pieces),
                       unk_token=trainer.unk_piece, fuse_unk=True, byte_fallback=byte_fallback,
                       dropout=None)
  tok = Tokenizer(model)
  # The normaliser, in SentencePiece's order: the character map, extra spaces, "▁", the prefix.
  steps = []
  if spec.precompiled_charsmap:
    steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
  space = "▁" if spec.escape_whitespaces else " "
  if spec.remove_extra_whitespaces:  # only " ": SentencePiece keeps other whitespace
    steps += [normalizers.Replace(Regex(r"\A +"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
  if spec.escape_whitespaces:
    steps.append(normalizers.Replace(" ", "▁"))
  if spec.remove_extra_whitespaces:  # at the end, a "▁" typed in the text goes too
    steps.append(normalizers.Replace(Regex(f"{space}+\\z"), ""))
  tok.normalizer = normalizers.Sequence(steps)
  # SentencePiece emits a user-defined piece whole wherever the normalised text spells it, so
  # never one that normalising changes. `tokenizers` normalises an added token's own text too:
  # with such tokens the dummy prefix is the pre-tokeniser's, else the normaliser's last step.
  user = [p.piece for p in pieces if p.type == _USER_DEFINED
          and tok.normalizer.normalize_str(p.piece) == p.piece]
  if spec.add_dummy_prefix and user:
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
  elif spec.add_dummy_prefix:  # once, before any text (the empty text stays empty)
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Prepend("▁")])
  tok.add_tokens([AddedToken(u, special=False, normalized=True) for u in user])
  steps = []
  if trainer.unk_surface and trainer.unk_surface != trainer.unk_piece:
    steps.append(decoders.Replace(trainer.unk_piece, trainer.unk_surface))
  steps.append(decoders.Replace("▁", " "))
  if byte_fallback:
    steps.append(decoders.ByteFallback())
  steps.append(decoders.Fuse())
  if spec.add_dummy_prefix or spec.remove_extra_whitespaces:  # as SentencePiece's decoder
    steps.append(decoders.Strip(content=" ", left=1))
  tok.decoder = decoders.Sequence(steps)
  controls = [p.piece for p in pieces if p.type == _CONTROL]
  tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in controls])
  bos = pieces[bos_id].piece
  tok.post_processor = processors.TemplateProcessing(
      single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
  return tok.to_str(pretty=True)


def _tokenizer_config(tokenizer, max_len: int) -> dict:
  proto = _proto(tokenizer.path)
  name = {i: p.piece for i, p in enumerate(proto.pieces)}
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
            "clean_up_tokenization_spaces": False,
            # sentencepiece reads "<s>" in a text as characters, never as the control piece
            "split_special_tokens": True, "add_bos_token": True}
  # No unk_token: transformers would drop it when decoding, where sentencepiece writes " ⁇ ".
  for key, i in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id),
                 ("pad_token", tokenizer.pad_id)):
    if i is not None and i >= 0:
      config[key] = name[i]
  return config


def probes(model_path: str) -> list[str]:
  """`PROBES`, and the model's own non-normal pieces typed as text (alone and in a sentence)."""
  own = [p.piece for p in _proto(model_path).pieces if p.type != _NORMAL]
  out = list(PROBES)
  for piece in own:
    out += [piece, f"a {piece} b", piece.replace("▁", " ") + piece]
  out.append(" ".join(own))
  return out


def mismatch(folder: str, tokenizer, texts) -> str | None:
  """The first of `texts` whose ids (BOS first) or decoded text differ between transformers
  loading `folder` and `tokenizer` (a SentencePieceTokenizer), described; None if none does."""
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  # No length limit here: a long probe is no error (and is not worth transformers' warning).
  theirs = AutoTokenizer.from_pretrained(folder, model_max_length=sys.maxsize)
  for text in texts:
    want = [tokenizer.bos_id] + [int(i) for i in tokenizer.encode(text.encode("utf-8"))]
    try:
      got = theirs(text).input_ids
    except BaseException as e:  # pylint: disable=broad-except  (tokenizers' panics are such)
      if isinstance(e, (KeyboardInterrupt, SystemExit)):
        raise
      return f"probe {_show(text)} fails there ({type(e).__name__}: {str(e)[:80]})"
    if got != want:
      at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
      return (f"probe {_show(text)} gives ids {got[at:at + 4]} there where sentencepiece gives "
              f"{want[at:at + 4]} (at token {at})")
    decoded, wanted = theirs.decode(got, skip_special_tokens=True), tokenizer.decode(want)
    if decoded != wanted:
      return f"probe {_show(text)} decodes to {_show(decoded)} there, {_show(wanted)} here"
  return None


def _show(text: str) -> str:
  return repr(text if len(text) <= 60 else text[:60] + "...")


def write_sentencepiece(tokenizer, out_dir: str, max_len: int) -> str | None:
  """tokenizer.json, tokenizer_config.json and tokenizer.model of the SentencePieceTokenizer
  `tokenizer` in `out_dir`, once transformers gives its ids on every probe; None, or the one
  line that says why nothing was written."""
  where = f"tokenizer not written: the run's SentencePiece model ({tokenizer.path})"
  try:  # pylint: disable=import-outside-toplevel,unused-import
    import tokenizers  # noqa: F401
    import transformers  # noqa: F401
    from sentencepiece import sentencepiece_model_pb2  # noqa: F401  (needs protobuf)
  except ImportError as e:
    return (f"{where} is written only once transformers confirms its ids, which needs "
            f"{e.name or e}; pip install transformers tokenizers protobuf")
  staging = tempfile.mkdtemp(dir=out_dir, prefix=".tokenizer.")
  try:
    try:
      text = sentencepiece_tokenizer_json(tokenizer.path, tokenizer.bos_id)
    except ValueError as e:
      return f"{where} has no exact Hugging Face form: {e}"
    with open(os.path.join(staging, TOKENIZER_FILE), "w", encoding="utf-8") as f:
      f.write(text)
    with open(os.path.join(staging, TOKENIZER_CONFIG_FILE), "w", encoding="utf-8") as f:
      json.dump(_tokenizer_config(tokenizer, max_len), f, indent=2)
      f.write("\n")
    shutil.copyfile(tokenizer.path, os.path.join(staging, MODEL_FILE))
    found = mismatch(staging, tokenizer, probes(tokenizer.path))
    if found:
      return f"{where} is not matched by transformers: {found}; tokenize with sentencepiece"
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, MODEL_FILE):
      os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    return None
  finally:
    shutil.rmtree(staging, ignore_errors=True)
