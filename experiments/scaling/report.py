"""Tables, targets and plots of the scaling experiment, from the rows of `rows.collect`.

Each (model, steps) group gets a section: the Table-4-shaped comparison (eval loss and gap
to data-parallel per M, the study's 35M row beside it), the targets marked met or missed
from the numbers, the outer sweep per M, goodput per run, and plots of the gap against M
and of eval loss against tokens. A last table puts the Decoupled M = 4 gap of every model
size side by side (the trend with N), and `size_table` every method's gap per M at each size
trained at 20N (at the global batch DP_BATCH), with its power law in N fitted over the sizes,
beside the study's. The batch and period
sweeps' tables: `report_batch`.
"""

from __future__ import annotations

import collections

import numpy as np

from experiments import harness
from experiments.scaling import config, stages
from experiments.scaling import rows as rows_lib

KIND_NAMES = {"diloco": "synchronous DiLoCo", "decoupled": "Decoupled DiLoCo"}
ROW_NAMES = {"diloco": "synchronous DiLoCo (ours)", "decoupled": "Decoupled DiLoCo (ours)",
             "data-parallel": ("data-parallel at one learner's batch (ours; 1/M of the tokens, at "
                               "that batch's tuned inner rate)")}


def gap(loss: float, reference: float) -> float:
  """Percent above the reference (the study's "gap to data-parallel")."""
  return 100.0 * (loss / reference - 1.0)


def other_rate(method: str) -> bool:
  """Whether a data-parallel method names a rate its batch is not tuned to (a row of its own:
  `rows.with_methods`)."""
  return " inner " in f" {method}" or " muon " in f" {method}"


def picked_stats(group: list[dict]) -> dict[tuple[str, int], dict]:
  """(kind, M) -> seed statistics of the picked setting; ("data-parallel", M) for the
  data-parallel runs at one learner's batch, ("data-parallel", 0) for the reference."""
  stats = rows_lib.stats(group)
  out = {(kind, m): stats[f"{kind} M={m} {s}"]
         for (kind, m), s in rows_lib.picks(group).items() if f"{kind} M={m} {s}" in stats}
  for s in stats.values():
    # The reference ("data-parallel") and one learner's batch ("data-parallel B=<batch>"),
    # each at its batch's tuned inner rate; other inner rates have rows of their own.
    if s["kind"] == "data-parallel" and not other_rate(s["method"]):
      batch = next(r["batch"] for r in group if r["method"] == s["method"])
      full = max(r["batch"] for r in group if r["kind"] == "data-parallel")
      out[("data-parallel", 0 if batch == full else full // batch)] = s
  return out


def seed_cell(s: dict | None, reference: float | None) -> str:
  """"mean ±half-spread (n seeds, gap%)" of a `picked_stats` entry; "" for none."""
  if s is None:
    return ""
  seeds = len(s["seeds"])
  spread = f" ±{s['spread'] / 2:.3f}" if seeds > 1 else ""
  g = f", {gap(s['mean'], reference):+.2f}%" if reference else ""
  return f"{s['mean']:.4f}{spread} ({seeds} seed{'s' * (seeds > 1)}{g})"


def table4(group: list[dict]) -> str:
  """Eval loss (gap to data-parallel) per M, one row per method, the study's 35M row last."""
  ps = picked_stats(group)
  dp = ps.get(("data-parallel", 0))
  ref = dp["mean"] if dp else None
  ms = sorted({m for kind, m in ps if kind != "data-parallel"} | {8})
  header = ["method", "data-parallel"] + [f"M = {m}" for m in ms]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for kind in ("diloco", "decoupled", "data-parallel"):
    cells = [seed_cell(ps.get((kind, m)) if kind != "data-parallel" or m > 1 else None, ref)
             for m in ms]
    if any(cells):
      lines.append(f"| {ROW_NAMES[kind]} | {seed_cell(dp, None)} | " + " | ".join(cells) + " |")
  study = config.STUDY_35M
  lines.append(f"| DiLoCo, study 35M | {study['data-parallel']:.3f} | " + " | ".join(
      f"{study[m]:.3f} ({gap(study[m], study['data-parallel']):+.2f}%)" if m in study else ""
      for m in ms) + " |")
  return "\n".join(lines)


def targets(group: list[dict]) -> list[dict]:
  """Each target of the experiment with its measured value and met / missed / not run."""
  ps = picked_stats(group)
  dp = ps.get(("data-parallel", 0))
  out = []

  def add(name, value, met):
    out.append({"target": name, "value": value,
                "status": "not run" if met is None else ("met" if met else "missed")})

  for kind in ("diloco", "decoupled"):
    s = ps.get((kind, 1))
    # At or below at the table's precision (0.01%): a mean 2e-7 above is data-parallel's.
    ok = None if s is None or dp is None else round(gap(s["mean"], dp["mean"]), 2) <= 0
    add(f"{KIND_NAMES[kind]} M = 1 at or below data-parallel",
        f"{gap(s['mean'], dp['mean']):+.2f}%" if ok is not None else "", ok)
  for m, limit in sorted(config.TARGET_GAP.items()):
    s = ps.get(("decoupled", m))
    ok = None if s is None or dp is None else gap(s["mean"], dp["mean"]) <= limit
    add(f"Decoupled M = {m} within {limit:g}% of data-parallel",
        f"{gap(s['mean'], dp['mean']):+.2f}%" if ok is not None else "", ok)
  for m in sorted({m for kind, m in ps if kind == "decoupled"}):
    dec, syn = ps.get(("decoupled", m)), ps.get(("diloco", m))
    if syn is None:
      add(f"Decoupled no worse than synchronous DiLoCo at M = {m}", "", None)
      continue
    noise = max(dec["spread"], syn["spread"])
    single = min(len(dec["seeds"]), len(syn["seeds"])) < 2
    add(f"Decoupled no worse than synchronous DiLoCo at M = {m}",
        f"{dec['mean'] - syn['mean']:+.4f} (" + ("one seed: spread not measured)" if single
                                                 else f"seed spread {noise:.4f}"
                                                 f"{paired_differences(dec, syn)})"),
        dec["mean"] - syn["mean"] <= noise)
  return out


def paired_differences(a: dict, b: dict) -> str:
  """"; by seed +x, +y" (a - b at each seed both ran: the same initialisation and data
  order, so a difference of one sign at every seed says more than the means and spreads do);
  "" with fewer than two shared seeds."""
  shared = sorted(set(a["by_seed"]) & set(b["by_seed"]))
  if len(shared) < 2:
    return ""
  return "; by seed " + ", ".join(f"{a['by_seed'][s] - b['by_seed'][s]:+.4f}" for s in shared)


def sweep_table(group: list[dict]) -> str:
  """Seed-0 eval loss of every outer setting (rows) per method and receipt (columns) and M;
  the picked setting of each column starred."""
  picked = rows_lib.picks(group)
  columns, cells = [], {}
  for r in group:
    if r["kind"] == "data-parallel" or r["seed"] != 0:
      continue
    receipt, outer = stages.parse_setting(r["setting"])
    column = f"M={r['M']} {r['kind']}" + (f" {receipt}" if r["kind"] == "decoupled" else "")
    if column not in columns:
      columns.append(column)
    star = "*" if picked.get((r["kind"], r["M"])) == r["setting"] else ""
    inner = stages.inner_of(r["setting"])
    row = config.outer_label(*outer) + (config.inner_label(inner) if inner else "")
    cells[(row, column)] = f"{r['eval_loss']:.4f}{star}"
  if not cells:
    return ""
  columns.sort(key=lambda c: (int(c.split()[0][2:]), c))
  outers = [config.outer_label(*o) for o in config.OUTER]
  outers += sorted({o for o, _ in cells} - set(outers))
  lines = ["| outer lr / momentum | " + " | ".join(columns) + " |",
           "|" + "---|" * (len(columns) + 1)]
  lines += [f"| {o.removeprefix('outer ')} | " + " | ".join(cells.get((o, c), "")
                                                            for c in columns) + " |"
            for o in outers if any((o, c) in cells for c in columns)]
  return "\n".join(lines)


def unswept_columns(group: list[dict]) -> list[str]:
  """The (M, kind, receipt) columns of the sweep with a single seed-0 outer setting."""
  settings: dict[str, set[str]] = {}
  for r in group:
    if r["kind"] != "data-parallel" and r["seed"] == 0:
      receipt, _ = stages.parse_setting(r["setting"])
      column = f"M={r['M']} {r['kind']}" + (f" {receipt}" if r["kind"] == "decoupled" else "")
      settings.setdefault(column, set()).add(r["setting"])
  return sorted((c for c, s in settings.items() if len(s) == 1),
                key=lambda c: (int(c.split()[0][2:]), c))


def goodput_table(group: list[dict]) -> str:
  """Every run with its gap, goodput and where it ran. `wall_s` is the run's own training
  time (accounting.json, or a data-parallel run's evaluations); `process_wall_s` the whole
  process, compilation included (provenance.json)."""
  ref = rows_lib.stats(group).get("data-parallel")
  rows = [dict(r, gap_pct=round(gap(r["eval_loss"], ref["mean"]), 2) if ref else "",
                carried_from=carried_from(r))
          for r in sorted(group, key=lambda r: (r["kind"], r["M"], r["setting"], r["seed"]))]
  return harness.table(rows, ("method", "seed", "tokens", "eval_loss", "gap_pct", "goodput",
                              "mean_learners_per_round", "wall_s", "process_wall_s", "machine",
                              "device", "carried_from"))


def trend_table(rows: list[dict]) -> str:
  """Decoupled M = 4 (picked setting) against data-parallel for every (model, steps) group
  that has both: the gap's trend with N and tokens per parameter."""
  out = []
  for (model, steps), group in sorted(rows_lib.groups(rows).items()):
    ps = picked_stats(group)
    dp, dec = ps.get(("data-parallel", 0)), ps.get(("decoupled", 4))
    if dp is None or dec is None:
      continue
    n = config.params(model)
    tokens = max(r["tokens"] for r in group if r["method"] == "data-parallel")
    out.append({"model": model, "N": n, "steps": steps, "tokens": tokens,
                "tokens_per_param": round(tokens / n, 2), "data-parallel": dp["mean"],
                "decoupled M=4": dec["mean"], "setting": dec["method"].split(" ", 2)[2],
                "gap_pct": round(gap(dec["mean"], dp["mean"]), 2)})
  if not out:
    return ""
  return harness.table(out, ("model", "N", "steps", "tokens", "tokens_per_param",
                             "data-parallel", "decoupled M=4", "setting", "gap_pct"))


def size_points(rows: list[dict]) -> list[tuple[int, str, dict]]:
  """(N, model, `picked_stats`) of every model size trained at 20N with a data-parallel
  reference, smallest N first; a size swept over the global batch is read at DP_BATCH (the
  sweep: `report_batch`)."""
  sizes, at_dp_batch = [], set()
  for (model, _), group in rows_lib.groups(rows).items():
    if config.optimizer_of(model) != "adamw":
      continue  # the trend is AdamW's (the study's); another optimizer: `optimizer_table`
    n = config.params(model)
    if max(r["tokens"] for r in group) < 0.98 * config.TOKENS_PER_PARAM * n:
      continue  # a partial budget inflates every gap; not a point of the 20N trend
    ps = picked_stats(group)
    batch = rows_lib.global_batch(group)
    at_dp_batch |= {model} if batch == config.DP_BATCH else set()
    if ("data-parallel", 0) in ps:
      sizes.append((n, model, batch, ps))
  return sorted(((n, model, ps) for n, model, batch, ps in sizes
                 if batch == config.DP_BATCH or model not in at_dp_batch), key=lambda t: t[:2])


# The smallest gap (percent) a power-law fit takes: the tables' precision.
MIN_FIT_GAP_PCT = 0.01


def gap_exponents(sizes: list[tuple[int, str, dict]], kind: str) -> dict[int, float]:
  """Per M, the exponent a of gap = c N^a fitted by least squares in log-log over `sizes`
  (`size_points`), for each M whose gap is at least MIN_FIT_GAP_PCT at every size (at least
  two): a gap of float rounding (synchronous M = 1 is data-parallel) has no power law."""
  out = {}
  for m in config.SIZE_LEARNERS:
    points = [(n, gap(ps[(kind, m)]["mean"], ps[("data-parallel", 0)]["mean"]))
              for n, _, ps in sizes if (kind, m) in ps]
    if len(points) == len(sizes) >= 2 and all(g >= MIN_FIT_GAP_PCT for _, g in points):
      out[m] = float(np.polyfit(np.log([n for n, _ in points]),
                                np.log([g for _, g in points]), 1)[0])
  return out


def size_table(rows: list[dict]) -> str:
  """The gap to data-parallel per M (picked settings, mean over seeds) of each method at every
  model size trained at 20N (`size_points`), with the study's 35M row and its fitted laws at
  tiny's N beside: does the gap shrink with N at every M?"""
  sizes = size_points(rows)
  if len(sizes) < 2:
    return ""
  ms = config.SIZE_LEARNERS
  header = ["method", "model", "N", "data-parallel"] + [f"M = {m}" for m in ms]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for kind in ("diloco", "decoupled"):
    for n, model, ps in sizes:
      ref = ps[("data-parallel", 0)]
      cells = [f"{gap(ps[(kind, m)]['mean'], ref['mean']):+.2f}% ({len(ps[(kind, m)]['seeds'])})"
               if (kind, m) in ps else "" for m in ms]
      if any(cells):
        lines.append(f"| {KIND_NAMES[kind]} | {model} | {n:,} | {ref['mean']:.4f} "
                     f"({len(ref['seeds'])}) | " + " | ".join(cells) + " |")
    exponents = gap_exponents(sizes, kind)
    if exponents:
      lines.append(f"| {KIND_NAMES[kind]}: gap ~ N^a, fitted over the {len(sizes)} sizes |  |  "
                   "|  | " + " | ".join(f"a = {exponents[m]:+.2f}" if m in exponents else ""
                                        for m in ms) + " |")
  study = config.STUDY_35M
  lines.append("| DiLoCo, study (Table 4) | 35M | about 35M | " f"{study['data-parallel']:.3f} | "
               + " | ".join(f"{gap(study[m], study['data-parallel']):+.2f}%" if m in study
                            else "" for m in ms) + " |")
  tiny_n = config.params("tiny")
  lines.append(f"| DiLoCo, study's fitted laws (Table 7) | extrapolated | {tiny_n:,} |  | "
               + " | ".join(f"{config.STUDY_LAW_AT_TINY[m]:+.2f}%"
                            if m in config.STUDY_LAW_AT_TINY else "" for m in ms) + " |")
  return "\n".join(lines)


def optimizer_table(rows: list[dict]) -> str:
  """Per model preset and steps trained with more than one inner optimizer: each method's
  gap per M to data-parallel with the *same* inner optimizer (picked settings, mean over the
  seeds in brackets), and Decoupled M = 4's loss against AdamW data-parallel's: does the
  switch narrow the gap, or only move both sides?"""
  by_preset: dict[tuple[str, int], dict[str, list[dict]]] = {}
  for (model, steps), group in rows_lib.groups(rows).items():
    by_preset.setdefault((config.preset_of(model), steps), {})[model] = group
  ms = config.SIZE_LEARNERS
  header = ["model", "steps", "method", "data-parallel (same optimizer)"] + [
      f"M = {m}" for m in ms] + ["M = 4 against AdamW data-parallel"]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for (preset, steps), models in sorted(by_preset.items()):
    if len(models) < 2 or preset not in models:
      continue
    adamw_dp = picked_stats(models[preset]).get(("data-parallel", 0))
    for model in sorted(models, key=lambda m: (m != preset, m)):
      ps = picked_stats(models[model])
      dp = ps.get(("data-parallel", 0))
      if dp is None:
        continue
      for kind in ("diloco", "decoupled"):
        cells = [f"{gap(ps[(kind, m)]['mean'], dp['mean']):+.2f}% ({len(ps[(kind, m)]['seeds'])})"
                 if (kind, m) in ps else "" for m in ms]
        m4 = ps.get((kind, 4))
        against = (f"{m4['mean']:.4f} ({gap(m4['mean'], adamw_dp['mean']):+.2f}%)"
                   if m4 and adamw_dp else "")
        if any(cells):
          lines.append(f"| {model} | {steps} | {KIND_NAMES[kind]} | {dp['mean']:.4f} "
                       f"({len(dp['seeds'])}) | " + " | ".join(cells) + f" | {against} |")
  return "\n".join(lines) if len(lines) > 2 else ""


def budget_note(model: str, group: list[dict]) -> str:
  """The group's token budget against 20N, labelled partial when it is less."""
  n = config.params(model)
  tokens = max(r["tokens"] for r in group)
  share = tokens / (config.TOKENS_PER_PARAM * n)
  label = "" if share >= 0.98 else f" **Partial run: {100 * share:.1f}% of the 20N budget.**"
  return (f"N = {n:,} parameters (counted from the `{model}` preset); the longest run trained "
          f"{tokens:,} tokens = {tokens / n:.2f} tokens per parameter.{label}")


def carried_note(rows: list[dict]) -> list[str]:
  """Which rows were carried from an earlier results.json (their runs are not in --outdir):
  per source report, how many and the machines that ran them."""
  sources: dict[tuple[str, str], list[dict]] = {}
  for r in rows:
    if "carried_commit" in r:
      sources.setdefault((r["carried_commit"], r["carried_date"]), []).append(r)
  if not sources:
    return []
  lines = [f"**Carried rows.** {sum(len(g) for g in sources.values())} of the {len(rows)} rows "
           "come from an earlier results.json: their run directories are not in `--outdir` "
           "here, so each row is the one the runner wrote then from that run's files, with "
           "its provenance; the `carried_from` column of each group's table below marks "
           "them. A run present in `--outdir` replaces its earlier row.", ""]
  for (commit, date), group in sorted(sources.items(), key=lambda kv: kv[0][1]):
    counts = collections.Counter(r.get("machine", "unrecorded") for r in group)
    machines = ", ".join(f"{m} ({n} runs)" for m, n in sorted(counts.items()))
    lines.append(f"- {len(group)} rows from the report of commit `{commit[:12]}` ({date}); "
                 f"runs made on {machines}.")
  return lines + [""]


def carried_from(row: dict) -> str:
  if "carried_commit" not in row:
    return ""
  return f"{row['carried_commit'][:12]} ({row['carried_date']})"


def reference_note(group: list[dict]) -> list[str]:
  """Which inner learning rate the data-parallel reference trains at, among those run."""
  full = [r for r in group if r["kind"] == "data-parallel"
          and (r["method"] == "data-parallel" or other_rate(r["method"]))
          and not r["method"].startswith("data-parallel B=")]
  def rate_of(r: dict) -> float:
    return stages.inner_of(r.get("setting", "")) or config.preset_inner_lr(r["model"]) or 0.0

  rates = sorted({rate_of(r) for r in full})
  if len(rates) < 2:
    return []
  chosen = [r for r in full if r["method"] == "data-parallel"]
  rate = rate_of(chosen[0])
  return [f"**The data-parallel reference** trains at inner learning rate {rate:g}, the lowest "
          "seed-0 eval loss at its batch among " + ", ".join(f"{x:g}" for x in rates)
          + " (the others are rows of their own below); the DiLoCo methods' rates are in "
          "their settings (none named: the preset's "
          f"{config.preset_inner_lr(chosen[0]['model']) or 0.0:g}).", ""]


def every_run(model: str, steps: int, group: list[dict]) -> list[str]:
  """The appendix's table of one (model, steps) group: every run, its goodput and machine."""
  batch = rows_lib.global_batch(group)
  at_batch = f", global batch {batch}" if batch != config.DP_BATCH else ""
  return [f"## `{model}`, {steps} steps per learner{at_batch}: every run", "",
          "`wall_s`: the run's own training time; `process_wall_s`: its whole process, "
          "compilation included; machine and device from its provenance.json; goodput from "
          "its accounting.json.", "", goodput_table(group), ""]


def section(model: str, steps: int, group: list[dict], folder: str,
            prefix: str, runs_table: bool = True) -> list[str]:
  """The markdown of one (model, steps) group; writes its plots into `folder`. Without
  `runs_table`, the every-run table is left to the appendix (`every_run`)."""
  from experiments.scaling import figures  # pylint: disable=import-outside-toplevel
  title = f"{model}, {steps} steps"
  tag = f"{prefix}_{model}_{steps}"
  target_rows = targets(group)
  batch = rows_lib.global_batch(group)
  at_batch = f", global batch {batch}" if batch != config.DP_BATCH else ""
  parts = [f"## `{model}`, {steps} steps per learner{at_batch}", "", budget_note(model, group),
           "",
           *reference_note(group),
           "### Eval loss and gap to data-parallel per M (picked settings; mean ± half the "
           "seeds' spread)", "", table4(group), "",
           f"The last row cites {config.STUDY_CITATION}; its losses are on another corpus and "
           "tokenizer, so only its gaps compare with ours.", "",
           *figures.section_plots(group, folder, tag, title),
           "### Targets", "", harness.table(target_rows, ("target", "value", "status")), ""]
  sweep = sweep_table(group)
  if sweep:
    parts += ["### Outer sweep (seed 0; * = picked per M and method)", "", sweep, ""]
    unswept = unswept_columns(group)
    if unswept:
      parts += ["Not swept (one outer setting each, picked by `--stage=m8` from the seed-0 "
                f"rows at M = {config.M8_FROM} for M = 8 and M = {config.M1_FROM} for M = 1, "
                "or a control of `--stage=m1`): " + ", ".join(unswept) + "; a star among them "
                "picks a receipt mode, not an outer setting.", ""]
  if runs_table:
    parts += ["### Every run (goodput from accounting.json)", "",
              "`wall_s`: the run's own training time; `process_wall_s`: its whole process, "
              "compilation included; machine and device from its provenance.json.", "",
              goodput_table(group), ""]
  return parts


def headline(rows: list[dict]) -> str:
  """One line for the top-level results table: per (model, steps), each picked method's gap
  to data-parallel per M (mean over seeds), at the comparison's global batch only (the batch
  sweep's groups have their own tables in the report)."""
  parts = []
  full = rows_lib.full_batches(rows)
  for (model, steps), group in sorted(rows_lib.groups(rows).items()):
    if full.get((model, steps), config.DP_BATCH) != config.DP_BATCH:
      continue
    ps = picked_stats(group)
    dp = ps.get(("data-parallel", 0))
    if dp is None:
      continue
    gaps = [f"{KIND_NAMES[kind].split()[0]} M={m} {gap(s['mean'], dp['mean']):+.2f}%"
            for (kind, m), s in sorted(ps.items()) if kind != "data-parallel"]
    parts.append(f"{model} {steps} steps: data-parallel {dp['mean']:.3f}; gap "
                 + ", ".join(gaps))
  return "; ".join(parts) or "no runs with a data-parallel reference"
