"""The `slurm` config group: what `diloco slurm` (`diloco.deploy.slurm`) cannot know about a
cluster (partitions, account, GPUs, time), as fields checked at start, never template edits."""

from __future__ import annotations

import re

from diloco.settings import AT_LEAST_ONE, NON_NEGATIVE, Range, frozen, require, setting

_TIME = re.compile(r"(\d+-)?\d+(:\d{1,2}){0,2}|\d+-\d+")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_NO_SPACE = ("partition", "cpu_partition", "account", "qos", "constraint", "gpu_type", "mem")


@frozen
class SlurmConfig:
  """`diloco slurm`: the batch jobs of a multi-process run on a SLURM cluster."""
  # Prefix of the job names: NAME-syncer, NAME-learner (the array), NAME-report, ...
  job_name: str = "diloco"
  # Partition of the learners' jobs; empty: the cluster's default partition.
  partition: str = ""
  # Partition of the syncer, evaluator and report jobs (CPU only); empty: `partition`.
  cpu_partition: str = ""
  # sbatch --account and --qos of every job; empty: none given.
  account: str = ""
  qos: str = ""
  # Node features a learner's nodes must have (sbatch --constraint), e.g. "h100&ib".
  constraint: str = ""
  # Wall-time limit of every job (sbatch --time, e.g. "2-00:00:00"); empty: the partition's.
  time: str = ""
  # Nodes per learner: > 1 makes each learner one jax.distributed world, a process per node.
  nodes_per_learner: int = setting(1, AT_LEAST_ONE)
  # GPUs per node of a learner (--gres=gpu[:gpu_type]:N); 0: the learners run on CPUs, with
  # launch.devices_per_learner emulated devices each, as the local launcher does.
  gpus_per_node: int = setting(0, NON_NEGATIVE)
  gpu_type: str = ""
  # CPUs of each learner process and of the syncer/evaluator (sbatch --cpus-per-task).
  cpus_per_learner: int = setting(1, AT_LEAST_ONE)
  cpus_per_syncer: int = setting(1, AT_LEAST_ONE)
  # Memory per node of every job (sbatch --mem, e.g. "200G"); empty: the partition's default.
  mem: str = ""
  # Shell lines each job runs first (module load, a venv's activate), ';'-separated: shell,
  # run as written (the only field that is; every other value is quoted or refused).
  setup: str = ""
  # The Python that runs diloco on the nodes; empty: the one that ran `diloco slurm`.
  python: str = ""
  # A job whose program exits non-zero requeues itself at most this many times.
  max_requeues: int = setting(20, NON_NEGATIVE)
  # jax.distributed's port on the first node of a multi-node learner.
  coordinator_port: int = setting(8476, Range(low=1024, high=65535))

  def check(self) -> None:
    """Names and times SLURM accepts; no whitespace where sbatch takes one word."""
    require(bool(_NAME.fullmatch(self.job_name)), "slurm.job_name",
            f"must be letters, digits, '_', '.', '-', got {self.job_name!r}")
    require(not self.time or bool(_TIME.fullmatch(self.time)), "slurm.time",
            f"must be a SLURM time such as 90, 4:00:00 or 2-00:00:00, got {self.time!r}")
    for name in _NO_SPACE:
      value = getattr(self, name)
      require(not re.search(r"[\s#'\"]", value), f"slurm.{name}",
              f"must be one word without quotes or '#', got {value!r}")
    require(not self.gpu_type or self.gpus_per_node > 0, "slurm.gpu_type",
            "needs slurm.gpus_per_node > 0")
    require("\n" not in self.setup, "slurm.setup", "must be one line; separate commands with ';'")
