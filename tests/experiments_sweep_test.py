"""experiments/sweep: grid rules, --only filters, TPU launch files, and the pipeline end to end."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from experiments.sweep import config, grid, launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu_points():
  return grid.expand(config.CPU_GRID, config.CPU_SIZES)


def test_grid_prunes_axes_that_do_not_apply():
  points = _cpu_points()
  assert len({p.label for p in points}) == len(points)  # no duplicates
  tiny = [p for p in points if p.size == "tiny"]
  by_method = {m: [p for p in tiny if p.method == m] for m in config.METHODS}
  assert [(p.M, p.K, p.H) for p in by_method["dp"]] == [(None, None, None)]
  for method in ("diloco", "streaming"):  # synchronous: K = M, one point per (M, H)
    assert {(p.M, p.K, p.H) for p in by_method[method]} == {
        (m, m, h) for m in (2, 4) for h in (8, 16)}
  assert {(p.M, p.K, p.H) for p in by_method["decoupled"]} == {
      (m, k, h) for m in (2, 4) for k in (1, m) for h in (8, 16)}
  assert {p.P for p in by_method["diloco"]} == {1}
  assert {p.P for p in by_method["streaming"] + by_method["decoupled"]} == {8}
  assert len(tiny) == 1 + 4 + 4 + 8


def test_grid_rules_cap_fragments_merge_k_and_reject_bad_values():
  sizes = {"s": dict(fragments=8, tau=2)}
  points = grid.expand({"s": dict(methods=("decoupled",), M=(1, 3), K=(1, "M"), H=(4,))}, sizes)
  assert [(p.M, p.K, p.P) for p in points] == [(1, 1, 4), (3, 1, 4), (3, 3, 4)]
  with pytest.raises(ValueError, match="H=2 must exceed the preset's tau=2"):
    grid.expand({"s": dict(methods=("decoupled",), M=(2,), K=(1,), H=(2,))}, sizes)
  with pytest.raises(ValueError, match=r"K=3 must be in \[1, M=2\]"):
    grid.expand({"s": dict(methods=("decoupled",), M=(2,), K=(3,), H=(8,))}, sizes)
  with pytest.raises(ValueError, match="method 'sgd' unknown"):
    grid.expand({"s": dict(methods=("sgd",), M=(2,), K=(1,), H=(8,))}, sizes)


def test_points_of_a_size_see_equal_tokens_on_the_virtual_clock():
  for p in _cpu_points():
    run = grid.run_of(p)
    o = dict(run.overrides)
    s = config.CPU_SIZES[p.size]
    assert o["train.batch_size"] * (p.M or 1) == s["global_batch"]
    assert o["train.steps"] == s["steps"] and o["learners.virtual_clock"] is True
    assert run.config == f"{config.CONFIGS[p.method]}:{s['preset']}"
    if p.method == "decoupled":
      assert o["sync.quorum"] == (0 if p.K == p.M else p.K)
    assert ("learners.count" in o) == (p.method != "dp")
  assert len({grid.run_of(p).name for p in _cpu_points()}) == len(_cpu_points())
  short = dict(grid.run_of(_cpu_points()[0], steps=16).overrides)
  assert short["train.steps"] == 16 and short["train.eval_every"] == 8


def test_only_filters_or_within_an_axis_and_across_axes():
  points = _cpu_points()
  wanted = grid.parse_only("size=tiny, method=dp,method=decoupled,M=4,K=1")
  assert wanted == {"size": {"tiny"}, "method": {"dp", "decoupled"}, "M": {"4"}, "K": {"1"}}
  chosen = grid.select(points, wanted)
  assert [p.label for p in chosen] == ["tiny dp", "tiny decoupled M=4 K=1 H=8",
                                       "tiny decoupled M=4 K=1 H=16"]
  all_learners = grid.select(points, grid.parse_only("size=small,method=decoupled,K=M"))
  assert [p.label for p in all_learners] == ["small decoupled M=4 K=4 H=24"]
  assert grid.select(points, grid.parse_only("")) == points


@pytest.mark.parametrize("text, message", [
    ("seed=1", "unknown axis 'seed'; allowed: size, method, M, K, H"),
    ("method", "'method' is not AXIS=VALUE"),
    ("size=", "'size=' is not AXIS=VALUE"),
])
def test_only_rejects_malformed_filters(text, message):
  with pytest.raises(ValueError, match=message):
    grid.parse_only(text)


def test_only_rejects_values_on_no_point():
  with pytest.raises(ValueError, match=r"method=sgd is on no point of this grid; method takes "
                     r"\['decoupled', 'diloco', 'dp', 'streaming'\]"):
    grid.select(_cpu_points(), grid.parse_only("method=sgd"))
  with pytest.raises(ValueError, match="H=12 is on no point"):
    grid.select(_cpu_points(), grid.parse_only("H=12"))


def test_tpu_points_render_to_manifests_and_commands(tmp_path):
  points = grid.expand(config.TPU_GRID, config.TPU_SIZES)
  assert {p.size for p in points} == set(config.TPU_SIZES)
  chosen = grid.select(points, grid.parse_only("size=gemma_2b,method=dp,method=decoupled,K=1"))
  rows = launch.render(chosen, str(tmp_path))
  assert [(r["method"], r["launch"]) for r in rows] == [
      ("dp", "commands.sh"), ("decoupled", "gemma-2b-decoupled-m8-k1-h24.yaml")]
  manifest = yaml.safe_load((tmp_path / "gemma-2b-decoupled-m8-k1-h24.yaml").read_text())
  jobs = {j["name"]: j for j in manifest["spec"]["replicatedJobs"]}
  assert manifest["kind"] == "JobSet" and manifest["metadata"]["name"] == "dd-gemma-2b-decoupled-m8-k1-h24"
  assert list(jobs) == ["syncer"] + [f"learner-{i}" for i in range(8)]
  (container,) = jobs["learner-3"]["template"]["spec"]["template"]["spec"]["containers"]
  command = container["command"]
  for flag in ("--config=configs/decoupled.py:gemma_2b", "--config.learners.count=8",
               "--config.sync.quorum=1", "--config.sync.period=24",
               "--config.sync.num_fragments=24", f"--config.data.path={config.DATA_PATH}",
               f"--store={config.BUCKET}/gemma-2b-decoupled-m8-k1-h24", "--learner_id=3"):
    assert flag in command
  script = (tmp_path / "commands.sh").read_text()
  assert "python -m diloco.main --config=configs/dp.py:gemma_2b" in script
  assert "--output=gemma-2b-decoupled-m8-k1-h24.yaml" in script
  assert "kubectl apply -f gemma-2b-decoupled-m8-k1-h24.yaml" in script


@pytest.mark.slow
def test_sweep_end_to_end_at_tiny_size(tmp_path):
  folder, outdir = tmp_path / "results", tmp_path / "runs"
  folder.mkdir()
  (folder / "analysis.md").write_text("## What it means\n\nAuthored text.")
  argv = [sys.executable, "-m", "experiments.sweep.run", "--steps=16", "--jobs=2",
          "--only=size=tiny,method=dp,method=decoupled,M=2,K=1,H=8",
          f"--outdir={outdir}", f"--results_dir={folder}"]
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, check=False)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "2 of 22 CPU points run, 25 TPU points rendered" in out.stdout
  results = json.loads((folder / "results.json").read_text())
  assert results["experiment"] == "sweep" and len(results["commit"]) in (7, 40) or (
      results["commit"] == "unknown")
  rows = {r["point"]: r for r in results["rows"]}
  assert set(rows) == {"tiny dp", "tiny decoupled M=2 K=1 H=8"}
  dp, dd = rows["tiny dp"], rows["tiny decoupled M=2 K=1 H=8"]
  assert dp["tokens"] == dd["tokens"] == 16 * 16 * 64  # steps x global batch x sequence
  for r in (dp, dd):
    assert r["seed"] == 0 and r["eval_loss"] < r["initial_loss"]
  assert (dp["M"], dp["K"], dp["H"]) == (None, None, None)
  assert (dd["method"], dd["M"], dd["K"], dd["H"]) == ("decoupled", 2, 1, 8)
  assert dd["goodput"] > 0 and dd["bytes_up"] > 0 and "goodput" not in dp
  assert len(results["rendered"]) == 25 and all(r["params"] for r in results["rendered"])
  readme = (folder / "README.md").read_text()
  assert "| tiny | decoupled | 2 | 1 | 8 | 8 |" in readme and "| tiny | dp |  |" in readme
  assert "Not run yet: tiny diloco M=2 K=2 H=8" in readme and "Authored text." in readme
  assert "| gemma_9b | decoupled | 8 | 1 | 24 | 24 |" in readme
  for plot in ("sweep.png", "eval_tiny.png"):
    assert f"]({plot})" in readme and (folder / plot).stat().st_size > 10_000
  assert len(list((folder / "launch").glob("*.yaml"))) == 20
  # Resumable: a second invocation reuses both runs and regenerates the same rows.
  again = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, check=False)
  assert again.returncode == 0 and "[1/1]" not in again.stdout
  assert json.loads((folder / "results.json").read_text())["rows"] == results["rows"]
