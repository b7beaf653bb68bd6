"""Stages two and three of the scaling experiment, derived from the runs that finished.

Stage one is the seed-0 sweep (`config.stage_one`). Stage two repeats, with seed 1, the
data-parallel baselines and the setting each method picked per M (lowest seed-0 eval loss).
Stage three adds seed 2 to both sides of every comparison of the targets whose difference is
within the seeds' spread, so that "within noise" rests on three seeds, not two.
"""

from __future__ import annotations

from experiments.harness import Run
from experiments.scaling import config, rows as rows_lib


def parse_setting(setting: str) -> tuple[str, tuple[float, float]]:
  """"keep_local outer 1/0" -> ("keep_local", (1.0, 0.0)); "outer 0.8/0.9" -> overwrite."""
  receipt, _, outer = setting.rpartition("outer ")
  lr, _, momentum = outer.partition("/")
  try:
    return receipt.strip() or "overwrite", (float(lr), float(momentum))
  except ValueError:
    raise ValueError(f"setting {setting!r}: expected '[receipt] outer LR/MOMENTUM'") from None


def method_run(kind: str, learners: int, setting: str, seed: int, steps: int,
               preset: str = "tiny") -> Run:
  """The run of a method (data-parallel at batch DP_BATCH / `learners`, or a DiLoCo kind
  with `setting`) at `seed`."""
  if kind == "data-parallel":
    return config.dp(seed, steps, config.DP_BATCH // learners, preset)
  receipt, outer = parse_setting(setting)
  return config.diloco(kind, learners, outer, seed, steps, receipt, preset)


def _tiny(rows: list[dict], steps: int) -> list[dict]:
  return rows_lib.groups(rows).get(("tiny", steps), [])


def stage_two(rows: list[dict], steps: int, learners=config.LEARNERS) -> list[Run]:
  """Seed 1 of data-parallel (both batches) and of each (kind, M)'s picked setting."""
  picked = rows_lib.picks(_tiny(rows, steps))
  runs = [config.dp(1, steps)] + [config.dp(1, steps, config.DP_BATCH // m)
                                  for m in learners if m > 1]
  runs += [method_run(kind, m, setting, 1, steps)
           for (kind, m), setting in picked.items() if m in learners]
  return runs


def comparisons(picked: dict[tuple[str, int], str]) -> list[tuple[str, str]]:
  """The method pairs the targets compare: each picked method against data-parallel, and
  Decoupled against synchronous DiLoCo at the same M."""
  name = {key: f"{key[0]} M={key[1]} {setting}" for key, setting in picked.items()}
  pairs = [(n, "data-parallel") for n in name.values()]
  pairs += [(name[("decoupled", m)], name[("diloco", m)])
            for kind, m in picked if kind == "decoupled" and ("diloco", m) in name]
  return pairs


def stage_three(rows: list[dict], steps: int, learners=config.LEARNERS,
                seeds: int = 3) -> list[Run]:
  """Seed 2 of both methods of every compared pair that two seeds leave within noise
  (|mean difference| <= the larger spread)."""
  group = _tiny(rows, steps)
  picked = {k: v for k, v in rows_lib.picks(group).items() if k[1] in learners}
  stats = rows_lib.stats(group)
  wanted: dict[str, Run] = {}
  for a, b in comparisons(picked):
    if a not in stats or b not in stats:
      continue
    sa, sb = stats[a], stats[b]
    if min(len(sa["seeds"]), len(sb["seeds"])) < 2:
      continue
    if abs(sa["mean"] - sb["mean"]) <= max(sa["spread"], sb["spread"]):
      for s in (sa, sb):
        setting = picked.get((s["kind"], s["M"]), "")
        for seed in range(len(s["seeds"]), seeds):
          run = method_run(s["kind"], s["M"], setting, seed, steps)
          wanted[run.name] = run
  return list(wanted.values())
