"""The run's lifecycle in the store: its start (the clock origin), readiness and its end.

Layout under the run's root (shared by every syncer shard):

  run.json                          the run's start time (the clock origin of all records)
  ready/l{m}.json                   learner m of the first cohort is compiled and ready
  end.json                          a hook ended the run early: every learner retires
  stop.json                         the launcher's end of the run: every syncer settles
"""

from __future__ import annotations

import time

from diloco.distributed.store.blob_io import Blobs
from diloco.distributed.store.names import LEARNER_RECORD, learner_record


class RunLifecycle:
  """The records that start and end the run, shared by every process."""

  def __init__(self, blobs: Blobs):
    self.blobs = blobs

  def start(self, create: bool = False) -> float | None:
    """Wall time at which the run started: the clock origin of every process's records."""
    record = self.blobs.read_json("run.json")
    if record is None and create:
      record = {"start": time.time()}
      self.blobs.write_json("run.json", record, durable=True)
    return None if record is None else float(record["start"])

  def mark_ready(self, learner: int) -> None:
    """Learner `learner` of the first cohort is compiled and holds the initial fragments."""
    self.blobs.write_json(f"ready/{learner_record(learner)}", {"time": time.time()})

  def ready_learners(self) -> set[int]:
    return {int(m[1]) for path in self.blobs.listdir("ready")
            if (m := LEARNER_RECORD.fullmatch(path.name)) is not None}

  def request_end(self, record: dict) -> None:
    """A hook's stop (`record`: who and why): every learner retires on purpose, with its final
    deliveries, and the syncer settles once they have all left, as at the run's last step.
    The first request is kept (the record is for people: nothing reads it back)."""
    if not self.end_requested():
      self.blobs.write_json("end.json", record)

  def end_requested(self) -> bool:
    return self.blobs.exists("end.json")

  def request_stop(self, record: dict) -> None:
    """The launcher's `stop.json`: every syncer shard settles and stops."""
    self.blobs.write_json("stop.json", record)

  def stop_requested(self) -> bool:
    return self.blobs.exists("stop.json")

