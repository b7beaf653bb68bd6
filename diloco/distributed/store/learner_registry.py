"""The learner registry: heartbeats, incarnation numbers and learner folders, at the root.

Layout under the run's root (shared by every syncer shard, names from `names`):

  heartbeats/l{m}.json              the latest heartbeat of learner m (its status: `UP`,
                                    `RETIRED` or `DONE`)
  incarnations/l{m}.json            the last incarnation number handed out to learner m
  learners/l{m}/                    learner m's own checkpoints (Orbax CheckpointManager)

Heartbeats are rewritten within seconds and not synced; an incarnation number is synced
before it is handed out, so no number is ever given twice.
"""

from __future__ import annotations

from etils import epath

from diloco.distributed.store.blob_io import Blobs
from diloco.distributed.store.entry_check import StoreError
from diloco.distributed.store.names import LEARNER_RECORD, checked_int, learner_record
from diloco.sync import intake

# A learner incarnation's status in its heartbeat: running, gone for good, or finished.
UP, RETIRED, DONE = "up", "retired", "done"


class LearnerRegistry:
  """Per-learner records of the run: what the syncers read to know who is alive."""

  def __init__(self, blobs: Blobs):
    self.blobs = blobs

  def put_heartbeat(self, learner: int, record: dict) -> None:
    self.blobs.write_json(f"heartbeats/{learner_record(learner)}", record)

  def heartbeats(self) -> dict[int, dict]:
    """The latest heartbeat record of every learner that has one (unreadable ones skipped)."""
    out = {}
    for path in self.blobs.listdir("heartbeats"):
      m = LEARNER_RECORD.fullmatch(path.name)
      if m is None:
        continue
      try:
        record = self.blobs.read_json(f"heartbeats/{path.name}")
      except StoreError:
        continue
      if isinstance(record, dict):
        out[int(m[1])] = record
    return out

  def next_incarnation(self, learner: int) -> int:
    """A fresh incarnation number for a starting learner process (one writer per id)."""
    rel = f"incarnations/{learner_record(learner)}"
    last = self.blobs.read_json(rel)
    incarnation = 0 if last is None else int(last["incarnation"]) + 1
    self.blobs.write_json(rel, {"incarnation": incarnation}, durable=True)  # never twice
    return incarnation

  def learner_dir(self, learner: int) -> epath.Path:
    """Learner m's checkpoint folder."""
    return self.blobs.root / "learners" / f"l{checked_int(learner, 'learner')}"


def beat_fields(record: dict) -> tuple | None:
  """((incarnation, seq), state, local_step, step_time, sent_at) of a heartbeat record, typed:
  None if an id is not a counter or the state is unknown. A step time or send time that is
  not a number is passed on as NaN (the syncer ignores unusable measurements)."""
  ids = [record.get(k) for k in ("incarnation", "seq", "local_step")]
  state = record.get("state", UP)
  if not all(intake.is_count(x, 0) for x in ids) or state not in (UP, RETIRED, DONE):
    return None
  step_time = intake.as_float(record.get("step_time"))
  sent_at = intake.as_float(record.get("sent_at", 0.0))
  return ((int(ids[0]), int(ids[1])), state, int(ids[2]),
          float("nan") if step_time is None else step_time,
          0.0 if sent_at is None or sent_at != sent_at else sent_at)
