"""What a run would run on TPU slices, compiled ahead of time on any host (`diloco compile`).

Each learner's init and train step is lowered through the learner's own island code
(`island.lower_learner`: the project's mesh, sharding and step) for its own slice's devices and
compiled by the real TPU compiler from libtpu, and so is the data-parallel baseline over every
slice at the same tokens per step. Synchronous DiLoCo's learners run the learner's program
itself (the sync group only changes what the host does between steps), so it is not compiled
twice. From each executable: HBM per chip against the chip's, the collectives with their bytes
per step and whether they cross slices, the program checks the CPU tests hold the step to, and
a roofline estimate of the step, labelled as one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
from collections.abc import Callable

import jax
from jax.experimental.compilation_cache import compilation_cache

from diloco.config.run_config import Config
from diloco.deploy import tpu_topology
from diloco.errors import ConfigError
from diloco.learner import island
from diloco.model import transformer
from diloco.programs import collectives as collectives_lib
from diloco.programs import hlo_text, program_digest
from diloco.sim import bandwidth
from diloco.train import flops as flops_lib
from diloco.train import mesh as mesh_lib

# A matmul of two float32 operands at least this large counts against the program (a bf16
# model's small f32 dots, norms and the loss's reductions, are the compiler's business).
F32_DOT_MIN_FLOPS = 2**24
_LARGEST = 6


@dataclasses.dataclass(frozen=True, kw_only=True)
class Buffer:
  what: str  # "argument" or the HLO opcode that computes it
  name: str
  dtype: str
  shape: tuple[int, ...]
  bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Program:
  """One compiled program on its devices; bytes are per chip, per call of the program."""
  name: str  # "learner 0 step", "data-parallel init", ...
  chips: int
  slices: tuple[int, ...]
  mesh: dict[str, int]
  batch: int  # sequences per step
  compile_s: float
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  hbm_bytes: int  # arguments + outputs + temporaries - aliased
  fits: bool
  largest: tuple[Buffer, ...]  # the largest arguments and values, when it does not fit
  # The compiler's refusal when the program does not fit at all (its figures are then the
  # temporaries it asked for and the arguments' shards; nothing else is known).
  refused: str = ""
  collective_bytes: dict[str, int]
  cross_slice_bytes: int
  cross_slice: tuple[str, ...]  # names of the collectives that join several slices
  f32_dots: int
  f32_dot_flops: int
  scatters: int
  host_transfers: int
  attention_kernels: int  # fused attention calls (Pallas splash on TPU); 0: XLA's attention
  model_flops_per_chip: float | None  # the FLOP model's count for a step; None for init
  estimate_s: float | None  # a roofline estimate (module `estimate`), None for init


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ledger:
  """The data-parallel step's bytes between slices, from its program, beside what the
  bandwidth ledger (`diloco.sim.bandwidth`) charges a datacenter for the same step."""
  compiled_bytes_per_slice: int  # every chip of a slice's DCN payloads, per step
  ledger_bytes_bf16: float  # the ledger at its default (bf16 gradients)
  ledger_bytes_f32: float  # the ledger with f32 gradients, as the parameters are kept

  @property
  def ratio(self) -> float:
    """Compiled over the ledger's bf16 figure."""
    return self.compiled_bytes_per_slice / self.ledger_bytes_bf16


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
  topology: str
  chip: str
  slices: int
  hbm_per_chip: int
  dcn_bytes_per_s_per_chip: float
  programs: tuple[Program, ...]
  ledger: Ledger | None = None  # with the data-parallel step over several slices

  @property
  def fits(self) -> bool:
    return all(p.fits for p in self.programs)


def estimate(flops_per_chip: float, ici_bytes: int, dcn_bytes: int, chip: tpu_topology.Chip,
             dcn_bytes_per_s: float) -> float:
  """Seconds of a step on a roofline: FLOPs at the chip's bf16 peak, plus collective bytes at
  the ICI and DCN rates, nothing overlapped and HBM traffic not counted. For choosing between
  variants, never a measurement."""
  return (flops_per_chip / chip.peak_bf16_flops + ici_bytes / chip.ici_bytes_per_s
          + dcn_bytes / dcn_bytes_per_s)


def _largest(text: str) -> tuple[Buffer, ...]:
  instructions, entry, _ = hlo_text.parse_hlo(text)
  found = []
  for inst in instructions.values():
    if inst.opcode in ("get-tuple-element", "tuple", "bitcast") or not inst.types:
      continue
    if inst.opcode == "parameter" and inst.computation != entry:
      continue
    array = max(inst.types, key=lambda a: a.size)
    size = array.size * collectives_lib.dtype_bytes(array.dtype)
    what = "argument" if inst.opcode == "parameter" else inst.opcode
    found.append(Buffer(what=what, name=inst.name, dtype=array.dtype, shape=array.shape,
                        bytes=size))
  return tuple(sorted(found, key=lambda b: -b.bytes)[:_LARGEST])


# The compiler's two ways of refusing a program too large for HBM: the temporaries it asked
# for, or (from libtpu 0.0.5x, when the program exceeds HBM by little) what it used in all.
_REFUSED = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)")
_USED = re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _argument_buffers(arguments) -> tuple[Buffer, ...]:
  """The per-chip shards of a program's arguments (ShapeDtypeStructs with shardings)."""
  found = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(arguments):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    found.append(Buffer(what="argument", name=jax.tree_util.keystr(path),
                        dtype=str(leaf.dtype), shape=tuple(shape),
                        bytes=math.prod(shape) * leaf.dtype.itemsize))
  return tuple(sorted(found, key=lambda b: -b.bytes))


def refused_bytes(message: str, argument_bytes: int) -> int | None:
  """The temporaries a refused program needs per chip, read from the compiler's message
  (`argument_bytes`: its arguments' shards, which a total includes); None if it says neither."""
  found = _REFUSED.search(message)
  if found:
    return int(float(found.group(1)) * _UNITS[found.group(2)])
  found = _USED.search(message)
  if found:
    return max(0, int(float(found.group(1)) * _UNITS[found.group(2)]) - argument_bytes)
  return None


def _refused(name, error, mesh, batch, arguments, compile_s, slices) -> Program:
  shards = _argument_buffers(arguments)
  args = sum(b.bytes for b in shards)
  temps = refused_bytes(str(error), args)
  if temps is None:
    raise error
  return Program(
      name=name, chips=mesh.devices.size, slices=slices,
      mesh=dict(mesh.shape), batch=batch, compile_s=round(compile_s, 2), argument_bytes=args,
      output_bytes=0, temp_bytes=temps, alias_bytes=0, hbm_bytes=args + temps, fits=False,
      largest=shards[:_LARGEST], refused=str(error).strip().splitlines()[0],
      collective_bytes={}, cross_slice_bytes=0, cross_slice=(), f32_dots=0, f32_dot_flops=0,
      scatters=0, host_transfers=0, attention_kernels=0, model_flops_per_chip=None,
      estimate_s=None)


@contextlib.contextmanager
def _without_persistent_cache():
  """TPU executables compiled without a TPU client cannot be read back from JAX's persistent
  compilation cache (JAX_COMPILATION_CACHE_DIR): compile them outside it, and give the CPU's
  programs their cache back afterwards (JAX decides once whether to use it: reset)."""
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()


def _program(name: str, lowered, mesh, batch: int, chip: tpu_topology.Chip, flops: float | None,
             dcn_bytes_per_s: float, slice_label: int | None = None,
             arguments=None) -> Program:
  """`lowered` compiled and read; `slice_label` names the slice of a program compiled for a
  single-slice description (its devices carry slice 0); `arguments` (its inputs' abstract
  values) name the largest shards when the compiler refuses a program too large for HBM."""
  devices = list(mesh.devices.flat)
  slice_of = mesh_lib.slice_indices(devices)
  slices = tuple(sorted(set(slice_of))) if slice_label is None else (slice_label,)
  start = time.perf_counter()
  try:
    with _without_persistent_cache():
      compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    return _refused(name, e, mesh, batch, arguments or (), time.perf_counter() - start, slices)
  compile_s = time.perf_counter() - start
  text = compiled.as_text() or ""
  stats = compiled.memory_analysis()
  args, outs = stats.argument_size_in_bytes, stats.output_size_in_bytes
  temps, alias = stats.temp_size_in_bytes, stats.alias_size_in_bytes
  hbm = args + outs + temps - alias
  found = collectives_lib.collectives(text)
  crossing = [c for c in found if collectives_lib.crosses(c, slice_of)]
  cross_bytes = sum(c.bytes_per_call for c in crossing)
  digest = program_digest.digest_hlo_text(text)
  network = collectives_lib.megascale_transfers(text)
  f32 = digest.f32_dots(F32_DOT_MIN_FLOPS)
  ici_bytes = sum(c.bytes_per_call for c in found) - cross_bytes
  return Program(
      name=name, chips=len(devices), slices=slices,
      mesh=dict(mesh.shape), batch=batch, compile_s=round(compile_s, 2), argument_bytes=args,
      output_bytes=outs, temp_bytes=temps, alias_bytes=alias, hbm_bytes=hbm,
      fits=hbm <= chip.hbm_bytes, largest=() if hbm <= chip.hbm_bytes else _largest(text),
      collective_bytes=collectives_lib.bytes_by_kind(found), cross_slice_bytes=cross_bytes,
      cross_slice=tuple(c.name for c in crossing), f32_dots=len(f32),
      f32_dot_flops=sum(d.flops * d.executions for d in f32),
      scatters=len(digest.scatters()),
      host_transfers=len([t for t in digest.host_transfers() if t.name not in network]),
      attention_kernels=len(digest.attention_kernels()),
      model_flops_per_chip=flops,
      estimate_s=None if flops is None else estimate(flops, ici_bytes, cross_bytes, chip,
                                                     dcn_bytes_per_s))


def _step_flops(cfg: Config, batch: int, chips: int) -> float:
  tokens = batch * cfg.data.seq_len
  causal = flops_lib.causal_flops_per_token(cfg.model, cfg.data.seq_len)
  extra, _ = flops_lib.recompute_flops_per_token(cfg.model, cfg.data.seq_len, "xla", batch)
  return (causal + (extra or 0.0)) * tokens / chips


def _with_batch(cfg: Config, batch: int) -> Config:
  return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=batch))


def compile_run(cfg: Config, topology: str, slices: int = 1, *, learners: str = "all",
                data_parallel: bool = True,
                dcn_bytes_per_s: float = tpu_topology.DCN_BYTES_PER_S_PER_CHIP,
                on_program: Callable[[Program], None] = lambda p: None) -> Report:
  """Compiles `cfg`'s programs for `slices` slices of `topology`: one learner per slice (all of
  them, or only the first with `learners="first"`) and the data-parallel baseline over all
  slices at `slices` x `train.batch_size` sequences per step (at one slice, the learner's own
  program: not compiled again). `on_program` sees each program as it is done."""
  if learners not in ("all", "first"):
    raise ConfigError(f"--learners={learners!r}: must be all or first")
  if not dcn_bytes_per_s > 0:
    raise ConfigError(f"--dcn_gbps_per_chip must be > 0, got {dcn_bytes_per_s * 8 / 1e9}")
  spec = tpu_topology.parse(topology)
  devices = tpu_topology.devices(spec, slices)
  groups = mesh_lib.device_groups(devices, [spec.chips] * slices)
  programs = []

  def add(program: Program) -> None:
    programs.append(program)
    on_program(program)

  batch = cfg.train.batch_size
  for m in range(1 if learners == "first" else slices):
    # Learner 0 is compiled on slice 0 of the multi-slice system, so its replica groups show
    # that it stays on its slice. libtpu compiles a multi-slice system's program only when
    # slice 0 takes part ("Slice is empty"), so every other learner, a job of its own on its
    # own slice as in a real run, is compiled for a single-slice description of that slice.
    group = groups[0] if m == 0 else tpu_topology.devices(spec, 1)
    state, init, step = island.lower_learner(cfg, group, m)
    add(_program(f"learner {m} init", init, state.mesh, batch, spec.chip, None,
                 dcn_bytes_per_s, slice_label=m))
    add(_program(f"learner {m} step", step, state.mesh, batch, spec.chip,
                 _step_flops(cfg, batch, spec.chips), dcn_bytes_per_s, slice_label=m,
                 arguments=state.abstract))
  if data_parallel and slices > 1:
    dp = _with_batch(cfg, batch * slices)
    state, init, step = island.lower_learner(dp, devices, 0)
    add(_program("data-parallel init", init, state.mesh, dp.train.batch_size, spec.chip, None,
                 dcn_bytes_per_s))
    add(_program("data-parallel step", step, state.mesh, dp.train.batch_size, spec.chip,
                 _step_flops(cfg, dp.train.batch_size, len(devices)), dcn_bytes_per_s,
                 arguments=state.abstract))
  dp_step = next((p for p in programs if p.name == "data-parallel step" and not p.refused), None)
  return Report(topology=spec.name, chip=spec.chip.name, slices=slices,
                hbm_per_chip=spec.chip.hbm_bytes, dcn_bytes_per_s_per_chip=dcn_bytes_per_s,
                programs=tuple(programs),
                ledger=None if dp_step is None else ledger(cfg, dp_step, spec.chips, slices))


def ledger(cfg: Config, dp_step: Program, chips_per_slice: int, slices: int) -> Ledger:
  """`Ledger` of a compiled data-parallel step: the ledger's own formula at one step a
  second, so that its Gbit/s are bits per step."""
  params = transformer.param_counts(cfg.model)["total"]

  def per_step(bits: int) -> float:
    rate = bandwidth.estimate(params=params, step_time=1.0, datacenters=slices, fragments=1,
                              H=1, tau=1, bits=bits, dp_bits=bits)
    return rate.dp_gbps * 1e9 / 8
  return Ledger(compiled_bytes_per_slice=dp_step.cross_slice_bytes * chips_per_slice,
                ledger_bytes_bf16=per_step(16), ledger_bytes_f32=per_step(32))


def largest_multiple(fits: Callable[[int], bool], unit: int, limit: int) -> int:
  """The largest multiple of `unit`, at most `limit`, for which `fits` holds, found in
  O(log(limit / unit)) calls by doubling then bisecting; 0 when not even `unit` fits. `fits` must
  be monotone (a batch that fits fits smaller), as memory is."""
  if limit < unit or not fits(unit):
    return 0
  good, k = 1, 2
  while k * unit <= limit and fits(k * unit):
    good, k = k, 2 * k
  bad = min(k, limit // unit + 1)  # the first multiple known not to fit (or past the limit)
  while bad - good > 1:
    mid = (good + bad) // 2
    good, bad = (mid, bad) if fits(mid * unit) else (good, mid)
  return good * unit


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fit:
  """The largest learner batch that fits a slice, and its step's program there."""
  batch: int  # sequences per step, 0 when not even one per batch shard fits
  per_shard: int  # sequences per data x fsdp shard
  probes: int  # step programs compiled to find it
  program: Program | None  # the step at `batch`


def largest_batch(cfg: Config, topology: str, *, limit: int = 1 << 16,
                  on_probe: Callable[[Program], None] = lambda p: None) -> Fit:
  """The largest `train.batch_size` (a multiple of the learner mesh's data x fsdp width) whose
  learner step fits one slice of `topology`, up to `limit` sequences; each probe compiles the
  step alone (its init does not depend on the batch)."""
  spec = tpu_topology.parse(topology)
  devices = tpu_topology.devices(spec, 1)
  width = mesh_lib.data_parallel_width(mesh_lib.learner_mesh(devices, cfg.mesh))
  found: dict[int, Program] = {}

  def fits(batch: int) -> bool:
    probe = _with_batch(cfg, batch)
    state, _, step = island.lower_learner(probe, devices, 0)
    found[batch] = _program(f"learner step at batch {batch}", step, state.mesh, batch,
                            spec.chip, _step_flops(probe, batch, spec.chips),
                            tpu_topology.DCN_BYTES_PER_S_PER_CHIP, slice_label=0,
                            arguments=state.abstract)
    on_probe(found[batch])
    return found[batch].fits

  batch = largest_multiple(fits, width, limit)
  return Fit(batch=batch, per_shard=batch // width, probes=len(found),
             program=found.get(batch))

