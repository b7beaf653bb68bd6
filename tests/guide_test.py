"""The commands of docs/guide.md run as written (the tiny ones, shortened by flags), from a
fresh venv outside the checkout with the project installed as a package.

Each fenced bash block of the guide is split into commands; those that match `TINY` run in a
temporary directory, in the guide's order (sampling, scoring, export and the comparison read
the runs before them), training commands shortened to an eighth of their steps (`_shortened`)
so that they take seconds and runs that the guide puts on equal tokens stay so. A command the
guide drops or renames fails `test_the_guide_still_has_its_tiny_commands`, so the list cannot
go stale silently.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from diloco.config import run_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(REPO, "docs", "guide.md")
# Commands cheap enough to run here: the tiny single-process runs, what reads their results
# (sample, score, safetensors and Hugging Face exports) and the comparison.
TRAIN = re.compile(r"^python -m diloco(\.main)? --config=configs/(decoupled|dp)\.py:tiny ")
TINY = (TRAIN, re.compile(r"^python -m diloco compare "),
        re.compile(r"^python -m diloco\.cli\.(sample|evaluate) --workdir=runs/first"),
        re.compile(r"^python -m diloco export --workdir=runs/first --format=(hf|safetensors)"))
SHORTEN = 8


def commands(markdown: str) -> list[str]:
  """The commands of the ```bash blocks, continuation lines joined, comments dropped."""
  out = []
  for block in re.findall(r"```bash\n(.*?)```", markdown, re.S):
    for line in block.replace("\\\n", " ").splitlines():
      line = " ".join(line.split("#")[0].split()) if "#" in line else " ".join(line.split())
      if line:
        out.append(line)
  return out


def tiny_commands() -> list[str]:
  with open(GUIDE, encoding="utf-8") as f:
    return [c for c in commands(f.read()) if any(p.match(c) for p in TINY)]


def test_commands_joins_continuations_and_drops_comments():
  text = "x\n```bash\npython -m a \\\n  --b=1  # note\n# only a comment\nls\n```\n```py\nno\n```"
  assert commands(text) == ["python -m a --b=1", "ls"]


def _shortened(argv: list[str]) -> list[str]:
  """A training command with an eighth of its steps (the preset's, or its own override)."""
  spec = next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))
  steps = run_config.load(os.path.join(REPO, spec)).train.steps
  for a in argv:
    if a.startswith("--config.train.steps="):
      steps = int(a.split("=", 1)[1])
  assert steps % SHORTEN == 0, argv
  return argv + [f"--config.train.steps={steps // SHORTEN}",
                 f"--config.train.eval_every={steps // SHORTEN // 2}"]


def test_the_guide_still_has_its_tiny_commands():
  found = tiny_commands()
  assert any("configs/decoupled.py:tiny" in c for c in found)
  assert any("configs/dp.py:tiny" in c for c in found)
  assert any(c.startswith("python -m diloco compare ") for c in found)
  for tool in ("sample", "evaluate"):
    assert any(c.startswith(f"python -m diloco.cli.{tool} ") for c in found), tool
  for form in ("hf", "safetensors"):
    assert any(c.startswith("python -m diloco export ") and f"--format={form}" in c
               for c in found), form
  assert any("--config.train.init_from=hf:runs/first/hf" in c for c in found)
  assert any("--config.log.hooks=my_hooks.py" in c for c in found)


def hooks_file(markdown: str) -> str:
  """The guide's `my_hooks.py`: its python block that defines HOOKS."""
  return next(b for b in re.findall(r"```python\n(.*?)```", markdown, re.S) if "\nHOOKS = " in b)


def installed_python(folder) -> str:
  """A fresh venv in `folder` with this project installed as a user installs it (a built
  package, not the checkout), beside the test venv's own dependencies: a `.pth` line adds
  that venv's site-packages, whose editable finder for the checkout is not loaded that way."""
  venv = os.path.join(folder, "venv")
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
  python = os.path.join(venv, "bin", "python")
  site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        capture_output=True, text=True, check=True).stdout.strip()
  deps = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
  with open(os.path.join(site, "test_deps.pth"), "w") as f:
    f.write("\n".join(deps) + "\n")
  source = os.path.join(folder, "source")  # what the package is built from (pip builds in-tree)
  shutil.copytree(os.path.join(REPO, "diloco"), os.path.join(source, "diloco"),
                  ignore=shutil.ignore_patterns("__pycache__"))
  for name in ("setup.py", "pyproject.toml", "README.md"):
    shutil.copy(os.path.join(REPO, name), source)
  proc = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps",
                         "--no-build-isolation", "--no-index", source],
                        capture_output=True, text=True, cwd=folder, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return python


@pytest.mark.slow
def test_the_guides_tiny_commands_run_as_written(tmp_path):
  """From a fresh venv outside the checkout, as a new user runs them."""
  python = installed_python(tmp_path / "env")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  where = subprocess.run([python, "-c", "import diloco; print(diloco.__file__)"], env=env,
                         capture_output=True, text=True, cwd=tmp_path, check=True).stdout
  assert not where.startswith(REPO) and "/env/venv/" in where, where
  os.symlink(os.path.join(REPO, "docs"), tmp_path / "docs")  # `--data=text:docs` (the root)
  with open(GUIDE, encoding="utf-8") as f:
    (tmp_path / "my_hooks.py").write_text(hooks_file(f.read()))  # as the guide says to save it
  for command in tiny_commands():
    argv = shlex.split(command)
    argv[0] = python
    if TRAIN.match(command):
      argv = _shortened(argv)
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=600)
    assert proc.returncode == 0, (command, proc.stderr[-3000:])
    if "compare" in argv:
      assert "| first |" in proc.stdout and "| first_dp |" in proc.stdout, proc.stdout
      assert "different numbers of tokens" not in proc.stdout  # the guide says "same tokens"
      assert (tmp_path / "runs" / "compare" / "eval.png").exists()
    elif TRAIN.match(command):
      workdir = next(a.split("=", 1)[1] for a in argv if a.startswith("--workdir="))
      assert (tmp_path / workdir / "export").is_dir(), command
      if "init_from=hf:" in command:  # the folder the export command wrote
        assert "initialised from Hugging Face folder runs/first/hf" in proc.stdout
      if "log.hooks=" in command:  # the file's hook ran, every 8 steps of each learner
        assert re.search(r"^hook low_enough: [1-9]\d* calls", proc.stdout, re.M), proc.stdout
    elif "diloco.cli.sample" in command:
      assert proc.stdout.startswith("import "), proc.stdout
    elif "--tasks=" in command:  # lm-evaluation-harness tasks: a line per task, the JSON
      assert re.search(r"^tiny_choice: acc \d\.\d+", proc.stdout, re.M), proc.stdout
      assert (tmp_path / "runs" / "first" / "benchmarks" / "results.json").is_file()
    elif "diloco.cli.evaluate" in command:
      assert re.search(r"loss \d+\.\d+, perplexity \d+\.\d+", proc.stdout), proc.stdout
    elif "--format=hf" in command:
      assert (tmp_path / "runs" / "first" / "hf" / "config.json").is_file()
    else:
      assert (tmp_path / "runs" / "first" / "export" / "model.safetensors").is_file()
