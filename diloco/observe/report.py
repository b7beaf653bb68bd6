"""The end-of-run report, one for both runtimes (`diloco.runtime.decoupled` and the launcher).

A run ends the same way whichever runtime carried it: the accounting summary of its tape and
activity records, joined with the figures only the runtime knows (`RunFigures`), goes to
WORKDIR/accounting.json and to the syncer's TensorBoard run; loss.png and timeline.png are
drawn; the fidelity line and a short table (`table`) are printed. The table rounds a few
headline figures for a person; accounting.json keeps every figure unrounded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence

from diloco.observe import accounting, fidelity, timeline, tracking
from diloco.observe import metrics as metrics_lib

ACCOUNTING_FILE = "accounting.json"
EXPORT_DIR = "export"  # where the final global parameters go (diloco/artifacts/export.py)


@dataclasses.dataclass(frozen=True)
class RunFigures:
  """What a runtime knows at the end that its records do not say.

  `eval_loss` / `initial_loss` are None or NaN when the run did not evaluate
  (`train.eval_mode=off`); `eval_step` is the step of the final eval, where the summary goes
  in TensorBoard. `restarts` counts the restarts of the run's learners and, in a launched
  run, of its syncer and evaluator processes (`syncer_restarts` of them the syncer's).
  `chaos_events` counts the fault schedule's events (`launch.chaos` of a
  launched run, `learners.faults` of a single-controller one), `chaos_applied` those that
  found a target.
  """
  eval_loss: float | None
  initial_loss: float | None
  eval_step: int
  wall_s: float
  restarts: int
  syncer_restarts: int
  chaos_events: int
  chaos_applied: int

  def as_summary(self) -> dict[str, float | None]:
    return {"eval/loss": self.eval_loss, "eval/initial_loss": self.initial_loss,
            "wall_s": float(self.wall_s), "restarts": float(self.restarts),
            "syncer_restarts": float(self.syncer_restarts),
            "chaos/events": float(self.chaos_events), "chaos/applied": float(self.chaos_applied)}


# The run-level keys of accounting.json, beside the `accounting/*` ones: the same in every runtime.
RUN_KEYS = tuple(RunFigures(None, None, 0, 0.0, 0, 0, 0, 0).as_summary())


def finish(workdir: str, *, num_fragments: int, num_params: int, figures: RunFigures,
           tape: Sequence[Mapping], activity: Sequence[Mapping],
           writer: metrics_lib.MetricWriter, loss_title: str, timeline_title: str
           ) -> dict[str, float | None]:
  """Writes and prints the report of a finished run in `workdir`; returns its summary.

  `tape` and `activity` are the run's records (the same ones as WORKDIR/tape.jsonl and
  activity.jsonl, which the accounting reads); `writer` is the syncer's metric writer, still
  open: the summary goes to its trackers at `figures.eval_step`.
  """
  print(fidelity.fidelity_line(tape), flush=True)
  summary: dict[str, float | None] = dict(accounting.summary(
      workdir, num_fragments=num_fragments, num_params=num_params))
  summary.update(figures.as_summary())
  writer.track(figures.eval_step, {k: v for k, v in summary.items()
                                   if not k.startswith("eval/")})
  with open(os.path.join(workdir, ACCOUNTING_FILE), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  records = metrics_lib.read_metrics(os.path.join(workdir, metrics_lib.METRICS_FILE))
  metrics_lib.plot_loss(records, os.path.join(workdir, "loss.png"), title=loss_title)
  timeline.plot_timeline(tape, activity, os.path.join(workdir, "timeline.png"),
                         title=timeline_title)
  print(table(summary, workdir, figures.eval_step), flush=True)
  return summary


def _loss(value: float | None) -> str:
  return "off" if value is None or not math.isfinite(value) else f"{value:.4f}"


def _shard_rows(summary: Mapping[str, float | None]) -> list[tuple[str, str]]:
  """A sharded syncer's row (docs/design.md 3.1): rounds and learners/round per shard."""
  shards = int(summary.get("accounting/shards") or 0)
  if shards < 2:
    return []
  a = lambda s, key: summary.get(f"accounting/shard{s}/{key}") or 0.0  # noqa: E731
  return [("syncer shards", ", ".join(
      f"s{s} {a(s, 'rounds'):.0f} rounds {a(s, 'mean_learners_per_round'):.2f} learners/round"
      for s in range(shards)))]


def table(summary: Mapping[str, float | None], workdir: str, eval_step: int) -> str:
  """A few headline figures of `summary` (an accounting.json), rounded, and where the run's
  outputs are."""
  a = lambda key: summary.get("accounting/" + key) or 0.0  # noqa: E731
  rows = [
      ("eval loss", f"{_loss(summary.get('eval/loss'))} at step {eval_step} "
                    f"(initial {_loss(summary.get('eval/initial_loss'))})"),
      ("tokens/s", f"{a('merged_tokens_per_s'):,.0f} merged ({a('merged_tokens'):,.0f} tokens "
                   f"in {a('horizon_s'):,.1f} s of run clock; {summary.get('wall_s', 0.0):,.1f} "
                   "s wall)"),
      ("goodput", f"{a('goodput'):.2f} (uptime {a('uptime'):.2f})"),
      ("learners/round", f"{a('mean_learners_per_round'):.2f} of "
                         f"{a('mean_alive_per_round'):.2f} alive, {a('rounds'):.0f} rounds, "
                         f"{a('rejected'):.0f} deliveries rejected"),
      ("staleness", f"mean {a('staleness_mean'):.2f}, max {a('staleness_max'):.0f}"),
      *_shard_rows(summary),
      ("restarts", f"{summary.get('restarts', 0):.0f} ({summary.get('syncer_restarts', 0):.0f} "
                   f"of them the syncer's); faults {summary.get('chaos/applied', 0):.0f} of "
                   f"{summary.get('chaos/events', 0):.0f} applied"),
      ("plots", f"{os.path.join(workdir, 'loss.png')}, {os.path.join(workdir, 'timeline.png')}"),
      *_output_rows(workdir),
  ]
  return _format(f"run summary (every figure, unrounded: "
                 f"{os.path.join(workdir, ACCOUNTING_FILE)})", rows)


def data_parallel_table(workdir: str, *, eval_loss: float | None,
                        initial_loss: float | None, eval_step: int, tokens: int,
                        train_s: float) -> str:
  """The data-parallel run's end (`diloco.runtime.data_parallel`): the same first row as
  `table`, its throughput, and where its outputs are. It has no syncer, so no accounting."""
  perplexity = ("" if eval_loss is None or not math.isfinite(eval_loss)
                else f", perplexity {math.exp(min(eval_loss, 50.0)):.2f}")
  rows = [
      ("eval loss", f"{_loss(eval_loss)} at step {eval_step} (initial {_loss(initial_loss)})"
                    f"{perplexity}"),
      ("tokens/s", f"{tokens / max(train_s, 1e-9):,.0f} ({tokens:,} tokens in {train_s:,.1f} s, "
                   "compilation included)"),
      ("plots", os.path.join(workdir, "loss.png")),
      *_output_rows(workdir),
  ]
  return _format(f"run summary (every step's figures: "
                 f"{os.path.join(workdir, metrics_lib.METRICS_FILE)})", rows)


def _output_rows(workdir: str) -> list[tuple[str, str]]:
  """Where a run's TensorBoard logs and exported parameters are, if it wrote them."""
  tb = os.path.join(workdir, tracking.TENSORBOARD_DIR)
  export_dir = os.path.join(workdir, EXPORT_DIR)
  return [("tensorboard", f"tensorboard --logdir {tb}" if os.path.isdir(tb) else "off"),
          ("export", export_dir if os.path.isdir(export_dir) else "none")]


def _format(title: str, rows: Sequence[tuple[str, str]]) -> str:
  width = max(len(name) for name, _ in rows)
  return "\n".join([title] + [f"  {name:<{width}}  {value}" for name, value in rows])
