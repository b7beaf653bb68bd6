"""`diloco compile`: the run's programs compiled by the real TPU compiler (libtpu) for small
Cloud TPU slices on this CPU host, and the readers of what it emits (collectives, slices)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import runtime_configs

from diloco.deploy import aot, tpu_topology
from diloco.errors import ConfigError
from diloco.programs import collectives

# Collectives as the TPU compiler writes them (one of each form), checked against groups
# written out by hand.
_HLO = """HloModule m, num_partitions=8

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]) parameter(0)
  %x = f32[64]{0} get-tuple-element(%p), index=1
  %ag = f32[256]{0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %rs = f32[16]{0} reduce-scatter(%x), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[64]) tuple(%i, %x)
}

ENTRY %main (a: bf16[1024,32], b: f32[64]) -> f32[64] {
  %a = bf16[1024,32]{1,0} parameter(0)
  %b = f32[64]{0} parameter(1)
  %ar = bf16[1024,32]{1,0:T(8,128)} all-reduce(%a), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use_global_device_ids=true, to_apply=%add
  %ags = (f32[64]{0}, f32[512]{0}) all-gather-start(%b), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %agd = f32[512]{0} all-gather-done(%ags)
  %cp = f32[64]{0} collective-permute(%b), channel_id=5, source_target_pairs={{0,4},{4,0}}
  %tok = token[] after-all()
  %s = (f32[64]{0}, u32[], token[]) send(%b, %tok), channel_id=6, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_transfer_type="ALL_REDUCE"}
  %sd = token[] send-done(%s), channel_id=6, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime"}
  %w = (s32[], f32[64]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"18"}}
  ROOT %r = f32[64]{0} add(%b, %b)
}
"""


def test_collectives_read_every_form_of_replica_groups_and_their_bytes():
  found = {c.name: c for c in collectives.collectives(_HLO)}
  assert set(found) == {"ag", "rs", "ar", "ags", "cp", "s"}
  ag, rs, ar, ags, cp, s = (found[n] for n in ("ag", "rs", "ar", "ags", "cp", "s"))
  assert (ag.kind, ag.bytes, ag.executions) == ("all-gather", 256 * 4, 18)
  assert ag.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert (rs.kind, rs.bytes, rs.executions) == ("reduce-scatter", 64 * 4, 18)  # its operand
  assert rs.groups == tuple(map(tuple, np.arange(8).reshape(2, 4).T.reshape(4, 2)))
  # The mesh form: devices 0..7 as a 2 x 4 grid, groups along axis_1 (the rows).
  assert (ar.kind, ar.bytes, ar.groups) == ("all-reduce", 1024 * 32 * 2,
                                            ((0, 1, 2, 3), (4, 5, 6, 7)))
  assert (ags.kind, ags.bytes, ags.executions) == ("all-gather", 512 * 4, 1)  # outputs only
  assert cp.groups == ((0, 4), (4, 0))
  assert (s.kind, s.bytes, s.dcn) == ("dcn all-reduce", 64 * 4, True)
  assert collectives.megascale_transfers(_HLO) == {"s", "sd"}
  assert collectives.bytes_by_kind(found.values())["all-gather"] == 256 * 4 * 18 + 512 * 4


def test_a_collective_crosses_slices_when_a_group_holds_two():
  found = {c.name: c for c in collectives.collectives(_HLO)}
  by_slice = [0, 0, 0, 0, 1, 1, 1, 1]
  assert not collectives.crosses(found["ag"], by_slice)  # groups 0-3 and 4-7
  assert collectives.crosses(found["rs"], by_slice)  # {0, 4}, ...
  assert collectives.crosses(found["cp"], by_slice) and collectives.crosses(found["s"], by_slice)
  assert not collectives.crosses(found["ags"], [0] * 8)


def test_topology_names_parse_and_unknown_ones_are_one_line():
  assert tpu_topology.parse("v5e-256").grid == (16, 16)
  assert tpu_topology.parse("v5p-128").grid == (4, 4, 4)  # 128 TensorCores, 64 chips
  assert tpu_topology.parse("V5P:2x2x1").chips == 4
  for bad in ("v5e-3", "v6e-8", "v5p-6", "v5e:2x2x2", "v5e:0x4", "", "v5e-256\n"):
    with pytest.raises(ConfigError, match=r"--topology=.*unknown TPU slice") as e:
      tpu_topology.parse(bad)
    assert "\n" not in str(e.value).replace(repr(bad), "")
  with pytest.raises(ConfigError, match="--slices=0"):
    tpu_topology.devices(tpu_topology.parse("v5e-4"), 0)


@pytest.fixture(scope="module")
def two_slices():
  """decoupled:tiny widened to TPU tiles (dimensions multiples of 128, as real models'; tiny's
  64 pads to 128), in bf16 with `attention_impl=auto` over 128 tokens, compiled for two v5e-4
  slices: both learners and the data-parallel baseline over both."""
  return aot.compile_run(runtime_configs.load("decoupled.py:tiny", **_WIDE), "v5e-4", 2)


_WIDE = {"model__embed_dim": 256, "model__mlp_dim": 1024, "model__head_dim": 128,
         "model__vocab_size": 1024, "model__dtype": "bfloat16", "model__attention_impl": "auto",
         "data__seq_len": 128}


def test_each_learner_stays_on_its_slice_and_data_parallel_crosses(two_slices):
  by_name = {p.name: p for p in two_slices.programs}
  assert list(by_name) == ["learner 0 init", "learner 0 step", "learner 1 init",
                           "learner 1 step", "data-parallel init", "data-parallel step"]
  for m in (0, 1):
    step = by_name[f"learner {m} step"]
    assert step.chips == 4 and step.slices == (m,) and step.batch == 8
    assert step.cross_slice == () and step.cross_slice_bytes == 0
    assert step.collective_bytes.get("all-reduce", 0) > 0  # its gradients, inside the slice
    # "auto" on a TPU mesh: the Pallas splash kernel, forward, dq and dkv in each of 2 layers.
    assert step.attention_kernels == 6
  dp = by_name["data-parallel step"]
  assert dp.chips == 8 and dp.slices == (0, 1) and dp.batch == 16
  assert dp.mesh == {"data": 8, "fsdp": 1, "tensor": 1}
  assert dp.cross_slice and dp.collective_bytes["dcn all-reduce"] == dp.cross_slice_bytes > 0
  assert two_slices.fits and two_slices.chip == "v5e"


def test_the_data_parallel_bytes_between_slices_sit_beside_the_ledgers(two_slices):
  """The ledger's figure for D = 2 datacenters is the gradient once per step, 2 (D - 1) / D = 1
  times the parameters, in closed form; the program's is every chip's DCN payloads. Every
  gradient crosses in bf16 (the tied table's too, `diloco.model.tied_table`: in float32 the
  program sent 1.31x the ledger); what is left above it is the table sent twice, once for each
  of its uses, and the float32 norm scales: 1.11x, bounded here in closed form."""
  from diloco.model import transformer
  cfg = runtime_configs.load("decoupled.py:tiny", **_WIDE)
  counts = transformer.param_counts(cfg.model)
  led = two_slices.ledger
  assert led.ledger_bytes_bf16 == pytest.approx(2 * counts["total"])
  assert led.ledger_bytes_f32 == pytest.approx(4 * counts["total"])
  dp = next(p for p in two_slices.programs if p.name == "data-parallel step")
  assert led.compiled_bytes_per_slice == 4 * dp.cross_slice_bytes
  table_twice = 2 * counts["embedding"]
  assert led.ledger_bytes_bf16 <= led.compiled_bytes_per_slice
  assert led.compiled_bytes_per_slice <= 1.01 * (led.ledger_bytes_bf16 + table_twice)
  assert led.ratio == led.compiled_bytes_per_slice / led.ledger_bytes_bf16 < 1.15


def test_the_program_checks_run_on_the_tpu_program(two_slices):
  for p in two_slices.programs:
    assert p.fits and 0 < p.hbm_bytes < tpu_topology.CHIPS["v5e"].hbm_bytes
    assert p.hbm_bytes == p.argument_bytes + p.output_bytes + p.temp_bytes - p.alias_bytes
    assert p.f32_dots == 0 and p.host_transfers == 0, p
  step = next(p for p in two_slices.programs if p.name == "learner 0 step")
  assert step.alias_bytes > 0  # the donated state is updated in place
  assert step.model_flops_per_chip > 0 and step.estimate_s > 0


def test_a_gemma_shaped_model_that_does_not_fit_names_its_largest_buffers():
  """Two of gemma_2b's layers at full width on one v5e chip, with a batch too large for it."""
  cfg = runtime_configs.load("decoupled.py:gemma_2b", model__num_layers=2, data__seq_len=1024,
                             train__batch_size=64, learners__count=1, mesh__tensor=1,
                             data__source="stdlib")
  report = aot.compile_run(cfg, "v5e-1", 1, learners="first")
  step = report.programs[1]
  assert not step.fits and not report.fits
  assert step.hbm_bytes > tpu_topology.CHIPS["v5e"].hbm_bytes
  assert step.largest and step.largest[0].bytes >= step.largest[-1].bytes > 0
  assert "Ran out of memory" in step.refused and step.temp_bytes > 16 * 2**30
  # The largest argument shard: the 256k x 2048 tied table, whole on its one chip.
  assert step.largest[0].shape == (cfg.model.vocab_size, cfg.model.embed_dim)


@pytest.mark.parametrize("unit", [1, 4, 64])
def test_the_batch_search_finds_the_largest_multiple_that_fits(unit):
  """Against every answer by brute force: a limit below, at and far above the largest batch
  that fits, and no batch that fits; only multiples of the unit within the limit are tried, in
  about two compiles per doubling."""
  for limit in (0, unit - 1, unit, 3 * unit, 64 * unit + 5):
    for largest in range(0, 70):
      tried = []

      def fits(batch, largest=largest, limit=limit, tried=tried):
        assert batch % unit == 0 and 0 < batch <= limit, (batch, limit)
        tried.append(batch)
        return batch <= largest * unit

      want = max((k * unit for k in range(1, limit // unit + 1) if k <= largest), default=0)
      assert aot.largest_multiple(fits, unit, limit) == want, (unit, limit, largest)
      assert len(tried) <= 2 * max(1, limit // unit).bit_length() + 1


def test_both_forms_of_the_compilers_refusal_are_read():
  """libtpu 0.0.4x names the temporaries it needs; 0.0.5x, for a program just over HBM, the
  total it used (arguments included), as in this message from a gemma_2b batch search."""
  old = "... 75.90G required for HLO temporaries (75.90G) ..."
  assert aot.refused_bytes(old, 5 * 2**30) == int(75.90 * 2**30)
  new = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out "
         "of memory in memory space hbm. Used 15.80G of 15.75G hbm. Exceeded hbm capacity by "
         "52.47M.")
  assert aot.refused_bytes(new, 2**30) == int(15.80 * 2**30) - 2**30
  assert aot.refused_bytes("RESOURCE_EXHAUSTED: something else", 0) is None


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "diloco", "compile", *args], capture_output=True,
                        text=True, timeout=300, cwd=runtime_configs.REPO)


def test_the_command_prints_a_table_and_one_json_line_and_refuses_bad_input_in_one_line():
  done = _cli("--config=decoupled:tiny", "--topology=v5p-8")
  assert done.returncode == 0, done.stderr[-2000:]
  lines = done.stdout.strip().splitlines()
  assert lines[-2] == "1 x v5p-8: every program fits" and lines[-1].startswith('{"fits": true')
  assert "learner 0 step: 4 chips" in done.stdout
  fit = _cli("--config=decoupled:tiny", "--topology=v5e-4", "--fit=8")
  assert fit.returncode == 0, fit.stderr[-2000:]
  found = json.loads(fit.stdout.strip().splitlines()[-1])
  assert (found["batch"], found["per_shard"], found["probes"]) == (8, 2, 2)
  assert found["program"]["fits"] and "the largest batch that fits is 8" in fit.stdout
  for args, message in [
      (["--config=decoupled:tiny", "--topology=v9-8"], "--topology='v9-8': unknown TPU slice"),
      (["--config=decoupled:tiny", "--topology=v5e-4", "--config.mesh.fsdp=3"], "mesh"),
      (["--config=decoupled:tiny", "--topology=v5e-4", "--slices=100"], "--slices=100"),
      (["--topology=v5e-4"], "--config is required")]:
    bad = _cli(*args)
    assert bad.returncode == 1 and message in bad.stderr, (args, bad.stderr[-2000:])
    assert "Traceback" not in bad.stderr
