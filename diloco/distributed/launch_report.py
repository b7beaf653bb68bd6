"""What the local launcher reports: a status line while the run goes on, the report at its end.

At the end it merges the processes' activity logs into activity.jsonl, writes chaos.json,
merges the syncer shards' tapes into the run's one tape.jsonl, and writes the same report as
the single-controller runtime (`diloco.observe.report`: accounting.json, loss.png,
timeline.png, a short table).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from diloco.config.run_config import Config
from diloco.distributed.store import Store
from diloco.distributed.supervision import Proc
from diloco.observe import accounting, report
from diloco.observe import metrics as metrics_lib


def status_line(procs: dict[int, Proc], beats: dict[int, dict], syncers: list[Proc],
                stores: list[Store]) -> str:
  """One console line: each learner's state, step and restarts; each syncer shard's rounds."""
  parts = []
  for m, proc in sorted(procs.items()):
    if m < 0 or proc.state == "idle":
      continue
    step = beats.get(m, {}).get("local_step", 0)
    parts.append(f"L{m} {proc.state} s{step} r{proc.restarts}")
  shards = []
  for proc, store in zip(syncers, stores):
    try:
      reg = store.blobs.read_json("registry.json") or {}
    except Exception:  # a status line never fails the run
      reg = {}
    shards.append(f"{proc.name} {proc.state} r{proc.restarts}: rounds {reg.get('rounds', 0)}, "
                  f"learners/round {reg.get('learners_per_round', 0.0):.2f} (last "
                  f"{reg.get('last_quorum', 0)}), rejected "
                  f"{sum(reg.get('rejected', {}).values())}")
  return " | ".join(parts) + " || " + " | ".join(shards)


def finish(cfg: Config, workdir: str, procs: dict[int, Proc], syncers: list[Proc],
           applied: list[dict], started: float) -> dict:
  """Merges the activity logs into activity.jsonl, writes chaos.json, and writes and prints
  the run's report (`diloco.observe.report`) from the records the processes left.
  `applied`: the chaos events as applied; `started`: the launcher's start (monotonic)."""
  activity = []
  folder = os.path.join(workdir, "activity")
  for name in sorted(os.listdir(folder)):
    activity += accounting.read_jsonl(os.path.join(folder, name))
  activity.sort(key=lambda r: (r["start"], r["learner"]))
  with open(os.path.join(workdir, accounting.ACTIVITY_FILE), "w") as f:
    for r in activity:
      f.write(json.dumps(r) + "\n")
  with open(os.path.join(workdir, "chaos.json"), "w") as f:
    json.dump(applied, f, indent=2)
  records = metrics_lib.read_metrics(os.path.join(workdir, metrics_lib.METRICS_FILE))
  evals = [r for r in records if r.get("role") == "syncer" and "eval/loss" in r]
  figures = report.RunFigures(
      eval_loss=evals[-1]["eval/loss"] if evals else float("nan"),
      initial_loss=evals[0]["eval/loss"] if evals else float("nan"),
      eval_step=evals[-1]["step"] if evals else 0,
      wall_s=time.monotonic() - started,
      restarts=sum(p.restarts for p in procs.values()),
      syncer_restarts=sum(p.restarts for p in syncers),
      chaos_events=len(applied),
      chaos_applied=sum(r["applied"] for r in applied))
  # Into the syncer's TensorBoard run (WORKDIR/tensorboard/syncer), at the last eval's step.
  writer = metrics_lib.open_writer(cfg.log, workdir, role="syncer", process="launcher")
  tape = merged_tape(workdir, cfg.sync.shards)
  try:
    summary = report.finish(
        workdir, num_fragments=cfg.sync.num_fragments,
        num_params=sum(int(np.prod(s)) for s in param_shapes(cfg).values()),
        figures=figures, activity=activity, tape=tape, writer=writer,
        loss_title=f"Decoupled DiLoCo, {cfg.learners.count} learner processes",
        timeline_title=f"multi-process, M={cfg.learners.count}, K={cfg.sync.quorum or 'M'}, "
                       f"chaos {len(applied)} events")
  finally:
    writer.close()
  return summary


def merged_tape(workdir: str, shards: int) -> list[dict]:
  """The run's tape: the syncer's, or every shard's merged in publication order (written to
  WORKDIR/tape.jsonl, where the accounting reads it)."""
  path = os.path.join(workdir, accounting.TAPE_FILE)
  if shards == 1:
    return accounting.read_jsonl(path)
  tape = []
  for s in range(shards):
    shard_tape = os.path.join(workdir, "shards", f"s{s}", accounting.TAPE_FILE)
    if os.path.exists(shard_tape):
      tape += [dict(r, shard=r.get("shard", s)) for r in accounting.read_jsonl(shard_tape)]
  tape.sort(key=lambda r: (r["published_at"], r["shard"], r["round"]))
  with open(path, "w", encoding="utf-8") as f:
    for r in tape:
      f.write(json.dumps(r) + "\n")
  return tape


def param_shapes(cfg: Config) -> dict:
  """The model's parameter shapes by path, from its abstract state (no arrays)."""
  import flax.nnx as nnx  # pylint: disable=import-outside-toplevel

  from diloco import fragments as fragments_lib  # pylint: disable=import-outside-toplevel
  from diloco.train import state as train_state  # pylint: disable=import-outside-toplevel
  _, state = train_state.abstract_params(cfg.model)
  return {k: v.shape for k, v in fragments_lib.flatten_tree(nnx.to_pure_dict(state)).items()}
