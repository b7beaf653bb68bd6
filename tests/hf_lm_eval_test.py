"""The two ways out of a run agree: lm-evaluation-harness scores the same local task with the
"diloco" model (JAX, this project's tokenizer) and with its own "hf" model on the export that
`diloco export --format=hf` wrote (transformers, PyTorch, the exported tokenizer): the same
log-likelihood of every choice and the same accuracy. Two independent stacks, one answer."""

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json

import numpy as np
import pytest
from hf_export_test import _make_export
from lm_eval import evaluator
from lm_eval.tasks import TaskManager

from diloco.artifacts import harness_model, hf_format
from diloco.model import presets

# Byte-level multiple choice: contexts and choices of different lengths, one past the run's 64
# tokens, so padding, left truncation and the local attention window (32) all take part
# (measured: the two stacks agree to 5e-6 nats).
CHOICES = [
    {"context": "import os\nimport ", "choices": ["sys", "}}}", "collections.abc"], "answer": 0},
    {"context": "def f(self", "choices": ["]]", ", name):"], "answer": 1},
    {"context": "class Model(nn.Module):\n  def __init__(self, cfg):\n    super().",
     "choices": ["__init__()", "(((", "x"], "answer": 0},
    {"context": "x = ", "choices": ["1", "((("], "answer": 0},
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """(the run's workdir, its HF folder, a folder holding the local task)."""
  root = tmp_path_factory.mktemp("hf_lm_eval")
  workdir = root / "run"
  workdir.mkdir()
  _make_export(workdir, presets.get("tiny"), seed=3, seq_len=64)
  hf = root / "hf"
  hf_format.write(str(workdir), str(hf))
  tasks = root / "tasks"
  tasks.mkdir()
  data = tasks / "agree_mc.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in CHOICES))
  (tasks / "agree_mc.yaml").write_text(
      f"task: agree_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
      "test_split: test\noutput_type: multiple_choice\ntarget_delimiter: ''\n"
      "doc_to_text: '{{context}}'\ndoc_to_choice: choices\ndoc_to_target: answer\n"
      "metric_list:\n  - metric: acc\n")
  return workdir, hf, tasks


def _scores(model, tasks):
  """(acc, each doc's log-likelihood per choice) of the local task under `model`."""
  out = evaluator.simple_evaluate(model=model, tasks=["agree_mc"], log_samples=True,
                                  task_manager=TaskManager(include_path=str(tasks),
                                                           include_defaults=False))
  samples = sorted(out["samples"]["agree_mc"], key=lambda s: s["doc_id"])
  per_doc = [[float(resp[0][0]) for resp in s["resps"]] for s in samples]
  return out["results"]["agree_mc"]["acc,none"], per_doc


@pytest.mark.torch
def test_lm_eval_scores_the_run_and_its_transformers_export_alike(exported):
  import torch
  from lm_eval.models.huggingface import HFLM
  torch.set_num_threads(1)
  workdir, hf, tasks = exported
  ours = harness_model.DilocoLM.from_model_args({"workdir": str(workdir), "batch_size": 3})
  theirs = HFLM(pretrained=str(hf), dtype="float32", device="cpu", batch_size=3)
  acc_ours, ll_ours = _scores(ours, tasks)
  acc_theirs, ll_theirs = _scores(theirs, tasks)
  assert [len(d) for d in ll_ours] == [len(c["choices"]) for c in CHOICES]
  np.testing.assert_allclose(np.concatenate(ll_ours), np.concatenate(ll_theirs),
                             rtol=0, atol=1e-4)
  assert acc_ours == acc_theirs
  # The scores are not all alike (a model that ignored its input would pass the rest).
  assert np.ptp(np.concatenate(ll_ours)) > 1.0
