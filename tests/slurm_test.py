"""`diloco slurm`: the batch scripts it renders, and a real run on a single-node SLURM cluster
(`tests/slurm_cluster.py`) where a learner killed mid-run is requeued alone and rejoins."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import slurm_cluster

from diloco.config import run_config
from diloco.deploy import slurm
from diloco.distributed.store import shared_store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(count: int = 2, **fields) -> run_config.Config:
  raw = run_config.load("multiprocess:tiny")
  raw.learners.count = count
  raw.launch.max_learners = 0
  for key, value in fields.items():
    group, name = key.split("__")
    setattr(getattr(raw, group), name, value)
  return run_config.from_config_dict(raw)


def _scripts(cfg, workdir="/shared/run", store="/shared/run/store") -> dict[str, str]:
  cfg = slurm.for_slurm(cfg, store)
  return {job.name: job.script for job in slurm.render(cfg, workdir, store)}


def test_scripts_one_learner_per_array_task_requeued_alone():
  scripts = _scripts(_config(3, slurm__partition="gpu", slurm__cpu_partition="cpu",
                             slurm__account="proj", slurm__time="4:00:00",
                             slurm__gpus_per_node=8, slurm__gpu_type="h100",
                             slurm__constraint="ib"))
  assert list(scripts) == ["syncer", "learner", "report"]
  learner, syncer = scripts["learner"], scripts["syncer"]
  for line in ("#SBATCH --array=0-2", "#SBATCH --requeue", "#SBATCH --partition=gpu",
               "#SBATCH --gres=gpu:h100:8", "#SBATCH --constraint=ib", "#SBATCH --account=proj",
               "#SBATCH --time=4:00:00", "export JAX_PLATFORMS=cuda",
               '  scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}" && exit 0'):
    assert line in learner.splitlines(), line
  assert '--learner_id="$SLURM_ARRAY_TASK_ID"' in learner
  assert "--jax_distributed" not in learner  # one node per learner
  assert "#SBATCH --partition=cpu" in syncer and "--gres" not in syncer
  assert "--role=syncer" in syncer and "export CUDA_VISIBLE_DEVICES=''" in syncer
  # Every #SBATCH line comes before the first command (sbatch stops reading at it).
  for text in scripts.values():
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines[1:], 1) if line and not line.startswith("#"))
    assert not any(line.startswith("#SBATCH") for line in lines[first:]), text


def test_a_learner_over_several_nodes_starts_jax_distributed_from_slurms_environment():
  scripts = _scripts(_config(2, slurm__nodes_per_learner=4, slurm__gpus_per_node=8))
  learner = scripts["learner"]
  assert "#SBATCH --nodes=4" in learner and "#SBATCH --ntasks-per-node=1" in learner
  assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):8476' in learner
  assert ('--num_processes="$SLURM_NTASKS" --process_id="$SLURM_PROCID"' in learner)


def test_sharded_syncer_and_evaluator_are_jobs_of_their_own():
  scripts = _scripts(_config(2, sync__shards=2))
  assert list(scripts) == ["syncer0", "syncer1", "evaluator", "learner", "report"]
  assert "config_syncer1.json" in scripts["syncer1"]
  assert "--role=evaluator" in scripts["evaluator"]


@pytest.mark.parametrize("key,value,message", [
    ("slurm__time", "tomorrow", "slurm.time"),
    ("slurm__partition", "gpu a100", "slurm.partition"),
    ("slurm__gpu_type", "h100", "slurm.gpu_type: needs slurm.gpus_per_node > 0"),
    ("slurm__nodes_per_learner", 0, "slurm.nodes_per_learner"),
])
def test_bad_slurm_fields_are_one_line_config_errors(key, value, message):
  with pytest.raises(run_config.ConfigError, match=re.escape(message)) as e:
    _config(2, **{key: value})
  assert "\n" not in str(e.value)


def test_gpus_that_do_not_fit_the_mesh_are_refused():
  cfg = _config(2, slurm__gpus_per_node=3, mesh__data=-1, mesh__fsdp=2)
  with pytest.raises(run_config.ConfigError, match=r"slurm.gpus_per_node: .* 3 devices"):
    _scripts(cfg)
  assert _scripts(_config(2, slurm__gpus_per_node=4, slurm__nodes_per_learner=2,
                          mesh__data=-1, mesh__fsdp=2))  # 8 devices: data 4 x fsdp 2


def test_dry_run_prints_the_scripts_and_submits_nothing(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "diloco", "slurm", "--config=multiprocess:tiny",
       f"--workdir={tmp_path / 'run'}", "--dry_run", "--config.learners.count=2",
       "--config.slurm.partition=gpu"],
      cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "### learner.sbatch" in proc.stdout and "#SBATCH --array=0-1" in proc.stdout
  assert not (tmp_path / "run").exists()
  bad = subprocess.run(
      [sys.executable, "-m", "diloco", "slurm", "--config=multiprocess:tiny",
       f"--workdir={tmp_path / 'run'}", "--dry_run", "--config.slurm.time=soon"],
      cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert bad.returncode != 0 and "slurm.time" in bad.stderr
  assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


# The real cluster.
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  missing = slurm_cluster.missing_binaries()
  if missing:
    pytest.fail(f"SLURM test cluster: missing {', '.join(missing)}; "
                "apt-get install -y slurm-wlm munge (.ci/run does)", pytrace=False)
  c = slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm"))
  try:
    c.start()
    yield c
  finally:
    c.stop()


def _jsonl(path) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _read(workdir, log: str) -> str:
  with open(os.path.join(workdir, "logs", log), encoding="utf-8", errors="replace") as f:
    return f.read()


def _wait(cluster, what, ready, timeout, workdir):
  deadline = time.monotonic() + timeout
  while not ready():
    if time.monotonic() > deadline:
      logs = "".join(f"--- {n}\n{_read(workdir, n)[-3000:]}"
                     for n in sorted(os.listdir(os.path.join(workdir, "logs"))))
      raise AssertionError(f"waited {timeout} s for {what}\n"
                           f"{cluster.run('squeue', check=False).stdout}\n{logs}\n"
                           f"{cluster.logs(15)}")
    time.sleep(1)


def _job(cluster, job_id: str) -> dict[str, str]:
  out = cluster.run("scontrol", "-o", "show", "job", job_id).stdout
  return dict(re.findall(r"(\w+)=(\S*)", out))


@pytest.mark.slow
@pytest.mark.processes
def test_killed_learners_are_requeued_alone_and_rejoin(cluster, tmp_path):
  """Both ways a learner's task goes, in one run of 3 learners: learner 1 crashes (SIGKILL to
  its program, which its batch script answers by requeueing its own array task) and learner 2
  is requeued by SLURM (`scontrol requeue`, as on preemption); learner 0 never stops."""
  steps = 200
  workdir = str(tmp_path / "run")
  store_root = os.path.join(workdir, "store")
  cfg = slurm.for_slurm(_config(3, train__steps=steps, learners__min_step_s=0.2,
                                slurm__job_name="dd"), store_root)
  started = time.monotonic()
  ids = slurm.submit(cfg, workdir, store_root, env=cluster.env)
  array = ids["learner"]
  store = shared_store(store_root, 1)

  def step(m):
    return store.learners.heartbeats().get(m, {}).get("local_step", 0)

  _wait(cluster, "every learner to reach step 40", lambda: all(step(m) >= 40 for m in range(3)),
        400, workdir)
  killed_at = time.time()
  before = step(0)
  cluster.run("scancel", "--signal=KILL", f"{array}_1.0")  # step 0 of task 1: the program
  cluster.run("scontrol", "requeue", f"{array}_2")
  _wait(cluster, "learners 1 and 2 to be requeued",
        lambda: all(int(_job(cluster, f"{array}_{m}").get("Restarts", 0)) >= 1 for m in (1, 2)),
        120, workdir)
  _wait(cluster, "the report job to finish",
        lambda: _job(cluster, ids["report"]).get("JobState") in ("COMPLETED", "FAILED",
                                                                  "CANCELLED", "TIMEOUT"),
        600, workdir)
  elapsed = time.monotonic() - started
  assert _job(cluster, ids["report"])["JobState"] == "COMPLETED", cluster.logs()
  assert os.path.exists(os.path.join(workdir, "accounting.json"))
  assert "restarts        2 (0 of them the syncer's)" in _read(workdir, "report.log")
  assert _job(cluster, f"{array}_0")["Restarts"] == "0"  # the other learner never stopped
  log0 = _read(workdir, "learner0.log")
  assert log0.count("==== learner 0: job") == 1, log0[-3000:]
  for m in (1, 2):
    assert _job(cluster, f"{array}_{m}")["JobState"] == "COMPLETED"
    log = _read(workdir, f"learner{m}.log")
    assert ", start 2 at" in log, log[-3000:]
    # The crash is answered by the script; the requeue's SIGTERM by the learner, which
    # checkpointed and left as a restart.
    assert (f"==== learner {m} exited with" in log) == (m == 1), log[-3000:]
    assert (f"learner {m} incarnation 0: preempted at local step" in log) == (m == 2), log[-3000:]
    assert f"learner {m} incarnation 1: joined" in log, log[-3000:]

  tape = _jsonl(os.path.join(workdir, "tape.jsonl"))
  admitted = [(r["fragment"], a["learner"], a["incarnation"], a["local_step"], r["closed_at"])
              for r in tape for a in r["admitted"]]
  origin = store.run.start()
  # Each killed learner delivered again after the kill, as a new incarnation; learner 0 kept
  # delivering while it was down.
  for m in (1, 2):
    assert any(lid == m and i >= 1 for _, lid, i, _, _ in admitted), (m, admitted)
    back = min(t for _, lid, i, _, t in admitted if lid == m and i >= 1)
    assert any(lid == 0 and killed_at - origin < t < back for _, lid, _, _, t in admitted), \
        f"learner 0 stopped delivering while learner {m} was down"
  assert step(0) == steps and before < steps
  # Every learner's last step is merged into every fragment; no delivery is merged twice.
  _rounds_exact(tape)
  for p in range(cfg.sync.num_fragments):
    for m in range(3):
      assert max(s for f, lid, _, s, _ in admitted if f == p and lid == m) == steps, (p, m)
  print(f"slurm run: {elapsed:.0f} s, learners 1 and 2 requeued, {len(tape)} rounds")


def _rounds_exact(tape) -> None:
  """Rounds numbered without gap or repeat, versions strictly increasing per fragment, and no
  delivery merged twice."""
  assert [r["round"] for r in tape] == list(range(len(tape)))
  last: dict[int, int] = {}
  for r in tape:
    assert r["version"] == last.get(r["fragment"], 0) + 1, r
    last[r["fragment"]] = r["version"]
  keys = [(r["fragment"], a["learner"], a["incarnation"], a["local_step"])
          for r in tape for a in r["admitted"]]
  assert len(keys) == len(set(keys)), "a delivery was merged twice"


@pytest.mark.slow
@pytest.mark.processes
def test_a_cancelled_run_resubmitted_resumes_from_its_store(cluster, tmp_path):
  steps = 200
  workdir = str(tmp_path / "run")
  store_root = os.path.join(workdir, "store")
  cfg = slurm.for_slurm(_config(2, train__steps=steps, learners__min_step_s=0.2,
                                slurm__job_name="dr"), store_root)
  ids = slurm.submit(cfg, workdir, store_root, env=cluster.env)
  store = shared_store(store_root, 1)

  def step(m):
    return store.learners.heartbeats().get(m, {}).get("local_step", 0)

  _wait(cluster, "both learners to reach step 60", lambda: step(0) >= 60 and step(1) >= 60,
        400, workdir)
  cluster.run("scancel", *ids.values())  # the whole run: what a user stops it with
  _wait(cluster, "the cancelled jobs to leave the queue",
        lambda: not cluster.run("squeue", "-h", "--name=dr-syncer,dr-learner,dr-report",
                                check=False).stdout.strip(), 120, workdir)
  stopped_at = {m: step(m) for m in (0, 1)}
  assert all(s < steps for s in stopped_at.values()), stopped_at
  assert not os.path.exists(os.path.join(workdir, "accounting.json"))

  again = slurm.submit(cfg, workdir, store_root, env=cluster.env)
  _wait(cluster, "the resubmitted run's report",
        lambda: _job(cluster, again["report"]).get("JobState") in ("COMPLETED", "FAILED",
                                                                    "CANCELLED", "TIMEOUT"),
        600, workdir)
  assert _job(cluster, again["report"])["JobState"] == "COMPLETED", cluster.logs()
  syncer_log = _read(workdir, "syncer.log")
  assert "syncer: resumed at round" in syncer_log, syncer_log[-3000:]
  for m in (0, 1):
    log = _read(workdir, f"learner{m}.log")
    joins = [int(s) for s in re.findall(rf"learner {m} incarnation \d+: joined at local step "
                                        r"(\d+)", log)]
    assert len(joins) == 2 and joins[1] > 0, log[-3000:]  # resumed, not from step 0
    assert f"learner {m} incarnation 1: done at local step {steps}" in log, log[-3000:]
  tape = _jsonl(os.path.join(workdir, "tape.jsonl"))
  _rounds_exact(tape)
  for p in range(cfg.sync.num_fragments):
    for m in (0, 1):
      assert max(a["local_step"] for r in tape if r["fragment"] == p for a in r["admitted"]
                 if a["learner"] == m) == steps, (p, m)


@pytest.mark.slow
@pytest.mark.processes
def test_a_submission_the_real_scheduler_refuses_part_way_is_cancelled(cluster, tmp_path):
  """The learners' partition is mistyped: sbatch queues the syncer, then refuses the array;
  the syncer job is cancelled, not left to wait for learners that never come."""
  workdir = str(tmp_path / "run")
  cfg = slurm.for_slurm(_config(2, slurm__partition="nope", slurm__cpu_partition="debug",
                                slurm__job_name="partial"), workdir + "/store")
  with pytest.raises(RuntimeError, match=r"sbatch .*learner\.sbatch failed: .*; cancelled "
                                         r"the jobs already queued \(syncer \d+\)"):
    slurm.submit(cfg, workdir, workdir + "/store", env=cluster.env)
  with open(os.path.join(workdir, slurm.JOBS_FILE), encoding="utf-8") as f:
    record = json.load(f)  # (the message above is one line: match does not cross lines)
  assert record["jobs"] == {} and set(record["cancelled"]) == {"syncer"}
  # A syncer job that had started passes through COMPLETING while its node tears it down (seen
  # on a loaded host); the state it ends in is what the test asserts.
  syncer_id = record["cancelled"]["syncer"]
  deadline = time.monotonic() + 60
  state = _job(cluster, syncer_id).get("JobState")
  while state == "COMPLETING" and time.monotonic() < deadline:
    time.sleep(0.5)
    state = _job(cluster, syncer_id).get("JobState")
  assert state == "CANCELLED", state
