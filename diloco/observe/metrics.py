"""Metrics: JSON lines always, trackers (TensorBoard, wandb) as configured, a loss plot, and live
progress."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any

from absl import logging

from diloco.observe import tracking

METRICS_FILE = "metrics.jsonl"


class MetricWriter:
  """Appends one JSON record per call to `workdir/metrics.jsonl` (flat, `/`-named keys).

  Every record also goes to `trackers` (`tracking.open_trackers`) under the writer's name:
  `learner_<m>` for a learner, else the role. `tensorboard=True` alone adds a TensorBoard
  tracker (WORKDIR/tensorboard/<name>).
  """

  def __init__(self, workdir: str, *, role: str, learner: int | None = None,
               tensorboard: bool = False, trackers: list | None = None):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, METRICS_FILE)
    self._file = open(self.path, "a", encoding="utf-8")
    self._role, self._learner = role, learner
    self.name = role if learner is None else f"{role}_{learner}"
    self.trackers = list(trackers or [])
    if tensorboard:
      self.trackers.append(tracking.TensorBoardTracker(workdir, self.name))

  def write(self, step: int, metrics: Mapping[str, float]) -> None:
    record = {"t": time.time(), "role": self._role, "step": int(step)}
    if self._learner is not None:
      record["learner"] = self._learner
    record.update({k: float(v) for k, v in metrics.items()})
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    for tracker in self.trackers:
      tracker.scalars(self.name if self._learner is not None else "", step, metrics)

  def track(self, step: int, values: Mapping[str, object]) -> None:
    """Finite numbers of `values` to the trackers only (e.g. the end-of-run accounting,
    already in accounting.json)."""
    scalars = {k: float(v) for k, v in values.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    for tracker in self.trackers:
      tracker.scalars(self.name if self._learner is not None else "", step, scalars)

  def close(self) -> None:
    self._file.close()
    for tracker in self.trackers:
      tracker.close()


def read_metrics(path: str) -> list[dict]:
  """Records of a metrics.jsonl; a torn last line (crash mid-write) is skipped."""
  records = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return records


class EvalFollower:
  """Follows a metrics.jsonl that other processes append to, for the global evals written
  after it started: a launcher prints them as the syncer or evaluator process records them.
  Evals at `last_step` or later are left out: that is the final eval, which the end-of-run
  report prints (`diloco.observe.report`)."""

  def __init__(self, path: str, last_step: int):
    self.path, self.last_step = path, last_step
    self._offset = os.path.getsize(path) if os.path.exists(path) else 0  # earlier runs' records

  def new_lines(self) -> list[str]:
    """One console line per global eval record completed since the last call."""
    try:
      with open(self.path, "rb") as f:
        f.seek(self._offset)
        chunk = f.read()
    except OSError:
      return []
    complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits
    self._offset += len(complete)
    lines = []
    for raw in complete.splitlines():
      try:
        r = json.loads(raw)
      except json.JSONDecodeError:
        continue
      if r.get("role") == "syncer" and "eval/loss" in r and "learner" not in r \
          and r["step"] < self.last_step:
        lines.append(f"t={r.get('time', 0.0):.1f}s step {r['step']}: global eval/loss "
                     f"{r['eval/loss']:.4f} after {r.get('outer/rounds', 0):.0f} rounds")
    return lines


def last_per_step(records: list[dict], key: str) -> tuple[list[int], list[float]]:
  """Sorted (steps, values) of `key`, keeping the latest record of a step (resumed runs)."""
  by_step = {r["step"]: r[key] for r in records if key in r}
  steps = sorted(by_step)
  return steps, [by_step[s] for s in steps]


def plot_loss(records: list[dict], path: str, title: str = "") -> None:
  """Train and eval loss against step, written as a PNG."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(7, 4))
  learners = sorted({r["learner"] for r in records if "learner" in r})
  for learner in learners or [None]:
    mine = [r for r in records if r.get("learner") == learner]
    steps, values = last_per_step(mine, "train/loss")
    if steps:
      label = "train/loss" if learner is None else f"train/loss, learner {learner}"
      ax.plot(steps, values, "-", label=label, alpha=0.8 if learner is None else 0.5, lw=1)
  steps, values = last_per_step([r for r in records if "learner" not in r], "eval/loss")
  if steps:
    ax.plot(steps, values, "o-", label="eval/loss" + (" (global params)" if learners else ""),
            markersize=4, color="black")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats/token)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


class Progress:
  """Logs `step n/N | tokens/s | loss | ETA` at most every `every_s` seconds."""

  def __init__(self, total_steps: int, every_s: float, start_step: int = 0):
    self._total, self._every = total_steps, every_s
    self._t0 = self._last = time.monotonic()
    self._start = start_step
    self._tokens = 0.0

  def update(self, step: int, tokens: float, loss: float, force: bool = False) -> str | None:
    self._tokens += tokens
    now = time.monotonic()
    if not force and now - self._last < self._every:
      return None
    self._last = now
    elapsed = max(now - self._t0, 1e-9)
    rate = (step - self._start) / elapsed
    eta = (self._total - step) / rate if rate > 0 else math.inf
    line = (f"step {step}/{self._total} ({100 * step / self._total:.0f}%) | "
            f"{self._tokens / elapsed:,.0f} tok/s | loss {loss:.4f} | "
            f"ETA {_duration(eta) if math.isfinite(eta) else '?'}")
    logging.info("%s", line)
    print(line, flush=True)
    return line


def open_writer(log, workdir: str, *, role: str, learner: int | None = None,
                process: str | None = None, config: Mapping[str, Any] | None = None,
                purge_step: int | None = None) -> MetricWriter:
  """A MetricWriter with the trackers `log` (the `log` group) asks for (TensorBoard by
  default, wandb).

  `process` names this process's wandb run (default: the writer's name); `config`, the resolved
  run config as a dict, is logged as hyperparameters (one writer per run gives it).
  """
  name = role if learner is None else f"{role}_{learner}"
  trackers = tracking.open_trackers(log, workdir, name, role=process or name, config=config,
                                    purge_step=purge_step)
  return MetricWriter(workdir, role=role, learner=learner, trackers=trackers)
