"""A multi-process run under attack, against the same run left alone: does the trust boundary
keep G on course? (docs/decisions/store_and_trust.md "How the trust boundary is tested: fuzzing, planted
entries, a run under attack").

While a 2-learner run trains (`configs/multiprocess.py:tiny`, no chaos), an attacker thread
writes into the store, as learner 1's live incarnation, a delivery every half second that
claims 2**53 tokens after one step, with values far from G (a liar that would take all the
weight), and writes again every delivery the tape shows merged, with the same far values (a
replayer). Both runs print the syncer's final eval loss and rejection counts. Usage:

  python scripts/attack_run.py --workdir=/tmp/attack --seeds=0,1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from diloco.delivery import Delivery  # noqa: E402
from diloco.distributed.store import Store  # noqa: E402  (after the path)


def _attack(store_root: str, workdir: str, stop: threading.Event, counts: dict) -> None:
  """Writes lying and replayed deliveries until `stop` (errors of a racing store: retried)."""
  rng = np.random.default_rng(123)
  replayed, step = set(), 10**6
  while not stop.wait(0.5):
    try:
      store = Store(store_root)
      index = store.merged.index()
      with open(os.path.join(store_root, "heartbeats", "l1.json"), encoding="utf-8") as f:
        incarnation = json.load(f)["incarnation"]
      for p, version in sorted(index.items())[:2]:
        values = store.merged.read(p, version)[0].tensors
        far = {k: v + 10.0 * rng.standard_normal(v.shape).astype(np.float32)
               for k, v in values.items()}
        step += 1
        store.payloads.put(Delivery(learner=1, incarnation=incarnation, fragment=p, local_step=step,
                                    steps=1, tokens=2**53, base_version=version, kind="values",
                                    tensors=far, transit_s=0.0))
        counts["lies"] += 1
      tape = os.path.join(workdir, "tape.jsonl")
      with open(tape, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
      for r in records:
        for a in r["admitted"]:
          key = (r["fragment"], a["learner"], a["incarnation"], a["local_step"])
          if key in replayed or r["fragment"] not in index:
            continue
          replayed.add(key)
          values = store.merged.read(r["fragment"], index[r["fragment"]])[0].tensors
          far = {k: v + 10.0 * rng.standard_normal(v.shape).astype(np.float32)
                 for k, v in values.items()}
          store.payloads.put(Delivery(learner=a["learner"], incarnation=a["incarnation"],
                                      fragment=r["fragment"], local_step=a["local_step"],
                                      steps=a["steps"], tokens=a["tokens"],
                                      base_version=index[r["fragment"]], kind="values", tensors=far,
                                      transit_s=0.0))
          counts["replays"] += 1
    except (OSError, ValueError, KeyError, RuntimeError):
      continue


def run(workdir: str, seed: int, attack: bool, steps: int) -> dict:
  store_root = os.path.join(workdir, "store")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.Popen(
      [sys.executable, "-m", "diloco.main", "--config=configs/multiprocess.py:tiny",
       f"--workdir={workdir}", "--role=launch", "--config.learners.count=2",
       f"--config.train.steps={steps}", "--config.launch.chaos_faults=0",
       f"--config.seed={seed}"],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  stop, counts = threading.Event(), {"lies": 0, "replays": 0}
  thread = threading.Thread(target=_attack, args=(store_root, workdir, stop, counts))
  if attack:
    thread.start()
  out, _ = proc.communicate(timeout=1800)
  stop.set()
  if attack:
    thread.join()
  if proc.returncode != 0:
    raise RuntimeError(out[-3000:])
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f if line.strip()]
  loss = [r["eval/loss"] for r in records if r.get("role") == "syncer" and "eval/loss" in r]
  with open(os.path.join(store_root, "registry.json"), encoding="utf-8") as f:
    rejected = json.load(f).get("rejected", {})
  return {"seed": seed, "attack": attack, "eval_loss": loss[-1] if loss else None,
          "rejected": rejected, **counts}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--seeds", default="0")
  parser.add_argument("--steps", type=int, default=120)
  args = parser.parse_args()
  for seed in [int(s) for s in args.seeds.split(",")]:
    for attack in (False, True):
      result = run(os.path.join(args.workdir, f"s{seed}_{'attack' if attack else 'honest'}"),
                   seed, attack, args.steps)
      print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
