"""The `diloco` command (and `python -m diloco`): training by default, the tools around a run.

`diloco NAME ARGS` calls `main(["diloco NAME", *ARGS])` of the module that `SUBCOMMANDS`
names for NAME: each tool parses its own flags (on its own FlagValues) and `diloco NAME --help`
shows them, as `python -m MODULE` does; without a name, or with `train`, it is
`python -m diloco.main`. `diloco --help` lists the subcommands and the training flags of this
project only (absl's and JAX's own are behind `--helpfull`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

# name: (module, what it does). Training is the default subcommand.
SUBCOMMANDS = {
    "train": ("diloco.cli.train",
              "train a model (the default): --config=NAME:PRESET --workdir=DIR"),
    "compare": ("diloco.cli.compare", "finished runs side by side: a table and eval-loss curves"),
    "sample": ("diloco.cli.sample", "generate text from a run's exported model"),
    "evaluate": ("diloco.cli.evaluate", ("score a run's exported model on held-out data, or "
                                         "on lm-evaluation-harness tasks (--tasks)")),
    "lm_eval": ("diloco.cli.harness", ("lm-evaluation-harness's CLI with the run's model: "
                                       "--model diloco --model_args workdir=RUN --tasks ...")),
    "export": ("diloco.cli.export_model",
               "write a run's model for other tools: --format=hf (transformers) | safetensors"),
    "compile": ("diloco.cli.tpu_compile", ("will it fit? the run's programs compiled for TPU "
                                          "slices on any host: --topology=v5e-256")),
    "slurm": ("diloco.cli.slurm_launch",
              "a multi-process run as SLURM batch jobs (--dry_run prints)"),
    "jobset": ("diloco.cli.jobset_manifest",
               "a multi-process run as a GKE JobSet manifest (stdout or --output)"),
}
# Other names people type for a subcommand.
ALIASES = {"eval": "evaluate"}
# Subcommands folded into another, named in the one-line error of their old name.
MOVED = {"to_safetensors": "export --format=safetensors",
         "safetensors": "export --format=safetensors"}
_HELP = ("-h", "--help", "-help", "--helpshort", "help")


def help_text() -> str:
  """The subcommands, then the training flags (the `diloco.main` module's own)."""
  from absl import flags  # pylint: disable=import-outside-toplevel

  from diloco.cli import train  # pylint: disable=import-outside-toplevel
  from diloco.config import files as config_files  # pylint: disable=import-outside-toplevel
  width = max(map(len, SUBCOMMANDS))
  lines = ["usage: diloco [SUBCOMMAND] [FLAGS]", "", "subcommands:"]
  lines += [f"  {name:<{width}}  {about}" for name, (_, about) in SUBCOMMANDS.items()]
  lines += [f"  ({', '.join(f'{a} = {n}' for a, n in ALIASES.items())})"]
  lines += ["", f"shipped configs (--config=NAME:PRESET): {', '.join(config_files.names())}",
            "`diloco SUBCOMMAND --help` shows a subcommand's flags; --config_help lists the "
            "config fields.", "", "training flags:",
            flags.FLAGS.module_help(train).strip().split("\n", 1)[-1]]  # less its name line
  return "\n".join(lines)


def _show(text: str) -> None:
  """Prints help text; a reader that stops early (`diloco --help | head`) is not an error."""
  try:
    print(text, flush=True)
  except BrokenPipeError:
    # Python would report the pipe again when it flushes stdout at exit: point it at devnull.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: list[str] | None = None) -> None:
  """Dispatches `argv` (default `sys.argv`) to its subcommand."""
  argv = list(sys.argv if argv is None else argv)
  args = argv[1:]
  if args[:1] and args[0] in _HELP:
    _show(help_text())
    return
  name = args.pop(0) if args[:1] and not args[0].startswith("-") else "train"
  name = ALIASES.get(name, name)
  if name in MOVED:
    sys.exit(f"diloco: {name!r} is now `diloco {MOVED[name]}`")
  if name not in SUBCOMMANDS:
    sys.exit(f"diloco: unknown subcommand {name!r}; subcommands: {', '.join(SUBCOMMANDS)} "
             "(see diloco --help)")
  module = SUBCOMMANDS[name][0]
  if importlib.util.find_spec(module) is None:
    sys.exit(f"diloco {name}: this install has no {module} module")
  if name == "train":
    if any(a in _HELP for a in args):  # absl's --help describes the __main__ module: not this
      from absl import flags  # pylint: disable=import-outside-toplevel

      from diloco.cli import train  # pylint: disable=import-outside-toplevel
      _show(f"{train.__doc__.strip()}\n\n{flags.FLAGS.module_help(train)}")
      return
    sys.argv = [f"diloco {name}", *args]
    from diloco.cli import train  # pylint: disable=import-outside-toplevel
    train.run_cli()
    return
  if name != "compile":  # which sets its own platforms
    from diloco.deploy import accelerators  # pylint: disable=import-outside-toplevel
    platforms = accelerators.platforms_without_absent_tpu()
    if platforms:
      import jax  # pylint: disable=import-outside-toplevel
      jax.config.update("jax_platforms", platforms)
  importlib.import_module(module).main([f"diloco {name}", *args])


if __name__ == "__main__":
  main()
