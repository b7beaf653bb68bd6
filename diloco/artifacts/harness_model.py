"""A trained run as an lm-evaluation-harness model, registered as "diloco" when imported.

lm_eval finds a model only once its module is imported (it has no plugin lookup), so
`diloco evaluate --tasks=...` and `diloco lm_eval ...` import this module first. Model args:
`workdir=RUN_OR_EXPORT` (required), `step` (a checkpoint instead of the export), `batch_size`
(8), `max_length` (the run's data.seq_len), `max_gen_toks` (256), `trust_export_code` (false).

Text is framed as training frames it: every context starts with the tokenizer's BOS (the
document separator that `diloco.train.data` puts before each document), and a rolling
log-likelihood scores a document from its BOS, in disjoint windows of `max_length` inputs
(lm_eval's own window helpers). Scored rows are sorted by length and right-padded to a few
bucket lengths (powers of two up to max_length), so jit compiles a handful of shapes; the
model is causal, so padding and batch-mates change no value. A mixture-of-experts model drops
tokens by a capacity that counts the whole batch, so it is scored one unpadded row at a time.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from diloco import settings
from diloco.artifacts import trained
from diloco.errors import ConfigError
from diloco.model import decode
from diloco.train.data import DataConfig

_LOG = logging.getLogger(__name__)
DEFAULT_BATCH_SIZE = 8
DEFAULT_MAX_GEN_TOKS = 256
# Shortest padded length; the others double up to max_length.
_MIN_BUCKET = 16
# Model args lm_eval passes to every model (its --batch_size, --max_batch_size and --device)
# that have no meaning here beyond batch_size.
_IGNORED_ARGS = ("max_batch_size", "device")


def buckets(max_length: int) -> list[int]:
  """The padded lengths of scored rows: powers of two from 16, then max_length itself."""
  out, n = [], _MIN_BUCKET
  while n < max_length:
    out.append(n)
    n *= 2
  return out + [max_length]


@functools.partial(jax.jit, static_argnums=(0, 3))
def _token_scores(graphdef, state, tokens_BL1, vocab_limit: int):
  """Per position: log p(target) (float32, log-softmax over the whole table) and whether the
  target is the argmax among the ids the tokenizer has (below `vocab_limit`)."""
  model = nnx.merge(graphdef, state)
  inputs_BL, targets_BL = tokens_BL1[:, :-1], tokens_BL1[:, 1:]
  out = model(inputs_BL)
  logits_BLV = (out[0] if isinstance(out, tuple) else out).astype(jnp.float32)
  logp_BLV = jax.nn.log_softmax(logits_BLV, axis=-1)
  target_BL = jnp.take_along_axis(logp_BLV, targets_BL[..., None], axis=-1)[..., 0]
  ids_V = jnp.arange(logits_BLV.shape[-1])
  greedy_BL = jnp.argmax(jnp.where(ids_V < vocab_limit, logits_BLV, -jnp.inf), axis=-1)
  return target_BL, greedy_BL == targets_BL


# The integer model args: (default, lowest, highest). The highest keep a typo from asking for
# an allocation no host has (the batch as `diloco sample --num_samples`, lengths as its
# `--max_tokens`).
INT_ARGS = {"step": (None, 0, settings.MAX_INT), "batch_size": (DEFAULT_BATCH_SIZE, 1, 4096),
            "max_length": (None, 2, 2**20), "max_gen_toks": (DEFAULT_MAX_GEN_TOKS, 1, 2**20)}


def _int_arg(args: dict, name: str):
  """`args[name]` (popped) as an integer within `INT_ARGS[name]`, its default when absent."""
  default, low, high = INT_ARGS[name]
  value = args.pop(name, default)
  if value is None:
    return None
  if isinstance(value, str) and name == "batch_size" and value.startswith("auto"):
    return default  # lm_eval's --batch_size=auto: no search here, the default
  try:
    number = int(value) if not isinstance(value, bool) and float(value) == int(value) else None
  except (TypeError, ValueError, OverflowError):  # not a number, NaN, an infinity
    number = None
  if number is None:
    raise ConfigError(f"--model_args {name}: must be an integer, got {value!r}")
  if not low <= number <= high:
    raise ConfigError(f"--model_args {name}: must be in [{low}, {high}], got {number}")
  return number


def run_seq_len(model: trained.Trained) -> int:
  """The sequence length the run trained on (export.json or config.json `data.seq_len`)."""
  data = model.meta.get("data") if isinstance(model.meta, dict) else None
  seq_len = data.get("seq_len") if isinstance(data, dict) else None
  return int(seq_len) if isinstance(seq_len, int) and seq_len >= 2 else DataConfig().seq_len


@register_model("diloco")
class DilocoLM(TemplateLM):
  """lm_eval's `LM` over a loaded run (`diloco.artifacts.trained.load`)."""

  def __init__(self, model: trained.Trained, *, batch_size: int = DEFAULT_BATCH_SIZE,
               max_length: int | None = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS):
    super().__init__()
    self.loaded = model
    self.tokenizer = model.tokenizer
    self.batch_size = 1 if getattr(model.cfg, "num_experts", 0) else batch_size
    self.exact = bool(getattr(model.cfg, "num_experts", 0))  # MoE: unpadded rows, one a call
    self.max_length = max_length or run_seq_len(model)
    self.max_gen_toks = max_gen_toks
    self.vocab_limit = min(model.tokenizer.vocab_size, model.cfg.vocab_size)
    self._graphdef, self._state = nnx.split(model.model)
    self._warned_sampling = False

  @classmethod
  def from_model_args(cls, args: dict) -> DilocoLM:
    """The model of lm_eval's `--model_args` (parsed to a dict); ConfigError on a bad one."""
    args = {k: v for k, v in args.items() if k not in _IGNORED_ARGS}
    workdir = args.pop("workdir", None)
    if not workdir:
      raise ConfigError("--model_args workdir: required: workdir=RUN_OR_EXPORT_FOLDER")
    problem = settings.general_problem(str(workdir))
    if problem:
      raise ConfigError(f"--model_args workdir: {problem}")
    step, batch_size, max_length, max_gen_toks = (
        _int_arg(args, name) for name in INT_ARGS)
    trust = args.pop("trust_export_code", False)
    if not isinstance(trust, bool):
      raise ConfigError(f"--model_args trust_export_code: must be true or false, got {trust!r}")
    if args:
      raise ConfigError(f"--model_args {min(args)}: unknown; the diloco model takes "
                        "workdir, step, batch_size, max_length, max_gen_toks, "
                        "trust_export_code")
    try:
      loaded = trained.load(str(workdir), step, trust_code=trust)
    except ConfigError as e:  # its messages name --workdir / --step: here they are model args
      message = str(e)
      for flag in ("workdir", "step", "trust_export_code"):
        message = message.replace(f"--{flag}", f"--model_args {flag}")
      raise ConfigError(message) from None
    return cls(loaded, batch_size=batch_size, max_length=max_length, max_gen_toks=max_gen_toks)

  @classmethod
  def create_from_arg_string(cls, arg_string, additional_config=None):
    return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string),
                                   additional_config)

  @classmethod
  def create_from_arg_obj(cls, arg_dict, additional_config=None):
    extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
    return cls.from_model_args({**extra, **dict(arg_dict)})

  def get_model_info(self) -> dict:
    return {"diloco_source": self.loaded.source, "max_length": self.max_length,
            "tokenizer": self.loaded.tokenizer_spec}

  # Tokens, framed as in training: BOS (the document separator) first.

  @property
  def eot_token_id(self) -> int:
    tok = self.loaded.tokenizer
    return tok.eos_id if tok.eos_id >= 0 else tok.bos_id

  @property
  def prefix_token_id(self) -> int:
    return self.loaded.tokenizer.bos_id

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
    ids = self.loaded.tokenizer.encode(string.encode("utf-8")).tolist()
    return ids if add_special_tokens is False else [self.prefix_token_id] + ids

  def tok_decode(self, tokens) -> str:
    return self.loaded.tokenizer.decode(tokens)

  # Scoring.

  def score_rows(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
    """For each (tokens, n): the summed log-probability of the last n tokens given those
    before them, and whether each of them is the greedy choice. len(tokens) <= max_length + 1."""
    order = sorted(range(len(rows)), key=lambda i: (-len(rows[i][0]), rows[i][0]))
    lengths = buckets(self.max_length)
    out: list[tuple[float, bool] | None] = [None] * len(rows)
    for start in range(0, len(order), self.batch_size):
      chunk = order[start:start + self.batch_size]
      longest = len(rows[chunk[0]][0]) - 1
      width = longest if self.exact else next(n for n in lengths if n >= longest)
      batch = np.zeros((len(chunk) if self.exact else self.batch_size, width + 1), np.int32)
      for r, i in enumerate(chunk):
        batch[r, :len(rows[i][0])] = rows[i][0]
      logp, greedy = _token_scores(self._graphdef, self._state, jnp.asarray(batch),
                                   self.vocab_limit)
      logp, greedy = np.asarray(logp, np.float64), np.asarray(greedy)
      for r, i in enumerate(chunk):
        tokens, n = rows[i]
        end = len(tokens) - 1
        out[i] = (float(logp[r, end - n:end].sum()), bool(greedy[r, end - n:end].all()))
    return out

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    rows = []
    for _, context, continuation in requests:
      if len(continuation) > self.max_length:
        raise ConfigError(f"max_length: a continuation of {len(continuation)} tokens does not "
                          f"fit in max_length={self.max_length}")
      rows.append(((context + continuation)[-(self.max_length + 1):], len(continuation)))
    results = self.score_rows(rows)
    for (pair, _, _), answer in zip(requests, results):
      if pair is not None:
        self.cache_hook.add_partial("loglikelihood", pair, answer)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    rows, owner = [], []
    for r, (string,) in enumerate(req.args for req in requests):
      windows = lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(string, add_special_tokens=False),
          prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)
      for context, predicted in map(lm_utils.make_disjoint_window, windows):
        rows.append((context + predicted, len(predicted)))
        owner.append(r)
    totals = [0.0] * len(requests)
    for r, (logp, _) in zip(owner, self.score_rows(rows)):
      totals[r] += logp
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return totals

  # Generation.

  def _gen_settings(self, kwargs) -> tuple[list[str], int]:
    kwargs = dict(kwargs or {})
    until = kwargs.get("until") or []
    until = [until] if isinstance(until, str) else [u for u in until if u]
    max_gen = int(kwargs.get("max_gen_toks", self.max_gen_toks))
    if max_gen < 1 or max_gen >= self.max_length:
      raise ConfigError(f"max_gen_toks: must be in [1, max_length={self.max_length}), got "
                        f"{max_gen}")
    if (kwargs.get("do_sample") or float(kwargs.get("temperature") or 0) > 0) and not \
        self._warned_sampling:
      _LOG.warning("diloco: generation is greedy; sampling settings %s are ignored", kwargs)
      self._warned_sampling = True
    return until, max_gen

  def finish(self, ids: np.ndarray, until: list[str]) -> str:
    """The text of generated `ids`, cut at the first document boundary, then at the first
    stop string."""
    tok = self.loaded.tokenizer
    ends = [i for i, t in enumerate(ids) if int(t) in (tok.bos_id, tok.eos_id)]
    text = tok.decode(ids[:ends[0]] if ends else ids)
    cuts = [text.find(u) for u in until if u in text]
    return text[:min(cuts)] if cuts else text

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    jobs: dict[tuple[int, int], list[int]] = {}  # (prompt length, max_gen) -> request indices
    prompts, settings = [], []
    for i, req in enumerate(requests):
      context, kwargs = req.args
      until, max_gen = self._gen_settings(kwargs)
      prompt = self.tok_encode(context)[-(self.max_length - max_gen):]
      prompts.append(prompt)
      settings.append(until)
      jobs.setdefault((len(prompt), max_gen), []).append(i)
    sampling = decode.Sampling(vocab_limit=self.vocab_limit)
    out = [""] * len(requests)
    for (_, max_gen), indices in sorted(jobs.items()):
      for start in range(0, len(indices), self.batch_size):
        chunk = indices[start:start + self.batch_size]
        ids = decode.generate(self.loaded.model, np.asarray([prompts[i] for i in chunk]),
                              max_tokens=max_gen, sampling=sampling)
        for row, i in zip(ids, chunk):
          out[i] = self.finish(row, settings[i])
          self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
    return out
