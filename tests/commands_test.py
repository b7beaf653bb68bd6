"""The command line from a user's side: shipped configs by name from any directory, `diloco
--help`, one-line errors for every kind of bad input before any model is built, and a clean
stop on SIGINT that the same command resumes."""

import dataclasses
import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from diloco.cli import commands, interrupt, preflight
from diloco.config import files as config_files
from diloco.config import run_config
from diloco.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _diloco(*args, cwd, timeout=180):
  """`python -m diloco ARGS` (the `diloco` command) run from `cwd`, the checkout importable."""
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True,
                        cwd=cwd, timeout=timeout, env=env)


def test_shipped_configs_are_the_repository_configs():
  assert config_files.names() == sorted(
      f[:-3] for f in os.listdir(os.path.join(REPO, "configs"))
      if f.endswith(".py") and not f.startswith("_"))
  for spec in ("decoupled:tiny", "decoupled.py:tiny", "configs/decoupled.py:tiny"):
    path, _, preset = config_files.resolve(spec).partition(":")
    assert os.path.samefile(path, os.path.join(REPO, "configs", "decoupled.py"))
    assert preset == "tiny"
  # By name, by repository path and by absolute path: the same config.
  by_name = run_config.load("decoupled:tiny").to_dict()
  assert by_name == run_config.load(os.path.join(REPO, "configs/decoupled.py:tiny")).to_dict()
  assert by_name["learners"]["count"] == 4 and by_name["train"]["steps"] == 64


def test_a_config_name_resolves_from_outside_the_checkout(tmp_path):
  proc = _diloco("--config=decoupled:tiny", "--config_help=learners.count", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "learners.count = 4" in proc.stdout
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  main = subprocess.run([sys.executable, "-m", "diloco.main", "--config=dp:tiny",
                         "--config_help=learners.count"], capture_output=True, text=True,
                        cwd=tmp_path, timeout=180, env=env)
  assert main.returncode == 0 and "learners.count = 0" in main.stdout, main.stderr[-2000:]
  # The repository path of a shipped file works from anywhere too (the docs' commands).
  proc = _diloco("--config=configs/dp.py:tiny", "--config_help=train.steps", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "train.steps = " in proc.stdout


def test_help_lists_the_subcommands_and_only_the_projects_flags(tmp_path):
  proc = _diloco("--help", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = proc.stdout.splitlines()
  assert len(lines) < 80  # absl's and JAX's ~700 lines of flags are not in it
  for name in ("train", "compare", "sample", "evaluate", "export"):
    assert any(line.startswith(f"  {name} ") for line in lines), name
  assert "--workdir" in proc.stdout and "--config" in proc.stdout
  assert "jax_enable_x64" not in proc.stdout and "--only_check_args" not in proc.stdout
  assert "decoupled" in proc.stdout  # the shipped configs are named


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"]])
def test_help_read_by_a_reader_that_stops_early_is_not_an_error(tmp_path, args):
  # `diloco --help | head`: the reader is gone before the help is written (the pipe is closed
  # at once, while the command still imports), so every write meets a broken pipe.
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.Popen([sys.executable, "-m", "diloco", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, cwd=tmp_path, env=env)
  proc.stdout.close()
  _, err = proc.communicate(timeout=180)
  assert proc.returncode == 0, err.decode()[-2000:]
  assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()[-2000:]


def test_train_help_is_the_training_flags(tmp_path):
  proc = _diloco("train", "--help", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.startswith("Training: `python -m diloco.main")
  assert "--workdir" in proc.stdout and "--role" in proc.stdout
  assert len(proc.stdout.splitlines()) < 80


@pytest.mark.parametrize("alias", sorted(commands.ALIASES))
def test_an_alias_runs_its_subcommand(tmp_path, alias):
  proc = _diloco(alias, "--help", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  module = commands.SUBCOMMANDS[commands.ALIASES[alias]][0]
  assert module.rsplit(".", 1)[1] in proc.stdout and "--workdir" in proc.stdout


def test_unknown_subcommand_is_one_line(tmp_path):
  proc = _diloco("trian", "--config=dp:tiny", cwd=tmp_path)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines() == [
      "diloco: unknown subcommand 'trian'; subcommands: " + ", ".join(commands.SUBCOMMANDS)
      + " (see diloco --help)"]


@pytest.mark.parametrize("old", sorted(commands.MOVED))
def test_a_folded_subcommand_names_its_new_form(tmp_path, old):
  proc = _diloco(old, "--workdir=runs/first", cwd=tmp_path)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines() == [
      f"diloco: {old!r} is now `diloco export --format=safetensors`"]


def _jsonl(path, records, compress=False):
  lines = "".join(json.dumps(r) + "\n" for r in records).encode()
  with (gzip.open if compress else open)(path, "wb") as f:
    f.write(lines)
  return str(path)


def _parquet(path, columns):
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  pq.write_table(pa.table(columns), path)
  return str(path)


def _bad_inputs(tmp) -> dict[str, tuple[tuple[str, ...], list[str]]]:
  """{case: (flags, the words its one-line error must hold)} for every kind of bad input:
  config file and preset, workdir, flag and override types, data path and text field of each
  record source, tokenizer file."""
  afile = tmp / "afile"
  afile.write_text("not a directory")
  unreadable = tmp / "tok.model"
  unreadable.write_bytes(b"\x00" * 64)
  unreadable.chmod(0)
  garbage = tmp / "garbage.model"
  garbage.write_bytes(b"this is not a sentencepiece model")
  wrong_field = _jsonl(tmp / "docs.jsonl", [{"content": "hello"}, {"content": "world"}])
  wrong_field_gz = _jsonl(tmp / "docs.jsonl.gz", [{"body": "hello"}], compress=True)
  good = _jsonl(tmp / "good.jsonl", [{"text": "hello world"}])
  not_json = tmp / "broken.jsonl"
  not_json.write_text("{not json\n")
  parquet = _parquet(tmp / "docs.parquet", {"body": ["hello", "world"]})
  jsonl = ("--config.data.source=jsonl",)
  cases = {
      "config_path_missing": (("--config=configs/nope.py:tiny",),
                              ["config file", "configs/nope.py", "does not exist"]),
      "config_name_unknown": (("--config=nope:tiny",), ["config file", "'nope'", "decoupled"]),
      "preset_unknown": (("--config=decoupled:huge",), ["unknown preset", "'huge'"]),
      "workdir_is_file": ((f"--workdir={afile}",), ["--workdir", "afile", "is a file"]),
      "workdir_under_file": ((f"--workdir={afile}/run",), ["--workdir", "afile", "is a file"]),
      "workdir_empty": (("--workdir=",), ["--workdir"]),
      "int_override": (("--config.train.steps=abc",), ["train.steps", "must be int", "'abc'"]),
      "float_override": (("--config.optim.learning_rate=fast",),
                         ["optim.learning_rate", "must be float", "'fast'"]),
      "unknown_group": (("--config.trian.steps=3",), ["unknown config group", "'trian'"]),
      "unknown_key": (("--config.train.stpes=3",), ["--config.train.stpes", "train.steps"]),
      "int_flag": (("--learner_id=one",), ["--learner_id", "one"]),
      "enum_flag": (("--role=boss",), ["--role", "boss"]),
      "jsonl_missing": ((*jsonl, f"--config.data.path={tmp}/missing.jsonl"),
                        ["data.path", "missing.jsonl"]),
      "jsonl_field": ((*jsonl, f"--config.data.path={wrong_field}"),
                      ["data.text_key", "docs.jsonl:1", "'text'", "content"]),
      "jsonl_gz_field": ((*jsonl, f"--config.data.path={wrong_field_gz}"),
                         ["data.text_key", "'text'", "body"]),
      "text_key_override": ((*jsonl, f"--config.data.path={good}", "--config.data.text_key=body"),
                            ["data.text_key", "'body'", "text"]),
      "jsonl_not_json": ((*jsonl, f"--config.data.path={not_json}"),
                         ["data.path", "broken.jsonl", "JSON"]),
      "parquet_field": (("--config.data.source=parquet", f"--config.data.path={parquet}"),
                        ["data.text_key", "docs.parquet", "'text'", "body"]),
      "parquet_not_parquet": (("--config.data.source=parquet", f"--config.data.path={good}"),
                              ["data.path", "good.jsonl", "not a parquet file"]),
      "text_dir_missing": (("--config.data.source=text", f"--config.data.path={tmp}/no_dir"),
                           ["data.path", "no_dir"]),
      "shards_missing": (("--config.data.source=array_record", f"--config.data.path={tmp}"),
                         ["data.path", "shards"]),
      "tokenizer_missing": ((f"--config.data.tokenizer={tmp}/missing.model",),
                            ["data.tokenizer", "missing.model"]),
      "tokenizer_garbage": ((f"--config.data.tokenizer={garbage}",),
                            ["data.tokenizer", "garbage.model"]),
  }
  if os.geteuid() != 0:  # root reads any file
    cases["tokenizer_unreadable"] = ((f"--config.data.tokenizer={unreadable}",),
                                     ["data.tokenizer", "tok.model"])
  return cases


CASES = [
    "config_path_missing", "config_name_unknown", "preset_unknown", "workdir_is_file",
    "workdir_under_file", "workdir_empty", "int_override", "float_override", "unknown_group",
    "unknown_key", "int_flag", "enum_flag", "jsonl_missing", "jsonl_field", "jsonl_gz_field",
    "text_key_override", "jsonl_not_json", "parquet_field", "parquet_not_parquet",
    "text_dir_missing", "shards_missing", "tokenizer_missing", "tokenizer_garbage",
] + (["tokenizer_unreadable"] if os.geteuid() != 0 else [])


def test_the_case_list_covers_every_case(tmp_path):
  assert sorted(CASES) == sorted(_bad_inputs(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_before_any_model_is_built(tmp_path, case):
  args, words = _bad_inputs(tmp_path)[case]
  argv = list(args)
  if not any(a.startswith("--config=") for a in argv):
    argv.insert(0, "--config=dp:tiny")
  workdir = tmp_path / "run"
  if not any(a.startswith("--workdir") for a in argv):
    argv.append(f"--workdir={workdir}")
  proc = _diloco(*argv, cwd=tmp_path)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode != 0, proc.stdout[-1000:]
  assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert all(w in lines[0] for w in words), (lines[0], words)
  assert "compiling" not in proc.stdout  # it stopped before any model was built
  assert not workdir.exists()


def test_preflight_names_the_field_and_file_of_each_bad_data_input(tmp_path):
  """The same data cases in this process, against `preflight.check` (fast)."""
  base = run_config.from_config_dict(run_config.load("dp:tiny"))
  checked = 0
  for args, words in _bad_inputs(tmp_path).values():
    if not all(a.startswith("--config.data.") for a in args):
      continue
    data = dataclasses.asdict(base.data)
    for arg in args:
      key, _, value = arg[len("--config.data."):].partition("=")
      data[key] = value
    try:
      cfg = run_config.from_config_dict(dict(dataclasses.asdict(base), data=data))
    except ConfigError as e:  # the config's own rules refuse it first (a missing file)
      message = str(e)
    else:
      with pytest.raises(ConfigError) as error:
        preflight.check(cfg, str(tmp_path / "run"))
      message = str(error.value)
      checked += 1
    assert "\n" not in message and all(w in message for w in words), (args, message)
  assert checked >= 6  # most of them reach the preflight


@pytest.mark.parametrize("name", ["file", "file/below", "file/below/deeper"])
def test_a_workdir_under_a_file_is_refused(tmp_path, name):
  (tmp_path / "file").write_text("x")
  with pytest.raises(ConfigError, match=r"--workdir: .*file.* is a file"):
    preflight.check_workdir(str(tmp_path / name))
  preflight.check_workdir(str(tmp_path / "new" / "run"))  # not there yet: fine
  assert not (tmp_path / "new").exists()  # and nothing was created


def test_stopped_line_says_where_and_how_to_resume(tmp_path):
  line = interrupt.stopped_line(str(tmp_path), "SIGINT")
  assert line == ("stopped by SIGINT before the first step; no checkpoint yet: the same command "
                  "starts the run again from the beginning")
  with open(tmp_path / "metrics.jsonl", "w") as f:
    for step in (0, 1, 2, 7):
      f.write(json.dumps({"t": 1.0, "role": "learner", "step": step, "train/loss": 3.0}) + "\n")
    f.write(json.dumps({"t": 1.0, "role": "syncer", "step": 9, "eval/loss": 3.0}) + "\n")
  with open(tmp_path / "tape.jsonl", "w") as f:
    f.write("".join(json.dumps({"round": r}) + "\n" for r in range(5)))
  os.makedirs(tmp_path / "run_checkpoints" / "2")
  os.makedirs(tmp_path / "run_checkpoints" / "10")
  os.makedirs(tmp_path / "run_checkpoints" / "11.orbax-checkpoint-tmp")
  line = interrupt.stopped_line(str(tmp_path), "SIGTERM")
  assert line == ("stopped by SIGTERM at round 5, step 7; rerun the same command to resume from "
                  f"its last checkpoint ({tmp_path}/run_checkpoints/10)")


def _wait_for(predicate, proc, timeout):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    if proc.poll() is not None:
      return False
    time.sleep(0.5)
  return False


def _committed(directory):
  return os.path.isdir(directory) and any(d.isdigit() for d in os.listdir(directory))


_SWALLOWED = """
import gc, signal, sys, time
from diloco.cli import interrupt
interrupt.install()
where = sys.argv[1]

class Dropped:
  def __del__(self):
    signal.raise_signal(signal.SIGTERM)  # the handler runs in here, where raising is dropped

def in_gc_callback(phase, info):
  if phase == "start":
    gc.callbacks.remove(in_gc_callback)
    signal.raise_signal(signal.SIGTERM)

try:
  if where == "gc":
    gc.callbacks.append(in_gc_callback)
    gc.collect()
  else:
    Dropped()
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline:
    sum(range(1000))
  print("lost")
except interrupt.Interrupted as e:
  print("stopped", e)
"""


@pytest.mark.parametrize("where", ["gc", "del"])
def test_a_signal_landing_where_python_drops_exceptions_still_stops_the_run(where):
  """A signal whose handler runs inside a gc callback (jax registers one) or a `__del__` raises
  `Interrupted` where Python prints "Exception ignored" and drops it: the stop must still come
  (the signal is delivered again), not be lost while training goes on."""
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, "-c", _SWALLOWED, where], capture_output=True, text=True,
                       timeout=60, env=env)
  assert out.stdout.strip() == "stopped SIGTERM", (out.stdout, out.stderr[-2000:])
  assert "Exception ignored" not in out.stderr


@pytest.mark.slow
def test_sigint_stops_a_threaded_run_in_one_line_and_the_same_command_resumes(tmp_path):
  workdir = tmp_path / "run"
  args = [sys.executable, "-m", "diloco", "--config=decoupled:tiny", f"--workdir={workdir}",
          "--config.train.steps=5000", "--config.checkpoint.every_rounds=4"]
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))

  def start(out):
    return subprocess.Popen(args, stdout=out, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=env)

  with open(tmp_path / "first.out", "w") as out:
    proc = start(out)
    try:
      assert _wait_for(lambda: _committed(workdir / "run_checkpoints"), proc, 400)
      time.sleep(1.0)
      os.kill(proc.pid, signal.SIGINT)
      _, err = proc.communicate(timeout=120)
    finally:
      proc.kill()
  first = (tmp_path / "first.out").read_text()
  assert "compiling the model's steps" in first
  assert proc.returncode == 128 + signal.SIGINT
  (line,) = err.strip().splitlines()
  assert line.startswith("stopped by SIGINT at round ") and ", step " in line, line
  assert "rerun the same command to resume from its last checkpoint" in line
  assert str(workdir / "run_checkpoints") in line
  # The same command resumes from that checkpoint (and stops as cleanly on SIGTERM).
  with open(tmp_path / "second.out", "w") as out:
    proc = start(out)
    try:
      assert _wait_for(lambda: "resumed from" in (tmp_path / "second.out").read_text(), proc, 400)
      os.kill(proc.pid, signal.SIGTERM)
      _, err = proc.communicate(timeout=120)
    finally:
      proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM
  assert len(err.strip().splitlines()) == 1 and err.startswith("stopped by SIGTERM"), err
