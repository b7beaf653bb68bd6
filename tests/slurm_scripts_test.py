"""The SLURM batch scripts hold values, never code: a workdir, store or Python path of any
characters reaches the program byte for byte, run by bash under stand-ins for srun and
scontrol, or is refused in one line before anything is written; partial submissions are undone
and resubmissions of another run refused (stand-ins for sbatch and scancel)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.config import run_config
from diloco.deploy import slurm
from diloco.errors import ConfigError

# Characters that mean something to bash or to sbatch's directive parser, and some that do not.
DANGEROUS = "\n\t '\"$`;&|<>()*?[]{}!#%\\~=,:/.-_aZé\x01"
_RECORDER = """#!{python}
import json, os, sys
with open(os.environ["ARGV_LOG"], "a", encoding="utf-8") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def _config(python: str, **fields) -> run_config.Config:
  raw = run_config.load("multiprocess:tiny")
  raw.learners.count = 2
  raw.launch.max_learners = 0
  raw.slurm.python = python
  for key, value in fields.items():
    group, name = key.split("__")
    setattr(getattr(raw, group), name, value)
  return run_config.from_config_dict(raw)


def _executable(path: str, text: str) -> None:
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
  os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory):
  """Stand-ins: srun runs its command (its options dropped), scontrol and hostname do nothing
  harmful, and the recorder (the jobs' Python) appends its argv to $ARGV_LOG."""
  folder = tmp_path_factory.mktemp("bin")
  _executable(str(folder / "srun"), '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                                    'exec "$@"\n')
  _executable(str(folder / "scontrol"), "#!/bin/bash\nexit 0\n")
  _executable(str(folder / "recorder"), _RECORDER.format(python=sys.executable))
  return folder


def _run(script: str, bin_dir, tmp_path) -> list[list[str]]:
  path, log = tmp_path / "job.sbatch", tmp_path / "argv.jsonl"
  path.write_text(script, encoding="utf-8")
  log.unlink(missing_ok=True)
  env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "ARGV_LOG": str(log), "SLURM_JOB_ID": "7",
         "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_JOB_ID": "6", "SLURM_JOB_NODELIST": "n1",
         "SLURM_RESTART_COUNT": "0", "HOME": str(tmp_path)}
  done = subprocess.run(["bash", str(path)], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=60, check=False)
  assert done.returncode == 0, done.stderr
  return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]


def _directives(script: str) -> list[str]:
  """The #SBATCH lines sbatch reads: those before the first line that is not a comment."""
  found = []
  for line in script.splitlines()[1:]:
    if line and not line.startswith("#"):
      break
    if line.startswith("#SBATCH"):
      found.append(line)
  return found


_TEXT = st.text(alphabet=DANGEROUS, min_size=1, max_size=24)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workdir=_TEXT, store=_TEXT)
def test_any_workdir_and_store_reach_the_program_byte_for_byte_or_are_refused(
    workdir, store, bin_dir, tmp_path):
  workdir, store = "/shared/" + workdir, "/stores/" + store
  cfg = slurm.for_slurm(_config(str(bin_dir / "recorder")), store)
  try:
    jobs = slurm.render(cfg, workdir, store)
  except ConfigError as e:
    assert "--workdir:" in str(e) and "\n" not in str(e).replace(repr(workdir), "")
    assert re.search(r"[\s#%'\"\\\x01]", workdir)  # refused only for what a directive can't hold
    return
  for job in jobs:
    directives = _directives(job.script)
    assert len(directives) == job.script.count("#SBATCH"), job.script  # none read as a command
    output = next(d for d in directives if d.startswith("#SBATCH --output="))
    assert output.removeprefix("#SBATCH --output=").startswith(os.path.join(workdir, "logs", ""))
    argvs = _run(job.script, bin_dir, tmp_path)
    assert len(argvs) == 1, argvs  # the program ran once, and nothing else did
    argv = argvs[0]
    assert f"--workdir={workdir}" in argv, (argv, workdir)
    if job.name != "report":
      assert f"--store={store}" in argv and argv[:2] == ["-m", "diloco.main"]


def test_the_python_path_is_a_value_too(bin_dir, tmp_path):
  odd = tmp_path / "a dir; with $(touch pwned) `and` 'quotes'"
  os.makedirs(odd)
  python = odd / "py thon"
  _executable(str(python), _RECORDER.format(python=sys.executable))
  cfg = slurm.for_slurm(_config(str(python)), "/stores/s")
  for job in slurm.render(cfg, "/shared/run", "/stores/s"):
    assert len(_run(job.script, bin_dir, tmp_path)) == 1
  assert not (tmp_path / "pwned").exists()


def test_a_workdir_with_a_newline_or_space_is_refused_before_anything_is_written(tmp_path):
  for workdir in (f"{tmp_path}/run\ntouch /tmp/pwned", f"{tmp_path}/my run"):
    done = subprocess.run([sys.executable, "-m", "diloco", "slurm", "--config=multiprocess:tiny",
                           f"--workdir={workdir}", "--config.learners.count=2"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1 and "--workdir:" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert os.listdir(tmp_path) == []


def _scheduler(tmp_path, refuse: str = "", cancel_fails: bool = False):
  """Stand-in sbatch (job ids 100, 101, ...; refuses scripts whose name contains `refuse`) and
  scancel (records its arguments), on a PATH of their own."""
  folder = tmp_path / "scheduler"
  os.makedirs(folder)
  _executable(str(folder / "sbatch"), f"""#!/bin/bash
script="${{@: -1}}"
if [[ -n "{refuse}" && "$script" == *"{refuse}"* ]]; then
  echo "sbatch: error: invalid partition specified: nope" >&2; exit 1
fi
n=$(cat "{folder}/next" 2>/dev/null || echo 100); echo $((n + 1)) > "{folder}/next"
echo "$n"
""")
  _executable(str(folder / "scancel"), f'#!/bin/bash\necho "$@" >> "{folder}/cancelled"\n'
                                       f'exit {1 if cancel_fails else 0}\n')
  return folder, {"PATH": f"{folder}:{os.environ['PATH']}"}


@pytest.mark.parametrize("cancel_fails", [False, True])
def test_a_refused_job_cancels_what_was_queued_and_says_so(tmp_path, cancel_fails):
  folder, env = _scheduler(tmp_path, refuse="learner", cancel_fails=cancel_fails)
  workdir = str(tmp_path / "run")
  cfg = slurm.for_slurm(_config(sys.executable), workdir + "/store")
  with pytest.raises(RuntimeError) as e:
    slurm.submit(cfg, workdir, workdir + "/store", env=env)
  message = str(e.value)
  assert "invalid partition" in message and "syncer 100" in message and "\n" not in message
  record = json.loads(open(os.path.join(workdir, slurm.JOBS_FILE)).read())
  assert (folder / "cancelled").read_text().split() == ["100"]
  if cancel_fails:
    assert "could not cancel" in message and record["left"] == {"syncer": "100"}
  else:
    assert "cancelled the jobs already queued" in message and record["cancelled"] == {
        "syncer": "100"}
  assert record["jobs"] == {}


def test_a_resubmission_may_change_only_the_slurm_group(tmp_path):
  _, env = _scheduler(tmp_path)
  workdir = str(tmp_path / "run")
  cfg = slurm.for_slurm(_config(sys.executable), workdir + "/store")
  slurm.submit(cfg, workdir, workdir + "/store", env=env)
  moved = dataclasses.replace(cfg, slurm=dataclasses.replace(cfg.slurm, partition="other"))
  assert set(slurm.submit(moved, workdir, workdir + "/store", env=env)) >= {"syncer", "learner"}
  more = dataclasses.replace(cfg, learners=dataclasses.replace(cfg.learners, count=3))
  with pytest.raises(ConfigError, match=r"differs in learners\.count; a resubmission may "
                                        r"change only the slurm group"):
    slurm.submit(more, workdir, workdir + "/store", env=env)
  recorded = json.loads(open(os.path.join(workdir, "config.json")).read())
  assert recorded["learners"]["count"] == 2 and recorded["slurm"]["partition"] == "other"
