"""Training: `python -m diloco.main --config=dp:small --workdir=DIR` (or `diloco train ...`).

`--config` takes a shipped config by name (`decoupled:tiny`; the files of the repository's
`configs/`) or a config file's path (`configs/decoupled.py:tiny`, `my_exp.py:PRESET`).

`--role` picks what this process is: `train` (default: data-parallel, or the single-
controller Decoupled DiLoCo runtime when `learners.count > 0`), `launch` (a local
multi-process run: a syncer and learner processes sharing a store), or one process of a
multi-process run: `syncer`, `learner --learner_id=N` (e.g. one per TPU slice, with
`--store=gs://bucket/run`), or `evaluator` (with `train.eval_mode=process`).

`--config_help[=FILTER]` lists the config fields with their values and help, e.g.
`--config=decoupled:cpu --config_help=sync`. Installed, `diloco` (or `python -m diloco`)
runs this as its default subcommand, next to `compare`, `sample` and `evaluate`
(`diloco --help`). The inputs (workdir, config, data, tokenizer) are checked before any
model is built (`diloco.cli.preflight`); Ctrl-C stops a run with one line on how to resume it.
"""

from __future__ import annotations

import os
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags as ml_config_flags

from diloco import settings
from diloco.cli import config_flags, interrupt, preflight
from diloco.config import run_config
from diloco.deploy import accelerators

_CONFIG = ml_config_flags.DEFINE_config_file(
    "config", None, "Config and preset: a shipped name (dp:small, decoupled:tiny) or a file "
    "(configs/dp.py:small); override "
    "fields with --config.GROUP.FIELD=VALUE (list them with --config_help).", lock_config=True)
_CONFIG_HELP = flags.DEFINE_string(
    "config_help", None, "Print the config fields (group.field = value  # help) and exit; a "
    "value filters them by key, e.g. --config_help=sync. With --config, its values.")
_CONFIG_JSON = flags.DEFINE_string(
    "config_json", None, "A resolved config written by a launcher (instead of --config).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots "
                                "(required).")
_ROLE = flags.DEFINE_enum("role", "train",
                          ["train", "launch", "syncer", "learner", "evaluator"],
                          "What this process runs (see the module docstring).")
_LEARNER_ID = flags.DEFINE_integer("learner_id", None, "The learner id of --role=learner.")
_STORE = flags.DEFINE_string("store", None, "Store root of a multi-process run: a local path or "
                             "gs://bucket/run (default: store.root, else WORKDIR/store).")
_JAX_DISTRIBUTED = flags.DEFINE_bool(
    "jax_distributed", False, "Call jax.distributed.initialize() first (a learner that spans "
    "several hosts, e.g. of one TPU slice; there JAX finds its hosts by itself).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "With --jax_distributed where JAX cannot find the hosts by "
    "itself (plain VMs, one machine): host:port of the learner's host 0.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "With --coordinator_address: the learner's number of hosts.")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "With --coordinator_address: this host's index (0 talks to the store).")

# This module's own flags (absl's and JAX's are not the command's to check).
_OWN_FLAGS = (_CONFIG_HELP, _CONFIG_JSON, _WORKDIR, _ROLE, _LEARNER_ID, _STORE, _JAX_DISTRIBUTED,
              _COORDINATOR, _NUM_PROCESSES, _PROCESS_ID)


def _load_config() -> run_config.Config:
  if (_CONFIG.value is None) == (_CONFIG_JSON.value is None):
    raise run_config.ConfigError("give exactly one of --config=NAME:PRESET (or FILE.py:PRESET) "
                                 "or --config_json=FILE")
  if _CONFIG_JSON.value is not None:
    return run_config.read_file(_CONFIG_JSON.value)
  return run_config.from_config_dict(_CONFIG.value)


def _run(cfg: run_config.Config, workdir: str):
  role = _ROLE.value
  if role == "train":
    from diloco.runtime import data_parallel, decoupled
    return (decoupled.run if cfg.learners.count else data_parallel.run)(cfg, workdir)
  if cfg.learners.count < 1:
    raise run_config.ConfigError(f"--role={role} needs learners.count >= 1")
  if role == "launch":
    from diloco.distributed import launcher  # pylint: disable=import-outside-toplevel
    return launcher.run(cfg, workdir)
  store = _STORE.value or cfg.store.root or os.path.join(workdir, "store")
  if role == "syncer":
    from diloco.distributed import syncer_process  # pylint: disable=import-outside-toplevel
    return syncer_process.run(cfg, workdir, store)
  if role == "evaluator":
    from diloco.distributed import evaluator  # pylint: disable=import-outside-toplevel
    return evaluator.run(cfg, workdir, store)
  if _LEARNER_ID.value is None:
    raise run_config.ConfigError("--role=learner needs --learner_id=N")
  from diloco.distributed import learner_process  # pylint: disable=import-outside-toplevel
  return learner_process.run(cfg, workdir, store, _LEARNER_ID.value)


def _quiet_logs() -> None:
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  # Orbax warns on every save without OCDBT (the store's choice, see diloco/distributed/store/__init__.py).
  logging.get_absl_logger().addFilter(
      lambda record: "Skipping merge of OCDBT" not in record.getMessage())


def _start_jax_distributed() -> None:
  if _JAX_DISTRIBUTED.value:
    # CPU hosts need a collectives library for computations that span processes.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value,
                               process_id=_PROCESS_ID.value)
  elif _COORDINATOR.value or _NUM_PROCESSES.value is not None or _PROCESS_ID.value is not None:
    raise run_config.ConfigError("--coordinator_address, --num_processes and --process_id need "
                                 "--jax_distributed")


def _prepare() -> run_config.Config:
  """The checked config, after the workdir and inputs passed `preflight` (before any model)."""
  if _WORKDIR.value is None:
    raise run_config.ConfigError("--workdir=DIR is required")
  cfg = _load_config()
  preflight.check(cfg, _WORKDIR.value)
  _quiet_logs()
  _start_jax_distributed()
  return cfg


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    sys.exit(f"usage error: unexpected arguments {argv[1:]}; flags are --NAME=VALUE "
             "(see --help)")
  try:  # the flags of this module; the config's fields have their own rules
    settings.check_flags(flags.FLAGS, names=[f.name for f in _OWN_FLAGS])
  except run_config.ConfigError as e:
    sys.exit(f"flag error: {e}")
  if _CONFIG_HELP.value is not None:
    try:
      print(config_flags.help_text(_CONFIG.value, _CONFIG_HELP.value))
    except run_config.ConfigError as e:
      sys.exit(f"config error: {e}")
    return
  try:
    cfg = _prepare()
  except run_config.ConfigError as e:
    sys.exit(f"config error: {e}")
  logging.info("jax %s on %d %s devices (process %d of %d)", jax.__version__,
               jax.device_count(), jax.default_backend(), jax.process_index(),
               jax.process_count())
  lines = config_flags.summary(cfg)
  logging.info("resolved config (non-default fields):\n%s", "\n".join(lines))
  if _ROLE.value in ("train", "launch"):  # the processes of a launch log to logs/ instead
    print("config (non-default fields; all of them in WORKDIR/config.json):\n  "
          + "\n  ".join(lines), flush=True)
  if _ROLE.value == "train":  # the launcher and learner processes handle signals themselves
    interrupt.install()
    print("compiling the model's steps (minutes for a large model; the first step waits for "
          "it)...", flush=True)
  try:
    result = _run(cfg, _WORKDIR.value)
  except run_config.ConfigError as e:
    sys.exit(f"config error: {e}")
  except interrupt.Interrupted as e:
    interrupt.exit_stopped(_WORKDIR.value, e)
  if not _printed_report():
    print(f"done: {result}", flush=True)
  if isinstance(result, dict) and result.get("exit_code"):
    sys.exit(result["exit_code"])  # e.g. a preempted learner asks its supervisor for a restart


def _printed_report() -> bool:
  """Whether the run printed its end-of-run table (`diloco.observe.report`) itself, as a
  launcher and every single-process run do; the processes of a launch (syncer, learner,
  evaluator) end with their result on a `done:` line, which their logs keep."""
  return _ROLE.value in ("launch", "train")


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's parser, but every mistake on the command line is one line that names the flag or
  the config key: a missing config file or preset (`config_flags.with_config_resolved`), an
  unknown `--config.KEY`, a value of the wrong type."""
  if "--config_help" in argv[1:]:  # bare: all fields
    i = argv.index("--config_help")
    if i + 1 == len(argv) or argv[i + 1].startswith("-"):
      argv = argv[:i] + ["--config_help="] + argv[i + 1:]
  try:
    argv = config_flags.with_config_resolved(argv)
  except run_config.ConfigError as e:
    sys.exit(f"config error: {e}")
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(f"flag error: {config_flags.bad_value_message(argv[1:], str(e))}")
  except (AttributeError, KeyError):
    message = config_flags.unknown_override(argv[1:])
    if message is None:
      raise
    sys.exit(f"config error: {message}")


def run_cli() -> None:
  """`python -m diloco.main` and the `train` subcommand of `diloco` (diloco/cli/commands.py)."""
  platforms = accelerators.platforms_without_absent_tpu()
  if platforms:
    jax.config.update("jax_platforms", platforms)
  jax.config.config_with_absl()
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run_cli()
