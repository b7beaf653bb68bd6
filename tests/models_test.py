"""Models: a registered custom NNX model through the real runtime, exports and `init_from`."""

import json
import os

import jax
import numpy as np
import pytest
import runtime_configs

from diloco import fragments
from diloco.artifacts import export
from diloco.config import run_config
from diloco.model import registry
from diloco.model import sharding as sharding_lib
from diloco.runtime import core, data_parallel, decoupled
from diloco.train import mesh as mesh_lib
from diloco.train import optim
from diloco.train import state as train_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUSTOM = os.path.join(REPO, "tests", "custom_model.py")
pytestmark = pytest.mark.slow


def _config(path="decoupled.py:tiny", **dotted):
  return runtime_configs.load(path, **{"learners__virtual_clock": True, "log__tensorboard": False,
                                  **dotted})


def _flat(tree):
  return {k: np.asarray(v) for k, v in fragments.flatten_tree(tree).items()}


def test_custom_model_trains_through_the_single_controller_runtime(tmp_path):
  cfg = _config(learners__count=2, train__steps=8, sync__num_fragments=4, sync__period=4,
                model__arch="mixer_lm", model__module=CUSTOM, checkpoint__every_rounds=0)
  rt, summary = decoupled.run_with_runtime(cfg, str(tmp_path / "run"))
  assert "mixer_lm" in registry.names()
  params = rt.syncer.global_params()
  assert set(params) == {"embed"} | {f"layers/{i}/{n}" for i in range(cfg.model.num_layers)
                                     for n in ("up_DF", "down_FD", "scale_D")}
  # The plan flags the declared embedding; the sharding rules read the model's logical axes.
  assert rt.plan.embedding_paths == {"embed"}
  assert sorted(p for f in rt.plan.fragments for p in f) == sorted(params)
  spec = rt.slots[0].spec.shardings["params"]
  assert spec["embed"].spec == sharding_lib.logical_spec(("vocab", "embed"))
  assert spec["layers"][0]["up_DF"].spec == sharding_lib.logical_spec(("embed", "mlp"))
  assert rt.syncer.rounds > 0
  assert summary["eval/loss"] < summary["eval/initial_loss"] - 0.1, summary
  exported, meta = export.load(str(tmp_path / "run"))
  assert meta["model"]["arch"] == "mixer_lm" and meta["runtime"] == "decoupled"
  for k, v in _flat(exported).items():
    np.testing.assert_array_equal(v, params[k])


def test_unknown_arch_and_bad_model_module_are_one_line_errors(tmp_path):
  cfg = _config(model__arch="nope")
  with pytest.raises(run_config.ConfigError, match=r"model.arch: unknown model 'nope'"):
    train_state.abstract_params(cfg.model)
  cfg = _config(model__arch="nope", model__module=str(tmp_path / "missing.py"))
  with pytest.raises(run_config.ConfigError, match="model.module: file .*missing.py"):
    train_state.abstract_params(cfg.model)
  bad = tmp_path / "bad_model.py"
  bad.write_text("raise RuntimeError('boom')\n")
  cfg = _config(model__arch="x", model__module=str(bad))
  with pytest.raises(run_config.ConfigError, match="cannot import .*RuntimeError: boom"):
    train_state.abstract_params(cfg.model)


def test_export_then_init_from_continues_exactly(tmp_path):
  a_dir, b_dir = str(tmp_path / "a"), str(tmp_path / "b")
  cfg_a = _config(learners__count=2, train__steps=8, checkpoint__every_rounds=4)
  rt_a, summary_a = decoupled.run_with_runtime(cfg_a, a_dir)
  with open(os.path.join(a_dir, "export", "export.json")) as f:
    meta = json.load(f)
  assert meta["format"] == export.FORMAT and meta["step"] == 8
  assert meta["eval/loss"] == summary_a["eval/loss"]
  exported, _ = export.load(os.path.join(a_dir, "export"))
  g_a = rt_a.syncer.global_params()
  exported = _flat(exported)
  assert set(exported) == set(g_a)
  for k, v in exported.items():
    np.testing.assert_array_equal(v, g_a[k])
  # The durable run's final checkpoint holds the same G.
  abstract = rt_a.slots[0].spec.abstract["params"]
  for k, v in _flat(export.load_init(os.path.join(a_dir, "run_checkpoints"), abstract)).items():
    np.testing.assert_array_equal(v, g_a[k])
  # A path relative to the working directory (as typed on a command line) reads the same.
  relative = os.path.relpath(os.path.join(a_dir, "run_checkpoints"))
  for k, v in _flat(export.load_init(relative, abstract)).items():
    np.testing.assert_array_equal(v, g_a[k])

  cfg_b = _config(learners__count=2, train__steps=4, checkpoint__every_rounds=0,
                  train__init_from=a_dir, seed=1)
  # B's syncer starts from A's export ...
  os.makedirs(tmp_path / "b_probe")
  rt_b = core.Runtime(cfg_b, str(tmp_path / "b_probe"))
  for k, v in rt_b.syncer.global_params().items():
    np.testing.assert_array_equal(v, g_a[k])
  rt_b.recorder.close()
  # ... so its step-0 global eval is A's final one.
  summary_b = decoupled.run(cfg_b, b_dir)
  assert summary_b["eval/initial_loss"] == summary_a["eval/loss"]


def test_data_parallel_export_checkpoint_init_and_shape_errors(tmp_path):
  workdir = str(tmp_path / "dp")
  cfg = _config("dp.py:tiny", train__steps=2, train__batch_size=8, checkpoint__every_steps=2)
  data_parallel.run(cfg, workdir)
  exported, meta = export.load(workdir)
  assert meta["runtime"] == "data_parallel" and meta["step"] == 2
  mesh = mesh_lib.learner_mesh(jax.devices()[:1], cfg.mesh)
  spec = train_state.make_spec(cfg.model, optim.inner_optimizer(cfg.optim, 2), mesh)
  from_ckpt = _flat(export.load_init(os.path.join(workdir, "checkpoints"),
                                     spec.abstract["params"]))
  for k, v in _flat(exported).items():
    np.testing.assert_array_equal(v, from_ckpt[k])
  # Onto shardings, for a data-parallel init.
  placed, _ = export.load(workdir, spec.abstract["params"])
  assert fragments.flatten_tree(placed)["embedder/embedding"].sharding == \
      fragments.flatten_tree(spec.shardings["params"])["embedder/embedding"]

  # A data-parallel run started from it evaluates to the exported model at step 0.
  cfg2 = _config("dp.py:tiny", train__steps=1, train__batch_size=8, checkpoint__every_steps=0,
                 train__init_from=os.path.join(workdir, "export"))
  data_parallel.run(cfg2, str(tmp_path / "dp2"))
  with open(os.path.join(tmp_path, "dp", "metrics.jsonl")) as f:
    first = [json.loads(line) for line in f if "eval/loss" in line][-1]
  with open(os.path.join(tmp_path, "dp2", "metrics.jsonl")) as f:
    second = [json.loads(line) for line in f if "eval/loss" in line][0]
  assert second["step"] == 0 and second["eval/loss"] == pytest.approx(first["eval/loss"],
                                                                       rel=1e-6)

  other = _config("dp.py:tiny", model__mlp_dim=128)
  spec2 = train_state.make_spec(other.model, optim.inner_optimizer(other.optim, 2), mesh)
  with pytest.raises(run_config.ConfigError,
                     match=r"tensor 'layers/0/mlp/down_FD' has shape \(256, 64\) .* \(128, 64\)"):
    export.load_init(workdir, spec2.abstract["params"])
  custom = _config("dp.py:tiny", model__arch="mixer_lm", model__module=CUSTOM)
  spec3 = train_state.make_spec(custom.model, optim.inner_optimizer(custom.optim, 2), mesh)
  with pytest.raises(run_config.ConfigError, match="has no tensor 'embed'"):
    export.load_init(workdir, spec3.abstract["params"])
  with pytest.raises(run_config.ConfigError, match="holds no export"):
    export.load_init(str(tmp_path), spec.abstract["params"])


def test_command_line_picks_a_model_by_module_and_name(tmp_path):
  import subprocess
  import sys
  base = [sys.executable, "-m", "diloco.main", "--config=configs/dp.py:tiny",
          "--config.train.steps=2", "--config.train.eval_batches=1",
          "--config.checkpoint.every_steps=0"]
  env = dict(os.environ, PYTHONPATH=REPO)
  bad = subprocess.run(base + [f"--workdir={tmp_path / 'bad'}", "--config.model.arch=nope"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert bad.returncode == 1
  assert bad.stderr.strip().splitlines()[-1].startswith(
      "config error: model.arch: unknown model 'nope'; registered: ['transformer']"), bad.stderr
  ok = subprocess.run(base + [f"--workdir={tmp_path / 'ok'}", "--config.model.arch=mixer_lm",
                              "--config.model.module=tests/custom_model.py"],
                      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
  params, meta = export.load(str(tmp_path / "ok"))
  assert meta["model"]["arch"] == "mixer_lm" and "embed" in params
