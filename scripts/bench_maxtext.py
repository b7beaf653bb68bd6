"""MaxText and diloco compiled side by side for one Cloud TPU slice, on any host: one JSON line.

    python scripts/bench_maxtext.py --topology=v5e-256 --batch=512 --seq_len=2048 --remat=full

Both learners' train steps are compiled by the same libtpu for the same slice at the same
global batch, sequence length, remat policy and model shapes (MaxText's `gemma-2b`: vocabulary
256,128, width 2,048, MLP 16,384, one kv head, global attention; diloco's `gemma_2b` preset set
to those shapes, FSDP over every chip), and
read the same way: HBM per chip from `memory_analysis()` (arguments + outputs + temporaries -
aliased) and collective bytes per step and chip from the optimized HLO (`diloco.programs.
collectives`, loop trip counts multiplied in). MaxText runs its own AOT path
(`maxtext.trainers.pre_train.train_compile`) in a subprocess, its HLO dumped by XLA.

Needs Python 3.12 and `pip install -e ".[maxtext]"` (MaxText 0.2.5 and this project in one
environment, so that both use one JAX and one libtpu). Minutes per
program on a 2-core host; run it niced, alone. The ratios are diloco over MaxText: below 1 is
leaner than MaxText.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_TOPOLOGY = flags.DEFINE_string("topology", "v5e-256", "A TPU slice (`diloco compile`'s names).")
_BATCH = flags.DEFINE_integer("batch", 512, "Global batch, sequences per step.")
_SEQ = flags.DEFINE_integer("seq_len", 2048, "Tokens per sequence.")
_REMAT = flags.DEFINE_enum("remat", "full", ["full", "minimal"],
                           "Remat policy: full (both) or minimal (MaxText's, diloco's "
                           "dots_with_no_batch_dims_saveable).")
_LAYERS = flags.DEFINE_integer("num_layers", 18, "Decoder layers (gemma-2b: 18).")
_ONLY = flags.DEFINE_enum("only", "both", ["both", "diloco", "maxtext"], "Which to compile.")

_DILOCO_REMAT = {"full": "full", "minimal": "dots_with_no_batch_dims_saveable"}
_STATS = re.compile(r"\b(argument|output|alias|temp)_size_in_bytes=(\d+)")  # not host_...


def _hbm(stats: dict[str, int]) -> int:
  return stats["argument"] + stats["output"] + stats["temp"] - stats["alias"]


def diloco_step(chips: int) -> dict:
  """diloco's learner step at MaxText's gemma-2b shapes, through `diloco compile`'s path."""
  import diloco  # noqa: PLC0415  (imported here: JAX must not start before the flags)
  from diloco.deploy import aot  # noqa: PLC0415
  cfg = diloco.load_config("decoupled:gemma_2b", {
      # MaxText's gemma-2b (Gemma 1): width, depth, heads, vocabulary, global attention only.
      "model.vocab_size": 256128, "model.embed_dim": 2048, "model.mlp_dim": 16384,
      "model.num_heads": 8, "model.num_kv_heads": 1, "model.head_dim": 256,
      "model.num_layers": _LAYERS.value, "model.attention_pattern": "G",
      "model.final_logit_softcap": 0.0, "model.qk_norm": False,
      "model.remat": _DILOCO_REMAT[_REMAT.value], "train.batch_size": _BATCH.value,
      "data.seq_len": _SEQ.value, "mesh.fsdp": chips, "mesh.tensor": 1, "mesh.data": 1,
      "learners.count": 1, "data.source": "stdlib"})
  report = aot.compile_run(cfg, _TOPOLOGY.value, 1, learners="first", data_parallel=False)
  step = report.programs[1]
  return {"hbm_bytes": step.hbm_bytes, "argument_bytes": step.argument_bytes,
          "temp_bytes": step.temp_bytes, "compile_s": step.compile_s,
          "collective_bytes": step.collective_bytes, "attention_kernels": step.attention_kernels,
          "fits": step.fits}


def maxtext_step(chips: int) -> dict:
  """MaxText's own AOT compile of its train step, read from its output and its HLO dump."""
  import maxtext  # noqa: PLC0415

  from diloco.programs import collectives, program_digest  # noqa: PLC0415
  base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  dump = tempfile.mkdtemp(prefix="maxtext-hlo-")
  env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text",
             JAX_PLATFORMS="cpu")
  argv = [sys.executable, "-m", "maxtext.trainers.pre_train.train_compile", base,
          f"compile_topology={_TOPOLOGY.value}", "compile_topology_num_slices=1",
          "model_name=gemma-2b", f"per_device_batch_size={_BATCH.value / chips}",
          f"max_target_length={_SEQ.value}", f"remat_policy={_REMAT.value}",
          f"base_num_decoder_layers={_LAYERS.value}", "override_model_config=True",
          "run_name=bench",
          f"base_output_directory={dump}", "dataset_type=synthetic"]
  start = time.perf_counter()
  done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
  wall = time.perf_counter() - start
  if done.returncode != 0:
    raise SystemExit(f"MaxText's train_compile failed:\n{done.stderr[-3000:]}")
  stats = {k: int(v) for k, v in _STATS.findall(done.stdout.split("Memory analysis:")[-1])}
  steps = sorted(glob.glob(os.path.join(dump, "*train_step*after_optimizations.txt")),
                 key=os.path.getsize)
  text = open(steps[-1], encoding="utf-8").read() if steps else ""
  found = collectives.collectives(text)
  return {"hbm_bytes": _hbm(stats), "argument_bytes": stats["argument"],
          "temp_bytes": stats["temp"], "compile_s": round(wall, 2),
          "collective_bytes": collectives.bytes_by_kind(found),
          "attention_kernels": len(program_digest.digest_hlo_text(text).attention_kernels()),
          "hlo": os.path.basename(steps[-1]) if steps else None}


def _ratio(a: float, b: float) -> float | None:
  return round(a / b, 3) if b else None


def main(argv: list[str]) -> None:
  del argv
  from diloco.deploy import tpu_topology  # noqa: PLC0415
  chips = tpu_topology.parse(_TOPOLOGY.value).chips
  out = {"bench": "maxtext_side_by_side", "topology": _TOPOLOGY.value, "batch": _BATCH.value,
         "seq_len": _SEQ.value, "remat": _REMAT.value, "num_layers": _LAYERS.value}
  if _ONLY.value in ("both", "maxtext"):
    out["maxtext"] = maxtext_step(chips)
  if _ONLY.value in ("both", "diloco"):
    out["diloco"] = diloco_step(chips)
  if _ONLY.value == "both":
    d, m = out["diloco"], out["maxtext"]
    total = lambda r: sum(r["collective_bytes"].values())  # noqa: E731
    out["ratio"] = {
        "hbm": _ratio(d["hbm_bytes"], m["hbm_bytes"]),
        "temp": _ratio(d["temp_bytes"], m["temp_bytes"]),
        "collective_bytes": _ratio(total(d), total(m)),
        **{kind: _ratio(d["collective_bytes"].get(kind, 0), m["collective_bytes"][kind])
           for kind in sorted(m["collective_bytes"])},
        "compile_s": _ratio(d["compile_s"], m["compile_s"])}
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
