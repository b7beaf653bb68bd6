"""Every invalid configuration fails at start with a message naming the field."""

import os
import subprocess
import sys

import jax
import pytest

from configs import dp
from diloco.config import run_config
from diloco.errors import ConfigError
from diloco.model import presets as model_presets
from diloco.runtime import data_parallel
from diloco.train import mesh as mesh_lib

REPO = os.path.dirname(os.path.dirname(__file__))


def _with(preset="tiny", **dotted):
  cfg = dp.get_config(preset)
  for key, value in dotted.items():
    group, field = key.split("__")
    setattr(cfg[group], field, value)
  return cfg


@pytest.mark.parametrize("dotted, message", [
    ({"optim__learning_rate": -0.1},
     r"optim.learning_rate: must be a finite number > 0, got -0.1"),
    ({"optim__learning_rate": float("inf")}, r"optim.learning_rate: must be a finite number > 0"),
    ({"outer__learning_rate": float("inf")}, r"outer.learning_rate: must be a finite number > 0"),
    ({"optim__weight_decay": -1.0}, r"optim.weight_decay: must be >= 0"),
    ({"optim__b1": 1.5}, r"optim.b1: must be in \[0, 1\), got 1.5"),
    ({"train__steps": 0}, r"train.steps: must be >= 1"),
    ({"train__batch_size": -4}, r"train.batch_size: must be >= 1"),
    ({"mesh__data": -1, "mesh__fsdp": -1}, r"mesh: at most one axis may be -1"),
    ({"mesh__tensor": 0}, r"mesh.tensor: must be -1 \(fill\) or >= 1"),
    ({"data__source": "web"}, r"data.source: must be one of \('stdlib', 'text', 'jsonl', "
                               r"'parquet', 'datasets', 'array_record'\)"),
    ({"data__source": "text"}, r"data.path: is required when data.source='text'"),
    ({"data__source": "text", "data__path": "/nonexistent/dir"},
     r"data.path: no directory or files match '/nonexistent/dir'"),
    ({"data__tokenizer": "/nonexistent/sp.model"}, r"data.tokenizer: must be 'byte' or an exist"),
    ({"model__num_kv_heads": 3}, r"model.num_kv_heads: must divide model.num_heads=4"),
    ({"model__attention_pattern": "LX"}, r"model.attention_pattern: must be a string of L and G"),
    ({"model__dtype": "float8"}, r"model.dtype: must be one of \('float32', 'bfloat16'\)"),
    ({"model__num_experts": 4, "model__expert_mlp_dim": 0}, r"model.expert_mlp_dim: must be >= 1"),
    ({"learners__min_step_s": -0.5}, r"learners.min_step_s: must be a finite number >= 0"),
    ({"learners__min_step_s": float("inf")}, r"learners.min_step_s: must be a finite number"),
    ({"learners__join_schedule": "peers"},
     r"learners.join_schedule: must be one of \('own', 'cohort'\), got 'peers'"),
    ({"store__on_sigterm": "ignore"},
     r"store.on_sigterm: must be one of \('retire', 'restart'\), got 'ignore'"),
    ({"launch__hosts_per_learner": 0}, r"launch.hosts_per_learner: must be >= 1"),
    ({"launch__hosts_per_learner": 3}, r"launch.hosts_per_learner: must divide every learner"),
    ({"outer__quantize_bits": 3}, r"outer.quantize_bits: must be one of \(0, 16, 8, 4, 2, 1\)"),
    ({"outer__anchor": "G"}, r"outer.anchor: must be one of \('syncer', 'base'\), got 'G'"),
    ({"sync__scheme": "random"}, r"sync.scheme: must be one of \('balanced', 'layer', 'tensor'\)"),
    ({"sync__gamma": 11.0}, r"sync.gamma: must be in \[0, 10\] \(0 disables grace\), got 11.0"),
    ({"receipt__mode": "blend"},
     r"receipt.mode: must be one of \('overwrite', 'mix', 'keep_local'\), got 'blend'"),
    ({"receipt__mixing_alpha": 0.5}, r"receipt.mixing_alpha: only applies with receipt.mode='mix'"),
    ({"receipt__mode": "mix", "receipt__mixing_alpha": 1.0},
     r"receipt.mixing_alpha: must be in \[0, 1\), got 1.0"),
    ({"learners__devices": "2,2.5"},
     r"learners.devices: expected comma-separated whole numbers, got '2,2.5'"),
    ({"learners__devices": "2,x"}, r"learners.devices: expected comma-separated numbers"),
    ({"learners__devices": "2,0"}, r"learners.devices: counts must be >= 1"),
    ({"store__wan_mbps": "10,-1"}, r"store.wan_mbps: values must be >= 0, got '10,-1'"),
])
def test_invalid_values_name_the_field(dotted, message):
  with pytest.raises(ConfigError, match=message):
    run_config.from_config_dict(_with(**dotted))


@pytest.mark.parametrize("bits", [2, 1])
def test_two_and_one_bit_payloads_are_accepted(bits):
  cfg = run_config.from_config_dict(_with(outer__quantize_bits=bits, outer__error_feedback=True))
  assert cfg.outer.quantize_bits == bits


def test_wrong_type_and_unknown_field():
  cfg = dp.get_config("tiny").to_dict()
  cfg["train"]["steps"] = "many"
  with pytest.raises(ConfigError, match=r"train.steps must be int, got 'many'"):
    run_config.from_config_dict(cfg)
  cfg = dp.get_config("tiny").to_dict()
  cfg["optim"]["lr"] = 0.1
  with pytest.raises(ConfigError, match=r"unknown field optim.lr; allowed: .*learning_rate"):
    run_config.from_config_dict(cfg)


def test_unknown_presets_list_the_allowed_ones():
  with pytest.raises(ConfigError, match=r"unknown 'gemma_7b'; allowed: \['tiny'"):
    model_presets.get("gemma_7b")
  with pytest.raises(ValueError, match=r"unknown preset 'huge'; allowed: .*'small'"):
    dp.get_config("huge")


def test_batch_not_divisible_by_data_parallel_width(tiny_config, replace):
  cfg = replace(tiny_config, "train", batch_size=6)
  mesh = mesh_lib.learner_mesh(jax.devices(), cfg.mesh)
  with pytest.raises(ConfigError, match=r"train.batch_size=6 must be divisible by mesh data x "
                                        r"fsdp = 8"):
    data_parallel.check_batch(cfg, mesh)


def test_vocab_smaller_than_tokenizer(tiny_config, replace):
  cfg = replace(tiny_config, "model", vocab_size=200)
  with pytest.raises(ConfigError, match=r"model.vocab_size=200 is smaller than the tokenizer's "
                                        r"258 ids"):
    data_parallel.check_vocab(cfg)


def test_cli_reports_config_errors(tmp_path):
  def run(*args):
    return subprocess.run([sys.executable, "-m", "diloco.main", *args,
                           f"--workdir={tmp_path}"], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
  bad_rate = run("--config=configs/dp.py:tiny", "--config.optim.learning_rate=-1")
  assert bad_rate.returncode != 0
  assert ("config error: optim.learning_rate: must be a finite number > 0, got -1.0"
          in bad_rate.stderr)
  bad_mesh = run("--config=configs/dp.py:tiny", "--config.mesh.data=3")
  assert bad_mesh.returncode != 0 and "does not match the 8 devices" in bad_mesh.stderr
  unknown = run("--config=configs/dp.py:tiny", "--config.bogus=1")
  assert unknown.returncode != 0 and "bogus" in unknown.stderr
  no_preset = run("--config=configs/dp.py:huge")
  assert no_preset.returncode != 0 and "unknown preset 'huge'" in no_preset.stderr


def test_load_config_file_by_path():
  loaded = run_config.load(os.path.join(REPO, "configs", "dp.py") + ":tiny")
  assert loaded.to_dict() == dp.get_config("tiny").to_dict()
  with pytest.raises(ConfigError, match="config file 'nope.py' does not exist"):
    run_config.load("nope.py:tiny")


def test_fault_schedules_parse_and_bad_events_name_the_field():
  from diloco.distributed import chaos
  from diloco.runtime import faults
  assert [(f.at, f.kind, f.learner, f.duration) for f in faults.parse(
      " add@40; kill:1@30+20;retire:2@60 ")] == [
          (30.0, "kill", 1, 20.0), (40.0, "add", -1, 0.0), (60.0, "retire", 2, 0.0)]
  with pytest.raises(ConfigError, match=r"learners.faults: cannot parse 'kill:1@'; expected"):
    faults.parse("add@4;kill:1@")
  with pytest.raises(ConfigError, match=r"learners.faults: 'down:1@30\+20' uses the old verb "
                     r"'down'; write 'kill:1@30\+20'"):
    faults.parse("add@4;down:1@30+20")
  # One verb for a planned retirement in both grammars: "retire".
  with pytest.raises(ConfigError, match=r"cannot parse 'remove:2@60'; expected .*retire:M@T"):
    faults.parse("remove:2@60")
  assert [str(e) for e in chaos.parse("retire:1@5")] == ["retire:1@5"]
  assert [str(e) for e in chaos.parse("stop:*@3+2;kill:0@1")] == ["kill:0@1", "stop:*@3+2"]
  with pytest.raises(ConfigError, match=r"launch.chaos: cannot parse 'explode@3'; expected"):
    chaos.parse("kill:0@1;explode@3")


def test_launcher_refuses_retire_events_when_sigterm_means_restart(tmp_path):
  from configs import multiprocess  # pylint: disable=import-outside-toplevel
  from diloco.distributed import launcher  # pylint: disable=import-outside-toplevel
  cfg = multiprocess.get_config("tiny")
  cfg.launch.chaos, cfg.launch.chaos_faults = "retire:1@5", 0
  cfg.store.on_sigterm = "restart"
  with pytest.raises(ConfigError, match=r"launch.chaos: retire events .*store.on_sigterm"):
    launcher.Launcher(run_config.from_config_dict(cfg), str(tmp_path), "unused.json")
  cfg.store.on_sigterm = "retire"
  events = launcher.Launcher(run_config.from_config_dict(cfg), str(tmp_path), "unused.json").events
  assert [e.kind for e in events] == ["retire"]
