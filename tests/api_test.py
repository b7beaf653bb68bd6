"""The public API (`import diloco`): the names are pinned, resolve lazily, and are what the
shipped config files and the guide use; a run through them trains and exports."""

import ast
import os
import re
import subprocess
import sys

import pytest

import diloco
from diloco import api
from diloco.config import run_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The public names: a change here is a change of the API (docs/reference.md lists them).
PUBLIC = {"Config", "ModelConfig", "DataConfig", "MeshConfig", "OptimConfig", "TrainConfig",
          "CheckpointConfig", "LogConfig", "SyncConfig", "ReceiptConfig", "OuterConfig",
          "LearnersConfig",
          "StoreConfig", "LaunchConfig", "SlurmConfig", "base_config", "load_config_dict",
          "load_config", "ALL_LEARNERS", "ConfigError", "run", "Hook", "HookView", "STOP",
          "load_model", "export_hf", "evaluate_tasks"}


def test_the_public_names_are_pinned_and_resolve():
  assert set(diloco.__all__) == set(api.__all__) == PUBLIC
  for name in PUBLIC:
    assert getattr(diloco, name) is getattr(api, name), name
  # Every config group of Config is public, under its own class name.
  assert {cls.__name__ for cls in run_config.GROUPS.values()} | {"Config"} <= PUBLIC
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    diloco.nope  # noqa: B018


def test_import_diloco_imports_nothing_heavy():
  out = subprocess.run([sys.executable, "-c", "import sys, diloco; print('jax' in sys.modules)"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
  assert out.stdout.strip() == "False", out.stderr


def test_the_docs_list_exactly_the_public_names():
  with open(os.path.join(REPO, "docs", "reference.md"), encoding="utf-8") as f:
    text = f.read()
  section = text.split("## The public API", 1)[1].split("\n## ", 1)[0]
  assert set(re.findall(r"`diloco\.(\w+)", section)) == PUBLIC


def _diloco_imports(path: str) -> set[str]:
  """The modules a Python file imports from the project."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.split(".")[0] == "diloco"}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "diloco":
      found.add(node.module)
  return found


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(REPO, "configs"))))
def test_the_shipped_config_files_use_only_the_public_api(name):
  if not name.endswith(".py"):
    return
  path = os.path.join(REPO, "configs", name)
  assert _diloco_imports(path) <= {"diloco"}, name
  with open(path, encoding="utf-8") as f:
    # Not `python -m diloco.main` nor `configs/diloco.py`.
    used = set(re.findall(r"(?<!-m )(?<!/)\bdiloco\.(\w+)", f.read()))
  assert used <= PUBLIC, used - PUBLIC


def test_the_guides_python_uses_only_the_public_api():
  with open(os.path.join(REPO, "docs", "guide.md"), encoding="utf-8") as f:
    blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
  used = set()
  for block in blocks:
    used |= set(re.findall(r"\bdiloco\.(\w+)", block))
    assert not re.search(r"from diloco\b", block), block
  assert used <= PUBLIC, used - PUBLIC


def test_load_config_takes_dotted_overrides_and_names_a_bad_one():
  cfg = diloco.load_config("configs/decoupled.py:tiny", {"train.steps": 16})
  assert isinstance(cfg, diloco.Config) and cfg.train.steps == 16
  with pytest.raises(diloco.ConfigError, match="unknown field 'train.stepz'"):
    diloco.load_config("configs/decoupled.py:tiny", {"train.stepz": 16})
  with pytest.raises(diloco.ConfigError, match="^train.steps: "):
    diloco.load_config("configs/decoupled.py:tiny", {"train.steps": "many"})
  with pytest.raises(diloco.ConfigError, match="train.steps: must be >= 1"):
    diloco.load_config("configs/decoupled.py:tiny", {"train.steps": 0})


@pytest.mark.slow
def test_a_script_trains_exports_and_loads_through_the_public_api(tmp_path):
  script = f"""
import diloco
cfg = diloco.load_config("configs/dp.py:tiny", {{"train.steps": 8, "train.eval_every": 4}})
metrics = diloco.run(cfg, {str(tmp_path / 'run')!r})
folder = diloco.export_hf({str(tmp_path / 'run')!r})
model = diloco.load_model({str(tmp_path / 'run')!r})
print("eval", round(metrics["eval/loss"], 3), folder.endswith("hf"), model.cfg.num_layers)
"""
  out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ,
                                             XLA_FLAGS="--xla_force_host_platform_device_count=8"))
  assert out.returncode == 0, out.stderr[-3000:]
  line = out.stdout.strip().splitlines()[-1]
  assert line.startswith("eval ") and line.endswith(" True 2"), line
