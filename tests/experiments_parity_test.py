"""The parity experiment's run list and its pipeline end to end at a tiny size."""

import json
import os

import pytest

from experiments import harness
from experiments.parity import config
from experiments.parity import run as parity_run


def test_every_method_trains_the_same_tokens_and_scores_the_same_windows():
  tuned = config.SWEEP[3]
  assert tuned[0] == "outer 1.4/0.0"
  runs = (config.sweep("cpu") + config.with_tuned(tuned, "cpu") + config.inner(tuned, "cpu")
          + config.longer(tuned, "cpu"))
  assert len({r.name for r in runs}) == len(runs)
  methods = {r.method for r in runs}
  for needed in ("data-parallel", "data-parallel B=8", "decoupled outer 0.7/0.9",
                 "diloco outer 1.4/0.0", "streaming outer 1.4/0.0",
                 "decoupled M=1 outer 1.4/0.0", "decoupled outer 1.4/0.0"):
    assert needed in methods
  for r in runs:
    o = dict(r.overrides)
    learners = o.get("learners.count", 1)
    # Batch x eval batches = the same 128 held-out windows for every run.
    assert o["train.batch_size"] * o["train.eval_batches"] == config.EVAL_WINDOWS
    if r.method.startswith("decoupled warm"):
      continue
    if (r.method.startswith("data-parallel") and "B=" not in r.method) or learners > 1:
      assert learners * o["train.batch_size"] == config.DP_BATCH  # equal tokens per step
    assert o.get("train.steps", config.STEPS) == dict(r.labels)["steps"]
  by_method = {r.method: dict(r.overrides) for r in runs}
  warm = by_method["decoupled warm start outer 1.4/0.0"]
  assert warm["train.init_from"] == "runs/experiments/parity/data-parallel__s1/checkpoints/40"
  assert warm["train.steps"] == 80 and warm["outer.learning_rate"] == 1.4
  # Equal tokens: 40 data-parallel steps of 32 sequences + 80 steps of 4 learners x 8.
  assert (config.WARM_STEPS * config.DP_BATCH + warm["train.steps"] * 4 * 8
          == config.STEPS * config.DP_BATCH)
  assert by_method["diloco outer 1.4/0.0"]["sync.period"] == 24  # the same H as Decoupled
  # Second seeds of the baselines and the M = 1 check; the longer runs at the tuned setting.
  seeds = {}
  for r in runs:
    seeds.setdefault(r.method, set()).add(r.seed)
  for method in ("diloco outer 1.4/0.0", "streaming outer 1.4/0.0", "data-parallel B=8",
                 "decoupled M=1 outer 1.4/0.0", "data-parallel", "decoupled outer 1.4/0.0"):
    assert seeds[method] == {0, 1}, method
  for steps in config.LENGTHS:
    assert by_method[f"data-parallel {steps} steps"]["train.steps"] == steps
    long = by_method[f"decoupled outer 1.4/0.0 {steps} steps"]
    assert long["train.steps"] == steps and long["outer.learning_rate"] == 1.4
  for lr in config.INNER_LRS:
    assert by_method[f"decoupled outer 1.4/0.0 inner lr {lr:g}"]["optim.learning_rate"] == lr
  assert by_method["decoupled M=2 outer 1.4/0.0"]["train.batch_size"] == 16
  h8 = dict(config.SWEEP)["H=8 outer 1.0/0.0"]
  assert "sync.num_fragments" not in dict(config.diloco("cpu", "diloco", ("x", h8)).overrides)


def test_the_sweep_picks_the_setting_of_lowest_loss():
  best = config.tuned_setting({"outer 1.0/0.0": 1.80, "outer 0.7/0.9": 1.90,
                               "outer 1.4/0.0": 1.75})
  assert best == ("outer 1.4/0.0", (("outer.learning_rate", 1.4), ("outer.momentum", 0.0)))
  assert config.tuned_setting({})[0] == "outer 0.7/0.9"  # the design's


def test_ratios_are_taken_against_data_parallel_of_the_same_seed():
  rows = [{"method": "data-parallel", "seed": 0, "eval_loss": 2.0},
          {"method": "data-parallel", "seed": 1, "eval_loss": 1.0},
          {"method": "x", "seed": 1, "eval_loss": 1.5}, {"method": "x", "seed": 7,
                                                         "eval_loss": 3.0}]
  ratios = [r["ratio_to_dp"] for r in parity_run.with_ratios(rows)]
  assert ratios == [1.0, 1.0, 1.5, 2.0]  # seed 7 has no data-parallel row: the mean (1.5)
  # A longer run is compared with data-parallel of its own length, not the presets'.
  rows = [{"method": "data-parallel", "seed": 0, "steps": 120, "eval_loss": 2.0},
          {"method": "data-parallel 480 steps", "seed": 0, "steps": 480, "eval_loss": 1.6},
          {"method": "data-parallel B=8", "seed": 0, "steps": 120, "eval_loss": 2.2},
          {"method": "decoupled x 480 steps", "seed": 0, "steps": 480, "eval_loss": 1.68}]
  ratios = [r["ratio_to_dp"] for r in parity_run.with_ratios(rows)]
  assert ratios == [1.0, 1.0, 1.1, 1.05]


def test_run_length_section_pairs_each_length(tmp_path):
  rows = [{"method": m, "seed": 0, "steps": n, "tokens": n * 32 * 128, "eval_loss": loss}
          for m, n, loss in [("data-parallel", 120, 2.0), ("decoupled x", 120, 2.3),
                             ("decoupled M=1 x", 120, 2.5), ("data-parallel 480 steps", 480, 1.6),
                             ("decoupled x 480 steps", 480, 1.68)]]
  text = "\n".join(parity_run.length_section(parity_run.with_ratios(rows), str(tmp_path)))
  assert "| 120 | 491520 | 2 | 2.3 | 1.15 | decoupled x |" in text
  assert "| 480 | 1966080 | 1.6 | 1.68 | 1.05 | decoupled x 480 steps |" in text
  assert os.path.getsize(tmp_path / "length.png") > 10_000
  assert parity_run.length_section(rows[:3], str(tmp_path)) == []  # one length: no section


@pytest.mark.slow
def test_pipeline_writes_results_readme_and_plots(tmp_path):
  outdir, folder = str(tmp_path / "runs"), str(tmp_path / "results")
  os.makedirs(folder)
  # Two runs of the sweep at 4 steps of the tiny model; the sweep's only finished Decoupled
  # run then sets the outer setting of the rest.
  first = [r for r in config.shrink(config.sweep("tiny"), 4)
           if r.method in ("data-parallel", "decoupled outer 0.7/0.9")]
  wall = harness.run_all(first, outdir)
  runs, _ = parity_run.all_runs(outdir, "tiny", 4, execute=False)
  assert len(runs) == (len(config.SWEEP) + 1 + len(config.with_tuned(config.SWEEP[0]))
                       + len(config.inner(config.SWEEP[0])) + 2 * len(config.LENGTHS))
  assert "diloco outer 0.7/0.9" in {r.method for r in runs}
  results = harness.report("parity", runs, outdir, folder, columns=config.COLUMNS, wall_s=wall,
                           derive=parity_run.with_ratios, sections=parity_run.sections(folder),
                           about=config.__doc__, command="python -m experiments.parity.run")
  assert json.load(open(os.path.join(folder, "results.json"))) == results
  rows = {r["method"]: r for r in results["rows"]}
  assert rows["data-parallel"]["ratio_to_dp"] == 1.0
  dec = rows["decoupled outer 0.7/0.9"]
  assert dec["tokens"] == rows["data-parallel"]["tokens"] == 4 * 32 * 64
  assert dec["ratio_to_dp"] == pytest.approx(dec["eval_loss"] / rows["data-parallel"]["eval_loss"],
                                             abs=1e-4)
  readme = open(os.path.join(folder, "README.md")).read()
  assert "## Sweep of Decoupled settings" in readme and "| outer 0.7/0.9 |" in readme
  assert "Expected outcome" in readme  # the config's docstring heads the report
  for plot in ("eval.png", "methods.png"):
    assert os.path.getsize(os.path.join(folder, plot)) > 10_000
