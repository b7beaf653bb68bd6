"""The rows of the scaling report, read from whatever runs an output directory holds.

Nothing here needs the runner's list of runs: each run directory is described from its own
`config.json` (model, method, M, batch, receipt, outer setting, seed), `metrics.jsonl` and
`accounting.json` (through `harness.collect`) and `provenance.json` (the machine that ran it),
so runs made on another machine and copied into the directory are reported like local ones.
Rows of an earlier results.json whose runs are no longer there are carried forward
(`merged`), marked with the commit and date of the report they come from.
"""

from __future__ import annotations

import json
import os
import subprocess

from experiments import harness
from experiments.scaling import config, pool

# Each row keeps its run's evaluations, so that its curve is drawn again once the run
# directory is gone (a row carried from an earlier results.json, see `carried`).
CURVE_KEYS = ("step", "tokens", "time", "eval_loss")


def receipt_of(cfg: dict) -> str:
  """The receipt mode of a run's config.json: its `receipt` group's, or in a config of before
  that group its sync group's `receipt` (and, before that field, mix when `mixing_alpha` > 0)."""
  if "receipt" in cfg:
    return cfg["receipt"]["mode"]
  sync = cfg["sync"]
  if "receipt" in sync:
    return sync["receipt"]
  return "mix" if sync.get("mixing_alpha", 0.0) > 0 else "overwrite"


def describe(cfg: dict) -> dict:
  """The labels of a run from its config.json: model (with its inner optimizer unless AdamW:
  `config.model_label`), kind, M, batch, setting, and a DiLoCo kind's H ("period"; its
  setting ends in " H=<H>" when H is not the study's)."""
  count, sync, outer = cfg["learners"]["count"], cfg["sync"], cfg["outer"]
  labels = {"model": cfg["model"].get("name") or "custom", "M": max(count, 1),
            "batch": cfg["train"]["batch_size"], "steps": cfg["train"]["steps"],
            "seed": cfg.get("seed", 0)}
  optim = cfg.get("optim", {})
  inner = optim.get("learning_rate")
  preset_inner = config.PRESET_INNER_LR.get(labels["model"])
  own_inner = ""
  if inner is not None and preset_inner is not None and abs(inner - preset_inner) > 1e-12:
    own_inner = config.inner_label(inner)
  # Another inner optimizer is a group of its own ("tiny+muon"); Muon's rate joins the setting.
  optimizer = optim.get("name", "adamw")
  labels["model"] = config.model_label(labels["model"], optimizer)
  muon = optim.get("muon_learning_rate", config.MUON_LR)
  if optimizer == "muon" and abs(muon - config.MUON_LR) > 1e-12:
    own_inner += config.muon_label(muon)
  if count == 0:
    return dict(labels, kind="data-parallel", setting=own_inner.strip())
  period = sync.get("period", config.PERIOD)
  labels["period"] = period
  restart = outer.get("momentum_restart", 0)
  setting = (config.outer_label(outer["learning_rate"], outer["momentum"]) + own_inner
             + (config.restart_label(restart) if restart else "") + config.period_label(period))
  if sync["quorum"] == 0 and sync["num_fragments"] == 1:
    return dict(labels, kind="diloco", setting=setting)
  return dict(labels, kind="decoupled", setting=f"{receipt_of(cfg)} {setting}")


def _read(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def run_dirs(outdir: str) -> list[str]:
  """Finished run directories directly under `outdir`, sorted by name."""
  if not os.path.isdir(outdir):
    return []
  return [os.path.join(outdir, d) for d in sorted(os.listdir(outdir))
          if os.path.exists(os.path.join(outdir, d, "config.json"))
          and harness.finished(os.path.join(outdir, d))]


def collect(outdir: str) -> list[dict]:
  """One row per finished run under `outdir` (see the module docstring)."""
  rows = []
  for workdir in run_dirs(outdir):
    labels = describe(_read(os.path.join(workdir, "config.json")))
    run = harness.Run(method=labels["kind"], config="", seed=labels["seed"])
    row = harness.collect(run, workdir)
    where = _read(os.path.join(workdir, pool.PROVENANCE_FILE))
    row.update(labels, run=os.path.basename(workdir),
               machine=where.get("label") or where.get("machine", "unrecorded"),
               device=(pool.with_count(where["device"], where["devices"])
                       if "device" in where and "devices" in where
                       else where.get("device", "unrecorded")),
               process_wall_s=where.get("wall_s", ""),
               eval_curve=[{k: p[k] for k in CURVE_KEYS}
                           for p in harness.eval_curve(workdir)])
    rows.append(row)
  return with_methods(rows)




def results_date(path: str, results: dict) -> str:
  """The day `results` (read from `path`) was written: its own "date", else the day of the
  last commit that changed the file, else "unknown"."""
  if results.get("date"):
    return results["date"]
  try:
    out = subprocess.check_output(["git", "log", "-1", "--format=%cs", "--", path],
                                  cwd=os.path.dirname(os.path.abspath(path)), text=True,
                                  stderr=subprocess.DEVNULL).strip()
  except (OSError, subprocess.CalledProcessError):
    out = ""
  return out or "unknown"


def carried(results_path: str, present: set[str]) -> list[dict]:
  """The rows of an earlier results.json whose run is not in `present` (the runs of
  `--outdir`): results the runner wrote from runs that are no longer on this machine. Each
  keeps its provenance (machine, device, wall times) and gains the commit and date of the
  report it is carried from (kept from its first carrying when carried again)."""
  if not os.path.exists(results_path):
    return []
  with open(results_path, encoding="utf-8") as f:
    results = json.load(f)
  date = results_date(results_path, results)
  out = []
  for row in results.get("rows", []):
    if row.get("run") in present:
      continue
    row = dict(row)
    row.setdefault("carried_commit", results.get("commit", "unknown"))
    row.setdefault("carried_date", date)
    out.append(row)
  return out


def merged(outdir: str, results_path: str) -> list[dict]:
  """The finished runs of `outdir` plus the rows of `results_path` for runs not there: a run
  present locally wins over its earlier row."""
  local = collect(outdir)
  return with_methods(local + carried(results_path, {r["run"] for r in local}))


def full_batches(rows: list[dict]) -> dict[tuple[str, int], int]:
  """(model, steps) -> the group's largest data-parallel batch (the reference's)."""
  full: dict[tuple[str, int], int] = {}
  for r in rows:
    if r["kind"] == "data-parallel":
      key = (r["model"], r["steps"])
      full[key] = max(full.get(key, 0), r["batch"])
  return full


def batch_settings(rows: list[dict]) -> dict[tuple[str, int, int], str]:
  """(model, steps, batch) -> the inner-rate setting ("" for the preset's, or "inner LR") of
  data-parallel at that batch: the setting of lowest seed-0 eval loss (data-parallel is tuned
  at every batch like every other method; a setting without a seed-0 run ranks after those
  with one, by its lowest loss; a tie goes to the preset's rate)."""
  best: dict[tuple[str, int, int], tuple[tuple[int, float], str]] = {}
  for r in rows:
    if r["kind"] != "data-parallel":
      continue
    key = (r["model"], r["steps"], r["batch"])
    rank = (0 if r["seed"] == 0 else 1, r["eval_loss"])
    setting = r.get("setting", "")
    if key not in best or rank < best[key][0] or (rank == best[key][0] and not setting):
      best[key] = (rank, setting)
  return {key: setting for key, (_, setting) in best.items()}


def reference_settings(rows: list[dict]) -> dict[tuple[str, int], str]:
  """(model, steps) -> the `batch_settings` setting of the group's largest data-parallel
  batch: the reference's inner rate."""
  tuned = batch_settings(rows)
  return {key: tuned[key + (batch,)] for key, batch in full_batches(rows).items()}


def with_methods(rows: list[dict]) -> list[dict]:
  """Names each row's method; data-parallel at a (model, steps) group's largest batch is
  "data-parallel" (the reference), at a smaller one "data-parallel B=<batch>", each at its
  batch's tuned inner rate (`batch_settings`); at another rate the name ends in
  "inner <LR>" (the preset's rate, when another one is tuned, reads "inner <preset LR>")."""
  full = full_batches(rows)
  tuned = batch_settings(rows)
  for r in rows:
    if r["kind"] == "data-parallel":
      key, setting = (r["model"], r["steps"]), r.get("setting", "")
      r["method"] = "data-parallel" if r["batch"] == full[key] else f"data-parallel B={r['batch']}"
      if setting != tuned[key + (r["batch"],)]:  # not the inner rate its batch is tuned to
        rate = setting or config.inner_label(config.preset_inner_lr(r["model"]) or 0.0).strip()
        r["method"] += f" {rate}"
    else:
      r["method"] = f"{r['kind']} M={r['M']} {r['setting']}"
  return rows


def at_period(row: dict) -> bool:
  """Whether a row trains at the study's H (data-parallel, and rows written before the
  period sweep, have no "period": they do)."""
  return row.get("period", config.PERIOD) == config.PERIOD


def groups(rows: list[dict]) -> dict[tuple[str, int], list[dict]]:
  """Rows at the study's H by (model, steps): one token budget of one model per report
  section, its picks and its stages (runs at another H: `period_groups`)."""
  out: dict[tuple[str, int], list[dict]] = {}
  for r in rows:
    if at_period(r):
      out.setdefault((r["model"], r["steps"]), []).append(r)
  return out


def period_groups(rows: list[dict]) -> dict[tuple[str, int], list[dict]]:
  """The rows at another H than the study's, by (model, steps): never among `groups`."""
  out: dict[tuple[str, int], list[dict]] = {}
  for r in rows:
    if not at_period(r):
      out.setdefault((r["model"], r["steps"]), []).append(r)
  return out


def global_batch(group: list[dict]) -> int:
  """The global batch of a group: M x each learner's batch (the largest over its rows;
  data-parallel at one learner's batch trains fewer tokens)."""
  return max(r["batch"] * r["M"] for r in group)


def stats(rows: list[dict]) -> dict[str, dict]:
  """Per method: mean eval loss over seeds, spread (max - min), seeds, each seed's loss,
  mean goodput."""
  by: dict[str, list[dict]] = {}
  for r in rows:
    by.setdefault(r["method"], []).append(r)
  out = {}
  for method, group in by.items():
    losses = [r["eval_loss"] for r in group]
    goodputs = [r["goodput"] for r in group if "goodput" in r]
    out[method] = {"method": method, "kind": group[0]["kind"], "M": group[0]["M"],
                   "mean": sum(losses) / len(losses), "spread": max(losses) - min(losses),
                   "seeds": sorted(r["seed"] for r in group),
                   "by_seed": {r["seed"]: r["eval_loss"] for r in group},
                   "goodput": sum(goodputs) / len(goodputs) if goodputs else None}
  return out


def picks(rows: list[dict]) -> dict[tuple[str, int], str]:
  """(kind, M) -> the setting of lowest seed-0 eval loss among that kind's runs at that M
  (one group's rows): what the study's per-M outer sweep picks."""
  best: dict[tuple[str, int], dict] = {}
  for r in rows:
    if r["kind"] == "data-parallel" or r["seed"] != 0:
      continue
    key = (r["kind"], r["M"])
    if key not in best or r["eval_loss"] < best[key]["eval_loss"]:
      best[key] = r
  return {key: r["setting"] for key, r in sorted(best.items())}
