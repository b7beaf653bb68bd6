"""Renders and submits the SLURM batch jobs of a Decoupled DiLoCo run (`diloco slurm`): the
syncer (one job per shard) on CPUs, the learners as one job array with one learner per array
task, the evaluator where the local launcher would start one, and a report job at the end.

Each learner is its own array task, so SLURM requeues a preempted or failed learner alone while
the others keep training: `--requeue` covers preemption and node failure, and a task whose
program exits non-zero requeues itself (`scontrol requeue`, at most `slurm.max_requeues` times).
A requeued learner is a new incarnation that rejoins from the store, as after a restart by the
local launcher. A learner over several nodes is one `jax.distributed` world: one process per
node, its coordinator on the allocation's first node, its process id SLURM_PROCID. Cluster
specifics (partitions, account, constraint, GPUs, time) are the `slurm` config fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time

from diloco.config import run_config
from diloco.config.run_config import Config
from diloco.config.slurm_config import SlurmConfig
from diloco.deploy import accelerators
from diloco.errors import ConfigError

# The repository the nodes run from (a shared filesystem, as the workdir).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOBS_FILE = "slurm/jobs.json"  # under the workdir: the ids of the last submission


@dataclasses.dataclass
class Job:
  """One batch script: `name` (syncer0, learner, ...) and its text."""
  name: str
  script: str
  depends_on_all: bool = False  # the report: after every other job succeeded


# What an #SBATCH directive's value cannot hold: sbatch reads a directive line as words, with
# no quoting, stops reading directives at a line that is not one, and expands '%' in --output.
_NOT_IN_DIRECTIVE = re.compile(r"[\s\x00-\x1f\x7f#%'\"\\]")


def check_workdir(workdir: str) -> None:
  """ConfigError unless `workdir` can name the jobs' logs in an #SBATCH --output directive."""
  bad = _NOT_IN_DIRECTIVE.search(workdir)
  if bad:
    raise ConfigError(f"--workdir: {workdir!r} holds {bad.group(0)!r}, which an #SBATCH "
                      "--output directive cannot carry (no whitespace, quotes, '#', '%', '\\' "
                      "or control characters); choose another folder")


def _sbatch_lines(s: SlurmConfig, name: str, log: str, cpu: bool) -> list[str]:
  partition = (s.cpu_partition or s.partition) if cpu else s.partition
  options = [f"--job-name={s.job_name}-{name}", f"--output={log}", "--open-mode=append"]
  options += [f"--partition={partition}"] if partition else []
  options += [f"--account={s.account}"] if s.account else []
  options += [f"--qos={s.qos}"] if s.qos else []
  options += [f"--time={s.time}"] if s.time else []
  options += [f"--mem={s.mem}"] if s.mem else []
  return [f"#SBATCH {o}" for o in options]


def _python(s: SlurmConfig) -> str:
  return s.python or sys.executable


def _env_lines(env: dict[str, str]) -> list[str]:
  return [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]


def _restart_lines(what: str, job: str, max_requeues: int) -> list[str]:
  """After the program: a failed job requeues itself (preemption and node failure are SLURM's,
  with --requeue); one that exited 0 is done. `job` names this job alone: an array task is
  ARRAYID_TASK (its SLURM_JOB_ID may be the array's id, which would requeue every task)."""
  return [
      "code=$?",
      f'if [ "$code" -ne 0 ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {max_requeues} ]; then',
      f'  echo "==== {what} exited with $code at $(date -u +%FT%TZ): requeued ===="',
      f'  scontrol requeue "{job}" && exit 0',
      "fi",
      'exit "$code"']


def _header(s: SlurmConfig, about: str) -> list[str]:
  lines = [f"# {about}", ("# Rendered by `diloco slurm` (docs/scale_out.md); change the "
                          "slurm config fields, not this file."),
           "set -uo pipefail", f"cd {shlex.quote(ROOT)}"]
  return lines + ([s.setup] if s.setup else [])


def _command(config_json: str, workdir: str, store: str, role: str) -> list[str]:
  return ["-m", "diloco.main", f"--config_json={config_json}", f"--workdir={workdir}",
          f"--store={store}", f"--role={role}"]


def cpu_job(cfg: Config, name: str, args: list[str], workdir: str, about: str) -> Job:
  """A one-process CPU job (syncer shard, evaluator) that requeues itself when it fails."""
  s = cfg.slurm
  env = accelerators.syncer_env({}, "cuda" if s.gpus_per_node else "cpu")
  lines = ["#!/bin/bash", *_sbatch_lines(s, name, os.path.join(workdir, "logs", f"{name}.log"),
                                         cpu=True),
           "#SBATCH --requeue", "#SBATCH --nodes=1", "#SBATCH --ntasks=1",
           f"#SBATCH --cpus-per-task={s.cpus_per_syncer}", *_header(s, about), *_env_lines(env),
           (f'echo "==== {name}: job $SLURM_JOB_ID on $(hostname), start '
            '$((${SLURM_RESTART_COUNT:-0} + 1)) at $(date -u +%FT%TZ) ===="'),
           shlex.join(["srun", "--kill-on-bad-exit=1", _python(s), *args]),
           *_restart_lines(name, "$SLURM_JOB_ID", s.max_requeues)]
  return Job(name, "\n".join(lines) + "\n")


def learner_job(cfg: Config, config_json: str, workdir: str, store: str) -> Job:
  """The job array: task m is learner m, on `slurm.nodes_per_learner` nodes of its own."""
  s, count = cfg.slurm, cfg.learners.count
  nodes = s.nodes_per_learner
  if s.gpus_per_node:
    env = {"JAX_PLATFORMS": "cuda"}  # SLURM sets CUDA_VISIBLE_DEVICES to the task's GPUs
    gres = [f"#SBATCH --gres=gpu:{s.gpu_type + ':' if s.gpu_type else ''}{s.gpus_per_node}"]
  else:
    env = accelerators.child_env({}, "cpu",
                                 emulated=max(cfg.launch.devices_per_learner // nodes, 1))
    gres = []
  args = [_python(s), *_command(config_json, workdir, store, "learner")]
  program = shlex.join(args) + ' --learner_id="$SLURM_ARRAY_TASK_ID"'
  if nodes > 1:
    program += (' --jax_distributed --coordinator_address="$DILOCO_COORDINATOR"'
                ' --num_processes="$SLURM_NTASKS" --process_id="$SLURM_PROCID"')
  log = os.path.join(workdir, "logs", "learner%a.log")
  lines = ["#!/bin/bash", *_sbatch_lines(s, "learner", log, cpu=False),
           f"#SBATCH --array=0-{count - 1}", "#SBATCH --requeue", f"#SBATCH --nodes={nodes}",
           "#SBATCH --ntasks-per-node=1", f"#SBATCH --cpus-per-task={s.cpus_per_learner}",
           *gres, *([f"#SBATCH --constraint={s.constraint}"] if s.constraint else []),
           *_header(s, f"The {count} learners: array task m is learner m, requeued alone."),
           *_env_lines(env),
           ('echo "==== learner $SLURM_ARRAY_TASK_ID: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, '
            'start $((${SLURM_RESTART_COUNT:-0} + 1)) at $(date -u +%FT%TZ) ===="')]
  if nodes > 1:
    lines += [('DILOCO_COORDINATOR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
               f':{s.coordinator_port}"'), "export DILOCO_COORDINATOR"]
  # One process per node; bash -c so each expands its own SLURM_PROCID.
  lines += [f"srun --kill-on-bad-exit=1 bash -c {shlex.quote('exec ' + program)}",
            *_restart_lines("learner $SLURM_ARRAY_TASK_ID",
                            "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}", s.max_requeues)]
  return Job("learner", "\n".join(lines) + "\n")


def report_job(cfg: Config, workdir: str) -> Job:
  """Once the syncer (and evaluator) finished: the report the local launcher writes."""
  s = cfg.slurm
  lines = ["#!/bin/bash", *_sbatch_lines(s, "report", os.path.join(workdir, "logs",
                                                                    "report.log"), cpu=True),
           "#SBATCH --nodes=1", "#SBATCH --ntasks=1", "#SBATCH --cpus-per-task=1",
           *_header(s, "The end-of-run report, after the syncer and evaluator succeeded."),
           "export JAX_PLATFORMS=cpu",
           shlex.join([_python(s), "-m", "diloco", "slurm", "--report", f"--workdir={workdir}"])]
  return Job("report", "\n".join(lines) + "\n", depends_on_all=True)


def check_devices(cfg: Config) -> None:
  """ConfigError unless the mesh fits one GPU learner's devices (nodes x GPUs per node)."""
  s, mesh = cfg.slurm, cfg.mesh
  if not s.gpus_per_node:
    return
  devices = s.nodes_per_learner * s.gpus_per_node
  sizes = [mesh.data, mesh.fsdp, mesh.tensor]
  fixed = math.prod(n for n in sizes if n != -1)
  if (devices % fixed if -1 in sizes else devices - fixed):
    raise ConfigError(f"slurm.gpus_per_node: a learner's {s.nodes_per_learner} node(s) x "
                      f"{s.gpus_per_node} GPUs = {devices} devices do not fit mesh data x fsdp x "
                      f"tensor = {sizes}")


def render(cfg: Config, workdir: str, store: str) -> list[Job]:
  """Every job of the run, in submission order (the report last); ConfigError when a learner's
  GPUs do not fit the mesh."""
  check_devices(cfg)
  check_workdir(workdir)
  config_json = os.path.join(workdir, "config.json")
  shards = cfg.sync.shards
  jobs = []
  for shard in range(shards):
    name = "syncer" if shards == 1 else f"syncer{shard}"
    path = config_json if shards == 1 else os.path.join(workdir, f"config_syncer{shard}.json")
    jobs.append(cpu_job(cfg, name, _command(path, workdir, store, "syncer"), workdir,
                        "The syncer: merges the learners' fragments (no accelerator)."
                        if shards == 1 else f"Syncer shard {shard} of {shards}."))
  if cfg.train.eval_mode == "process" or (shards > 1 and cfg.train.eval_mode != "off"):
    jobs.append(cpu_job(cfg, "evaluator", _command(config_json, workdir, store,
                                                   "evaluator"), workdir,
                        "The evaluator: the global evals, off the syncer."))
  jobs.append(learner_job(cfg, config_json, workdir, store))
  jobs.append(report_job(cfg, workdir))
  return jobs


def for_slurm(cfg: Config, store: str) -> Config:
  """The run's config as its jobs read it: the store's root (the report finds it there), and
  SIGTERM means restart: SLURM stops a preempted or requeued job with SIGTERM, and the learner
  should come back, not retire."""
  return dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, root=store,
                                                            on_sigterm="restart"))


def check_resubmission(cfg: Config, workdir: str) -> None:
  """ConfigError unless `cfg` is the config WORKDIR/config.json recorded (when there is one)
  in every group but `slurm`: a resubmitted run resumes from its store, which only the same
  run can (the cluster's settings may change)."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return
  recorded = dataclasses.asdict(run_config.read_file(path, "the run's config.json"))
  wanted = dataclasses.asdict(cfg)
  changed = []
  for group, value in wanted.items():
    if group == "slurm":
      continue
    if not isinstance(value, dict):  # a top-level field (seed)
      changed += [group] if recorded.get(group) != value else []
      continue
    changed += [f"{group}.{k}" for k, v in value.items() if recorded[group].get(k) != v]
  if changed:
    shown = ", ".join(changed[:6]) + (", ..." if len(changed) > 6 else "")
    raise ConfigError(f"--workdir: {workdir!r} holds a run whose config differs in {shown}; "
                      "a resubmission may change only the slurm group (or use another workdir)")


def write_configs(cfg: Config, workdir: str) -> None:
  """WORKDIR/config.json (and one per syncer shard), which every job reads."""
  raw = dataclasses.asdict(cfg)
  files = {"config.json": raw}
  for shard in range(cfg.sync.shards if cfg.sync.shards > 1 else 0):
    files[f"config_syncer{shard}.json"] = dict(raw, sync=dict(raw["sync"], shard=shard))
  for name, doc in files.items():
    with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
      json.dump(doc, f, indent=2)


def sbatch(script: str, extra: list[str], env: dict[str, str] | None = None) -> str:
  """Submits a script file; its job id."""
  out = subprocess.run(["sbatch", "--parsable", *extra, script], capture_output=True, text=True,
                       check=False, env=env)
  if out.returncode != 0:
    said = [line.strip() for line in (out.stderr or out.stdout).splitlines() if line.strip()]
    raise RuntimeError(f"sbatch {script} failed: {'; '.join(said)}")
  return out.stdout.strip().split(";")[0]


def submit(cfg: Config, workdir: str, store: str, env: dict[str, str] | None = None) -> dict:
  """Writes the configs and scripts under `workdir` and submits them; the job ids by name."""
  check_resubmission(cfg, workdir)
  for sub in ("logs", "slurm", "activity"):
    os.makedirs(os.path.join(workdir, sub), exist_ok=True)
  write_configs(cfg, workdir)
  ids: dict[str, str] = {}
  jobs = render(cfg, workdir, store)
  paths = {}
  for job in jobs:
    paths[job.name] = os.path.join(workdir, "slurm", f"{job.name}.sbatch")
    with open(paths[job.name], "w", encoding="utf-8") as f:
      f.write(job.script)
  for job in jobs:
    extra = [f"--dependency=afterok:{':'.join(ids.values())}"] if job.depends_on_all else []
    try:
      ids[job.name] = sbatch(paths[job.name], extra, env)
    except (RuntimeError, OSError) as e:  # OSError: no sbatch to run
      raise RuntimeError(f"{e}; {_undo(ids, workdir, env)}") from None
  _record(workdir, {"submitted_at": time.time(), "jobs": ids})
  return ids


def _record(workdir: str, doc: dict) -> None:
  with open(os.path.join(workdir, JOBS_FILE), "w", encoding="utf-8") as f:
    json.dump(doc, f, indent=2)


def _undo(ids: dict[str, str], workdir: str, env: dict[str, str] | None) -> str:
  """Cancels the jobs of a submission that failed part way; what it did, in words. Jobs that
  cannot be cancelled are recorded in jobs.json (as `left`) and named."""
  if not ids:
    return "nothing was queued"
  try:
    done = subprocess.run(["scancel", *ids.values()], capture_output=True, text=True,
                          check=False, env=env)
  except OSError as e:
    done = subprocess.CompletedProcess(["scancel"], 1, "", str(e))
  listed = ", ".join(f"{k} {v}" for k, v in ids.items())
  if done.returncode == 0:
    _record(workdir, {"submitted_at": time.time(), "jobs": {}, "cancelled": ids})
    return f"cancelled the jobs already queued ({listed})"
  _record(workdir, {"submitted_at": time.time(), "jobs": {}, "left": ids})
  return (f"could not cancel the jobs already queued ({listed}: "
          f"{done.stderr.strip() or done.stdout.strip()}); they are in {JOBS_FILE}")
