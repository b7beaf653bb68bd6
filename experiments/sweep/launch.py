"""Launch files of the TPU points: JobSet manifests from `diloco jobset`, and commands.

These points are rendered, never run here: a DiLoCo-family point becomes a JobSet (one TPU
slice per learner, a CPU syncer, the store on GCS) built by `diloco.deploy.jobset`, so
the manifests pass its checks (config builds, mesh fits the slice); a `dp` point is the one
command that every host of a single slice runs. `commands.sh` lists how to reproduce and
apply each file.
"""

from __future__ import annotations

import os

from diloco.deploy import jobset
from experiments.sweep import config
from experiments.sweep.grid import Point


def overrides(point: Point, data_path: str) -> list[str]:
  """KEY=VALUE config overrides of a point (M travels as the JobSet's --learners)."""
  out = [f"data.path={data_path}"]
  if point.method != "dp":
    out += [f"sync.period={point.H}", f"sync.num_fragments={point.P}"]
  if point.method == "decoupled":
    out.append(f"sync.quorum={0 if point.K == point.M else point.K}")
  return out


def jobset_argv(point: Point, *, image: str, bucket: str, data_path: str) -> list[str]:
  size = config.TPU_SIZES[point.size]
  return [f"--name=dd-{point.slug}", f"--image={image}", f"--store={bucket}/{point.slug}",
          f"--config={config.CONFIGS[point.method]}:{size['preset']}",
          f"--learners={point.M}", f"--tpu_type={size['tpu_type']}",
          *(f"--override={o}" for o in overrides(point, data_path))]


def dp_command(point: Point, *, bucket: str, data_path: str) -> str:
  size = config.TPU_SIZES[point.size]
  return (f"python -m diloco.main --config={config.CONFIGS['dp']}:{size['preset']} "
          f"--workdir={bucket}/{point.slug} --jax_distributed "
          + " ".join(f"--config.{o}" for o in overrides(point, data_path)))


def render(points: list[Point], folder: str, *, image: str = config.IMAGE,
           bucket: str = config.BUCKET, data_path: str = config.DATA_PATH) -> list[dict]:
  """Writes `folder`/<slug>.yaml per DiLoCo-family point and `folder`/commands.sh; returns
  one row per point (what was rendered, where, on which slices)."""
  os.makedirs(folder, exist_ok=True)
  rows, script = [], ["#!/bin/sh", "# The TPU points of experiments/sweep, rendered by "
                      "`python -m experiments.sweep.run`; not run by it.", "set -e", ""]
  for point in points:
    size = config.TPU_SIZES[point.size]
    row = {"size": point.size, "method": point.method, "M": point.M, "K": point.K,
           "H": point.H, "P": point.P, "tpu_type": size["tpu_type"]}
    if point.method == "dp":
      command = dp_command(point, bucket=bucket, data_path=data_path)
      script += [f"# {point.label}: on every host of one {size['tpu_type']} slice", command, ""]
      row["launch"] = "commands.sh"
    else:
      argv = jobset_argv(point, image=image, bucket=bucket, data_path=data_path)
      file = f"{point.slug}.yaml"
      with open(os.path.join(folder, file), "w", encoding="utf-8") as f:
        f.write(jobset.render(jobset.parse_args(argv)))
      script += [f"# {point.label}: {point.M} x {size['tpu_type']} + a CPU syncer",
                 "diloco jobset " + " ".join(argv) + f" --output={file}",
                 f"kubectl apply -f {file}", ""]
      row["launch"] = file
    rows.append(row)
  with open(os.path.join(folder, "commands.sh"), "w", encoding="utf-8") as f:
    f.write("\n".join(script))
  return rows
