"""`diloco slurm`: a Decoupled DiLoCo run as SLURM batch jobs (`diloco.deploy.slurm`).

  diloco slurm --config=decoupled:tiny --workdir=/shared/runs/x [--store=/shared/runs/x/store] \\
      [--config.slurm.partition=gpu --config.slurm.gpus_per_node=8 ...] [--dry_run]

With --dry_run it prints the batch scripts and submits nothing; without, it writes them and the
run's config.json under WORKDIR (on a filesystem every node sees) and submits them with sbatch.
Run it again with the same --workdir to resume a cancelled run from its store. `--report`
(the run's last job) writes the end-of-run report of WORKDIR.
"""

from __future__ import annotations

import os
import re
import sys
import time

from absl import flags
from ml_collections import config_flags as ml_config_flags

from diloco.cli import command, config_flags
from diloco.config import run_config
from diloco.deploy import slurm
from diloco.distributed import launch_report
from diloco.distributed.store import shared_store
from diloco.distributed.supervision import EVALUATOR, Proc, syncer_key
from diloco.errors import ConfigError

FLAGS = flags.FlagValues()
_CONFIG = ml_config_flags.DEFINE_config_file(
    "config", None, "Config and preset (decoupled:tiny, configs/decoupled.py:gemma_2b); "
    "override fields with --config.GROUP.FIELD=VALUE, the cluster's in --config.slurm.*.",
    flag_values=FLAGS, lock_config=True)
flags.DEFINE_string("workdir", None, "The run's folder, on a filesystem every node mounts.",
                    flag_values=FLAGS)
flags.DEFINE_string("store", None, "The run's store: a shared path or gs://BUCKET/RUN "
                    "(default: store.root, else WORKDIR/store).", flag_values=FLAGS)
flags.DEFINE_bool("dry_run", False, "Print the batch scripts; write and submit nothing.",
                  flag_values=FLAGS)
flags.DEFINE_bool("report", False, "Write the end-of-run report of --workdir (the run's last "
                  "job runs this).", flag_values=FLAGS)


def _body() -> None:
  if not FLAGS.workdir:
    raise ConfigError("--workdir is required: the run's folder on a shared filesystem")
  workdir = os.path.abspath(FLAGS.workdir)
  if FLAGS.report:
    report(workdir)
    return
  if _CONFIG.value is None:
    raise ConfigError("--config is required, e.g. --config=decoupled:tiny")
  cfg = run_config.from_config_dict(_CONFIG.value)
  if cfg.learners.count < 1:
    raise ConfigError("learners.count: diloco slurm runs a Decoupled DiLoCo config (>= 1 "
                      f"learner), got {cfg.learners.count}")
  store = FLAGS.store or cfg.store.root or os.path.join(workdir, "store")
  store = store if store.startswith("gs://") else os.path.abspath(store)
  cfg = slurm.for_slurm(cfg, store)
  slurm.check_workdir(workdir)  # before anything is written
  if FLAGS.dry_run:
    for job in slurm.render(cfg, workdir, store):
      print(f"### {job.name}.sbatch" + (" (submitted with --dependency=afterok: every other "
                                         "job)" if job.depends_on_all else ""))
      print(job.script)
    return
  slurm.check_resubmission(cfg, workdir)
  os.makedirs(workdir, exist_ok=True)
  try:
    ids = slurm.submit(cfg, workdir, store)
  except (OSError, RuntimeError) as e:
    sys.exit(f"diloco slurm: error: {e}")
  name = cfg.slurm.job_name
  print(f"submitted {', '.join(f'{k} {v}' for k, v in ids.items())}; scripts in "
        f"{workdir}/slurm, logs in {workdir}/logs\n"
        f"watch: squeue --name={','.join(f'{name}-{k}' for k in ids)}\n"
        f"stop:  scancel {' '.join(ids.values())}  (resume: run this command again)")


def report(workdir: str) -> dict:
  """The end-of-run report of a finished SLURM run, as the local launcher writes it."""
  cfg = run_config.read_file(os.path.join(workdir, "config.json"))
  store = shared_store(cfg.store.root or os.path.join(workdir, "store"), cfg.sync.shards)
  origin = store.run.start() or time.time()
  os.makedirs(os.path.join(workdir, "activity"), exist_ok=True)
  started = time.monotonic() - (time.time() - origin)
  procs = _requeues(workdir, cfg)
  syncers = [p for p in procs.values() if p.name.startswith("syncer")]
  return launch_report.finish(cfg, workdir, procs, syncers, [], started)


def _requeues(workdir: str, cfg: run_config.Config) -> dict:
  """Each process (as `supervision.Proc`) with its restarts: the starts its log records with a
  SLURM restart count above 0 (a resubmitted run starts at 1 again)."""
  shards = cfg.sync.shards
  names = {syncer_key(s): "syncer" if shards == 1 else f"syncer{s}" for s in range(shards)}
  names.update({m: f"learner{m}" for m in range(cfg.learners.count)})
  if os.path.exists(os.path.join(workdir, "logs", "evaluator.log")):
    names[EVALUATOR] = "evaluator"
  procs = {}
  for key, name in names.items():
    path = os.path.join(workdir, "logs", f"{name}.log")
    text = ""
    if os.path.exists(path):
      with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    restarts = len([n for n in re.findall(r"^==== .*, start (\d+) at ", text, re.MULTILINE)
                    if int(n) > 1])
    procs[key] = Proc(name, key, 1, restarts=restarts)
  return procs


def main(argv: list[str]) -> None:
  """`argv[0]` is the program name; the rest are this command's flags (module docstring)."""
  config_flags.run_command(FLAGS, argv, _body, "diloco slurm")


if __name__ == "__main__":
  command.app_run(main)
