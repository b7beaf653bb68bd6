"""One launched multi-process run (two syncer shards, the evaluator and two learner processes)
with its store on `gs://`,
through a local GCS emulator speaking the real HTTP API (`tests/gcs_emulator.py`). The
processes the launcher starts inherit the emulator's address from the environment."""

import json
import os
import subprocess
import sys

import pytest
from gcs_emulator import gcs, use_gcsfs

pytestmark = [pytest.mark.slow, pytest.mark.processes]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 48


@pytest.mark.parametrize("shards", [2])  # S = 1 runs the same store code on one folder
def test_a_launched_run_with_its_store_on_gcs_finishes_and_exports(
    gcs_emulator, tmp_path, monkeypatch, shards):
  workdir, root = str(tmp_path / "run"), gcs_emulator.root("run")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(gcs_emulator.env())
  proc = subprocess.run(
      [sys.executable, "-m", "diloco.main", "--config=configs/multiprocess.py:tiny",
       f"--workdir={workdir}", "--role=launch", "--config.learners.count=2",
       f"--config.store.root={root}", f"--config.sync.shards={shards}",
       "--config.sync.num_fragments=2", f"--config.train.steps={STEPS}",
       f"--config.train.eval_every={STEPS}",
       # No learner checkpoints: Orbax writes their arrays through TensorStore's OCDBT, whose
       # generation-conditioned writes the emulator cannot answer ("Malformed
       # StorageGeneration"; see docs/scale_out.md).
       "--config.checkpoint.every_steps=0",
       # The emulator answers one request at a time (a syncer pass with a round takes 2-5 s
       # there): fewer polls, and a learner is not declared dead while its heartbeat queues.
       "--config.store.poll_s=0.2", "--config.sync.heartbeat_timeout_s=30",
       "--config.launch.chaos_faults=0", "--config.launch.timeout_s=600"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=700, check=False)
  logs = proc.stdout[-3000:] + proc.stderr[-3000:]
  assert proc.returncode == 0, logs + "\nemulator:\n" + gcs_emulator.output()
  with open(os.path.join(workdir, "export", "export.json")) as f:
    exported = json.load(f)
  assert exported["runtime"] == "multiprocess" and exported["outer/rounds"] >= 1, exported
  # The store lies on the emulator (nothing of it under the workdir), and says the run ended.
  assert not os.path.exists(os.path.join(workdir, "store"))
  use_gcsfs(monkeypatch, gcs_emulator)
  fs, key = gcs(), root.removeprefix("gs://")
  folders = [key] if shards == 1 else [f"{key}/shards/s{s}" for s in range(shards)]
  registries = [json.loads(fs.cat_file(f"{folder}/registry.json")) for folder in folders]
  assert all(r["stopped"] for r in registries), registries
  assert sum(r["rounds"] for r in registries) == exported["outer/rounds"], registries
  index = {}
  for folder in folders:  # each shard's index lists its own fragments
    index.update(json.loads(fs.cat_file(f"{folder}/merged/index.json")))
  assert len(index) == 2 and min(index.values()) >= 1, index  # every fragment merged
  heartbeats = fs.ls(f"{key}/heartbeats", detail=False)
  assert sorted(os.path.basename(h) for h in heartbeats) == ["l0.json", "l1.json"]
