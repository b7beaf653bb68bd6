"""Running a subcommand (`diloco.cli.sample`, `diloco.cli.evaluate`, `diloco.cli.export_model`).

Each subcommand defines its flags on its own `absl.flags.FlagValues`, not on absl's global
FLAGS, so that a dispatcher (`diloco.main`) can import all of them beside its own `--workdir`
and hand each its argv: `module.main(["diloco sample", "--workdir=runs/x", ...])`. `run`
parses them and turns every bad input (a flag that does not parse, a ConfigError) into one
line on stderr and exit status 1.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

from absl import app, flags, logging

from diloco import settings
from diloco.errors import ConfigError


def run(flag_values: flags.FlagValues, argv: list[str], body: Callable[[], None], *,
        text_flags=()) -> None:
  """Parses `argv` (argv[0] is the program name) into `flag_values`, checks every flag
  (`settings.check_flags`; `text_flags` hold free text), then calls `body`."""
  prog = argv[0] if argv else "diloco"
  if any(a in ("--help", "-h", "--helpfull") for a in argv[1:]):
    print(f"usage: {prog} [flags]\n{flag_values.get_help()}")
    return
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every read at INFO
  flag_values.unparse_flags()  # a second call in one process starts from the defaults
  try:
    extra = flag_values(list(argv) if argv else [prog])
  except flags.Error as e:
    sys.exit(f"{prog}: error: {e}")
  if len(extra) > 1:
    sys.exit(f"{prog}: error: unexpected arguments {extra[1:]}")
  try:
    settings.check_flags(flag_values, text_flags=text_flags)
    body()
  except ConfigError as e:
    sys.exit(f"{prog}: error: {e}")


def at_least(value, low, flag: str, high=None) -> None:
  """ConfigError naming `flag` unless value is a finite number >= low (and <= high)."""
  if isinstance(value, float) and not math.isfinite(value):
    raise ConfigError(f"--{flag}: must be a finite number >= {low}, got {value}")
  if value < low or (high is not None and value > high):
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ConfigError(f"--{flag}: must be {bound}, got {value}")


def define_trust_flag(flag_values: flags.FlagValues) -> None:
  """--trust_export_code on a command that loads a model from a folder: without it, an export
  (or run config) whose `model.module` names code to import is refused, because building that
  model would run the code; with it, the code runs with the user's rights."""
  flags.DEFINE_bool("trust_export_code", False,
                    "Build a model whose export.json (or config.json) names code to import "
                    "(model.module): that code runs. Only for an export you trust.",
                    flag_values=flag_values)


def _own_flags(argv: list[str]) -> list[str]:
  flags.FLAGS(argv[:1])  # absl's global flags stay at their defaults; main parses the rest
  return argv


def app_run(main: Callable[[list[str]], None]) -> None:
  """`python -m diloco.<subcommand>`: absl's `app.run`, with the whole argv left to `main`."""
  app.run(main, flags_parser=_own_flags)
