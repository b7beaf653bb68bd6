"""diloco.deploy.jobset (`diloco jobset`): the rendered JobSet parses and has the structure GKE needs.

Nothing here talks to a cluster; these checks guard the manifest's shape (one job per
learner, hosts per slice, selectors, commands) and that bad flags fail with their name.
"""

import pathlib
import subprocess
import sys

import pytest
import yaml

from diloco.deploy import jobset as make_jobset

ROOT = pathlib.Path(__file__).resolve().parents[1]

STORE = "gs://diloco-test-bucket/run-7"


def _argv(**overrides) -> list[str]:
  flags = {"name": "dd-test", "image": "us-docker.pkg.dev/proj/repo/diloco:abc",
           "store": STORE, "config": "configs/decoupled.py:gemma_2b", "learners": "3",
           "tpu_type": "v5p-128"}
  flags.update(overrides)
  return [f"--{k}={v}" for k, v in flags.items() if v is not None]


def _render(**overrides) -> dict:
  text = make_jobset.render(make_jobset.parse_args(_argv(**overrides)))
  return yaml.safe_load(text)


def _jobs(manifest: dict) -> dict[str, dict]:
  return {rj["name"]: rj for rj in manifest["spec"]["replicatedJobs"]}


def _backoff(rj: dict) -> int:
  return rj["template"]["spec"]["backoffLimit"]


def _container(rj: dict) -> dict:
  (container,) = rj["template"]["spec"]["template"]["spec"]["containers"]
  return container


@pytest.mark.parametrize("tpu_type, accelerator, topology, hosts, chips_per_host", [
    ("v5p-128", "tpu-v5p-slice", "4x4x4", 16, 4),  # v5p-N counts TensorCores: 64 chips
    ("v5litepod-256", "tpu-v5-lite-podslice", "16x16", 64, 4),
    ("v6e-16", "tpu-v6e-slice", "4x4", 4, 4),
])
def test_multi_host_slices(tpu_type, accelerator, topology, hosts, chips_per_host):
  manifest = _render(tpu_type=tpu_type)
  assert manifest["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
  assert manifest["kind"] == "JobSet"
  jobs = _jobs(manifest)
  assert list(jobs) == ["syncer", "learner-0", "learner-1", "learner-2"]
  for i in range(3):
    rj = jobs[f"learner-{i}"]
    assert rj["replicas"] == 1
    job = rj["template"]["spec"]
    assert job["parallelism"] == job["completions"] == hosts
    assert job["completionMode"] == "Indexed"
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": accelerator,
                                   "cloud.google.com/gke-tpu-topology": topology}
    container = _container(rj)
    assert container["resources"]["limits"] == {"google.com/tpu": chips_per_host}
    assert container["resources"]["requests"] == {"google.com/tpu": chips_per_host}
    cmd = container["command"]
    assert cmd[:3] == ["python", "-m", "diloco.main"]
    assert "--role=learner" in cmd and "--jax_distributed" in cmd
    assert [a for a in cmd if a.startswith("--learner_id=")] == [f"--learner_id={i}"]
    assert f"--store={STORE}" in cmd
    assert "--config=configs/decoupled.py:gemma_2b" in cmd
    assert "--config.learners.count=3" in cmd
    env = {e["name"]: e for e in container["env"]}
    assert env["DILOCO_LEARNER_ID"]["value"] == str(i)
    assert env["DILOCO_STORE"]["value"] == STORE
    assert "job-completion-index" in env["DILOCO_HOST_INDEX"]["valueFrom"]["fieldRef"][
        "fieldPath"]
    annotations = rj["template"]["metadata"]["annotations"]
    assert annotations[make_jobset.EXCLUSIVE_KEY] == "cloud.google.com/gke-nodepool"


def test_syncer_is_one_cpu_pod():
  syncer = _jobs(_render(syncer_machine="n2-highmem-64"))["syncer"]
  job = syncer["template"]["spec"]
  assert syncer["replicas"] == 1 and job["parallelism"] == job["completions"] == 1
  pod = job["template"]["spec"]
  assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "n2-highmem-64"}
  container = _container(syncer)
  assert "resources" not in container  # no google.com/tpu
  cmd = container["command"]
  assert "--role=syncer" in cmd and f"--store={STORE}" in cmd
  assert not any(a.startswith("--learner_id") or a == "--jax_distributed" for a in cmd)


def test_single_host_slice_has_no_jax_distributed():
  learner = _jobs(_render(tpu_type="v5litepod-8", learners="1"))["learner-0"]
  job = learner["template"]["spec"]
  assert job["parallelism"] == 1
  container = _container(learner)
  assert container["resources"]["limits"] == {"google.com/tpu": 8}
  assert "--jax_distributed" not in container["command"]
  assert job["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x4"


def test_overrides_topology_and_chips_per_host():
  learner = _jobs(_render(tpu_type="v6e-8", chips_per_host="4"))["learner-0"]
  assert learner["template"]["spec"]["parallelism"] == 2
  assert "--jax_distributed" in _container(learner)["command"]
  learner = _jobs(_render(tpu_type="v5p-32", topology="2x2x4"))["learner-0"]
  assert learner["template"]["spec"]["parallelism"] == 4


def test_failure_policy_restarts_only_the_failed_job():
  manifest = _render(max_restarts="7")
  policy = manifest["spec"]["failurePolicy"]
  assert policy["maxRestarts"] == 7
  assert [r["action"] for r in policy["rules"]] == ["RestartJob"]
  assert all(not r.get("targetReplicatedJobs") for r in policy["rules"])  # every job
  assert {_backoff(rj) for rj in manifest["spec"]["replicatedJobs"]} == {0}


def test_pod_restart_mode_never_restarts_the_jobset():
  manifest = _render(restart_mode="pod", max_restarts="5")
  assert manifest["spec"]["failurePolicy"] == {"maxRestarts": 0}
  assert {_backoff(rj) for rj in manifest["spec"]["replicatedJobs"]} == {5}


def test_config_overrides_reach_every_process():
  argv = _argv() + ["--override=data.path=gs://b/tokens", "--override=checkpoint.every_steps=500"]
  manifest = yaml.safe_load(make_jobset.render(make_jobset.parse_args(argv)))
  for rj in manifest["spec"]["replicatedJobs"]:
    cmd = _container(rj)["command"]
    assert "--config.data.path=gs://b/tokens" in cmd
    assert "--config.checkpoint.every_steps=500" in cmd
    assert "--config.store.heartbeat_every_s=2.0" in cmd  # GCS: ~1 update/s per object
    assert "--config.store.on_sigterm=restart" in cmd  # a preempted pod comes back
    assert "--config.store.poll_s=1.0" in cmd  # every host of every learner polls the index
  argv = _argv() + ["--override=store.heartbeat_every_s=5"]
  cmd = _container(_jobs(yaml.safe_load(make_jobset.render(make_jobset.parse_args(argv))))[
      "syncer"])["command"]
  assert [a for a in cmd if "heartbeat_every_s" in a] == ["--config.store.heartbeat_every_s=5"]


@pytest.mark.parametrize("override", [
    "data.pth=x", "nodots=1", "learners.count=4", "checkpoint.every_steps=often",
    "mesh.tensor=3",  # 3 does not divide the 64 chips of a v5p-128
])
def test_bad_overrides_are_named(override):
  with pytest.raises(ValueError, match="--override|--config"):
    make_jobset.build_jobset(make_jobset.parse_args(_argv() + [f"--override={override}"]))


@pytest.mark.parametrize("overrides, flag", [
    ({"store": "/tmp/store"}, "--store"),
    ({"store": "s3://bucket/run"}, "--store"),
    ({"learners": "0"}, "--learners"),
    ({"learners": "100000"}, "--learners: need 1 to 512"),  # once rendered for minutes
    ({"tpu_type": "v4-8"}, "--tpu_type"),
    ({"tpu_type": "v5p-7"}, "--tpu_type"),
    ({"tpu_type": "v5p-32"}, "--topology"),  # no default shape: must be given
    ({"topology": "4x4x8"}, "--topology"),  # 128 chips, but v5p-128 has 64
    ({"tpu_type": "v5litepod-16", "chips_per_host": "3"}, "--chips_per_host"),
    ({"config": "configs/decoupled.py:gemma_99b"}, "--config"),
    ({"config": "configs/nope.py:tiny"}, "--config"),
    ({"tpu_type": "v5litepod-1"}, "--config"),  # tensor=4 does not fit one chip
    ({"name": "Bad_Name"}, "--name"),
    ({"name": "x" * 60}, "--name"),
    ({"image": ""}, "--image"),
    ({"syncer_machine": "ct5lp-hightpu-4t"}, "--syncer_machine"),
    ({"max_restarts": "-1"}, "--max_restarts"),
])
def test_bad_flags_are_named(overrides, flag):
  with pytest.raises(ValueError, match=flag):
    make_jobset.build_jobset(make_jobset.parse_args(_argv(**overrides)))


def test_main_reports_bad_flag_and_writes_nothing(capsys, tmp_path):
  out = tmp_path / "js.yaml"
  assert make_jobset.main(_argv(store="bucket/run", output=str(out))) == 2
  captured = capsys.readouterr()
  assert "--store" in captured.err and captured.out == ""
  assert not out.exists()


def test_main_writes_output_file(capsys, tmp_path):
  out = tmp_path / "js.yaml"
  assert make_jobset.main(_argv(output=str(out), learners="2")) == 0
  assert "wrote" in capsys.readouterr().out
  assert len(_jobs(yaml.safe_load(out.read_text()))) == 3


@pytest.mark.parametrize("where", ["missing/folder/js.yaml", "."])
def test_an_output_that_cannot_be_written_is_one_line_naming_the_flag(capsys, tmp_path, where):
  out = tmp_path / where
  assert make_jobset.main(_argv(output=str(out), learners="2")) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("diloco jobset: error: --output: cannot write") and "\n" not in err
  assert not (tmp_path / "missing").exists()


def test_dry_run_subprocess_prints_only_yaml(tmp_path):
  """`diloco jobset` prints the manifest; the script under the older name prints the same."""
  argv = ["--dry_run", *_argv(tpu_type="v5litepod-256", learners="2")]
  proc, script = (subprocess.run(cmd + argv, cwd=ROOT, capture_output=True, text=True,
                                 timeout=120, check=False)
                  for cmd in ([sys.executable, "-m", "diloco", "jobset"],
                              [sys.executable, "scripts/make_jobset.py"]))
  assert proc.returncode == 0 == script.returncode, proc.stderr + script.stderr
  assert proc.stdout == script.stdout
  manifest = yaml.safe_load(proc.stdout)
  assert manifest["kind"] == "JobSet"
  assert [rj["name"] for rj in manifest["spec"]["replicatedJobs"]] == [
      "syncer", "learner-0", "learner-1"]
  assert not list(tmp_path.iterdir())


# --- GPU node pools and the container image -------------------------------------------------

def _gpu(**overrides) -> dict:
  return _render(**{"tpu_type": None, "gpu_type": "nvidia-h100-80gb", "image": None,
                    **overrides})


def test_gpu_learners_request_gpus_on_their_node_type():
  manifest = _gpu(learners="2")
  jobs = _jobs(manifest)
  assert list(jobs) == ["syncer", "learner-0", "learner-1"]
  for i in range(2):
    rj = jobs[f"learner-{i}"]
    pod = rj["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    container = _container(rj)
    assert container["resources"] == {"requests": {"nvidia.com/gpu": 8},
                                      "limits": {"nvidia.com/gpu": 8}}
    assert container["image"] == "diloco:cuda"  # the Dockerfile's documented CUDA tag
    assert "--jax_distributed" not in container["command"]
    assert rj["template"]["spec"]["parallelism"] == 1
  syncer = _container(jobs["syncer"])
  assert "resources" not in syncer and syncer["image"] == "diloco:cuda"


def test_multi_host_gpu_learner_names_its_coordinator():
  rj = _jobs(_gpu(learners="2", gpu_hosts="2", gpus_per_host="4"))["learner-1"]
  assert rj["template"]["spec"]["parallelism"] == 2
  container = _container(rj)
  cmd = container["command"]
  assert "--jax_distributed" in cmd and "--num_processes=2" in cmd
  # Pod 0 of job learner-1, by the JobSet's DNS host name (subdomain = JobSet name).
  assert "--coordinator_address=dd-test-learner-1-0-0.dd-test:8476" in cmd
  # Kubernetes expands $(VAR) in a command from the container's env: the completion index.
  assert "--process_id=$(DILOCO_HOST_INDEX)" in cmd
  assert "DILOCO_HOST_INDEX" in {e["name"] for e in container["env"]}


@pytest.mark.parametrize("overrides, flag", [
    ({"tpu_type": "v5p-128"}, "--tpu_type/--gpu_type"),  # both
    ({"gpu_type": "h100"}, "--gpu_type"),
    ({"gpus_per_host": "3"}, "--gpus_per_host"),
    ({"gpu_hosts": "0"}, "--gpu_hosts"),
    ({"gpus_per_host": "2"}, r"--config: .* 2 chips of one learner \(--gpu_type\)"),
])
def test_bad_gpu_flags_are_named(overrides, flag):
  with pytest.raises(ValueError, match=flag):
    _gpu(**overrides)
  with pytest.raises(ValueError, match="--tpu_type/--gpu_type"):
    _render(tpu_type=None)  # neither


def test_default_image_is_the_tag_the_dockerfile_builds():
  dockerfile = (ROOT / "Dockerfile").read_text()
  assert _container(_jobs(_render(image=None))["learner-0"])["image"] == "diloco:tpu"
  for accel, tag in make_jobset.DEFAULT_IMAGE.items():
    assert f"--build-arg EXTRAS={accel},gcs -t {tag} " in dockerfile.replace("  ", " ")


def test_dockerfile_copies_what_exists_and_installs_declared_extras():
  """The container recipe (not built here: no Docker daemon) refers to real files and extras."""
  import ast
  import re
  dockerfile = (ROOT / "Dockerfile").read_text()
  ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")}
  copies = re.findall(r"^COPY (.+) \S+$", dockerfile, re.MULTILINE)
  sources = [s for line in copies for s in line.split()]
  assert {"setup.py", "diloco", "configs", "scripts"} <= set(sources)
  for source in sources:
    assert (ROOT / source).exists(), source
    assert source not in ignored, source
  setup = ast.parse((ROOT / "setup.py").read_text())
  call = next(n for n in ast.walk(setup) if isinstance(n, ast.Call)
              and getattr(n.func, "id", None) == "setup")
  extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
  assert extras["cuda"] == ["jax[cuda12]>=0.10.2,<0.13"] and extras["tpu"] == [
      "jax[tpu]>=0.10.2,<0.13"]
  for build in re.findall(r"--build-arg EXTRAS=(\S+)", dockerfile):
    assert set(build.split(",")) <= set(extras), build
  # The manifests run with --workdir=WORKDIR and relative config paths from the image's
  # WORKDIR, which must hold the repository's configs/.
  assert f"mkdir -p {make_jobset.WORKDIR}" in dockerfile
  workdir = re.findall(r"^WORKDIR (\S+)$", dockerfile, re.MULTILINE)[-1]
  assert re.search(rf"^COPY configs {re.escape('./configs')}$", dockerfile, re.MULTILINE)
  assert workdir != make_jobset.WORKDIR  # the run's files never land in the code's directory


def test_a_sharded_syncer_renders_one_job_per_shard_and_an_evaluator():
  manifest = _render(override="sync.shards=3")
  jobs = _jobs(manifest)
  assert list(jobs) == ["syncer-0", "syncer-1", "syncer-2", "evaluator", "learner-0",
                        "learner-1", "learner-2"]
  for s in range(3):
    command = _container(jobs[f"syncer-{s}"])["command"]
    assert "--role=syncer" in command and f"--config.sync.shard={s}" in command
    assert "--config.sync.shards=3" in command
    assert [c for c in command if c.startswith("--config.sync.shard=")] == [
        f"--config.sync.shard={s}"]
    assert _backoff(jobs[f"syncer-{s}"]) == 0  # each shard's job restarts on its own
  evaluator = _container(jobs["evaluator"])["command"]
  assert "--role=evaluator" in evaluator and "--config.train.eval_mode=process" in evaluator
  # Learners get the shard count too (they route deliveries by it), never a shard index.
  learner = _container(jobs["learner-0"])["command"]
  assert "--config.sync.shards=3" in learner
  assert not [c for c in learner if c.startswith("--config.sync.shard=")]
  # One shard: the single syncer job, as before.
  assert list(_jobs(_render()))[0] == "syncer"
