"""A finished run's global evaluations read back from its own files, and their plot.

`eval_curve` is what `diloco compare` and the experiments' reports draw: each evaluation's
step, tokens (all learners together) and loss on three clocks: `time` (the runtime's own run
clock, virtual seconds on the virtual clock), `wall` (real seconds since the run's first
record: a data-parallel run's first step compiles on it) and `train_s` (real seconds since the
run's first training step ended, so compilation and start-up are left out alike for every
runtime; None where the run's metrics hold no training step, e.g. a multi-process run whose
learners log elsewhere).
"""

from __future__ import annotations

import os

import matplotlib

from diloco import documents
from diloco.observe.accounting import read_jsonl

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_SHAPE = {"train": {"batch_size": int, "init_from": documents.Field(str, required=False)},
          "data": {"seq_len": int}, "learners": {"count": int}}


def run_shape(path: str) -> dict[str, dict]:
  """The fields of a run's config.json that its token counts need, typed (DocumentError naming
  the file and the field otherwise)."""
  doc = documents.obj(documents.read(path), path)
  return {group: documents.fields(documents.obj(doc.get(group), path, group), spec, path,
                                  f"{group}.")
          for group, spec in _SHAPE.items()}


_RECORD = {"t": float, "step": int, "eval/loss": documents.Field(float, finite=False),
           "role": documents.Field((str, type(None)), required=False),
           "time": documents.Field(float, required=False)}
_STEP = {"end": float, "tokens": documents.Field(int, required=False)}


def init_tokens(cfg: dict, base: str = "") -> int:
  """Tokens already trained by the checkpoint a run starts from (`train.init_from` naming a
  run's `checkpoints/STEP`, relative to `base`, default the current directory), so that a warm
  start counts them; 0 otherwise."""
  source = os.path.normpath(os.path.join(base or os.getcwd(), cfg["train"].get("init_from")
                                         or "."))
  head, step = os.path.split(source)
  run_dir, kind = os.path.split(head)
  config_path = os.path.join(run_dir, "config.json")
  if kind != "checkpoints" or not step.isdigit() or not os.path.exists(config_path):
    return 0
  source_cfg = run_shape(config_path)
  return int(step) * source_cfg["train"]["batch_size"] * source_cfg["data"]["seq_len"] * max(
      source_cfg["learners"]["count"], 1)


def _first_train_t(records: list[dict]) -> float | None:
  """Wall time of the run's first training-step record (its step had ended by then)."""
  times = [r["t"] for r in records if any(k.startswith("train/") for k in r)]
  return min(times) if times else None


def eval_curve(workdir: str, base: str = "") -> list[dict]:
  """(step, tokens, time, wall, train_s, eval_loss) of every global evaluation, in order.

  Tokens count all learners together: the steps that ended by then in `activity.jsonl` (so
  learners added or removed midway count), or, for a data-parallel run, which has none, the
  step times the tokens per step; plus those of the checkpoint it started from (`init_tokens`,
  `base` resolving a relative `train.init_from`)."""
  cfg = run_shape(os.path.join(workdir, "config.json"))
  per_step = cfg["train"]["batch_size"] * cfg["data"]["seq_len"] * max(
      cfg["learners"]["count"], 1)
  activity = os.path.join(workdir, "activity.jsonl")
  steps = sorted((s["end"], s.get("tokens", 0)) for s in (
      documents.fields(r, _STEP, activity, "step record: ")
      for r in read_jsonl(activity) if r.get("kind") == "step"))
  metrics_file = os.path.join(workdir, "metrics.jsonl")
  records = read_jsonl(metrics_file)
  for r in records:  # the fields read below, typed, on the records that have them
    documents.fields(r, {"t": float}, metrics_file, "record: ")
    if "eval/loss" in r:
      r.update(documents.fields(r, _RECORD, metrics_file, "eval record: "))
  t0 = records[0]["t"] if records else 0.0
  trained_from = _first_train_t(records)
  start = init_tokens(cfg, base)
  points = []
  for r in records:
    if "eval/loss" in r and r.get("role") in ("syncer", "dp", "train", None):
      time = r.get("time", r["t"] - t0)
      tokens = start + (sum(n for end, n in steps if end <= time + 1e-9) if steps
                        else r["step"] * per_step)
      train_s = None if trained_from is None else max(r["t"] - trained_from, 0.0)
      points.append({"step": r["step"], "tokens": tokens, "time": time, "wall": r["t"] - t0,
                     "train_s": train_s, "eval_loss": r["eval/loss"]})
  return points


def line_style(i: int) -> dict[str, str]:
  """The `i`-th line's colour and dash: 40 distinct ones, then they repeat."""
  return {"color": f"C{i % 10}", "linestyle": ("-", "--", ":", "-.")[i // 10 % 4]}


def plot_curves(curves: dict[str, list[dict]], path: str, title: str, *,
                time_key: str = "wall", time_label: str = "wall clock since the run's start (s)"
                ) -> None:
  """Eval loss against tokens (left) and against `time_key` (right), one line per run.

  Past matplotlib's 10 colours the line style changes too, so that an experiment's dozens of
  runs stay apart; the legend goes below both panels, and the figure grows to hold it."""
  drawn = [(label, points) for label, points in sorted(curves.items()) if points]
  columns = 1 if len(drawn) <= 4 else 3
  legend_rows = -(-len(drawn) // columns)
  fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(11, 4 + 0.2 * legend_rows),
                                           layout="constrained")
  for i, (label, points) in enumerate(drawn):
    style = dict(line_style(i), marker="o", ms=3)
    by_tokens.plot([p["tokens"] for p in points], [p["eval_loss"] for p in points],
                   label=label, **style)
    by_time.plot([p[time_key] for p in points], [p["eval_loss"] for p in points], **style)
  by_tokens.set_xlabel("tokens (all learners)")
  by_time.set_xlabel(time_label)
  for ax in (by_tokens, by_time):
    ax.set_ylabel("global eval loss")
    ax.grid(alpha=0.3)
  if drawn:
    fig.legend(loc="outside lower center", ncol=columns, fontsize=7)
  fig.suptitle(title)
  fig.savefig(path, dpi=120)
  plt.close(fig)
