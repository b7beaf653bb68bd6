"""The program digest against references computed independently: hand-counted FLOPs, known
dtypes and counts, and the train step's FLOPs from its configuration (as the bench counts them)."""

import gzip
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diloco.model import tied_table, transformer
from diloco.model.sharding import batch_sharding
from diloco.programs import hlo_text, program_digest
from diloco.train import mesh as mesh_lib
from diloco.train import optim
from diloco.train import state as train_state
from diloco.train import step as train_step


def test_an_f32_matmul_is_one_dot_with_its_flops():
  a, b = jnp.ones((32, 48), jnp.float32), jnp.ones((48, 16), jnp.float32)
  d = program_digest.digest(jax.jit(lambda x, y: x @ y), a, b)
  assert len(d.dots) == 1
  dot = d.dots[0]
  assert dot.flops == 2 * 32 * 16 * 48 and dot.executions == 1
  assert dot.operand_dtypes == ("f32", "f32") and dot.result.dtype == "f32"
  assert (dot.lhs.shape, dot.rhs.shape, dot.result.shape) == ((32, 48), (48, 16), (32, 16))
  assert d.f32_dots(min_flops=dot.flops) == (dot,)
  assert d.f32_dots(min_flops=dot.flops + 1) == ()
  assert d.lowered_dots is not None and [x.flops for x in d.lowered_dots] == [dot.flops]
  assert d.memory.argument_bytes == (32 * 48 + 48 * 16) * 4
  assert d.memory.output_bytes == 32 * 16 * 4
  assert d.cost_flops is None or d.cost_flops >= dot.flops
  assert not d.host_transfers() and not d.while_loops


def test_a_bf16_dot_with_f32_accumulation_keeps_bf16_operands():
  def f(x, y):
    return jax.lax.dot_general(x, y, (((2,), (1,)), ((0,), (0,))),
                               preferred_element_type=jnp.float32)

  x, y = jnp.ones((4, 8, 32), jnp.bfloat16), jnp.ones((4, 32, 16), jnp.bfloat16)
  d = program_digest.digest(f, x, y)
  assert [(dot.operand_dtypes, dot.result.dtype) for dot in d.dots] == [(("bf16", "bf16"), "f32")]
  assert d.dots[0].flops == 2 * 4 * 8 * 16 * 32
  assert not d.f32_dots()
  assert [(x.operand_dtypes, x.result.dtype) for x in d.lowered_dots] == [
      (("bf16", "bf16"), "f32")]


def test_an_indexed_add_is_one_scatter_of_its_dtype_and_updates():
  table, ids = jnp.zeros((10, 4), jnp.float32), jnp.array([1, 1, 2, 9, 1, 0, 3], jnp.int32)
  d = program_digest.digest(lambda t, i, u: t.at[i].add(u), table, ids, jnp.ones((7, 4)))
  assert [(s.dtype, s.count, s.operand.shape) for s in d.scatters()] == [("f32", 7, (10, 4))]
  assert len(d.scatters("f32")) == 1 and not d.scatters("bf16")
  # A bf16 scatter-add: the CPU backend compiles it in f32, the lowered program says bf16.
  d = program_digest.digest(lambda t, i, u: t.at[i].add(u), table.astype(jnp.bfloat16), ids,
                            jnp.ones((7, 4), jnp.bfloat16))
  assert [(s.dtype, s.count) for s in d.lowered_scatters] == [("bf16", 7)]
  assert len(d.scatters()) == 1


def test_a_scan_is_one_while_loop_with_its_trip_count():
  def f(x):
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ c), None), x, None, length=5)[0]

  d = program_digest.digest(f, jnp.ones((8, 8)))
  assert len(d.while_loops) == 1
  assert d.while_loops[0].trip_count in (5, None)  # stated by this XLA: 5
  [dot] = d.dots
  assert dot.flops == 2 * 8 * 8 * 8
  assert dot.executions == (d.while_loops[0].trip_count or 1)


def test_callbacks_are_host_transfers():
  def debug(x):
    jax.debug.callback(lambda v: None, x)
    return x + 1

  def pure(x):
    return jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct((3,), jnp.float32),
                             x)

  for fn in (debug, pure):
    d = program_digest.digest(fn, jnp.ones(3))
    assert len(d.host_transfers()) == 1, fn.__name__
    assert "callback" in d.host_transfers()[0].kind
    assert d.summary()["host_transfer_count"] == 1


def test_a_compiled_or_lowered_program_is_digested_as_given():
  f = jax.jit(lambda x, y: x @ y)
  lowered = f.lower(jnp.ones((8, 4)), jnp.ones((4, 2)))
  assert program_digest.digest(lowered).dots[0].flops == 2 * 8 * 2 * 4
  from_compiled = program_digest.digest(lowered.compile())
  assert from_compiled.dots[0].flops == 2 * 8 * 2 * 4 and from_compiled.lowered_dots is None


# A hand-written GPU program in XLA's text form (CPU tests cannot compile one): a cuBLAS gemm,
# a cuBLASLt matmul in a loop of 3, a cuDNN attention call, a send and a move to host memory.
_GPU_HLO = """\
HloModule jit_step, entry_computation_layout={(bf16[64,32]{1,0})->f32[64,16]{1,0}}, num_partitions=2

%body (p: (s32[], bf16[64,32])) -> (s32[], bf16[64,32]) {
  %p = (s32[], bf16[64,32]{1,0}) parameter(0)
  %x = bf16[64,32]{1,0} get-tuple-element(%p), index=1
  %w = bf16[32,32]{1,0} constant({...})
  %lt = (bf16[64,32]{1,0}, s8[1024]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %i = s32[] get-tuple-element(%p), index=0
  %y = bf16[64,32]{1,0} get-tuple-element(%lt), index=0
  ROOT %t = (s32[], bf16[64,32]{1,0}) tuple(%i, %y)
}

%cond (q: (s32[], bf16[64,32])) -> pred[] {
  %q = (s32[], bf16[64,32]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(3)
  ROOT %lt.1 = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (a: bf16[64,32]) -> f32[64,16] {
  %a = bf16[64,32]{1,0} parameter(0), metadata={op_name="a"}
  %b = f32[32,16]{1,0} constant({...})
  %af = f32[64,32]{1,0} convert(%a)
  %gemm = (f32[64,16]{1,0}, s8[4096]{0}) custom-call(%af, %b), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,32]{1,0}) tuple(%zero, %a)
  %loop = (s32[], bf16[64,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %q4 = bf16[1,64,4,8]{3,2,1,0} bitcast(%a)
  %fmha = (bf16[1,64,4,8]{3,2,1,0}, u8[0]{0}) custom-call(%q4, %q4, %q4), custom_call_target="__cudnn$fmhaSoftmax"
  %host = bf16[64,32]{1,0:S(5)} copy(%a)
  %tok = token[] after-all()
  %snd = (bf16[64,32]{1,0}, u32[], token[]) send(%a, %tok), channel_id=1
  %out = f32[64,16]{1,0} get-tuple-element(%gemm), index=0
  ROOT %r = f32[64,16]{1,0} copy(%out)
}
"""


def test_gpu_gemms_attention_and_transfers_are_read_from_the_hlo_text():
  d = program_digest.digest_hlo_text(_GPU_HLO)
  assert d.num_partitions == 2
  by_kind = {dot.kind: dot for dot in d.dots}
  assert set(by_kind) == {"__cublas$gemm", "__cublas$lt$matmul"}
  gemm, lt = by_kind["__cublas$gemm"], by_kind["__cublas$lt$matmul"]
  assert (gemm.flops, gemm.executions, gemm.operand_dtypes) == (2 * 64 * 16 * 32, 1, ("f32", "f32"))
  assert gemm.op_name == "jit(step)/dot_general"
  assert (lt.flops, lt.executions, lt.operand_dtypes) == (2 * 64 * 32 * 32, 3, ("bf16", "bf16"))
  assert d.f32_dots() == (gemm,)
  assert d.dot_flops() == gemm.flops + 3 * lt.flops
  assert [w.trip_count for w in d.while_loops] == [3]
  assert [c.kind for c in d.attention_kernels()] == ["__cudnn$fmhaSoftmax"]
  assert sorted(t.kind for t in d.host_transfers()) == ["send", "to_host"]
  summary = d.summary()
  assert summary["attention_kernels"] == ["__cudnn$fmhaSoftmax"]
  assert summary["dot_flops_by_dtypes"] == {"bf16 x bf16 -> bf16": 3 * lt.flops,
                                           "f32 x f32 -> f32": gemm.flops}
  assert d.memory == program_digest.Memory()


# A TPU Pallas kernel as libtpu prints it: its attributes run over three lines (the kernel's
# metadata is a JSON string), the op_name that says which kernel it is on the last.
_TPU_HLO = """HloModule m, num_partitions=1

ENTRY %main (q: bf16[2,128,16]) -> bf16[2,128,16] {
  %q = bf16[2,128,16]{2,1,0} parameter(0)
  %k = bf16[2,128,16]{2,1,0} custom-call(%q), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 128}"
}}, metadata={op_name="jit(step)/shard_map/vmap(static_sparsity_splash)/pallas_call"}
  %o = bf16[2,128,16]{2,1,0} custom-call(%k), custom_call_target="tpu_custom_call", metadata={op_name="jit(step)/other_kernel"}
  ROOT %r = bf16[2,128,16]{2,1,0} add(%k, %o)
}
"""


def test_a_tpu_kernel_written_over_several_lines_is_one_instruction():
  d = program_digest.digest_hlo_text(_TPU_HLO)
  assert [(c.name, c.kind) for c in d.custom_calls] == [("k", "tpu_custom_call"),
                                                         ("o", "tpu_custom_call")]
  assert [c.name for c in d.attention_kernels()] == ["k"]  # splash; the other kernel is not
  instructions, entry, _ = hlo_text.parse_hlo(_TPU_HLO)
  assert entry == "main" and set(instructions) == {"q", "k", "o", "r"}
  assert instructions["r"].operands == ("k", "o")


def _tiny_step(tiny_config):
  cfg = tiny_config
  mesh = mesh_lib.learner_mesh(jax.devices(), cfg.mesh)
  spec = train_state.make_spec(cfg.model, optim.inner_optimizer(cfg.optim, 100), mesh)
  state = train_state.create(cfg.model, spec, jax.random.key(0))
  step = train_step.make_train_step(spec, cfg.optim, optim.lr_schedule(cfg.optim, 100))
  tokens = jax.device_put(
      np.random.default_rng(0).integers(0, cfg.model.vocab_size,
                                        (cfg.train.batch_size, cfg.data.seq_len + 1), np.int32),
      batch_sharding(mesh))
  return mesh, step, state, tokens


def test_the_tiny_train_step_has_its_model_flops_and_no_host_transfer(tiny_config):
  cfg = tiny_config
  m = cfg.model
  mesh, step, state, tokens = _tiny_step(cfg)
  with jax.set_mesh(mesh):
    d = program_digest.digest(step, state, tokens)
  assert d.host_transfers() == ()
  assert d.num_partitions == len(jax.devices())  # data parallel: the figures are per device
  # The bench's count (PaLM): 6 x matmul parameters (the tied head included, norms not) per
  # token, plus full-length attention, which is what the reference attention computes.
  counts = transformer.param_counts(m)
  norms = m.num_layers * (4 * m.embed_dim + 2 * m.head_dim) + m.embed_dim
  seq, tokens_per_step = cfg.data.seq_len, cfg.train.batch_size * cfg.data.seq_len
  expected = (6 * (counts["active"] - norms)
              + 12 * m.num_layers * m.num_heads * m.head_dim * seq) * tokens_per_step
  assert abs(d.dot_flops() * d.num_partitions - expected) <= 0.1 * expected
  assert abs(sum(x.flops for x in d.lowered_dots) - expected) <= 0.1 * expected
  assert m.dtype == "float32" and d.f32_dots()  # the tiny preset computes in f32
  # The embedding's gradient is no scatter-add into the table: at this byte vocabulary the
  # default `embed_impl="auto"` is the one-hot matmul (the gather paths' scatters are checked
  # in tests/embed_remat_test.py).
  assert m.embed_impl == "auto" and m.vocab_size <= tied_table.EMBED_ONE_HOT_MAX_VOCAB
  # Nor is the loss's: the target logit is picked by an index comparison, not a gather, so no
  # scatter-add into a (B, L, V) buffer is left anywhere in the step.
  assert d.scatters() == () and d.lowered_scatters == ()
  assert d.memory.temp_bytes is not None and d.memory.argument_bytes > 0


def test_full_remat_saves_fewer_residuals_than_none(tiny_config):
  m = tiny_config.model
  with nnx.use_eager_sharding(False):  # one layer on one device, no mesh needed
    graphdef, params = nnx.split(transformer.Block(m, local=False, rngs=nnx.Rngs(0)))
  x = jnp.ones((2, 16, m.embed_dim), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
  saved = {}
  for remat in ("none", "full"):
    layer = transformer._layer_fn(graphdef, remat, True, True)  # the model's own remat wiring
    saved[remat] = program_digest.saved_residuals(
        lambda p, h, fn=layer: fn(p, h, positions)[0].sum(), params, x)
  assert 0 < saved["full"].total_bytes < saved["none"].total_bytes
  assert len(saved["full"].entries) < len(saved["none"].entries)
  assert all(r.nbytes > 0 or r.shape == () for r in saved["none"].entries)


_H200 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                     "device", "h200-2026-11-27")


def _h200_program(name):
  with gzip.open(os.path.join(_H200, f"gemma_2b_{name}.hlo.txt.gz"), "rt") as f:
    return program_digest.digest_hlo_text(f.read())


def test_the_gemma_2b_step_an_h200_compiled_before_and_after_the_speed_switches():
  """The programs an H200 compiled for gemma_2b at batch 4 x 2048 (the device bundle's run,
  kept with its results): before the switches the head's backward ran two f32 x f32 matmuls
  (TF32 at best) and the embedding's gradient was a bf16 scatter-add; after, neither, with
  the same matmul work, the cuDNN attention kernels and no host transfer."""
  before, after = _h200_program("before"), _h200_program("after")
  head = 2 * 4 * 1024 * 262_144 * 2304  # one chunk of 1024 positions x 4 rows through the head
  assert {d.flops for d in before.f32_dots(min_flops=10**12)} == {head}
  assert after.f32_dots(min_flops=10**9) == ()
  assert [s.count for s in before.scatters("bf16")] == [4 * 2048]
  assert after.scatters("bf16") == () and [s.count for s in after.scatters("f32")
                                           if "take_along_axis" not in s.op_name] == [4 * 2048]
  assert before.dot_flops() == after.dot_flops()
  for program in (before, after):
    assert program.host_transfers() == ()
    assert {c.kind for c in program.attention_kernels()} == {
        "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
