"""Stages two and three of the scaling experiment, derived from the runs that finished.

Stage one is the seed-0 sweep (`config.stage_one`). Stage two repeats, with seed 1, the
data-parallel baselines and the setting each method picked per M (lowest seed-0 eval loss).
Stage three adds seed 2 to both sides of every comparison of the targets whose difference is
within the seeds' spread, so that "within noise" rests on three seeds, not two.
"""

from __future__ import annotations

from experiments.harness import Run
from experiments.scaling import config
from experiments.scaling import rows as rows_lib

# The suffixes a setting may end in, in this order:
# "overwrite outer 1/0.9 inner 0.006 muon 0.04 restart 8 H=15" (data-parallel: "inner 0.006").
SUFFIXES = (" inner ", " muon ", " restart ", " H=")


def _before(setting: str, key: str) -> str:
  """`setting` cut before its suffix `key` and every later one."""
  text = f" {setting}"
  for k in SUFFIXES[SUFFIXES.index(key):]:
    text = text.partition(k)[0]
  return text[1:]


def _suffix(setting: str, key: str, kind: type, what: str):
  """The value of suffix `key` ("... muon 0.04" -> 0.04), None when the setting names none."""
  _, found, rest = f" {setting}".partition(key)
  if not found:
    return None
  later = SUFFIXES[SUFFIXES.index(key) + 1:]
  value = _before(rest, later[0]) if later else rest
  try:
    return kind(value)
  except ValueError:
    raise ValueError(f"setting {setting!r}: expected '...{key}{what}' with a number") from None


def period_of(setting: str) -> int:
  """The H a setting names ("... H=15"), the study's PERIOD when it names none."""
  period = _suffix(setting, " H=", int, "<int>")
  return config.PERIOD if period is None else period


def parse_setting(setting: str) -> tuple[str, tuple[float, float]]:
  """"keep_local outer 1/0" -> ("keep_local", (1.0, 0.0)); "outer 0.8/0.9" -> overwrite.
  The `SUFFIXES` are read by `inner_of`, `muon_of`, `restart_of` and `period_of`."""
  inner_of(setting)  # a malformed suffix fails here too
  muon_of(setting)
  restart_of(setting)
  period_of(setting)
  receipt, _, outer = _before(setting, " inner ").rpartition("outer ")
  lr, _, momentum = outer.partition("/")
  try:
    return receipt.strip() or "overwrite", (float(lr), float(momentum))
  except ValueError:
    raise ValueError(f"setting {setting!r}: expected '[receipt] outer LR/MOMENTUM'") from None


def inner_of(setting: str) -> float | None:
  """The inner learning rate a setting names ("... inner 0.0015"), None for the preset's."""
  return _suffix(setting, " inner ", float, "LR")


def muon_of(setting: str) -> float | None:
  """Muon's matrix rate a setting names ("... muon 0.04"), None for config.MUON_LR."""
  return _suffix(setting, " muon ", float, "LR")


def restart_of(setting: str) -> int:
  """The outer-momentum restart period a setting names ("... restart 8"), 0 for none."""
  return _suffix(setting, " restart ", int, "<rounds>") or 0


def method_run(kind: str, learners: int, setting: str, seed: int, steps: int,
               preset: str = "tiny", batch: int = config.DP_BATCH) -> Run:
  """The run of a method at global batch `batch` (data-parallel at `batch` / `learners`, or
  a DiLoCo kind with `setting`, its H included) at `seed`."""
  shape = config.batch_shape(batch)
  if kind == "data-parallel":
    return config.dp(seed, steps, batch // learners, preset, inner_lr=inner_of(setting),
                     muon_lr=muon_of(setting), **shape)
  receipt, outer = parse_setting(setting)
  return config.diloco(kind, learners, outer, seed, steps, receipt, preset,
                       inner_lr=inner_of(setting), period=period_of(setting),
                       muon_lr=muon_of(setting), restart=restart_of(setting), **shape)


def _batch(group: list[dict]) -> int:
  """The global batch of a group's runs (DP_BATCH for a group with none yet)."""
  return rows_lib.global_batch(group) if group else config.DP_BATCH


def _tiny(rows: list[dict], steps: int, preset: str = "tiny") -> list[dict]:
  """The rows of `preset` (default tiny) at `steps` steps."""
  return rows_lib.groups(rows).get((preset, steps), [])


def _reference(rows: list[dict], steps: int, preset: str = "tiny") -> str:
  """The data-parallel reference's inner-rate setting ("" = the preset's) of the group."""
  return rows_lib.reference_settings(_tiny(rows, steps, preset)).get((preset, steps), "")


def stage_two(rows: list[dict], steps: int, learners=config.LEARNERS,
              preset: str = "tiny") -> list[Run]:
  """Seed 1 of data-parallel (the full batch and each learner's, at each batch's tuned inner
  rate) and of each (kind, M)'s picked setting, at the group's global batch. Outside tiny,
  data-parallel at a learner's batch only where its seed 0 ran (--stage=size runs none)."""
  group = _tiny(rows, steps, preset)
  picked = rows_lib.picks(group)
  tuned = rows_lib.batch_settings(group)
  full = _batch(group)
  batches = [m for m in learners if m > 1
             and (preset == "tiny" or (preset, steps, full // m) in tuned)]
  runs = [method_run("data-parallel", m, tuned.get((preset, steps, full // m), ""),
                     1, steps, preset, full) for m in (1, *batches)]
  runs += [method_run(kind, m, setting, 1, steps, preset, full)
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
                seeds: int = 3, preset: str = "tiny") -> list[Run]:
  """Seed 2 of both methods of every compared pair that two seeds leave within noise
  (|mean difference| <= the larger spread)."""
  group = _tiny(rows, steps, preset)
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
        setting = (_reference(rows, steps, preset) if s["method"] == "data-parallel"
                   else picked.get((s["kind"], s["M"]), ""))
        for seed in range(len(s["seeds"]), seeds):
          run = method_run(s["kind"], s["M"], setting, seed, steps, preset, _batch(group))
          wanted[run.name] = run
  return list(wanted.values())


def mode_picks(rows: list[dict], learners: int) -> dict[tuple[str, str], str]:
  """(kind, receipt) -> the outer setting of lowest seed-0 eval loss at M = `learners`:
  each receipt mode's own pick (synchronous DiLoCo's receipt reads "overwrite")."""
  best: dict[tuple[str, str], dict] = {}
  for r in rows:
    if r["kind"] == "data-parallel" or r["seed"] != 0 or r["M"] != learners:
      continue
    key = (r["kind"], parse_setting(r["setting"])[0])
    if key not in best or r["eval_loss"] < best[key]["eval_loss"]:
      best[key] = r
  return {key: r["setting"] for key, r in sorted(best.items())}


def stage_m8(rows: list[dict], steps: int, seed: int = 0) -> list[Run]:
  """M = 8 and M = 1 without a sweep of their own, at settings picked from smaller M.

  M = 8: data-parallel at one learner's batch (DP_BATCH / 8), and synchronous DiLoCo and
  each Decoupled receipt mode at its own M = `M8_FROM` pick. M = 1, one learner at the full
  batch: Decoupled with `M1_RECEIPT` and synchronous DiLoCo, each at its M = `M1_FROM` pick
  (the nearest M whose sweep was run; see config.py)."""
  group = _tiny(rows, steps)
  at_from = mode_picks(group, config.M8_FROM)
  wanted = [("diloco", "overwrite")] + [("decoupled", r) for r in config.RECEIPTS]
  missing = [k for k in wanted if k not in at_from]
  at_m1 = mode_picks(group, config.M1_FROM)
  m1 = [("decoupled", config.M1_RECEIPT), ("diloco", "overwrite")]
  missing_m1 = [k for k in m1 if k not in at_m1]
  if missing or missing_m1:
    raise ValueError(f"--stage=m8 needs the seed-0 sweep of the tiny model at {steps} steps: "
                     f"M = {config.M8_FROM} for {missing or 'every mode'} and M = "
                     f"{config.M1_FROM} for {missing_m1 or 'both M = 1 methods'} (the runs "
                     "or the rows of results.json)")
  runs = [config.dp(seed, steps, config.DP_BATCH // 8)]
  runs += [method_run(kind, 8, at_from[(kind, receipt)], seed, steps)
           for kind, receipt in wanted]
  return runs + [method_run(kind, 1, at_m1[(kind, receipt)], seed, steps)
                 for kind, receipt in m1]


def stage_inner(rows: list[dict], steps: int, learners=(config.INNER_M,),
                scales=config.INNER_SCALES, preset: str = "tiny") -> list[Run]:
  """Seed 0 of synchronous DiLoCo and Decoupled (overwrite, the default receipt) at each M
  of `learners`, each at its seed-0 outer pick among the runs at the data-parallel
  reference's inner rate, with that rate scaled by each of `scales`, and data-parallel at the
  scales above 1 (the reference is offered the same larger step): does a learner's smaller
  batch want another inner step than data-parallel's?"""
  reference = _reference(rows, steps, preset)
  ref_inner = inner_of(reference) if reference else None
  base = ref_inner or config.preset_inner_lr(preset)
  runs = [config.dp(0, steps, preset=preset, inner_lr=base * scale)
          for scale in scales if scale > 1]
  wanted = [("diloco", "overwrite"), ("decoupled", "overwrite")]
  for m in learners:
    at_m = {k: v.partition(" inner ")[0]
            for k, v in mode_picks(_tiny(rows, steps, preset), m).items()
            if inner_of(v) == ref_inner}
    missing = [k for k in wanted if k not in at_m]
    if missing:
      raise ValueError(f"--stage=inner needs the seed-0 runs at M = {m} of the {preset} model "
                       f"at {steps} steps for {missing}")
    runs += [method_run(kind, m, at_m[(kind, receipt)] + config.inner_label(base * scale), 0,
                        steps, preset) for kind, receipt in wanted for scale in scales]
  return runs


def stage_cross(rows: list[dict], steps: int, learners=config.LEARNERS) -> list[Run]:
  """Seed 0 of synchronous DiLoCo and Decoupled (overwrite) at each M of `learners` at the
  other method's pick (outer and inner rates), where that combination has not run: the two
  are then compared at each other's best setting, not only at their own."""
  group = _tiny(rows, steps)
  names = {r["method"] for r in group}
  runs = []
  for m in learners:
    at_m = mode_picks(group, m)
    pair = {"diloco": at_m.get(("diloco", "overwrite")),
            "decoupled": at_m.get(("decoupled", "overwrite"))}
    if None in pair.values():
      raise ValueError(f"--stage=cross needs seed-0 runs of both methods at M = {m} of the "
                       f"tiny model at {steps} steps")
    for kind, other in (("diloco", "decoupled"), ("decoupled", "diloco")):
      _, outer = parse_setting(pair[other])
      inner = inner_of(pair[other])
      setting = _setting(kind, "overwrite", outer, inner)
      if f"{kind} M={m} {setting}" not in names:
        runs.append(method_run(kind, m, setting, 0, steps))
  return runs


def stage_m1(rows: list[dict], steps: int, settings=config.M1_RUNS) -> list[Run]:
  """Seed 0 at M = 1 of each (kind, receipt, outer) of `settings`, at the data-parallel
  reference's inner rate, where that run has not run yet (`config.M1_RUNS` says what each
  separates)."""
  reference = _reference(rows, steps)
  inner = inner_of(reference) if reference else None
  names = {r["method"] for r in _tiny(rows, steps)}
  runs = []
  for kind, receipt, outer in settings:
    setting = _setting(kind, receipt, outer, inner)
    if f"{kind} M=1 {setting}" not in names:
      runs.append(method_run(kind, 1, setting, 0, steps))
  return runs


def stage_small(rows: list[dict], steps: int, small_steps: int) -> list[Run]:
  """The second model size, seed 0: data-parallel at the tiny reference's inner rate against
  Decoupled M = 4 at its tiny pick (receipt, outer and inner rates): each method at the
  setting tuned one size down, since a sweep at `small` does not fit the host."""
  picked = rows_lib.picks(_tiny(rows, steps)).get(("decoupled", 4))
  if picked is None:
    raise ValueError("--stage=small needs stage one's Decoupled M = 4 runs of the tiny model "
                     f"at {steps} steps")
  receipt, outer = parse_setting(picked)
  reference = _reference(rows, steps)
  shape = dict(preset="small", seq_len=config.SMALL_SEQ_LEN, eval_every=config.SMALL_EVAL_EVERY)
  return [config.dp(0, small_steps, inner_lr=inner_of(reference) if reference else None,
                    **shape),
          config.diloco("decoupled", 4, outer, 0, small_steps, receipt,
                        inner_lr=inner_of(picked), **shape)]


def stage_size(rows: list[dict], steps: int, pick_steps: int, preset: str,
               learners=config.SIZE_LEARNERS, *, batch: int = config.DP_BATCH,
               pick_preset: str = "tiny", scales=config.SIZE_INNER_SCALES) -> list[Run]:
  """Seed 0 of the protocol at `preset` and global batch `batch` (`steps`: its 20N):
  data-parallel at the preset's inner rate times each of `scales`; once all of them have rows,
  synchronous DiLoCo and Decoupled (overwrite) at each M of `learners` at the reference's
  inner rate (`size_methods`)."""
  base = config.preset_inner_lr(preset)
  runs = [config.dp(0, steps, batch, preset=preset,
                    inner_lr=None if scale == 1 else base * scale, **config.batch_shape(batch))
          for scale in scales]
  group = _tiny(rows, steps, preset)
  # A row's method names the tuned rate "data-parallel": match the rates by setting instead.
  done = {r["setting"] for r in group
          if r["kind"] == "data-parallel" and r["seed"] == 0 and r["batch"] == batch}
  if any(("" if scale == 1 else config.inner_label(base * scale).strip()) not in done
         for scale in scales):
    return runs  # the reference is picked from all of them first
  reference = _reference(rows, steps, preset)
  inner = inner_of(reference) if reference else None
  return runs + size_methods(rows, steps, pick_steps, preset, learners, inner, batch=batch,
                             pick_preset=pick_preset)


def size_methods(rows: list[dict], steps: int, pick_steps: int, preset: str, learners,
                 inner: float | None, *, batch: int = config.DP_BATCH,
                 pick_preset: str = "tiny", muon: float | None = None,
                 beside=config.SIZE_OUTER) -> list[Run]:
  """Stage size's DiLoCo runs at inner rate `inner` (None: the preset's) and Muon rate `muon`
  (None: config.MUON_LR, or no Muon): at each M, each method first at the outer setting it
  picked in `pick_preset`'s group at `pick_steps` (the runs or carried rows), then at the
  neighbours `beside`."""
  suffix = config.inner_label(inner) if inner is not None else ""
  suffix += config.muon_label(muon) if muon is not None else ""
  picked_from = _tiny(rows, pick_steps, pick_preset)
  firsts, neighbours = [], []
  for m in learners:
    at_m = mode_picks(picked_from, m)
    for kind in ("diloco", "decoupled"):
      prefix = "overwrite " if kind == "decoupled" else ""
      pick = at_m.get((kind, "overwrite"))
      outers = [parse_setting(pick)[1]] if pick else []
      firsts += [method_run(kind, m, prefix + config.outer_label(*o) + suffix, 0, steps, preset,
                            batch) for o in outers]
      neighbours += [method_run(kind, m, prefix + config.outer_label(*o) + suffix, 0, steps,
                                preset, batch) for o in beside if o not in outers]
  return firsts + neighbours


def stage_optim(rows: list[dict], steps: int, preset: str, optimizer: str,
                learners=config.SIZE_LEARNERS, scales=config.MUON_SCALES) -> list[Run]:
  """Seed 0 of the protocol with inner optimizer `optimizer` at `preset` (its group:
  `config.model_label`): data-parallel with Muon's matrix rate at config.MUON_LR times each of
  `scales`, the rest of the model at the AdamW reference's inner rate; once all have rows,
  both DiLoCo methods at each M of `learners` at that group's reference rates, each at the
  outer setting it picked in the AdamW group (`size_methods`, no neighbours)."""
  if optimizer != "muon":
    raise ValueError(f"--stage=optim compares 'muon' with AdamW, got --optimizer={optimizer!r}")
  adamw = _tiny(rows, steps, preset)
  if not any(r["method"] == "data-parallel" for r in adamw):
    raise ValueError(f"--stage=optim needs the AdamW data-parallel runs of the {preset} model "
                     f"at {steps} steps (its reference's inner rate)")
  inner = inner_of(_reference(rows, steps, preset))
  label = config.model_label(preset, optimizer)
  rates = [None if scale == 1 else config.MUON_LR * scale for scale in scales]
  runs = [config.dp(0, steps, preset=label, inner_lr=inner, muon_lr=rate) for rate in rates]
  done = {(inner_of(r["setting"]), muon_of(r["setting"])) for r in _tiny(rows, steps, label)
          if r["kind"] == "data-parallel" and r["seed"] == 0 and r["batch"] == config.DP_BATCH}
  if any((inner, rate) not in done for rate in rates):
    return runs  # the reference is picked from all of them first
  reference = _reference(rows, steps, label)
  return runs + size_methods(rows, steps, steps, label, learners, inner_of(reference),
                             pick_preset=preset, muon=muon_of(reference), beside=())


def batch_steps(preset: str, batch: int, steps: int) -> int:
  """The steps at global batch `batch` that train the tokens of `steps` at DP_BATCH: 20N's
  own rounding (`compute_optimal_steps`) when `steps` is 20N."""
  if steps == config.compute_optimal_steps(preset):
    return config.compute_optimal_steps(preset, batch)
  return max(1, round(steps * config.DP_BATCH / batch))


def stage_batch(rows: list[dict], steps: int, preset: str, learners=config.SIZE_LEARNERS,
                batches=config.BATCH_SWEEP, scales=config.SIZE_INNER_SCALES) -> list[Run]:
  """Stage size at each global batch of `batches` at the tokens of `steps` x DP_BATCH: each
  batch its own (preset, steps) group, its data-parallel inner rate tuned anew over `scales`,
  its DiLoCo runs first at the outer settings picked in `preset`'s DP_BATCH group at `steps`."""
  main = _tiny(rows, steps, preset)
  missing = [(kind, m) for m in learners for kind in ("diloco", "decoupled")
             if (kind, "overwrite") not in mode_picks(main, m)]
  if missing:
    raise ValueError(f"--stage=batch needs the seed-0 runs of {missing} (kind, M) of the "
                     f"{preset} model at batch {config.DP_BATCH} and {steps} steps (--stage=size)")
  runs = []
  for batch in batches:
    runs += stage_size(rows, batch_steps(preset, batch, steps), steps, preset, learners,
                       batch=batch, pick_preset=preset, scales=scales)
  return runs


def _setting(kind: str, receipt: str, outer: tuple[float, float], inner: float | None,
             period: int = config.PERIOD, restart: int = 0, muon: float | None = None) -> str:
  """The setting string of a DiLoCo run (synchronous DiLoCo names no receipt)."""
  return ((f"{receipt} " if kind == "decoupled" else "") + config.outer_label(*outer)
          + (config.inner_label(inner) if inner is not None else "")
          + (config.muon_label(muon) if muon is not None else "")
          + (config.restart_label(restart) if restart else "") + config.period_label(period))


def stage_period(rows: list[dict], steps: int, preset: str, learners=config.PERIOD_LEARNERS,
                 periods=config.PERIODS, receipts=("overwrite",), seed: int = 0,
                 outers=None) -> list[Run]:
  """Seed `seed` of synchronous DiLoCo and Decoupled at each M of `learners` at their picks
  (outer and inner rates, picked at seed 0) of `preset`'s group at `steps`, with H at each of
  `periods` (Decoupled's fragments scaled with H, `config.fragments`), Decoupled at each
  receipt of `receipts`, and each method at each (rate, momentum) of `outers` in place of its
  pick's outer setting when given. A receipt or outer setting other than the pick's runs at
  the study's PERIOD too, its reference (the pick's own run there is the group's, seeds 1 and
  2 from stages 2 and 3)."""
  picked = rows_lib.picks(_tiny(rows, steps, preset))
  missing = [(kind, m) for m in learners for kind in ("diloco", "decoupled")
             if (kind, m) not in picked]
  if missing:
    raise ValueError(f"--stage=period needs the seed-0 runs of {missing} (kind, M) of the "
                     f"{preset} model at {steps} steps")
  runs = []
  for h in (*periods, *(() if config.PERIOD in periods else (config.PERIOD,))):
    for m in learners:
      for kind in ("diloco", "decoupled"):
        own, picked_outer = parse_setting(picked[(kind, m)])
        inner = inner_of(picked[(kind, m)])
        runs += [method_run(kind, m, _setting(kind, receipt, outer, inner, h), seed, steps,
                            preset)
                 for outer in (outers or (picked_outer,))
                 for receipt in (receipts if kind == "decoupled" else (own,))
                 if h != config.PERIOD or receipt != own or outer != picked_outer]
  return runs


def stage_outer(rows: list[dict], steps: int, preset: str, learners=config.PERIOD_LEARNERS,
                outers=config.OUTER_BELOW, receipts=("overwrite",),
                restarts=(0,)) -> list[Run]:
  """Seed 0 of synchronous DiLoCo and Decoupled (each receipt of `receipts`) at each M of
  `learners` and each outer setting of `outers`, at `preset`'s group at `steps`: its global
  batch and its data-parallel reference's inner (and Muon) rate, with the outer momentum
  restarted every
  R rounds for each R of `restarts` (0: never; a setting without momentum has nothing to
  restart and runs at 0 only). The runs join the group, so the picks (and stages two and
  three) follow the rule over the wider grid."""
  group = _tiny(rows, steps, preset)
  # The reference's setting is "" at the preset's inner rate: ask for its rows instead.
  if not any(r["kind"] == "data-parallel" for r in group):
    raise ValueError(f"--stage=outer needs the data-parallel runs of the {preset} model at "
                     f"{steps} steps")
  reference = _reference(rows, steps, preset)
  inner, muon, batch = inner_of(reference), muon_of(reference), _batch(group)
  return [method_run(kind, m, _setting(kind, receipt, outer, inner, restart=r, muon=muon), 0,
                     steps, preset, batch)
          for m in learners for kind in ("diloco", "decoupled")
          for receipt in (receipts if kind == "decoupled" else ("overwrite",))
          for outer in outers for r in restarts if r == 0 or outer[1] > 0]


def batch_plan(rows: list[dict], steps: int, preset: str, learners, runs: list[Run],
               batches=config.BATCH_SWEEP) -> list[str]:
  """One line per global batch of `stage_batch`: its steps, warmup, evaluation cadence and
  learners' batches, the runs of `runs` at it, and its DiLoCo runs in all (proposed once its
  data-parallel rates all have rows, by `--stage=batch`'s second pass or its next call)."""
  lines = []
  for batch in batches:
    b_steps, shape = batch_steps(preset, batch, steps), config.batch_shape(batch)
    mine = [r for r in runs if dict(r.overrides)["train.steps"] == b_steps]
    dps = sum(dict(r.labels)["kind"] == "data-parallel" for r in mine)
    methods = size_methods(rows, b_steps, steps, preset, learners, None, batch=batch,
                           pick_preset=preset)
    lines.append(f"  batch {batch}: {b_steps} steps, warmup {shape['warmup']}, eval every "
                 f"{shape['eval_every']}, learners' batches "
                 + ", ".join(f"M={m}: {batch // m}" for m in learners)
                 + f"; proposed now: {dps} data-parallel, {len(mine) - dps} DiLoCo; "
                 f"{len(methods)} DiLoCo runs in all")
  return lines
