"""The commands of docs/guide.md run as written (the tiny ones, shortened by flags).

Each fenced bash block of the guide is split into commands; those that match `TINY` run in a
temporary directory, in the guide's order (the comparison reads the runs before it), with
`SHORT` appended to training commands so that they take seconds. A command the guide drops or
renames fails `test_the_guide_still_has_its_tiny_commands`, so the list cannot go stale
silently.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(REPO, "docs", "guide.md")
# Commands cheap enough to run here: the tiny single-process runs and the comparison.
TINY = (re.compile(r"^python -m diloco(\.main)? --config=configs/(decoupled|dp)\.py:tiny "),
        re.compile(r"^python -m diloco compare "))
SHORT = ("--config.train.steps=8", "--config.train.eval_every=4")


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


def test_the_guide_still_has_its_tiny_commands():
  found = tiny_commands()
  assert any("configs/decoupled.py:tiny" in c for c in found)
  assert any("configs/dp.py:tiny" in c for c in found)
  assert any(c.startswith("python -m diloco compare ") for c in found)


@pytest.mark.slow
def test_the_guides_tiny_commands_run_as_written(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  for command in tiny_commands():
    argv = shlex.split(command)
    argv[0] = sys.executable
    if "compare" not in argv:
      argv += SHORT
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=600)
    assert proc.returncode == 0, (command, proc.stderr[-3000:])
    if "compare" in argv:
      assert "| first |" in proc.stdout and "| first_dp |" in proc.stdout, proc.stdout
      assert (tmp_path / "runs" / "compare" / "eval.png").exists()
    else:
      workdir = next(a.split("=", 1)[1] for a in argv if a.startswith("--workdir="))
      assert (tmp_path / workdir / "export").is_dir(), command
