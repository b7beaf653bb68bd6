"""Scoring a run on lm-evaluation-harness tasks: `diloco evaluate --workdir=RUN --tasks=a,b`.

Looks the tasks up (lm_eval's own and `--include_path`'s), runs them through lm_eval's
`simple_evaluate` on the run's model (`diloco.artifacts.harness_model`), writes the harness's
results JSON to RUN/benchmarks/results.json (a later evaluation of other tasks adds them
beside the earlier ones) and prints one line per task. `diloco compare`
reads that file (`metric_columns`) for a column per task metric. lm_eval is imported only
here, when tasks are asked for, so the rest of the CLI works without it (and `diloco
compare`, which reads the results file only, imports no model code).
"""

from __future__ import annotations

import contextlib
import json
import os
import traceback
from typing import TYPE_CHECKING

from diloco import documents
from diloco.errors import ConfigError

if TYPE_CHECKING:
  from diloco.artifacts import trained

RESULTS_FILE = os.path.join("benchmarks", "results.json")
_INSTALL = "pip install -e '.[lm-eval]'"


def _lm_eval():
  try:
    import lm_eval  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ConfigError(f"--tasks: scoring tasks needs lm-evaluation-harness; {_INSTALL}") from None
  return lm_eval


# Where lm_eval loads the tasks named on its command line (`TaskManager.load`, its YAML, its
# datasets): an error with this frame on its stack is about a task's config or data.
_TASK_LOADER = ("lm_eval/tasks/manager.py", "load")


@contextlib.contextmanager
def task_config_errors():
  """Turns an error lm_eval raises while it loads the tasks (a bad `output_type`, a missing
  data file, a YAML that does not parse) into one ConfigError line naming --tasks; any other
  error, the model's among them, keeps its traceback."""
  try:
    yield
  except (ValueError, TypeError, KeyError, OSError, ImportError) as e:
    frames = traceback.extract_tb(e.__traceback__)
    if not any(f.filename.replace(os.sep, "/").endswith(_TASK_LOADER[0])
               and f.name == _TASK_LOADER[1] for f in frames):
      raise
    first = (str(e).strip().splitlines() or [""])[0]
    raise ConfigError(f"--tasks: lm_eval cannot load a task's config or data: "
                      f"{type(e).__name__}: {first} (see the task's YAML and "
                      "--include_path)") from None


def task_names(spec: str) -> list[str]:
  """The comma-separated `--tasks` names, in order, without repeats."""
  names = list(dict.fromkeys(t.strip() for t in spec.split(",") if t.strip()))
  if not names:
    raise ConfigError("--tasks: give task names, e.g. --tasks=hellaswag,arc_easy")
  return names


def task_manager(names: list[str], include_path: str | None):
  """An lm_eval TaskManager that knows every name; ConfigError naming the first unknown one.
  When `include_path` holds them all, lm_eval's own index (some 15,000 tasks, seconds to
  build) is not read."""
  _lm_eval()
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel
  if include_path is not None and not os.path.isdir(include_path):
    raise ConfigError(f"--include_path: {include_path!r} is not a directory")
  if include_path is not None:
    local = TaskManager(include_path=include_path, include_defaults=False)
    if all(local.match_tasks([n]) for n in names):
      return local
  manager = TaskManager(include_path=include_path)
  for name in names:
    if not manager.match_tasks([name]):
      where = "lm_eval's tasks" + (f" and --include_path={include_path}" if include_path
                                   else " (--include_path=DIR adds a folder of task YAMLs)")
      raise ConfigError(f"--tasks: unknown task {name!r}; looked up in {where}; "
                        "`lm_eval ls tasks` lists them")
  return manager


def run_dir(workdir: str) -> str:
  """The run folder of `workdir`: itself, or the run around an export folder named directly."""
  from diloco.artifacts import export  # pylint: disable=import-outside-toplevel
  workdir = os.path.abspath(workdir)
  parent = os.path.dirname(workdir)
  if (export.export_dir(workdir) == workdir
      and os.path.isfile(os.path.join(parent, "config.json"))):
    return parent
  return workdir


def evaluate(model: trained.Trained, workdir: str, *, tasks: str, include_path: str | None,
             num_fewshot: int | None, limit: float | None, batch_size: int,
             max_length: int | None) -> tuple[dict, str]:
  """Runs the tasks; returns the harness's results (no samples) and where they were written."""
  names = task_names(tasks)
  path = os.path.join(run_dir(workdir), RESULTS_FILE)
  earlier = read_results(path)  # a damaged file stops here, before the tasks run
  manager = task_manager(names, include_path)
  from lm_eval import evaluator, utils  # pylint: disable=import-outside-toplevel

  from diloco.artifacts import harness_model  # pylint: disable=import-outside-toplevel
  lm = harness_model.DilocoLM(model, batch_size=batch_size, max_length=max_length)
  resolved = list(dict.fromkeys(m for n in names for m in manager.match_tasks([n])))
  with task_config_errors():
    results = evaluator.simple_evaluate(model=lm, tasks=resolved, num_fewshot=num_fewshot,
                                        limit=limit, task_manager=manager, log_samples=False)
  results.pop("samples", None)
  results["config"]["model"] = "diloco"
  results["config"]["model_args"] = f"workdir={workdir}"
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(merged(earlier, results), f, indent=2, default=utils.handle_non_serializable)
  os.replace(path + ".tmp", path)
  return results, path


# The sections of a results JSON that are keyed by task: a later evaluation of other tasks adds
# its own entries beside the earlier ones (and replaces those of a task it scores again).
_PER_TASK = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot",
             "higher_is_better", "n-samples")


def read_results(path: str) -> dict:
  """The results JSON at `path` ({} when there is none); ConfigError naming it if unreadable."""
  if not os.path.exists(path):
    return {}
  results = documents.read(path)
  if not isinstance(results, dict) or not all(
      isinstance(results.get(k, {}), dict) for k in _PER_TASK):
    raise ConfigError(f"{path}: not a results JSON (expected an object of per-task sections); "
                      "move it aside to keep it")
  for key in ("results", "higher_is_better", "n-samples"):  # each task's entry is read
    for task, entry in (results.get(key) or {}).items():
      documents.obj(entry, path, f"{key}.{task}")
  return results


def merged(earlier: dict, latest: dict) -> dict:
  """`latest` with the per-task entries of `earlier` for the tasks it did not score."""
  out = dict(latest)
  for key in _PER_TASK:
    if key in earlier or key in latest:
      out[key] = {**earlier.get(key, {}), **latest.get(key, {})}
  return out


def metrics(results: dict) -> dict[str, dict[str, float]]:
  """{task: {metric: value}} of a results JSON: numbers only, no stderr; a metric under a
  filter other than lm_eval's "none" keeps the filter's name in parentheses."""
  out = {}
  for task, values in (results.get("results") or {}).items():
    # The task's metrics are those it says which way is better (not sample_len, stderrs).
    named = set((results.get("higher_is_better") or {}).get(task) or ())
    row = {}
    for key, value in values.items():
      if not isinstance(value, (int, float)) or isinstance(value, bool):
        continue
      metric, _, filt = key.partition(",")
      if metric.endswith("_stderr") or metric in ("samples", "sample_len") or (
          named and metric not in named):
        continue
      row[metric if filt in ("", "none") else f"{metric} ({filt})"] = float(value)
    if row:
      out[task] = row
  return out


def lines(results: dict) -> list[str]:
  """One line per task: its metrics and how many examples were scored."""
  counts = results.get("n-samples") or {}
  out = []
  for task, row in metrics(results).items():
    shown = ", ".join(f"{m} {v:.4f}" if abs(v) < 1e4 else f"{m} {v:.4g}" for m, v in row.items())
    n = (counts.get(task) or {}).get("effective")
    out.append(f"{task}: {shown}" + (f" ({n} examples)" if n is not None else ""))
  return out


def metric_columns(workdir: str) -> dict[str, float]:
  """{"TASK METRIC": value} of WORKDIR/benchmarks/results.json; {} when there is none."""
  path = os.path.join(workdir, RESULTS_FILE)
  if not os.path.isfile(path):
    return {}
  results = read_results(path)
  return {f"{task} {metric}": value for task, row in metrics(results).items()
          for metric, value in row.items()}
