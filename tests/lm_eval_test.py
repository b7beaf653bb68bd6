"""lm-evaluation-harness on a run: the "diloco" model's scores against an independent NumPy
computation, local tasks end to end through `diloco evaluate --tasks`, the compare column, and
one-line errors. No torch, no network: the tasks are YAML over local jsonl files."""

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses
import json

import jax
import numpy as np
import pytest
import runtime_configs
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from diloco.artifacts import export, harness_model
from diloco.cli import commands, compare, evaluate
from diloco.errors import ConfigError
from diloco.model import registry

BOS, EOS, VOCAB_LIMIT = 256, 257, 258
SEQ_LEN = 32
CHOICES = [
    {"context": "import os\nimport ", "choices": ["sys", "}}}", "3.14"], "answer": 0},
    {"context": "def f(self", "choices": ["]]", ", name):"], "answer": 1},
    {"context": "for i in range(", "choices": ["):)(", "import", "len(items)):"], "answer": 2},
    {"context": "x = ", "choices": ["1", "((("], "answer": 0},
]
TEXTS = [{"text": "def main():\n  return 0\n" * 3}, {"text": "import sys\n"}]


def _task(folder, name, body, rows):
  data = os.path.join(folder, f"{name}.jsonl")
  with open(data, "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows))
  with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
    f.write(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n{body}")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A finished tiny run (random parameters, byte tokenizer, seq_len 32) with the files that
  `diloco compare` reads, and a folder of two local tasks."""
  root = tmp_path_factory.mktemp("lm_eval")
  cfg = runtime_configs.load("dp.py:tiny", data__seq_len=SEQ_LEN)
  with nnx.use_eager_sharding(False):
    model = registry.build(cfg.model, nnx.Rngs(0))
  params = jax.tree.map(lambda v: np.asarray(v) * 3.0, nnx.to_pure_dict(nnx.state(model)))
  workdir = str(root / "run")
  os.makedirs(workdir)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(dataclasses.asdict(cfg), f)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps({"t": t, "role": "dp", "step": int(t), "eval/loss": loss}) + "\n"
                 for t, loss in ((1.0, 5.5), (2.0, 5.0)))
  export.save(workdir, params, model=cfg.model, data=cfg.data, seed=0, step=2,
              runtime="data_parallel")
  tasks = str(root / "tasks")
  os.makedirs(tasks)
  _task(tasks, "tiny_mc", "output_type: multiple_choice\ntarget_delimiter: ''\n"
        "doc_to_text: '{{context}}'\ndoc_to_choice: choices\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n", CHOICES)
  _task(tasks, "tiny_text", "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
        "  - metric: bits_per_byte\n", TEXTS)
  lm = get_model("diloco").create_from_arg_string(f"workdir={workdir},batch_size=4")
  return workdir, tasks, lm


@pytest.fixture(scope="module")
def forward(run):
  """The independent reference: the model's plain forward on unpadded tokens, as NumPy
  float64 log-softmax (one row at a time, no padding, no harness code)."""
  model = run[2].loaded.model
  graphdef, state = nnx.split(model)
  apply = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])

  def logprobs(tokens):
    logits = np.asarray(apply(state, np.asarray([tokens], np.int32))[0], np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return logits, shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  return logprobs


def _reference(forward, context, continuation):
  """(sum of log p(continuation), continuation == the argmax at every position)."""
  tokens = context + continuation
  logits, logp = forward(tokens[:-1])
  n = len(continuation)
  rows = np.arange(len(tokens) - 1 - n, len(tokens) - 1)
  greedy = np.argmax(logits[rows, :VOCAB_LIMIT], -1)
  return float(logp[rows, continuation].sum()), bool((greedy == continuation).all())


def _enc(text):
  return list(text.encode())


def _request(kind, *args):
  return Instance(kind, {}, tuple(args), 0)


def test_loglikelihood_matches_the_plain_forward_alone_and_in_mixed_batches(run, forward):
  lm = run[2]
  assert lm.max_length == SEQ_LEN and lm.prefix_token_id == BOS
  pairs = [("import os\nimport", " sys"), ("x", " = 1"), ("", "def f():"),
           ("a long context " * 4, "tail"), ("y =", " " + "z" * 20)]
  # Greedy continuation of "q", found independently: is_greedy must say so.
  tokens = [BOS] + _enc("q")
  for _ in range(3):
    tokens.append(int(np.argmax(forward(tokens)[0][-1, :VOCAB_LIMIT])))
  greedy_text = bytes(tokens[2:]).decode("latin-1")
  if all(t < 128 for t in tokens[2:]):
    pairs.append(("q", greedy_text))
  singles = [lm.loglikelihood([_request("loglikelihood", c, x)])[0] for c, x in pairs]
  batched = lm.loglikelihood([_request("loglikelihood", c, x) for c, x in pairs])
  for (context, continuation), one, many in zip(pairs, singles, batched):
    # The training framing: BOS, then the bytes; left-truncated to max_length + 1 tokens.
    # lm_eval moves the context's trailing spaces into the continuation.
    whole = ([BOS] + _enc(context + continuation))[-(SEQ_LEN + 1):]
    n = len(_enc(continuation)) + len(context) - len(context.rstrip())
    want_logp, want_greedy = _reference(forward, whole[:-n], whole[-n:])
    for got in (one, many):
      np.testing.assert_allclose(got[0], want_logp, rtol=1e-5, atol=1e-4)
      assert got[1] == want_greedy
  if all(t < 128 for t in tokens[2:]):
    assert batched[-1][1]
  assert not all(b[1] for b in batched)


def test_rolling_loglikelihood_is_the_sum_over_disjoint_windows(run, forward):
  lm = run[2]
  text = "def main():\n    return 0\n" * 4  # 100 bytes: windows of 32, 32, 32 and 4
  ids = _enc(text)
  want, predicted = 0.0, 0
  while predicted < len(ids):  # each window: up to 32 inputs, predicting the next tokens
    end = min(predicted + SEQ_LEN, len(ids))
    inputs = ([BOS] + ids)[max(0, end - SEQ_LEN):end]
    logp = forward(inputs)[1]
    n = end - predicted
    want += sum(logp[len(inputs) - n + k, ids[predicted + k]] for k in range(n))
    predicted = end
  got = lm.loglikelihood_rolling([_request("loglikelihood_rolling", text),
                                  _request("loglikelihood_rolling", "hi")])
  np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-3)
  np.testing.assert_allclose(got[1], _reference(forward, [BOS], _enc("hi"))[0], rtol=1e-5,
                             atol=1e-4)
  windows = list(lm_utils.get_rolling_token_windows(ids, BOS, SEQ_LEN, 1))
  assert len(windows) == 4  # the harness's helper cuts the same windows


def test_generate_until_is_greedy_decoding_cut_at_the_stop_string(run, forward):
  lm = run[2]
  context = "import "
  tokens = [BOS] + _enc(context)
  for _ in range(12):  # greedy decoding without a cache, among the tokenizer's ids
    tokens.append(int(np.argmax(forward(tokens)[0][-1, :VOCAB_LIMIT])))
  new = tokens[1 + len(context):]
  cut = next((i for i, t in enumerate(new) if t in (BOS, EOS)), len(new))
  text = lm.loaded.tokenizer.decode(new[:cut])
  until = text[4:6] if len(text) >= 6 else None
  requests = [_request("generate_until", context, {"until": [until] if until else [],
                                                   "max_gen_toks": 12}),
              _request("generate_until", context, {"until": [], "max_gen_toks": 12}),
              _request("generate_until", "x", {"until": ["\n"], "max_gen_toks": 5})]
  got = lm.generate_until(requests)
  assert got[1] == text
  if until:
    assert got[0] == text[:text.find(until)] and len(got[0]) <= 4
  assert "\n" not in got[2]


def test_evaluate_tasks_writes_the_results_and_compare_shows_them(run, capsys):
  workdir, tasks, _ = run
  evaluate.main(["diloco evaluate", f"--workdir={workdir}", "--tasks=tiny_mc,tiny_text",
                 f"--include_path={tasks}", "--batch_size=4"])
  out = capsys.readouterr().out
  assert "tiny_mc: acc " in out and "(4 examples)" in out and "tiny_text: word_perplexity" in out
  with open(os.path.join(workdir, "benchmarks", "results.json")) as f:
    results = json.load(f)
  assert set(results["results"]) == {"tiny_mc", "tiny_text"}
  acc = results["results"]["tiny_mc"]["acc,none"]
  assert acc in (0, 0.25, 0.5, 0.75, 1)
  assert results["results"]["tiny_text"]["word_perplexity,none"] > 1
  # The scores are the model's: acc from the adapter's choice log-likelihoods.
  lm = run[2]
  scores = [[lm.loglikelihood([_request("loglikelihood", d["context"], c)])[0][0]
             for c in d["choices"]] for d in CHOICES]
  assert acc == np.mean([np.argmax(s) == d["answer"] for s, d in zip(scores, CHOICES)])
  table = compare.compare([workdir])
  header = table.splitlines()[0]
  assert "tiny_mc acc" in header and "tiny_text word_perplexity" in header
  assert f"{acc:.4g}" in table.splitlines()[2]


def test_a_later_evaluation_adds_its_tasks_beside_the_earlier_ones(run, tmp_path, capsys):
  workdir, tasks, _ = run
  path = os.path.join(workdir, "benchmarks", "results.json")
  argv = ["diloco evaluate", f"--workdir={workdir}", f"--include_path={tasks}", "--batch_size=4"]
  evaluate.main([*argv, "--tasks=tiny_mc"])
  with open(path) as f:
    first = json.load(f)["results"]["tiny_mc"]
  evaluate.main([*argv, "--tasks=tiny_text"])
  with open(path) as f:
    both = json.load(f)
  assert both["results"]["tiny_mc"] == first and "tiny_text" in both["results"]
  assert set(both["n-samples"]) >= {"tiny_mc", "tiny_text"}
  header = compare.compare([workdir]).splitlines()[0]
  assert "tiny_mc acc" in header and "tiny_text word_perplexity" in header
  # A damaged file stops the command in one line naming it, before any task runs; it is kept.
  with open(path, "w") as f:
    f.write("{not json")
  with pytest.raises(SystemExit) as e:
    evaluate.main([*argv, "--tasks=tiny_mc"])
  assert path in str(e.value) and "\n" not in str(e.value)
  with open(path) as f:
    assert f.read() == "{not json"
  os.remove(path)
  capsys.readouterr()


@pytest.mark.parametrize("argv, message", [
    (["--tasks=no_such_task"], "--tasks: unknown task 'no_such_task'"),
    (["--tasks=tiny_mc", "--data=stdlib"], "--data: scores held-out text"),
])
def test_bad_tasks_fail_in_one_line(run, argv, message):
  workdir, tasks, _ = run
  with pytest.raises(SystemExit) as e:
    evaluate.main(["diloco evaluate", f"--workdir={workdir}", f"--include_path={tasks}", *argv])
  assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("body, message", [
    ("output_type: nonsense\n", "ValueError: Got invalid output_type 'nonsense'"),
    ("output_type: multiple_choice\ndataset_kwargs:\n  data_files:\n    test: MISSING\n"
     "doc_to_text: x\ndoc_to_choice: choices\ndoc_to_target: answer\n",
     "FileNotFoundError: Unable to find"),
])
def test_a_task_yaml_lm_eval_cannot_load_fails_in_one_line_naming_tasks(run, tmp_path, body,
                                                                       message):
  workdir, _, _ = run
  folder = tmp_path / "tasks"
  folder.mkdir()
  body = body.replace("MISSING", str(tmp_path / "missing.jsonl"))
  (folder / "broken.yaml").write_text(f"task: broken\ndataset_path: json\ntest_split: test\n"
                                      f"{body}")
  with pytest.raises(SystemExit) as e:
    evaluate.main(["diloco evaluate", f"--workdir={workdir}", "--tasks=broken",
                   f"--include_path={folder}"])
  text = str(e.value.code)
  assert text.startswith("diloco evaluate: error: --tasks: lm_eval cannot load a task's")
  assert message in text and "\n" not in text, text


def test_a_run_without_an_export_or_a_bad_model_arg_fails_in_one_line(run, tmp_path):
  workdir, tasks, _ = run
  with pytest.raises(SystemExit) as e:
    evaluate.main(["diloco evaluate", f"--workdir={tmp_path}", "--tasks=tiny_mc",
                   f"--include_path={tasks}"])
  assert "--workdir:" in str(e.value) and "no export" in str(e.value)
  for args, message in ((f"workdir={tmp_path}", "--model_args workdir:"),
                        (f"workdir={workdir},batch_size=x", "--model_args batch_size:")):
    with pytest.raises(ConfigError, match=message):
      get_model("diloco").create_from_arg_string(args)
  # Through lm_eval's own CLI (it reads its ~15,000 task index first: one call only).
  with pytest.raises(SystemExit) as e:
    commands.main(["diloco", "lm_eval", "--model", "diloco", "--model_args",
                   f"workdir={workdir},colour=red", "--tasks", "tiny_mc", "--include_path",
                   tasks])
  assert "--model_args colour: unknown" in str(e.value) and "\n" not in str(e.value), e.value


def test_buckets_are_few_and_end_at_max_length():
  assert harness_model.buckets(32) == [16, 32]
  assert harness_model.buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
  assert harness_model.buckets(100) == [16, 32, 64, 100]
