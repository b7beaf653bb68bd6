"""The scaling runner end to end on a few real short runs (a file of its own, so that
`--dist loadfile` can run it beside experiments_scaling_test.py's GPU rehearsal)."""

import os
import subprocess
import sys

import pytest

from experiments.scaling import rows


@pytest.mark.slow
def test_runner_end_to_end_with_real_short_runs(tmp_path):
  """Data-parallel at both batches and Decoupled M = 2, 12 steps, two at once, then the
  report: picks, provenance and the table come from the real runs' files."""
  outdir, folder = str(tmp_path / "runs"), str(tmp_path / "out")
  code = subprocess.call(
      [sys.executable, "-m", "experiments.scaling.run", "--stage=1", "--steps=12",
       "--learners=2", "--only=tiny data-parallel,keep_local outer 0.4", f"--outdir={outdir}",
       f"--results_dir={folder}", "--parallel=2", "--threads=1", "--machine_label=ci"],
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert code == 0
  found = rows.collect(outdir)
  assert {r["method"] for r in found} == {"data-parallel", "data-parallel B=16",
                                         "decoupled M=2 keep_local outer 0.4/0.9"}
  assert all(r["machine"] == "ci" and r["device"].startswith("cpu") for r in found)
  assert "Decoupled DiLoCo (ours)" in open(os.path.join(folder, "README.md")).read()
