"""The heterogeneous experiment: its run list and a tiny pipeline (scavenging: its own file,
so that `--dist loadfile` runs the two pipelines on different workers)."""

import os

import pytest

from experiments import harness
from experiments.heterogeneous import config as hetero_config
from experiments.heterogeneous import run as hetero_run


def test_heterogeneous_runs_cover_every_policy_and_outer_setting_at_equal_tokens():
  runs = hetero_config.runs(seeds=(0, 1))
  # 3 policies x (2 outer settings with overwrite at 2 inner rates, the design's outer with
  # keep_local, and with keep_local and stale deliveries rebased).
  assert len(runs) == 2 * 3 * (2 * 2 + 1 + 1) and len({r.name for r in runs}) == len(runs)
  inner = [r for r in runs if "optim.learning_rate" in dict(r.overrides)]
  assert len(inner) == 2 * 3 * 2 and all(
      dict(r.overrides)["optim.learning_rate"] == 6e-3 and r.method.endswith(", inner 6e-3")
      and dict(r.overrides)["receipt.mode"] == "overwrite" for r in inner)
  # Each differs from its presets'-rate twin by the inner rate alone.
  twins = {(r.method, r.seed): dict(r.overrides) for r in runs}
  for r in inner:
    twin = twins[(r.method.removesuffix(", inner 6e-3"), r.seed)]
    assert {k: v for k, v in dict(r.overrides).items() if k != "optim.learning_rate"} == twin
  receipts = [(dict(r.overrides)["receipt.mode"], dict(r.overrides)["outer.stale"])
              for r in runs]
  assert receipts.count(("keep_local", "paper")) == 2 * 3
  assert receipts.count(("keep_local", "rebase")) == 2 * 3
  assert receipts.count(("overwrite", "paper")) == 2 * 3 * 2 * 2
  assert all(("keep_local" in r.method) == (receipt == "keep_local")
             and ("rebase" in r.method) == (stale == "rebase")
             for r, (receipt, stale) in zip(runs, receipts))
  policies = {(dict(r.overrides)["sync.quorum"], dict(r.overrides)["sync.gamma"]) for r in runs}
  assert policies == {(0, 0.0), (1, 0.0), (1, 0.8)}
  for r in runs:
    o = dict(r.overrides)
    assert o["learners.speeds"] == "1,1,1.18,1.18" and o["learners.step_jitter"] == 0.1
    assert o["train.steps"] == hetero_config.STEPS and o["learners.virtual_clock"]


@pytest.mark.slow
def test_heterogeneous_pipeline_writes_goodput_plot(tmp_path):
  """One policy, K = 1 with grace, under both receipts: the pipeline (runs, rows, sections,
  plot) treats every policy alike, and the receipt is what the rows' figures tell apart
  (K = 1 without grace in the runtime: decoupled_test's quorum and grace test)."""
  runs = [r for r in hetero_config.runs(seeds=(0,), steps=16) if "0.7/0.9" in r.method
          and r.method.startswith("K=1 + grace") and "rebase" not in r.method
          and "inner" not in r.method]
  outdir, folder = str(tmp_path / "runs"), str(tmp_path / "results")
  os.makedirs(folder)
  wall = harness.run_all(runs, outdir, jobs=2)  # a run leaves a core idle part of the time
  results = harness.report("heterogeneous", runs, outdir, folder,
                           columns=hetero_config.COLUMNS, wall_s=wall,
                           sections=hetero_run.sections(folder), command="x")
  assert [r["method"] for r in results["rows"]] == [
      "K=1 + grace, outer 0.7/0.9", "K=1 + grace, outer 0.7/0.9, keep_local"]
  for row in results["rows"]:
    assert 0 < row["goodput"] <= row["compute_goodput"] <= 1 and row["horizon_s"] > 16
    # Overwrite drops the tau steps before each receipt; keep_local drops nothing.
    assert (row["dropped_fraction"] > 1e-6) == ("keep_local" not in row["method"])
  readme = open(os.path.join(folder, "README.md")).read()
  assert "## Goodput over seeds" in readme
  assert os.path.getsize(os.path.join(folder, "goodput_vs_loss.png")) > 10_000
