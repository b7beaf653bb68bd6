"""`diloco compile`: will it fit? Compiles what a run would run for named Cloud TPU slices, on
any host (libtpu from PyPI: `pip install -e ".[tpu]"`), and prints a table and one JSON line.

    diloco compile --config=decoupled:gemma_2b --topology=v5e-256 [--slices=2]
        [--config.train.batch_size=256 --config.model.remat=full ...]

One learner per slice (each compiled for its own slice's devices) and, with several slices,
the data-parallel baseline over all of them at the same tokens per step. Per program: HBM per
chip against the chip's (fits or not, and the largest buffers when not), compile seconds,
collective bytes per step by kind and those that cross slices, the program checks (f32 x f32
dots, scatters, host transfers, fused attention kernels), the FLOP model's count and a roofline
step estimate. Exits 1 when a program does not fit. `--fit=N` instead finds the largest
batch (up to N sequences) whose learner step fits one slice.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
from absl import flags
from ml_collections import config_flags as ml_config_flags

from diloco.cli import command, config_flags
from diloco.config import run_config
from diloco.deploy import aot, tpu_topology
from diloco.errors import ConfigError

FLAGS = flags.FlagValues()
_CONFIG = ml_config_flags.DEFINE_config_file(
    "config", None, "Config and preset (decoupled:gemma_2b, configs/dp.py:tiny); override "
    "fields with --config.GROUP.FIELD=VALUE.", flag_values=FLAGS, lock_config=True)
flags.DEFINE_string("topology", None, "A TPU slice: " + ", ".join(tpu_topology.names())
                    + ", or a chip grid (v5e:4x4, v5p:2x2x1).", flag_values=FLAGS)
flags.DEFINE_integer("slices", 1, "Slices of --topology: one learner on each.",
                     flag_values=FLAGS)
flags.DEFINE_enum("learners", "all", ["all", "first"], "Compile every learner's programs "
                  "(each for its own slice) or only the first's.", flag_values=FLAGS)
flags.DEFINE_bool("data_parallel", True, "Also compile the data-parallel baseline over all "
                  "slices (with --slices > 1).", flag_values=FLAGS)
flags.DEFINE_float("dcn_gbps_per_chip", tpu_topology.DCN_BYTES_PER_S_PER_CHIP * 8 / 1e9,
                   "Assumed data-center network rate between slices, Gbit/s per chip, for "
                   "the step estimate.", flag_values=FLAGS)
flags.DEFINE_bool("json", False, "Print only the JSON line.", flag_values=FLAGS)
flags.DEFINE_integer("fit", 0, "Instead: the largest train.batch_size, up to this many "
                     "sequences, whose learner step fits one slice (doubling, then bisecting; a "
                     "compile per probe).", lower_bound=0, flag_values=FLAGS)

_GIB = 2**30


def _row(p: aot.Program, hbm: int) -> str:
  crossing = f"{p.cross_slice_bytes / 1e6:.1f} MB" if p.cross_slice else "none"
  coll = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in p.collective_bytes.items()) or "none"
  est = f", estimate {p.estimate_s:.3f} s" if p.estimate_s is not None else ""
  lines = [f"{p.name}: {p.chips} chips {p.mesh}, batch {p.batch}; HBM per chip "
           f"{p.hbm_bytes / _GIB:.2f} of {hbm / _GIB:.0f} GiB "
           f"({'fits' if p.fits else 'DOES NOT FIT'}; args {p.argument_bytes / _GIB:.2f}, out "
           f"{p.output_bytes / _GIB:.2f}, temp {p.temp_bytes / _GIB:.2f}, aliased "
           f"{p.alias_bytes / _GIB:.2f}); compiled in {p.compile_s:.1f} s",
           f"  collectives per step: {coll}; across slices: {crossing}",
           f"  checks: f32 x f32 dots {p.f32_dots}, scatters {p.scatters}, host transfers "
           f"{p.host_transfers}, attention kernels {p.attention_kernels}"
           + (f"; model FLOPs per chip {p.model_flops_per_chip:.3e}{est}"
              if p.model_flops_per_chip is not None else "")]
  if p.refused:
    lines[1:] = [f"  the compiler: {p.refused}"]
  lines += [f"  largest: {b.what} {b.name} {b.dtype}{list(b.shape)} {b.bytes / _GIB:.2f} GiB"
            for b in p.largest]
  return "\n".join(lines)


def _body() -> None:
  if _CONFIG.value is None:
    raise ConfigError("--config is required, e.g. --config=decoupled:gemma_2b")
  if not FLAGS.topology:
    raise ConfigError("--topology is required, e.g. --topology=v5e-256")
  if not os.environ.get("JAX_PLATFORMS"):
    # The programs are compiled for the slice's devices and nothing runs here: JAX needs no
    # backend of this host but its CPU (and libtpu must not look for chips).
    jax.config.update("jax_platforms", "cpu")
  raw = _CONFIG.value
  if raw.data.source != "stdlib" and not raw.data.path:
    # Nothing is read: the programs depend on data.seq_len and the batch only, so a TPU preset
    # that expects prepared shards compiles without naming them.
    raw = raw.copy_and_resolve_references()
    raw.data.source = "stdlib"
  cfg = run_config.from_config_dict(raw)
  if FLAGS.fit:
    _fit(cfg)
    return
  show = (lambda p: None) if FLAGS.json else (
      lambda p: print(_row(p, tpu_topology.parse(FLAGS.topology).chip.hbm_bytes), flush=True))
  report = aot.compile_run(cfg, FLAGS.topology, FLAGS.slices, learners=FLAGS.learners,
                           data_parallel=FLAGS.data_parallel,
                           dcn_bytes_per_s=FLAGS.dcn_gbps_per_chip * 1e9 / 8, on_program=show)
  if not FLAGS.json and report.ledger:
    led = report.ledger
    print(f"data-parallel between slices: {led.compiled_bytes_per_slice / 1e6:.2f} MB per slice "
          f"per step in the program; the bandwidth ledger charges {led.ledger_bytes_bf16 / 1e6:.2f}"
          f" MB (bf16 gradients) or {led.ledger_bytes_f32 / 1e6:.2f} MB (f32): {led.ratio:.2f}x "
          "its bf16 figure")
  if not FLAGS.json:
    print(f"{report.slices} x {report.topology}: "
          f"{'every program fits' if report.fits else 'a program does not fit'}")
  print(json.dumps({"fits": report.fits, **dataclasses.asdict(report),
                    "dcn_ratio_to_ledger": report.ledger.ratio if report.ledger else None}))
  if not report.fits:
    sys.exit(1)


def _fit(cfg) -> None:
  """`--fit`: the largest batch that fits, each probe's line, then one JSON line."""
  hbm = tpu_topology.parse(FLAGS.topology).chip.hbm_bytes
  show = (lambda p: None) if FLAGS.json else (lambda p: print(
      f"batch {p.batch}: HBM per chip {p.hbm_bytes / _GIB:.2f} of {hbm / _GIB:.0f} GiB, "
      f"{'fits' if p.fits else 'DOES NOT FIT'}", flush=True))
  fit = aot.largest_batch(cfg, FLAGS.topology, limit=FLAGS.fit, on_probe=show)
  if not FLAGS.json:
    print(f"{FLAGS.topology}: the largest batch that fits is {fit.batch} sequences of "
          f"{cfg.data.seq_len} ({fit.per_shard} per data x fsdp shard; {fit.probes} compiles)")
  print(json.dumps({"topology": FLAGS.topology, "seq_len": cfg.data.seq_len,
                    "remat": cfg.model.remat, **dataclasses.asdict(fit)}))
  if not fit.batch:
    sys.exit(1)


def main(argv: list[str]) -> None:
  """`argv[0]` is the program name; the rest are this command's flags (module docstring)."""
  config_flags.run_command(FLAGS, argv, _body, "diloco compile")


if __name__ == "__main__":
  command.app_run(main)
