"""The batch and period sweeps' tables, from the rows: each method at data-parallel's best
global batch and at its own (the study's Table 4 compares best against best), the seed-0 loss
at every batch, and the gap to data-parallel against the synchronisation period H.

The picks (of setting and of batch) are made at seed 0, and the tables give seed-0 losses,
but for `seeded_table`: the same two comparisons over whatever seeds the picks have (stages 2
and 3 with `--steps` of a batch's group). A run that has no row yet shows as "—".
"""

from __future__ import annotations

import math

from experiments.scaling import config, report
from experiments.scaling import rows as rows_lib

MISSING = "—"
KINDS = ("diloco", "decoupled")
REFERENCE = ("data-parallel", 0)


def seed0(group: list[dict]) -> dict[tuple[str, int], float]:
  """(kind, M) -> the seed-0 eval loss of its pick in one group (`rows.picks`), and
  ("data-parallel", 0) -> the reference's (data-parallel at the group's batch, tuned rate)."""
  picked = rows_lib.picks(group)
  out: dict[tuple[str, int], float] = {}
  for r in group:
    if r["seed"] != 0:
      continue
    if r["method"] == "data-parallel":
      key = REFERENCE
    elif r["kind"] != "data-parallel" and picked.get((r["kind"], r["M"])) == r["setting"]:
      key = (r["kind"], r["M"])
    else:
      continue
    out[key] = min(out.get(key, math.inf), r["eval_loss"])
  return out


def batch_groups(rows: list[dict], model: str) -> dict[int, list[dict]]:
  """Global batch -> the group of `model` trained at 20N at that batch (the study's H)."""
  budget = 0.98 * config.TOKENS_PER_PARAM * config.params(model)
  return {rows_lib.global_batch(group): group
          for (name, _), group in sorted(rows_lib.groups(rows).items())
          if name == model and max(r["tokens"] for r in group) >= budget}


def _loss(loss: float | None, reference: float | None, *extra: str) -> str:
  """"loss (gap%, extra...)", or "—" with no loss; the gap only with a reference."""
  if loss is None:
    return MISSING
  notes = ([f"{report.gap(loss, reference):+.2f}%"] if reference else []) + list(extra)
  return f"{loss:.4f}" + (f" ({', '.join(notes)})" if notes else "")


def _header(first: list[str], ms) -> list[str]:
  header = first + [f"M = {m}" for m in ms]
  return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]


def best_tables(rows: list[dict], model: str, ms=config.SIZE_LEARNERS) -> tuple[str, str]:
  """(i) every method at data-parallel's best global batch, (ii) each method and M at its own
  best batch, each gap to the best data-parallel loss over batches; ("", "") without a
  data-parallel reference at any batch. (ii) ends with the study's 35M row and its fitted
  laws at tiny's N."""
  by_batch = {b: seed0(g) for b, g in batch_groups(rows, model).items()}
  dps = {b: s[REFERENCE] for b, s in by_batch.items() if REFERENCE in s}
  if not dps:
    return "", ""
  best_b = min(dps, key=lambda b: (dps[b], b))
  best = dps[best_b]
  dp_cell = f"{best:.4f} (B = {best_b})"
  at_best = _header(["method", "data-parallel"], ms)
  own = _header(["method", "data-parallel"], ms)
  for kind in KINDS:
    cells = [_loss(by_batch[best_b].get((kind, m)), best) for m in ms]
    at_best.append(f"| {report.KIND_NAMES[kind]} | {dp_cell} | " + " | ".join(cells) + " |")
    mine = []
    for m in ms:
      found = {b: s[(kind, m)] for b, s in by_batch.items() if (kind, m) in s}
      b = min(found, key=lambda b: (found[b], b)) if found else None
      mine.append(_loss(found[b], best, f"B = {b}") if found else MISSING)
    own.append(f"| {report.KIND_NAMES[kind]} | {dp_cell} | " + " | ".join(mine) + " |")
  study = config.STUDY_35M
  own.append(f"| DiLoCo, study 35M | {study['data-parallel']:.3f} | " + " | ".join(
      f"{study[m]:.3f} ({report.gap(study[m], study['data-parallel']):+.2f}%)" if m in study
      else MISSING for m in ms) + " |")
  own.append("| DiLoCo, study's fitted laws at tiny's N |  | " + " | ".join(
      f"{config.STUDY_LAW_AT_TINY[m]:+.2f}%" if m in config.STUDY_LAW_AT_TINY else MISSING
      for m in ms) + " |")
  return "\n".join(at_best), "\n".join(own)


def _with_batch(cell: str, batch: int) -> str:
  """A `report.seed_cell` with its global batch added inside the bracket."""
  return f"{cell[:-1]}, B = {batch})" if cell.endswith(")") else cell


def seeded_table(rows: list[dict], model: str, ms=config.SIZE_LEARNERS) -> str:
  """The two comparisons of `best_tables` over the seeds: each batch is picked at seed 0 (as
  there), then each cell is the mean (± half the spread) over the seeds its pick has, the
  gap to data-parallel's mean at its best batch; "" without a data-parallel reference."""
  groups = batch_groups(rows, model)
  by_batch = {b: seed0(g) for b, g in groups.items()}
  dps = {b: s[REFERENCE] for b, s in by_batch.items() if REFERENCE in s}
  if not dps:
    return ""
  best_b = min(dps, key=lambda b: (dps[b], b))
  stats = {b: report.picked_stats(g) for b, g in groups.items()}
  dp = stats[best_b].get(REFERENCE)
  ref = dp["mean"] if dp else None
  lines = _header(["method", "data-parallel"], ms)
  for own in (False, True):
    for kind in KINDS:
      cells = []
      for m in ms:
        found = {b: s[(kind, m)] for b, s in by_batch.items() if (kind, m) in s}
        b = (min(found, key=lambda b: (found[b], b)) if found else None) if own else best_b
        cell = report.seed_cell(stats[b].get((kind, m)), ref) if b in stats else ""
        cells.append(_with_batch(cell, b) if cell and own else cell or MISSING)
      where = "its own best batch" if own else "data-parallel's best batch"
      lines.append(f"| {report.KIND_NAMES[kind]}, at {where} | "
                   f"{_with_batch(report.seed_cell(dp, None), best_b)} | "
                   + " | ".join(cells) + " |")
  return "\n".join(lines)


def batch_table(rows: list[dict], model: str, ms=config.SIZE_LEARNERS) -> str:
  """The sweep itself: the seed-0 loss of data-parallel and of each method's pick per M
  (rows) at each global batch (columns); * marks a row's lowest."""
  groups = batch_groups(rows, model)
  if len(groups) < 2:
    return ""
  by_batch = {b: seed0(g) for b, g in groups.items()}
  batches = sorted(by_batch)
  steps = {b: groups[b][0]["steps"] for b in batches}
  lines = ["| method | " + " | ".join(f"B = {b} ({steps[b]} steps)" for b in batches) + " |",
           "|" + "---|" * (len(batches) + 1)]
  keys = [(REFERENCE, "data-parallel")] + [
      ((kind, m), f"{report.KIND_NAMES[kind]} M = {m}") for kind in KINDS for m in ms]
  for key, name in keys:
    found = {b: by_batch[b][key] for b in batches if key in by_batch[b]}
    if not found:
      continue
    low = min(found.values())
    lines.append(f"| {name} | " + " | ".join(
        f"{found[b]:.4f}{'*' * (found[b] == low)}" if b in found else MISSING
        for b in batches) + " |")
  return "\n".join(lines)


def _without_period(setting: str) -> str:
  """A setting without its " H=<H>" suffix: the same run at the study's H."""
  return f" {setting}".partition(" H=")[0][1:]


def period_table(main: list[dict], at_periods: list[dict]) -> str:
  """Seed-0 loss and gap to the group's data-parallel reference of each (method, M, setting)
  run at another H (rows), at each H (columns; the study's H is the same setting's run in
  `main`, the group at the study's H), with the outer rounds each H makes of the steps. One
  row per setting, so a receipt or rate other than the pick's gets a row of its own."""
  if not at_periods:
    return ""
  ref = seed0(main).get(REFERENCE)
  steps = at_periods[0]["steps"]
  periods = sorted({r["period"] for r in at_periods} | {config.PERIOD})
  cells: dict[tuple[str, int, str], dict[int, float]] = {}
  for r in at_periods:
    if r["seed"] == 0:
      row = cells.setdefault((r["kind"], r["M"], _without_period(r["setting"])), {})
      row[r["period"]] = min(row.get(r["period"], math.inf), r["eval_loss"])
  for r in main:
    key = (r["kind"], r["M"], r["setting"])
    if r["seed"] == 0 and key in cells:
      cells[key][config.PERIOD] = min(cells[key].get(config.PERIOD, math.inf), r["eval_loss"])
  lines = ["| method | " + " | ".join(f"H = {h} ({steps // h} rounds)" for h in periods)
           + " |", "|" + "---|" * (len(periods) + 1)]
  for kind, m, setting in sorted(cells, key=lambda k: (KINDS.index(k[0]), k[1], k[2])):
    lines.append(f"| {report.KIND_NAMES[kind]} M = {m}, {setting} | " + " | ".join(
        _loss(cells[(kind, m, setting)].get(h), ref) for h in periods) + " |")
  ref_cell = f"{ref:.4f}" if ref else MISSING
  return "\n".join(lines + [f"| data-parallel (the reference) | {ref_cell} |"
                            + " |" * (len(periods) - 1)])


def period_seeded_table(main: list[dict], at_periods: list[dict]) -> str:
  """`period_table` over the seeds, once a run at another H has a seed other than 0: each
  cell the mean (± half the spread) over the seeds that (method, M, setting) has at that H
  (H = 30: its runs in `main`, stages 2 and 3's seeds included), the gap to data-parallel's
  mean over its seeds; "" while every run at another H is seed 0."""
  if all(r["seed"] == 0 for r in at_periods):
    return ""
  dp = report.picked_stats(main).get(REFERENCE)
  ref = dp["mean"] if dp else None
  periods = sorted({r["period"] for r in at_periods} | {config.PERIOD})
  losses: dict[tuple[str, int, str], dict[int, dict[int, float]]] = {}
  for r in at_periods:
    by_seed = losses.setdefault((r["kind"], r["M"], _without_period(r["setting"])), {}
                                ).setdefault(r["period"], {})
    by_seed[r["seed"]] = min(by_seed.get(r["seed"], math.inf), r["eval_loss"])
  for r in main:
    key = (r["kind"], r["M"], r["setting"])
    if key in losses:
      by_seed = losses[key].setdefault(config.PERIOD, {})
      by_seed[r["seed"]] = min(by_seed.get(r["seed"], math.inf), r["eval_loss"])

  def cell(by_seed: dict[int, float] | None) -> str:
    if not by_seed:
      return MISSING
    values = list(by_seed.values())
    return report.seed_cell({"mean": sum(values) / len(values), "seeds": sorted(by_seed),
                             "spread": max(values) - min(values)}, ref)

  lines = ["| method | " + " | ".join(f"H = {h}" for h in periods) + " |",
           "|" + "---|" * (len(periods) + 1)]
  for kind, m, setting in sorted(losses, key=lambda k: (KINDS.index(k[0]), k[1], k[2])):
    lines.append(f"| {report.KIND_NAMES[kind]} M = {m}, {setting} | " + " | ".join(
        cell(losses[(kind, m, setting)].get(h)) for h in periods) + " |")
  dp_cell = report.seed_cell(dp, None) or MISSING
  return "\n".join(lines + [f"| data-parallel (the reference) | {dp_cell} |"
                            + " |" * (len(periods) - 1)])


def sections(rows: list[dict]) -> list[str]:
  """The markdown of the batch sweep (per model with two or more batches at 20N) and of the
  period sweep (per group with runs at another H); none without such rows."""
  parts = []
  for model in sorted({r["model"] for r in rows}):
    sweep = batch_table(rows, model)
    if not sweep:
      continue
    at_best, own = best_tables(rows, model)
    parts += [f"## `{model}`: best against best over the global batch B", "",
              (f"The protocol at each global batch B (`--stage=batch`; B = {config.DP_BATCH} "
               "is its own section above), at the same tokens (20N), warmup and evaluations; "
               "each learner on B / M sequences, data-parallel's inner rate tuned at each B, "
               "each method's outer setting picked at each B. Seed-0 losses, gap to the best "
               "data-parallel loss over B; — = not run yet."), ""]
    if at_best:
      parts += ["### Every method at data-parallel's best batch", "", at_best, "",
                "### Each method and M at its own best batch (as the study tuned it)", "", own,
                "", (f"The study's rows cite {config.STUDY_CITATION} and its fitted laws "
                     "(Table 7) at tiny's N; its losses are on another corpus and tokenizer, "
                     "so only its gaps compare with ours."), ""]
    seeded = seeded_table(rows, model)
    if seeded:
      parts += ["### The same over the seeds (batches picked at seed 0; mean ± half the "
                "seeds' spread)", "", seeded, ""]
    parts += ["### Seed-0 loss at each batch (* = the row's lowest)", "", sweep, ""]
  groups = rows_lib.groups(rows)
  for (model, steps), at_periods in sorted(rows_lib.period_groups(rows).items()):
    main = groups.get((model, steps), [])
    parts += [f"## `{model}`, {steps} steps: the synchronisation period H", "",
              (f"Each method at a setting of the section `{model}`, {steps} steps (its pick's "
               "receipt, outer and inner rates, or another receipt) with H changed "
               "(`--stage=period`; Decoupled keeps a fragment due every "
               f"{config.FRAGMENT_STEPS} steps, tau = {config.TAU}); H = {config.PERIOD} is "
               "the same setting's run in that section. "
               "Seed-0 loss and gap to that section's data-parallel reference; the runs at "
               "another H never enter its picks. — = not run yet."), "",
              period_table(main, at_periods), ""]
    seeded = period_seeded_table(main, at_periods)
    if seeded:
      parts += ["### The same over the seeds (mean ± half the seeds' spread)", "", seeded, ""]
    parts += [report.goodput_table(at_periods + [r for r in main
                                                 if r["method"] == "data-parallel"]), ""]
  return parts
