"""lm-evaluation-harness's own CLI with this project's model: `diloco lm_eval ARGS...`.

lm_eval finds a model only once its module is imported, so this imports
`diloco.artifacts.harness_model` (registering "diloco") and then runs lm_eval's CLI on ARGS,
exactly as `lm_eval ARGS...` would:

    diloco lm_eval --model diloco --model_args workdir=runs/first --tasks hellaswag

A bad model arg (`--model_args workdir=...` without an export, an unknown key) or an unknown
task stops in one line on stderr, exit status 1.
"""

from __future__ import annotations

import sys

from diloco.errors import ConfigError

_PROG = "diloco lm_eval"


def main(argv: list[str]) -> None:
  """`argv[0]` is the program name; the rest go to lm_eval's CLI unchanged."""
  try:
    from lm_eval import __main__ as lm_eval_main  # pylint: disable=import-outside-toplevel

    # Imported for its side effect: it registers the "diloco" model with lm_eval.
    from diloco.artifacts import harness_model  # noqa: F401  pylint: disable=unused-import
  except ImportError as e:
    sys.exit(f"{_PROG}: error: needs lm-evaluation-harness ({e}); pip install -e '.[lm-eval]'")
  saved = sys.argv
  sys.argv = ["lm_eval", *argv[1:]]
  try:
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
