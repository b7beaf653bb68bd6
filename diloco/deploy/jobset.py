"""Renders a GKE JobSet that runs Decoupled DiLoCo: one TPU slice or GPU node group per
learner, one CPU syncer. The command is `diloco jobset` (`scripts/make_jobset.py` is the same
command under its older name); experiments (the sweep's TPU points) call `parse_args` and
`render` here directly.

  diloco jobset --name=dd-2b --image=IMAGE --store=gs://BUCKET/dd-2b \\
      --config=configs/decoupled.py:gemma_2b --learners=8 --tpu_type=v5p-128 [--output=FILE]
  diloco jobset --name=dd-2b --image=IMAGE --store=gs://BUCKET/dd-2b \\
      --config=configs/decoupled.py:gemma_2b --learners=4 --gpu_type=nvidia-h100-80gb \\
      --gpus_per_host=8 --gpu_hosts=2

IMAGE is built from the repository's Dockerfile with the matching extras (docs/scale_out.md);
the default names the tag that the docs build, diloco:tpu or diloco:cuda, which the cluster
can pull only once it is pushed to a registry it reads (pass --image=REGISTRY/diloco:TAG).

Without --output (or with --dry_run) the YAML goes to stdout and nothing else is printed, so
`... | kubectl apply -f -` works. docs/scale_out.md explains the choices; in short:

- One replicated job per learner (`learner-0`, ...). The replicas of one replicated job are
  the slices of one multislice JAX program on GKE, which would tie the learners together;
  separate replicated jobs give every learner its own `jax.distributed` world.
- `--restart_mode=job` (default): `backoffLimit: 0` and the JobSet action `RestartJob`, so a
  failed pod fails only its own job, which is recreated whole (all hosts of that slice) while
  the other learners and the syncer keep running. `maxRestarts` is one budget shared by all
  jobs. Needs a JobSet release with `RestartJob` (added in 2026); older controllers should
  reject the manifest. `--restart_mode=pod` is for those: Kubernetes re-creates failed pods up
  to `backoffLimit` per job and the JobSet never restarts as a whole (`maxRestarts: 0`: a job
  that exhausts its budget fails the JobSet).
- The syncer holds no accelerator; after a restart it resumes from what it committed to the
  store. With `sync.shards = S > 1` (the preset's, or `--override sync.shards=S`) it is S jobs,
  `syncer-0` ... `syncer-{S-1}`, each one shard (`--config.sync.shard=s`, docs/design.md 3.1)
  restarted on its own, plus an `evaluator` job on the same machine type for the global eval
  (unless `train.eval_mode=off`): no shard holds the whole model.
- GPU learners (`--gpu_type`, a GKE accelerator label such as nvidia-h100-80gb) request
  `nvidia.com/gpu` on nodes of that type and tolerate the GPU node taint; a learner over
  several GPU hosts (`--gpu_hosts`) joins one `jax.distributed` world whose coordinator is
  its host 0, found through the JobSet's DNS host names.
- Every process gets the same `--config.learners.count=M` and config overrides: GCS-friendly
  heartbeat and poll periods and `store.on_sigterm=restart` (DEFAULT_OVERRIDES: Kubernetes stops a
  preempted or drained pod with SIGTERM, and the learner should come back, not retire), and
  each `--override KEY=VALUE`, checked against the config here so that a typo fails now rather
  than in M pods.
"""

from __future__ import annotations

import math
import pathlib
import re
import sys
from collections.abc import Sequence

import yaml
from absl import flags

from diloco import settings
from diloco.config import run_config
from diloco.deploy import gke_nodes
from diloco.errors import ConfigError

# The repository: the image carries it, so a config must be one of its files.
ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKDIR = "/work"  # the run's directory in the container (the Dockerfile creates it)
# Tags that the Dockerfile's documented builds give (--build-arg EXTRAS=tpu,gcs / cuda,gcs).
DEFAULT_IMAGE = {"tpu": "diloco:tpu", "cuda": "diloco:cuda"}
# jax.distributed's coordinator on host 0 of a multi-host GPU learner.
COORDINATOR_PORT = 8476
EXCLUSIVE_KEY = "alpha.jobset.sigs.k8s.io/exclusive-topology"

# GCS allows about one update per second to one object, and every learner rewrites its
# heartbeat object: keep heartbeats well under that (--override replaces it).
# Kubernetes stops a pod it preempts or drains with SIGTERM: the learner checkpoints and exits
# 143, so its job is restarted (a learner that exited 0 would be gone for the rest of the run).
# Every process of every learner (each host of a slice) reads merged/index.json once per
# store.poll_s: at the local-disk default of 0.05 s, 8 learners on 64-host slices would make
# ~10,000 reads per second, above the ~5,000 a bucket starts with. 1 s costs at most a second
# of latency per round, small next to tau steps of a large model.
DEFAULT_OVERRIDES = {"store.heartbeat_every_s": "2.0", "store.poll_s": "1.0",
                     "store.on_sigterm": "restart"}
# The error of every flag check, here and in `gke_nodes` (`run` reports it as a usage error).
FlagError = gke_nodes.FlagError


def accelerator(args: flags.FlagValues) -> gke_nodes.Devices:
  """The devices of one learner: exactly one of --tpu_type and --gpu_type."""
  if (args.tpu_type is None) == (args.gpu_type is None):
    raise FlagError("--tpu_type/--gpu_type: give exactly one (a TPU slice or GPU nodes per "
                    "learner)")
  if args.gpu_type is not None:
    return gke_nodes.gpu_hosts(args.gpu_type, args.gpus_per_host, args.gpu_hosts)
  return gke_nodes.tpu_slice(args.tpu_type, args.topology, args.chips_per_host)


def check_store(store: str) -> str:
  """The store URL without a trailing slash; every process of the run must reach it."""
  m = re.fullmatch(r"gs://([a-z0-9][a-z0-9._-]{1,220}[a-z0-9])(/[^\s]*)?", store or "")
  if not m:
    raise FlagError(f"--store: {store!r} is not a gs://BUCKET[/PATH] URL; learners on different "
                    "slices and the syncer share nothing else, so the store must be on GCS")
  return store.rstrip("/")


def check_config(config: str, devices: gke_nodes.Devices, overrides: dict[str, str]) -> str:
  """The config argument as the container will see it; builds the config to catch typos."""
  return _check_config(config, devices, overrides)[0]


def _check_config(config: str, devices: gke_nodes.Devices, overrides: dict[str, str]):
  """(`check_config`'s answer, the built config with the overrides)."""
  path, _, preset = (config or "").partition(":")
  file = None
  for base in (pathlib.Path.cwd(), ROOT):  # as typed, or relative to the repository
    if path and (base / path).is_file():
      file = (base / path).resolve()
      break
  if file is None or file.suffix != ".py":
    raise FlagError(f"--config: {config!r} does not name a config file such as "
                    "configs/decoupled.py:gemma_2b")
  try:
    rel = file.relative_to(ROOT)
  except ValueError:
    raise FlagError(f"--config: {path} is outside the repository {ROOT}; the image carries "
                    "the repository, so the config must be one of its files") from None
  try:
    cfg = run_config.load(f"{file}:{preset}" if preset else str(file))
  except Exception as e:  # pylint: disable=broad-except
    raise FlagError(f"--config: {config} failed to build: {e}") from e
  for key, value in overrides.items():
    _apply_override(cfg, key, value)
  mesh = cfg.mesh
  sizes = [mesh.data, mesh.fsdp, mesh.tensor]
  fixed = math.prod(s for s in sizes if s != -1)
  fits = devices.chips % fixed == 0 if -1 in sizes else fixed == devices.chips
  if not fits:
    raise FlagError(f"--config: mesh data x fsdp x tensor = {sizes} of {config} (after any "
                    f"--override) does not fit the {devices.chips} chips of one learner "
                    f"({devices.flag})")
  return (f"{rel.as_posix()}:{preset}" if preset else rel.as_posix()), cfg


def parse_overrides(items: Sequence[str] | None) -> dict[str, str]:
  """`KEY=VALUE` config overrides on top of the defaults every process gets."""
  overrides = dict(DEFAULT_OVERRIDES)
  for item in items or ():
    key, sep, value = item.partition("=")
    if not sep or not re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+", key) or (
        re.search(r"\s", value)):
      raise FlagError(f"--override: {item!r} is not KEY=VALUE with a dotted config key, e.g. "
                      "data.path=gs://bucket/tokens")
    if key == "learners.count":
      raise FlagError("--override: learners.count is set by --learners")
    overrides[key] = value
  return overrides


def _apply_override(cfg, key: str, value: str) -> None:
  """Sets `key` on the config as ml_collections would, so unknown keys fail here."""
  *groups, field = key.split(".")
  node = cfg
  try:
    for group in groups:
      node = getattr(node, group)
    current = getattr(node, field)
  except (AttributeError, KeyError):
    raise FlagError(f"--override: {key} is not a field of the config") from None
  try:
    if isinstance(current, bool):
      parsed = {"true": True, "false": False}[value.lower()]
    elif isinstance(current, (int, float, str)):
      parsed = type(current)(value)
    else:
      return  # other types: left to the flags parser in the container
    setattr(node, field, parsed)
  except (KeyError, TypeError, ValueError):
    raise FlagError(f"--override: {key}={value} is not a valid {type(current).__name__}") from None


def _command(config: str, store: str, learners: int, overrides: dict[str, str], role: str,
             extra: Sequence[str] = ()) -> list[str]:
  # Every process gets the same learner count and overrides, whatever the preset says.
  return ["python", "-m", "diloco.main", f"--config={config}", f"--workdir={WORKDIR}",
          f"--role={role}", *extra, f"--store={store}", f"--config.learners.count={learners}",
          *(f"--config.{k}={v}" for k, v in overrides.items())]


def _store_env(store: str) -> dict:
  # A fresh dict per use, so that the YAML has no anchors and aliases.
  return {"name": "DILOCO_STORE", "value": store}


def _job(name: str, pods: int, backoff: int, pod_spec: dict,
         annotations: dict | None = None) -> dict:
  template = {"metadata": {"annotations": annotations}} if annotations else {}
  template["spec"] = {"parallelism": pods, "completions": pods, "backoffLimit": backoff,
                      "completionMode": "Indexed", "template": {"spec": pod_spec}}
  return {"name": name, "replicas": 1, "template": template}


def image(args: flags.FlagValues) -> str:
  """--image, or the tag the Dockerfile is built as for this accelerator (docs/scale_out.md)."""
  if args.image is not None:
    return args.image
  return DEFAULT_IMAGE["cuda" if args.gpu_type is not None else "tpu"]


# The API server stores an object of at most 1.5 MiB (etcd's request limit); each learner adds a
# replicated job of about 1.6 kB to the manifest (measured for gemma_2b on v5p-128).
MAX_LEARNERS = 512


def build_jobset(args: flags.FlagValues) -> dict:
  """The JobSet as a dict; FlagError names the first bad flag."""
  if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", args.name or ""):
    raise FlagError(f"--name: {args.name!r} must be lower-case letters, digits and '-', "
                    "starting with a letter (it becomes part of pod host names)")
  if not image(args) or re.search(r"\s", image(args)):
    raise FlagError(f"--image: {args.image!r} is not a container image reference")
  store = check_store(args.store)
  if args.learners is None or not 1 <= args.learners <= MAX_LEARNERS:
    raise FlagError(f"--learners: need 1 to {MAX_LEARNERS} learners, got {args.learners} (a "
                    "JobSet's manifest holds a replicated job per learner, about 1.6 kB each, "
                    "and the API server takes objects up to 1.5 MiB)")
  devices = accelerator(args)
  overrides = parse_overrides(args.override)
  config, cfg = _check_config(args.config, devices, overrides)
  if not re.fullmatch(r"[a-z][a-z0-9]*-[a-z0-9-]+", args.syncer_machine or "") or (
      args.syncer_machine.startswith(("ct", "tpu"))):
    raise FlagError(f"--syncer_machine: {args.syncer_machine!r} is not a CPU machine type "
                    "such as n2-highmem-32")
  if args.max_restarts < 0:
    raise FlagError(f"--max_restarts: must be >= 0, got {args.max_restarts}")
  # Pod host names are <name>-<replicated job>-<job index>-<pod index>: one DNS label.
  longest = f"{args.name}-learner-{args.learners - 1}-0-{devices.hosts - 1}"
  if len(longest) > 63:
    raise FlagError(f"--name: {args.name!r} is too long; host name {longest!r} exceeds 63 "
                    "characters")

  per_job = args.restart_mode == "job"
  backoff = 0 if per_job else args.max_restarts
  account = {"serviceAccountName": args.service_account} if args.service_account else {}

  jobs = _syncer_jobs(args, cfg, config, store, overrides, backoff, account)
  for i in range(args.learners):
    extra = [f"--learner_id={i}"] + (["--jax_distributed"] if devices.hosts > 1 else [])
    if devices.hosts > 1 and devices.platform == "cuda":
      # JAX finds a TPU slice's hosts by itself, not GPU nodes': name host 0 (the JobSet's
      # DNS host name of pod 0) and let Kubernetes put in each pod's completion index.
      coordinator = f"{args.name}-learner-{i}-0-0.{args.name}:{COORDINATOR_PORT}"
      extra += [f"--coordinator_address={coordinator}", f"--num_processes={devices.hosts}",
                "--process_id=$(DILOCO_HOST_INDEX)"]
    pod = {
        "restartPolicy": "Never", **account,
        "nodeSelector": devices.node_selector(),
        **({"tolerations": devices.tolerations()} if devices.tolerations() else {}),
        "containers": [{
            "name": "learner", "image": image(args),
            "command": _command(config, store, args.learners, overrides, "learner", extra),
            "env": [{"name": "DILOCO_LEARNER_ID", "value": str(i)}, _store_env(store),
                    {"name": "DILOCO_HOST_INDEX", "valueFrom": {"fieldRef": {
                        "fieldPath":
                            "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}],
            "resources": {"requests": devices.resources(), "limits": devices.resources()}}]}
    # TPU: all hosts of one learner on one node pool (= one slice), one learner per node pool.
    # GPU: each pod takes whole nodes' GPUs; learners may share a node pool.
    exclusive = {EXCLUSIVE_KEY: "cloud.google.com/gke-nodepool"} if devices.platform == "tpu" \
        else None
    jobs.append(_job(f"learner-{i}", devices.hosts, backoff, pod, exclusive))

  if per_job:
    failure = {"maxRestarts": args.max_restarts,
               "rules": [{"name": "restart_only_the_failed_job", "action": "RestartJob"}]}
  else:
    failure = {"maxRestarts": 0}
  return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
          "metadata": {"name": args.name, "labels": {"app.kubernetes.io/name": "diloco"}},
          "spec": {"failurePolicy": failure, "network": {"enableDNSHostnames": True},
                   "replicatedJobs": jobs}}


def _cpu_pod(args, account: dict, name: str, command: list[str], store: str) -> dict:
  return {"restartPolicy": "Never", **account,
          "nodeSelector": {"node.kubernetes.io/instance-type": args.syncer_machine},
          "containers": [{"name": name, "image": image(args), "command": command,
                          "env": [_store_env(store)]}]}


def _syncer_jobs(args, cfg, config: str, store: str, overrides: dict[str, str], backoff: int,
                 account: dict) -> list[dict]:
  """The syncer job, or with `sync.shards = S > 1` one job per shard and an evaluator job."""
  shards = cfg.sync.shards
  if shards == 1:
    return [_job("syncer", 1, backoff, _cpu_pod(
        args, account, "syncer", _command(config, store, args.learners, overrides, "syncer"),
        store))]
  jobs = [_job(f"syncer-{s}", 1, backoff, _cpu_pod(
      args, account, "syncer", _command(config, store, args.learners, overrides, "syncer",
                                        [f"--config.sync.shard={s}"]), store))
          for s in range(shards)]
  if cfg.train.eval_mode != "off":  # no shard holds the whole model: evaluated apart
    command = _command(config, store, args.learners,
                       dict(overrides, **{"train.eval_mode": "process"}), "evaluator")
    jobs.append(_job("evaluator", 1, backoff, _cpu_pod(args, account, "evaluator", command,
                                                       store)))
  return jobs


def render(args: flags.FlagValues) -> str:
  """The manifest as YAML, headed by a comment that records the slice layout."""
  manifest = build_jobset(args)
  devices = accelerator(args)
  name = args.tpu_type if devices.platform == "tpu" else args.gpu_type
  header = (f"# Decoupled DiLoCo: {args.learners} learner(s), each {devices.describe(name)},\n"
            f"# syncer on {args.syncer_machine}, restart mode {args.restart_mode}; image "
            f"{image(args)}; from diloco jobset (docs/scale_out.md).\n")
  return header + yaml.safe_dump(manifest, sort_keys=False, default_flow_style=False, width=100)


def define_flags(fv: flags.FlagValues) -> None:
  """The script's flags, defined on `fv` (the global FLAGS when run, a fresh set in tests)."""
  flags.DEFINE_string("name", None, "JobSet name (DNS label).", flag_values=fv)
  flags.DEFINE_string("image", None, "Container image whose WORKDIR is the repo (built from "
                      "the Dockerfile; default diloco:tpu or diloco:cuda, the documented tags).",
                      flag_values=fv)
  flags.DEFINE_string("store", None, "Shared store, gs://BUCKET/RUN.", flag_values=fv)
  flags.DEFINE_string("config", None, "e.g. configs/decoupled.py:gemma_2b", flag_values=fv)
  flags.DEFINE_integer("learners", None, "M, one TPU slice each.", flag_values=fv)
  flags.DEFINE_string("tpu_type", None, "Slice per learner: v5p-128, v5litepod-256..",
                      flag_values=fv)
  flags.DEFINE_string("gpu_type", None, "GPU nodes per learner instead of a TPU slice: the "
                      "GKE accelerator label, e.g. nvidia-h100-80gb.", flag_values=fv)
  flags.DEFINE_integer("gpus_per_host", 8, "GPUs per node (--gpu_type).", flag_values=fv)
  flags.DEFINE_integer("gpu_hosts", 1, "GPU nodes per learner (--gpu_type).", flag_values=fv)
  flags.DEFINE_string("topology", None, "Override the slice topology, e.g. 4x4x8.",
                      flag_values=fv)
  flags.DEFINE_integer("chips_per_host", None, "Override chips per node (e.g. 4 for an 8-chip "
                       "slice on 4-chip nodes).", flag_values=fv)
  flags.DEFINE_string("syncer_machine", "n2-highmem-32", "CPU machine type.", flag_values=fv)
  flags.DEFINE_enum("restart_mode", "job", ["job", "pod"],
                    "job: JobSet RestartJob per failed job; pod: per-pod Job backoff.",
                    flag_values=fv)
  flags.DEFINE_integer("max_restarts", 100, "job mode: restarts shared by all jobs; pod mode: "
                       "backoffLimit per job.", flag_values=fv)
  flags.DEFINE_multi_string("override", None, "KEY=VALUE config override for every process "
                            "(repeatable), e.g. data.path=gs://bucket/tokens or "
                            "checkpoint.every_steps=500.", flag_values=fv)
  flags.DEFINE_string("service_account", None, "Kubernetes service account with access to the "
                      "bucket (Workload Identity).", flag_values=fv)
  flags.DEFINE_string("output", None, "Write the YAML here instead of stdout.", flag_values=fv)
  flags.DEFINE_bool("dry_run", False, "Print the YAML to stdout and write nothing (default "
                    "without --output).", flag_values=fv)
  flags.mark_flags_as_required(["name", "store", "config", "learners"], flag_values=fv)


PROG = "diloco jobset"


def parse_args(argv: Sequence[str], prog: str = PROG) -> flags.FlagValues:
  """A fresh set of the command's flags parsed from `argv` (without the program name)."""
  fv = flags.FlagValues()
  define_flags(fv)
  rest = fv([prog, *argv])
  if len(rest) > 1:
    raise FlagError(f"unexpected arguments: {rest[1:]}")
  try:
    settings.check_flags(fv)
  except ConfigError as e:
    raise FlagError(str(e)) from None
  return fv


def run(args: flags.FlagValues, prog: str = PROG) -> int:
  """Renders the manifest to stdout or --output; 2 with a message naming the bad flag."""
  try:
    text = render(args)
  except FlagError as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    return 2
  if args.dry_run or not args.output:
    sys.stdout.write(text)
    return 0
  try:
    pathlib.Path(args.output).write_text(text, encoding="utf-8")
  except OSError as e:  # a missing folder, a directory, no permission: the user's path
    print(f"{prog}: error: --output: cannot write {args.output!r}: "
          f"{e.strerror or e}", file=sys.stderr)
    return 2
  print(f"wrote {args.output}: {args.learners} learner job(s) + syncer; "
        f"kubectl apply -f {args.output}")
  return 0


def main(argv: Sequence[str], prog: str = PROG) -> int:
  """`run` on flags parsed from `argv` (without the program name), for callers in Python."""
  try:
    args = parse_args(argv, prog)
  except (flags.Error, FlagError) as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    return 2
  return run(args, prog)
