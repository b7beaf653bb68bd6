"""The ablations experiment: its run list covers every factor level, and its pipeline (runs,
results.json, README with per-factor tables, plots) works end to end at a tiny size."""

import json
import os

import pytest

from configs import decoupled
from diloco.config import run_config
from experiments import harness
from experiments.ablations import config, figures, run


def _override(cfg, overrides):
  for key, value in overrides:
    group, field = key.split(".")
    setattr(cfg[group], field, value)
  return cfg


def test_run_list_covers_every_factor_level_once_per_seed():
  runs = config.runs(seeds=(0, 1))
  levels = sum(len(v) for v in config.FACTORS.values())
  assert len(runs) == 2 * (1 + levels) and len({r.name for r in runs}) == len(runs)
  assert all(r.config == "configs/decoupled.py:tiny" for r in runs)
  assert all(dict(r.overrides)["learners.virtual_clock"] is True for r in runs)
  seen = {}
  for r in runs:
    labels = dict(r.labels)
    seen.setdefault((labels["factor"], labels["level"]), set()).add(r.seed)
  assert seen[("baseline", "baseline")] == {0, 1}
  for factor, items in config.FACTORS.items():
    for level, _ in items:
      assert seen[(factor, level)] == {0, 1}, (factor, level)
  varied = {factor: [dict(overrides) for _, overrides in items]
            for factor, items in config.FACTORS.items()}
  assert {(d["outer.quantize_bits"], d["outer.error_feedback"]) for d in varied["precision"]} == {
      (16, False), *((b, f) for b in (8, 4, 2, 1) for f in (False, True))}
  assert [d["sync.scheme"] for d in varied["fragmentation"]] == ["layer", "tensor"]
  assert {(d.get("outer.merge", "rda"), d.get("learners.count", 4))
          for d in varied["merge"]} == {("mean", 4), ("rda", 8), ("mean", 8)}
  assert [d["sync.tau"] for d in varied["tau"]] == [1, 5]
  assert varied["anchor"] == [{"outer.anchor": "base"}]
  assert varied["receipt"] == [{"receipt.mode": "mix", "receipt.mixing_alpha": 0.5}]
  # The baseline is the preset's defaults, so each factor's baseline level is what it says.
  base = run_config.from_config_dict(decoupled.get_config("tiny"))
  assert (base.outer.merge, base.learners.count, base.outer.quantize_bits, base.sync.scheme,
          base.outer.anchor, base.receipt.mixing_alpha, base.sync.tau) == (
              "rda", 4, 0, "balanced", "syncer", 0.0, 2)


def test_every_run_is_a_valid_config():
  for r in config.runs(seeds=(0,)):
    run_config.from_config_dict(_override(decoupled.get_config("tiny"), r.overrides))


def test_factor_tables_put_the_baseline_first_and_compare_with_it(tmp_path):
  rows = [{"factor": "baseline", "level": "baseline", "eval_loss": 2.0, "bytes_up": 8.0},
          {"factor": "baseline", "level": "baseline", "eval_loss": 2.2, "bytes_up": 8.0},
          {"factor": "precision", "level": "int2", "eval_loss": 2.5, "bytes_up": 1.0}]
  (base, int2) = figures.level_summary(rows, "precision")
  assert base["level"] == "fp32 (baseline)" and base["seeds"] == 2
  assert base["eval_loss_mean"] == pytest.approx(2.1) and int2["vs_baseline"] == pytest.approx(0.4)
  text = figures.factor_sections(rows, str(tmp_path))
  assert "### precision" in text and "| int2 | 1 | 2.5 |" in text
  assert os.path.getsize(tmp_path / "bars_precision.png") > 5_000


@pytest.mark.slow
def test_pipeline_end_to_end_at_a_tiny_size(tmp_path):
  short = (("train.steps", 16), ("train.eval_every", 8), ("learners.count", 2))
  runs = [r for r in config.runs(seeds=(0,), extra=short)
          if r.method in ("baseline", "precision int2 +EF")]
  assert len(runs) == 2
  outdir, folder = str(tmp_path / "runs"), str(tmp_path / "results")
  os.makedirs(folder)
  with open(os.path.join(folder, "analysis.md"), "w") as f:
    f.write("## What it means\n\nAuthored text.")
  wall = harness.run_all(runs, outdir, jobs=2)
  assert wall > 0 and all(harness.finished(os.path.join(outdir, r.name)) for r in runs)
  results = run.write_report(runs, outdir, folder, wall)
  with open(os.path.join(folder, "results.json")) as f:
    on_disk = json.load(f)
  assert on_disk == results and on_disk["experiment"] == "ablations"
  rows = {r["method"]: r for r in on_disk["rows"]}
  assert set(rows) == {"baseline", "precision int2 +EF"}
  low = rows["precision int2 +EF"]
  assert low["factor"] == "precision" and low["level"] == "int2 +EF"
  assert low["outer.quantize_bits"] == 2 and low["outer.error_feedback"] is True
  for row in rows.values():
    assert row["eval_loss"] < row["initial_loss"] and row["round_bytes_up_peak"] > 0
  # int2 payloads (2.25 bits per value with the scales) are far smaller than float32 ones.
  assert low["bytes_up"] < 0.2 * rows["baseline"]["bytes_up"]
  with open(os.path.join(folder, "README.md")) as f:
    readme = f.read()
  assert "### precision" in readme and "| int2 +EF |" in readme and "Authored text." in readme
  assert readme.index("## Per factor") < readme.index("Authored text.")
  for image in ("eval.png", "bars_precision.png", "bars_fragmentation.png"):
    assert os.path.getsize(os.path.join(folder, image)) > 5_000
