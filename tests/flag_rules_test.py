"""Every flag of every command keeps the general rules of config fields (`settings.check_flags`).

The flags are enumerated from their own definitions (each subcommand's FlagValues, the training
command's own flags, the JobSet renderer's), never listed here: each one is fed the values a
careless or hostile user types, through its own absl parser, then the rule. A value either
parses and passes, or is refused in one line that names the flag; numbers are never NaN,
infinite or past `settings.MAX_INT` (unless the flag's own bound says otherwise), strings never
hold a lone surrogate, and only free-text flags hold a newline. Each command's entry point then
shows that the rule runs before its body.
"""

import importlib
import math

import pytest
from absl import flags

from diloco import settings
from diloco.cli import commands, harness, train
from diloco.deploy import jobset
from diloco.errors import ConfigError

BAD = ("nan", "inf", "-inf", "-1", "0", str(10**18), "", "a\nb", "x\udcff", "tab\there")
# The flags that hold free text (newlines and tabs allowed), by command.
TEXT_FLAGS = {"sample": ("prompt",)}


def _command_flags():
  """(command, FlagValues, names) of every command with flags of its own."""
  out = []
  for name, (module, _) in sorted(commands.SUBCOMMANDS.items()):
    values = getattr(importlib.import_module(module), "FLAGS", None)
    if isinstance(values, flags.FlagValues):
      out.append((name, values, sorted(n for n in values if values[n].name == n)))
  out.append(("train", flags.FLAGS, sorted(f.name for f in train._OWN_FLAGS)))
  fv = flags.FlagValues()
  jobset.define_flags(fv)
  out.append(("jobset", fv, sorted(n for n in fv if fv[n].name == n)))
  return out


COMMANDS = _command_flags()
CASES = [(command, fv, name) for command, fv, names in COMMANDS for name in names]


def test_the_commands_are_all_enumerated():
  names = {c for c, _, _ in COMMANDS}
  # Every subcommand but lm_eval (lm-evaluation-harness's own argparse CLI) has flags here.
  assert names >= set(commands.SUBCOMMANDS) - {"lm_eval"}, names
  assert len(CASES) > 60


def _admitted(flag, value, text: bool) -> bool:
  """Whether a parsed value is one the rules admit (checked here from first principles)."""
  for v in value if isinstance(value, list) else [value]:
    if isinstance(v, float) and not math.isfinite(v):
      return False
    if isinstance(v, int) and not isinstance(v, bool):
      bound = getattr(flag.parser, "upper_bound", None)
      if abs(v) > max(bound or 0, settings.MAX_INT):
        return False
    if isinstance(v, str) and (any("\ud800" <= c <= "\udfff" for c in v)
                               or not text and any(c in "\n\t" for c in v)):
      return False
  return True


@pytest.mark.parametrize("command, fv, name", CASES, ids=[f"{c}--{n}" for c, _, n in CASES])
def test_every_flag_parses_and_passes_the_rule_or_is_refused_in_one_line(command, fv, name):
  flag = fv[name]
  default, text = flag.value, name in TEXT_FLAGS.get(command, ())
  try:
    for raw in BAD:
      flag.value, flag.present = default, 0
      try:
        flag.parse(raw)
      except flags.Error as e:  # absl's own parser refused it, naming the flag
        assert name in str(e), (raw, e)
        continue
      try:
        settings.check_flags(fv, names=[name], text_flags=TEXT_FLAGS.get(command, ()))
      except ConfigError as e:
        assert str(e).startswith(f"--{name}: ") and "\n" not in str(e), e
        assert not _admitted(flag, flag.value, text), (raw, e)  # refused only what it must
        continue
      assert _admitted(flag, flag.value, text), (name, raw, flag.value)
  finally:
    flag.value, flag.present = default, 0


# Valid values of the flags a command requires before it parses the others.
REQUIRED = {"compile": ("--config=configs/decoupled.py:tiny", "--topology=v5e-4"),
            "slurm": ("--config=configs/decoupled.py:tiny", "--workdir=runs/never"),
            "jobset": ("--name=r", "--store=gs://bucket/run", "--config=configs/decoupled.py:tiny",
                            "--learners=2", "--tpu_type=v5e-4")}


def _bad_value(flag) -> str | None:
  """A value of the flag's type that the rule refuses (None: its type has none)."""
  kind = type(flag.parser).__name__
  if kind == "FloatParser":
    return "nan"
  if kind == "IntegerParser":
    return None if getattr(flag.parser, "upper_bound", None) else str(10**18)
  if kind in ("ArgumentParser", "ListParser", "CsvListParser"):
    return "x\udcff"
  return None


ENTRY_CASES = [(c, fv, n) for c, fv, n in CASES
               if c != "train" and _bad_value(fv[n]) is not None
               and not any(a.startswith(f"--{n}=") for a in REQUIRED.get(c, ()))]


@pytest.mark.parametrize("command, fv, name", ENTRY_CASES,
                         ids=[f"{c}--{n}" for c, _, n in ENTRY_CASES])
def test_each_command_refuses_a_bad_flag_before_its_body_runs(command, fv, name, capsys):
  """The command's real entry point, a bad value of each flag: one line naming the flag, and
  the body never starts (it would fail on the missing run first, naming no flag)."""
  argv = [*REQUIRED.get(command, ()), f"--{name}={_bad_value(fv[name])}"]
  if command == "jobset":
    assert jobset.main(argv) == 2
    message = capsys.readouterr().err.strip()
  else:
    module = importlib.import_module(commands.SUBCOMMANDS[command][0])
    with pytest.raises(SystemExit) as exit_info:
      module.main([f"diloco {command}", "--workdir=/nonexistent/run", *argv]
                  if "workdir" in fv and command != "slurm" else [f"diloco {command}", *argv])
    message = str(exit_info.value.code)
  assert f"--{name}: must" in message and "\n" not in message, message


def test_the_training_command_checks_its_own_flags_in_one_line(tmp_path):
  import subprocess
  import sys
  out = subprocess.run([sys.executable, "-m", "diloco.main", f"--workdir={tmp_path}/run",
                        "--config=configs/decoupled.py:tiny", f"--num_processes={10**18}"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 1 and not (tmp_path / "run").exists()
  assert out.stderr.strip().splitlines()[-1].startswith("flag error: --num_processes: must be")
  assert "Traceback" not in out.stderr


@pytest.mark.parametrize("name", sorted(harness._NUMBERS))
def test_lm_evals_numeric_flags_are_checked_before_lm_eval_runs(name):
  kind, low, open_low = harness._NUMBERS[name]
  for raw in BAD:
    for args in ([f"{name}={raw}"], [name, raw]):
      try:
        harness.check_args(["--tasks", "t", *args])
      except ConfigError as e:
        assert str(e).startswith(f"{name}: must") or str(e).startswith("argument "), e
        continue
      number = kind(raw)
      assert math.isfinite(number) and (number > low if open_low else number >= low), raw
  harness.check_args(["--limit", "0.5", "--num_fewshot=0", "--tasks", "a,b"])


def test_every_integer_model_arg_is_bounded_and_bad_ones_name_the_arg():
  """lm_eval's parser turns "inf" into a float and "10**18" into an int: each reaches the
  model's arguments as lm_eval passes them, and is refused naming the arg or accepted (then
  the missing run is what stops it)."""
  from lm_eval import utils as lm_utils

  from diloco.artifacts import harness_model
  for name, (_, low, high) in harness_model.INT_ARGS.items():
    for raw in (*BAD, str(low), str(high), str(high + 1)):
      if raw == "" or "\n" in raw or "\t" in raw:
        continue  # lm_eval's own syntax (key=value,...) cannot carry these
      args = lm_utils.simple_parse_args_string(f"workdir=/nonexistent/run,{name}={raw}")
      with pytest.raises(ConfigError) as e:
        harness_model.DilocoLM.from_model_args(args)
      accepted = raw in (str(low), str(high))
      assert str(e.value).startswith("--model_args workdir" if accepted
                                     else f"--model_args {name}: must"), (raw, e.value)
