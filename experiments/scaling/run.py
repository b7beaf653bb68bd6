"""Runs the `scaling` experiment (compute-optimal parity) and regenerates its report.

    python -m experiments.scaling.run [--stage=all] [--parallel=1 --threads=0] [--only=...]

Stage one is the seed-0 sweep, stage two the second seeds at the settings stage one picked,
stage three the third seeds where two leave a comparison within noise (`stages.py`), and
`small` the second model size. Every stage skips finished runs, so an interrupted or partial
invocation resumes; `--report_only` regenerates README.md, results.json and the plots from
whatever runs `--outdir` holds (runs copied back from another machine included).
See `config.py` for the setting and the targets, README.md for the commands and timings.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from experiments import harness
from experiments.scaling import config, figures, pool, report, report_batch, stages
from experiments.scaling import rows as rows_lib

STAGES = ("1", "2", "3", "all", "small", "m8", "inner", "cross", "m1", "size", "batch", "optim",
          "period", "outer", "none")


def define_flags() -> None:
  """The command line (defined only when run as a script, so tests can import this)."""
  harness.define_flags(config.NAME, os.path.dirname(os.path.abspath(__file__)))
  flags.DEFINE_enum("stage", "all", STAGES,
                    "1, 2, 3, all (1 then 2 then 3), small, m8 (M = 8 and 1 at picks from M = 4 "
                    "and 2), inner (other inner learning rates, --inner_scales), cross (each "
                    "method at the other's pick), m1 (M = 1 controls, config.M1_RUNS), size (the "
                    "protocol at --preset, config.SIZE_*), batch (stage size at each global "
                    "batch of --batches), period (H at each of --periods, Decoupled at each of "
                    "--receipts), outer (the DiLoCo methods at each of --outer), optim (the "
                    "protocol with --optimizer inside, config.MUON_*), none.")
  flags.DEFINE_enum("preset", "tiny", ("tiny", "nano", "mini"),
                    "The model of --stage=size, batch, period, inner, 2 and 3 (its steps: 20N "
                    "unless --steps).")
  flags.DEFINE_enum("optimizer", "adamw", config.OPTIMIZERS,
                    "The inner optimizer of --stage=optim, outer, 2 and 3: another than AdamW is a "
                    "group of its own, model '<preset>+<optimizer>'.")
  flags.DEFINE_integer("steps", 0, "Steps per run of --preset's model; 0: 20N tokens.")
  flags.DEFINE_integer("small_steps", config.SMALL_STEPS, "Steps of the `small` runs.")
  flags.DEFINE_list("learners", [str(m) for m in config.LEARNERS], "The values of M "
                    "(--stage=period: config.PERIOD_LEARNERS unless given).")
  flags.DEFINE_list("only", [], "Run only the runs whose method contains one of these "
                    "(e.g. 'tiny data-parallel,M=4 keep_local'), in that order; empty: all.")
  flags.DEFINE_integer("parallel", 1, "Runs at a time.")
  flags.DEFINE_integer("threads", 0, "Cores each run is pinned to (0: no pinning).")
  flags.DEFINE_string("machine_label", "", "Names this machine in each run's provenance.")
  flags.DEFINE_integer("seed", 0, "The seed of --stage=m8's and --stage=period's runs.")
  flags.DEFINE_list("batches", [str(b) for b in config.BATCH_SWEEP],
                    "--stage=batch: the global batches beside config.DP_BATCH (powers of 2; "
                    "each must split over every M of --learners).")
  flags.DEFINE_list("outer", [f"{lr:g}/{mom:g}" for lr, mom in config.OUTER_BELOW],
                    "--stage=outer: the outer settings, LR/MOMENTUM each; --stage=period: "
                    "each method at these instead of its pick's (only when given).")
  flags.DEFINE_list("restarts", ["0"], "--stage=outer: the outer-momentum restart periods "
                    "R (rounds of a fragment; 0: never) of each setting with momentum.")
  flags.DEFINE_list("periods", [str(h) for h in config.PERIODS],
                    "--stage=period: the periods H beside the study's 30 (each above "
                    f"Decoupled's tau = {config.TAU}).")
  flags.DEFINE_list("receipts", ["overwrite"], "--stage=period and outer: Decoupled's "
                    f"receipts ({', '.join(config.RECEIPTS)}).")
  flags.DEFINE_list("inner_scales", [str(s) for s in config.INNER_SCALES],
                    "--stage=inner: the factors on the reference's inner learning rate.")
  flags.DEFINE_list("size_scales", [f"{s:g}" for s in config.SIZE_INNER_SCALES],
                    "--stage=size and batch: data-parallel's inner rates, as factors on the "
                    "preset's.")
  flags.DEFINE_bool("dry_run", False, "Print the runs the stage would start, run nothing.")


def stage_runs(stage: str, outdir: str, steps: int, learners: tuple[int, ...],
               small_steps: int, found: list[dict] | None = None,
               seed: int = 0, inner_scales=config.INNER_SCALES,
               preset: str = "tiny", batches=config.BATCH_SWEEP, outers=None,
               receipts=("overwrite",),
               size_scales=config.SIZE_INNER_SCALES,
               periods=config.PERIODS, restarts=(0,)) -> list[harness.Run]:
  """The runs of `stage`, derived from `found` (default: the runs `outdir` holds now; the
  runner passes those plus the rows carried from the earlier results.json, `rows.merged`).
  `preset` (stages size, batch, period, inner, 2 and 3) names the model; stage size reads
  tiny's picks at 20N, stages batch and period `preset`'s own at `steps`. `outers`: stage
  outer's settings (default `config.OUTER_BELOW`), or stage period's in place of each method's
  pick (default: the picks'). `periods`: stage period's H values beside the study's;
  `restarts`: stage outer's outer-momentum restart periods (0: never)."""
  if found is None:
    found = rows_lib.collect(outdir)
  if stage == "1":
    return config.stage_one(steps, learners)
  if stage == "m8":
    return stages.stage_m8(found, steps, seed)
  if stage == "inner":
    return stages.stage_inner(found, steps, learners, inner_scales, preset)
  if stage == "cross":
    return stages.stage_cross(found, steps, learners)
  if stage == "m1":
    return stages.stage_m1(found, steps)
  if stage == "size":
    return stages.stage_size(found, steps, config.compute_optimal_steps(), preset, learners,
                             scales=size_scales)
  if stage == "batch":
    return stages.stage_batch(found, steps, preset, learners, batches, size_scales)
  if stage == "period":
    return stages.stage_period(found, steps, preset, learners, periods, receipts=receipts,
                               seed=seed, outers=outers)
  if stage == "outer":
    return stages.stage_outer(found, steps, preset, learners, outers or config.OUTER_BELOW,
                              receipts, restarts)
  if stage == "optim":
    return stages.stage_optim(found, steps, config.preset_of(preset),
                              config.optimizer_of(preset), learners)
  if stage == "2":
    return stages.stage_two(found, steps, learners, preset)
  if stage == "3":
    return stages.stage_three(found, steps, learners, preset=preset)
  return stages.stage_small(found, steps, small_steps)


def execute(stage: str, outdir: str, steps: int, learners: tuple[int, ...], *,
            small_steps: int = config.SMALL_STEPS, only=(), parallel: int = 1,
            threads: int = 0, label: str = "", folder: str = "", seed: int = 0,
            dry_run: bool = False, inner_scales=config.INNER_SCALES,
            preset: str = "tiny", batches=config.BATCH_SWEEP, outers=None,
            receipts=("overwrite",), size_scales=config.SIZE_INNER_SCALES,
            periods=config.PERIODS, restarts=(0,)) -> float:
  """Runs `stage` ("all": 1, 2, 3 in turn, each derived from the previous; "size" and
  "batch": twice, the second pass once the data-parallel references are known); returns the
  wall seconds spent. A run with a row in `folder`'s results.json (carried from another
  machine) counts as done. `dry_run` only prints the runs (and, for "batch", each batch's
  plan: `stages.batch_plan`)."""
  wall = 0.0
  passes = {"all": ("1", "2", "3"), "size": ("size", "size"),
            "batch": ("batch", "batch")}.get(stage, (stage,))
  for s in passes:
    found = rows_lib.merged(outdir, os.path.join(folder, "results.json") if folder else "")
    carried = {r["run"] for r in found if "carried_commit" in r}
    runs = [r for r in stage_runs(s, outdir, steps, learners, small_steps, found, seed,
                                  inner_scales, preset, batches, outers, receipts,
                                  size_scales, periods, restarts)
            if (not only or any(o in r.method for o in only)) and r.name not in carried]
    # In `only`'s order (the first entry a run matches), so a queue starts with what matters.
    runs.sort(key=lambda r: next((i for i, o in enumerate(only) if o in r.method), 0))
    print(f"stage {s}: {len(runs)} runs", flush=True)
    if dry_run and s == "batch":
      print("\n".join(stages.batch_plan(found, steps, preset, learners, runs, batches)))
    if dry_run:
      for r in runs:
        done = " (finished: skipped)" if harness.finished(os.path.join(outdir, r.name)) else ""
        print(f"  {r.name}{done}: {' '.join(r.command('WORKDIR')[2:])}")
      continue
    wall += pool.run_parallel(runs, outdir, parallel=parallel, threads=threads, label=label)
  return wall


def write_report(outdir: str, folder: str, *, wall_s: float = 0.0, prefix: str = "scaling",
                 command: str = "python -m experiments.scaling.run",
                 readme: str = "README.md", about: str = config.__doc__) -> dict:
  """results.json (or `prefix`.json), the plots and `readme` in `folder`, from `outdir`."""
  path = os.path.join(folder, "results.json" if prefix == config.NAME else f"{prefix}.json")
  found = rows_lib.merged(outdir, path)
  os.makedirs(folder, exist_ok=True)
  results = harness.write_results(prefix, found, path)
  results["date"] = harness.today()  # when carried rows say where they come from
  with open(path, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=2)
  appendix = "appendix.md" if prefix == config.NAME else f"{prefix}_appendix.md"
  groups = sorted(rows_lib.groups(found).items())
  parts = [f"# Experiment `{prefix}`", "", f"Command: `{command}`", "",
           f"Report generated {harness.today()} at commit `{results['commit'][:12]}` from "
           f"{len(found)} finished runs ({wall_s / 60:.1f} min of runs in this invocation). "
           f"Every run, the machine it ran on and where each carried row comes from: "
           f"[{appendix}]({appendix}).", "", *_answer(found, folder, prefix),
           "## The protocol", "", about.strip(), ""]
  if not found:
    parts += ["No finished runs yet: run the commands below, then this report is regenerated.",
              ""]
  for (model, steps), group in groups:
    parts += report.section(model, steps, group, folder, prefix, runs_table=False)
  with open(os.path.join(folder, appendix), "w", encoding="utf-8") as f:
    f.write("\n".join([f"# Experiment `{prefix}`: every run", "",
                        f"Generated with [{readme}]({readme}) from the same {len(found)} rows.",
                        "", *report.carried_note(found),
                        *(line for (model, steps), group in groups
                          for line in report.every_run(model, steps, group))]))
  parts += report_batch.sections(found)
  for extra in ("usage.md", "gpu35m.md") if prefix == config.NAME else ():
    path = os.path.join(folder, extra)
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        parts += [f.read().strip(), ""]
  if readme == "README.md":
    harness.write_readme(folder, parts)
  else:
    with open(os.path.join(folder, readme), "w", encoding="utf-8") as f:
      f.write("\n".join(parts))
  return results


def _answer(found: list[dict], folder: str, prefix: str) -> list[str]:
  """The report's opening: the gap against N at 20N (table and plot), the per-optimizer gaps
  and Decoupled M = 4 at every size; each section below has its group's details."""
  parts = []
  by_size = report.size_table(found)
  if by_size:
    parts += ["## The gap against N at 20N, per M", "",
              "Gap to each size's own data-parallel reference (picked settings, mean over the "
              "seeds in brackets); only sizes trained at 20 tokens per parameter. The study's "
              "rows are on another corpus and tokenizer: only gaps compare; its fitted laws are "
              "quoted at tiny's N only (extrapolated 2.4 decades below its smallest model). Each "
              "method's last row: the exponent a of gap ~ N^a, a least-squares line in "
              "log-log over the sizes, at each M whose gap is at least 0.01% at every size.", "",
              by_size, ""]
    if figures.size_plot(found, os.path.join(folder, f"{prefix}_gap_against_n.png")):
      parts += [f"![gap against N]({prefix}_gap_against_n.png)", ""]
  by_optimizer = report.optimizer_table(found)
  if by_optimizer:
    parts += ["## The inner optimizer: each method against data-parallel with the same one", "",
              "A model named `P+muon` trains with Muon inside (`--stage=optim`, then stages 2 "
              "and 3 with `--optimizer=muon`); its section below has its own reference, sweep "
              "and plots. The last column compares with AdamW data-parallel's loss: a switch "
              "that lowers both sides alike narrows no gap.", "", by_optimizer, ""]
  trend = report.trend_table(found)
  if trend:
    parts += ["## Decoupled M = 4 against data-parallel, every model size", "", trend, ""]
  return parts


def _batches(values: list[str], learners: tuple[int, ...]) -> tuple[int, ...]:
  """--batches as integers, each a power of 2 that every M of `learners` divides."""
  try:
    batches = tuple(int(b) for b in values)
  except ValueError:
    raise app.UsageError(f"--batches: {','.join(values)!r} is not a list of integers") from None
  for b in batches:
    if b < 1 or b & (b - 1) or any(b % m for m in learners):
      raise app.UsageError(f"--batches: {b} is not a power of 2 that every M of --learners "
                           f"({','.join(map(str, learners))}) divides")
  return batches


def _outers(values: list[str]) -> tuple[tuple[float, float], ...]:
  """--outer as (rate, momentum) pairs."""
  try:
    return tuple(stages.parse_setting(f"outer {v}")[1] for v in values)
  except ValueError:
    raise app.UsageError(
        f"--outer: expected LR/MOMENTUM values, got {','.join(values)!r}") from None


def _scales(values: list[str]) -> tuple[float, ...]:
  """--size_scales as positive factors."""
  try:
    scales = tuple(float(v) for v in values)
  except ValueError:
    scales = ()
  if not scales or any(s <= 0 for s in scales):
    raise app.UsageError(f"--size_scales: {','.join(values)!r}: expected positive factors")
  return scales


def _periods(values: list[str]) -> tuple[int, ...]:
  """--periods as integers, each above Decoupled's tau (a learner must see its receipt before
  its next delivery, docs/design.md 2.3)."""
  try:
    periods = tuple(int(v) for v in values)
  except ValueError:
    periods = ()
  if not periods or any(h <= config.TAU for h in periods):
    raise app.UsageError(f"--periods: {','.join(values)!r}: expected integers above "
                         f"Decoupled's tau = {config.TAU}")
  return periods


def _restarts(values: list[str]) -> tuple[int, ...]:
  """--restarts as integers >= 0 (0: never restart), each at most once."""
  try:
    restarts = tuple(dict.fromkeys(int(v) for v in values))
  except ValueError:
    restarts = ()
  if not restarts or any(r < 0 for r in restarts):
    raise app.UsageError(f"--restarts: {','.join(values)!r}: expected integers >= 0 "
                         "(rounds of a fragment; 0: never)")
  return restarts


def _receipts(values: list[str]) -> tuple[str, ...]:
  bad = [v for v in values if v not in config.RECEIPTS]
  if bad or not values:
    raise app.UsageError(f"--receipts: {','.join(bad) or 'empty'}: expected some of "
                         f"{', '.join(config.RECEIPTS)}")
  return tuple(values)


def main(argv):
  del argv
  f = flags.FLAGS
  steps = f.steps or config.compute_optimal_steps(f.preset)
  learners = tuple(int(m) for m in f.learners)
  if f.optimizer != "adamw" and f.stage not in ("optim", "outer", "2", "3", "none"):
    raise app.UsageError(f"--optimizer={f.optimizer} goes with --stage=optim, outer, 2 or 3, "
                         f"not --stage={f.stage}")
  if f.stage == "optim" and f.optimizer == "adamw":
    raise app.UsageError("--stage=optim needs --optimizer (another than adamw)")
  if f.stage == "period" and not f["learners"].present:
    learners = config.PERIOD_LEARNERS
  batches = _batches(f.batches, learners) if f.stage == "batch" else config.BATCH_SWEEP
  wall = 0.0
  if not f.report_only and f.stage != "none":
    wall = execute(f.stage, f.outdir, steps, learners, small_steps=f.small_steps,
                   only=f.only, parallel=f.parallel, threads=f.threads,
                   label=f.machine_label, folder=f.results_dir, seed=f.seed,
                   dry_run=f.dry_run, inner_scales=tuple(float(s) for s in f.inner_scales),
                   preset=config.model_label(f.preset, f.optimizer), batches=batches,
                   outers=_outers(f.outer) if f["outer"].present else None,
                   receipts=_receipts(f.receipts), size_scales=_scales(f.size_scales),
                   periods=_periods(f.periods), restarts=_restarts(f.restarts))
    if f.dry_run:
      return
  write_report(f.outdir, f.results_dir, wall_s=wall)
  print(f"report: {os.path.join(f.results_dir, 'README.md')}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
