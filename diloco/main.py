"""Command line: `python -m diloco.main --config=configs/dp.py:small --workdir=DIR`."""

from __future__ import annotations

import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from diloco import config_lib

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file and preset, e.g. configs/dp.py:small.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  from diloco import decoupled, train  # pylint: disable=import-outside-toplevel
  try:
    cfg = config_lib.from_config_dict(_CONFIG.value)
  except config_lib.ConfigError as e:
    sys.exit(f"config error: {e}")
  logging.info("jax %s on %d %s devices (process %d of %d)", jax.__version__,
               jax.device_count(), jax.default_backend(), jax.process_index(),
               jax.process_count())
  logging.info("config:\n%s", _CONFIG.value)
  try:
    runner = decoupled.run if cfg.learners.count else train.run
    result = runner(cfg, _WORKDIR.value)
  except config_lib.ConfigError as e:
    sys.exit(f"config error: {e}")
  print(f"done: {result}", flush=True)


def run_cli() -> None:
  jax.config.config_with_absl()
  app.run(main)


if __name__ == "__main__":
  run_cli()
