"""lm-evaluation-harness's own CLI with this project's model: `diloco lm_eval ARGS...`.

lm_eval finds a model only once its module is imported, so this imports
`diloco.artifacts.harness_model` (registering "diloco") and then runs lm_eval's CLI on ARGS,
exactly as `lm_eval ARGS...` would:

    diloco lm_eval --model diloco --model_args workdir=runs/first --tasks hellaswag

A bad model arg (`--model_args workdir=...` without an export, an unknown key, a batch size
of inf), an unknown task or a bad number (`--limit=nan`, `check_args`) stops in one line on
stderr, exit status 1.
"""

from __future__ import annotations

import math
import sys

from diloco import settings
from diloco.cli import benchmarks
from diloco.errors import ConfigError

_PROG = "diloco lm_eval"
# lm_eval's numeric flags that it takes as typed and fails on later with a traceback (a NaN or
# infinite --limit reaches int(); a negative one islice()): (kind, lowest, whether lowest is
# excluded). --limit below 1 is a fraction of each task's documents.
_NUMBERS = {"--limit": (float, 0.0, True), "--num_fewshot": (int, 0, False)}


def check_args(args: list[str]) -> None:
  """ConfigError naming the first of lm_eval's arguments that is bad input: a value with a
  control character or lone surrogate, or a `_NUMBERS` flag out of its range."""
  for i, arg in enumerate(args):
    problem = settings.general_problem(arg)
    if problem:
      raise ConfigError(f"argument {i + 1} {problem}")
    name, eq, value = arg.partition("=")
    if name not in _NUMBERS:
      continue
    if not eq:
      value = args[i + 1] if i + 1 < len(args) else ""
    kind, low, open_low = _NUMBERS[name]
    try:
      number = kind(value)
    except ValueError:
      number = None
    if number is None or not math.isfinite(number) or number < low or open_low and number == low:
      bound = f"{'>' if open_low else '>='} {low:g}"
      raise ConfigError(f"{name}: must be a finite {kind.__name__} {bound}, got {value!r}")


def main(argv: list[str]) -> None:
  """`argv[0]` is the program name; the rest go to lm_eval's CLI unchanged (`check_args`)."""
  try:
    check_args(argv[1:])
  except ConfigError as e:
    sys.exit(f"{_PROG}: error: {e}")
  try:
    from lm_eval import __main__ as lm_eval_main  # pylint: disable=import-outside-toplevel

    # Imported for its side effect: it registers the "diloco" model with lm_eval.
    from diloco.artifacts import harness_model  # noqa: F401  pylint: disable=unused-import
  except ImportError as e:
    sys.exit(f"{_PROG}: error: needs lm-evaluation-harness ({e}); pip install -e '.[lm-eval]'")
  saved = sys.argv
  sys.argv = ["lm_eval", *argv[1:]]
  try:
    with benchmarks.task_config_errors():
      lm_eval_main.cli_evaluate()
  except ConfigError as e:
    sys.exit(f"{_PROG}: error: {e}")
  except ValueError as e:
    if str(e).startswith("Tasks not found"):  # lm_eval's own lookup, with its own message
      sys.exit(f"{_PROG}: error: --tasks: {e} (lm_eval's tasks and --include_path; "
               "`lm_eval ls tasks` lists them)")
    raise
  finally:
    sys.argv = saved


if __name__ == "__main__":
  main(sys.argv)
