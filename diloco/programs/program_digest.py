"""What a compiled step really runs: its matmuls, scatters, loops, host transfers and memory,
read from the compiled program so that tests on CPU can hold the step to its performance rules.

Every HLO fact comes from one parser (`hlo_text.parse_hlo`) of the optimized HLO text
(`compiled.as_text()`), which sees what the backend made of the program: on CPU a dot sits inside
a fusion (`__ynn_fusion`, ...), on GPU it is a cuBLAS custom call (`__cublas$gemm`,
`__cublas$lt$matmul`), a dot inside a Triton fusion, or a cuDNN attention call (`__cudnn$fmha*`).
Figures are per device (an SPMD program is one partition's) and per execution; a dot inside a
loop body carries `executions`, the product of the known trip counts of the loops around it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.ad_checkpoint
import jax.extend

from diloco.programs import hlo_text

_HOST_OPCODES = ("send", "recv", "send-done", "recv-done", "infeed", "outfeed")
# Custom calls that place a value in host memory before the compiler turns them into copies.
_HOST_PLACEMENT_TARGETS = ("annotate_device_placement", "MoveToHost", "MoveToDevice")
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")
_ATTENTION = re.compile(r"fmha|flash|attention", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Dot:
  """A matmul: a `dot`, a `convolution` or a cuBLAS gemm custom call."""
  name: str
  kind: str  # "dot", "convolution" or the custom-call target
  lhs: hlo_text.Array
  rhs: hlo_text.Array
  result: hlo_text.Array
  flops: int  # one execution: 2 x result size x contracted size
  executions: int  # how often it runs per call of the program (known trip counts)
  op_name: str  # the JAX operation it came from (metadata), "" if none

  @property
  def operand_dtypes(self) -> tuple[str, str]:
    return (self.lhs.dtype, self.rhs.dtype)


@dataclasses.dataclass(frozen=True)
class Indexed:
  """A scatter (`window` is its updates) or a gather (`window` is its result): `count` index
  rows between `operand`, an array of `dtype`, and the windows."""
  name: str
  dtype: str
  operand: hlo_text.Array
  window: hlo_text.Array
  count: int
  executions: int
  op_name: str


@dataclasses.dataclass(frozen=True)
class WhileLoop:
  name: str
  trip_count: int | None  # None where the compiler does not state it
  op_name: str


@dataclasses.dataclass(frozen=True)
class Op:
  """A custom call (`kind` is its target) or a host transfer (`kind` is the opcode, the
  custom-call target, or "to_host" / "from_host" for a move between memory spaces)."""
  name: str
  kind: str
  op_name: str


@dataclasses.dataclass(frozen=True)
class Memory:
  """`compiled.memory_analysis()` in bytes per device; None where the backend gives none."""
  temp_bytes: int | None = None
  argument_bytes: int | None = None
  output_bytes: int | None = None
  alias_bytes: int | None = None
  generated_code_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class ProgramDigest:
  """The facts of one compiled program that its performance depends on."""
  dots: tuple[Dot, ...]
  scatters_all: tuple[Indexed, ...]
  gathers: tuple[Indexed, ...]
  while_loops: tuple[WhileLoop, ...]
  transfers: tuple[Op, ...]  # data moved between host and device, or host code run
  custom_calls: tuple[Op, ...]
  memory: Memory
  cost_flops: float | None  # `compiled.cost_analysis()["flops"]`, None where not given
  num_partitions: int  # devices one SPMD program runs on; the figures here are per device
  # The lowered StableHLO's dots and scatters, each once, in the dtypes the program asks for
  # before the backend rewrites any (None when only a Compiled was given).
  lowered_dots: tuple[Dot, ...] | None = None
  lowered_scatters: tuple[Indexed, ...] | None = None

  def dot_flops(self) -> int:
    """FLOPs of every matmul, per device, loops' known trip counts included."""
    return sum(d.flops * d.executions for d in self.dots)

  def f32_dots(self, min_flops: int = 0) -> tuple[Dot, ...]:
    """Matmuls with two float32 operands and at least `min_flops` per execution (TF32 at best
    on GPUs: half the bf16 rate)."""
    return tuple(d for d in self.dots
                 if d.operand_dtypes == ("f32", "f32") and d.flops >= min_flops)

  def scatters(self, dtype: str | None = None) -> tuple[Indexed, ...]:
    """Scatters, only those into `dtype` (HLO spelling: "bf16", "f32") if given."""
    return tuple(s for s in self.scatters_all if dtype is None or s.dtype == dtype)

  def host_transfers(self) -> tuple[Op, ...]:
    return self.transfers

  def custom_call_counts(self) -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in self.custom_calls:
      counts[c.kind] = counts.get(c.kind, 0) + 1
    return counts

  def attention_kernels(self) -> tuple[Op, ...]:
    """Fused attention custom calls: cuDNN's (`__cudnn$fmha*`) on GPU, the Pallas splash
    kernel's (a `tpu_custom_call` from `splash` code) on TPU; none on CPU."""
    return tuple(c for c in self.custom_calls if _ATTENTION.search(c.kind)
                 or (c.kind == "tpu_custom_call" and "splash" in c.op_name))

  def summary(self) -> dict[str, Any]:
    """A JSON-able account for benches: FLOPs by operand dtypes, the rest as counts."""
    by_dtypes: dict[str, int] = {}
    for d in self.dots:
      key = " x ".join(d.operand_dtypes) + " -> " + d.result.dtype
      by_dtypes[key] = by_dtypes.get(key, 0) + d.flops * d.executions
    return {
        "num_partitions": self.num_partitions,
        "dots": len(self.dots),
        "dot_flops": self.dot_flops(),
        "dot_flops_by_dtypes": dict(sorted(by_dtypes.items())),
        "cost_analysis_flops": self.cost_flops,
        "scatters": [{"dtype": s.dtype, "updates": s.count, "executions": s.executions,
                      "op_name": s.op_name} for s in self.scatters_all],
        "gathers": len(self.gathers),
        "while_loops": [w.trip_count for w in self.while_loops],
        "host_transfers": sorted({t.kind for t in self.transfers}),
        "host_transfer_count": len(self.transfers),
        "custom_calls": self.custom_call_counts(),
        "attention_kernels": sorted({c.kind for c in self.attention_kernels()}),
        "memory": dataclasses.asdict(self.memory),
    }


def _dims(attributes: str, key: str) -> tuple[int, ...]:
  m = re.search(key + r"=\{([\d,\s]*)\}", attributes)
  return tuple(int(d) for d in m.group(1).split(",") if d.strip()) if m else ()


def _json_dims(attributes: str, key: str) -> tuple[int, ...]:
  m = re.search(r'\\?"' + key + r'\\?"\s*:\s*\[([^\]]*)\]', attributes)
  return tuple(int(d) for d in re.findall(r"\d+", m.group(1))) if m else ()


def _matmul(inst: hlo_text.Instruction,
            shape_of: Callable[[str], hlo_text.Array | None]) -> Dot | None:
  """The Dot an instruction is, None if it is no matmul (or its operands are unknown)."""
  target = hlo_text.attr(inst.attributes, "custom_call_target")
  if inst.opcode == "custom-call" and target in _GEMM_TARGETS:
    contracting = _json_dims(inst.attributes, "lhs_contracting_dimensions")
  elif inst.opcode == "dot":
    contracting = _dims(inst.attributes, "lhs_contracting_dims")
  elif inst.opcode != "convolution":
    return None
  if len(inst.operands) < 2 or not inst.types:
    return None
  lhs, rhs = shape_of(inst.operands[0]), shape_of(inst.operands[1])
  if lhs is None or rhs is None:
    return None
  result = inst.types[0]  # a gemm's result is (output, workspace)
  if inst.opcode == "convolution":
    # Every kernel dimension but the output features is contracted (feature groups included:
    # the kernel's input-feature dimension is already per group).
    labels = re.search(r"dim_labels=\w+_(\w+)->", inst.attributes)
    kernel = labels.group(1) if labels else ""
    contracted = math.prod(n for n, label in zip(rhs.shape, kernel) if label != "o")
  else:
    contracted = math.prod(lhs.shape[d] for d in contracting if d < len(lhs.shape))
  return Dot(inst.name, target or inst.opcode, lhs, rhs, result, 2 * result.size * contracted,
             1, hlo_text.attr(inst.attributes, "op_name"))


def digest_hlo_text(text: str) -> ProgramDigest:
  """The digest of an optimized HLO module's text alone (no memory or cost figures)."""
  instructions, entry, callers = hlo_text.parse_hlo(text)
  runs = hlo_text.program_executions(instructions, entry, callers)

  def shape_of(name: str) -> hlo_text.Array | None:
    inst = instructions.get(name)
    return inst.types[0] if inst and inst.types else None

  dots, scatters, gathers, loops, transfers, calls = [], [], [], [], [], []
  for inst in instructions.values():
    op_name = hlo_text.attr(inst.attributes, "op_name")
    n = runs(inst.computation)
    dot = _matmul(inst, shape_of)
    if dot is not None:
      dots.append(dataclasses.replace(dot, executions=n))
    elif inst.opcode == "scatter" and len(inst.operands) >= 3:
      # Operands: inputs..., indices, updates...; one input and one update in the usual case.
      half = (len(inst.operands) - 1) // 2
      operand, updates = shape_of(inst.operands[0]), shape_of(inst.operands[half + 1])
      if operand is not None and updates is not None:
        window = _dims(inst.attributes, "update_window_dims")
        rows = math.prod(s for i, s in enumerate(updates.shape) if i not in window)
        scatters.append(Indexed(inst.name, inst.types[0].dtype, operand, updates, rows, n,
                                op_name))
    elif inst.opcode == "gather" and inst.operands:
      operand, result = shape_of(inst.operands[0]), inst.types[0]
      offsets = _dims(inst.attributes, "offset_dims")
      slices = math.prod(s for i, s in enumerate(result.shape) if i not in offsets)
      if operand is not None:
        gathers.append(Indexed(inst.name, result.dtype, operand, result, slices, n, op_name))
    elif inst.opcode == "while":
      loops.append(WhileLoop(inst.name, hlo_text.trip_count(inst), op_name))
    if inst.opcode == "custom-call":
      target = hlo_text.attr(inst.attributes, "custom_call_target")
      calls.append(Op(inst.name, target, op_name))
      if "callback" in target.lower() or target in _HOST_PLACEMENT_TARGETS:
        transfers.append(calls[-1])
    elif inst.opcode in _HOST_OPCODES:
      transfers.append(Op(inst.name, inst.opcode, op_name))
    elif inst.opcode != "parameter":
      to_host = any(t.host for t in inst.types)
      from_host = any((s := shape_of(o)) is not None and s.host for o in inst.operands)
      if to_host != from_host and inst.opcode not in ("get-tuple-element", "tuple", "bitcast"):
        transfers.append(Op(inst.name, "to_host" if to_host else "from_host", op_name))
  header = re.search(r"num_partitions=(\d+)", text.split("\n", 1)[0])
  return ProgramDigest(tuple(dots), tuple(scatters), tuple(gathers), tuple(loops),
                       tuple(transfers), tuple(calls), Memory(), None,
                       int(header.group(1)) if header else 1)


_STABLEHLO_DOT = re.compile(
    r"stablehlo\.dot_general\s+%[\w#.]+,\s*%[\w#.]+,?(.*?):\s*\(tensor<([^>]*)>,\s*"
    r"tensor<([^>]*)>\)\s*->\s*tensor<([^>]*)>")


def _tensor(text: str) -> hlo_text.Array:
  *dims, dtype = text.split("x")
  return hlo_text.Array(dtype, tuple(int(d) if d.isdigit() else -1 for d in dims))


def stablehlo_dots(text: str) -> tuple[Dot, ...]:
  """`dot_general`s of a lowered StableHLO module, as written (each once, before any rewrite
  of dtypes by the backend)."""
  dots = []
  for i, m in enumerate(_STABLEHLO_DOT.finditer(text)):
    lhs, rhs, result = _tensor(m.group(2)), _tensor(m.group(3)), _tensor(m.group(4))
    contract = re.search(r"contracting_dims\s*=\s*\[([\d,\s]*)\]", m.group(1))
    dims = [int(d) for d in contract.group(1).split(",") if d.strip()] if contract else []
    contracted = math.prod(lhs.shape[d] for d in dims)
    dots.append(Dot(f"dot_general.{i}", "dot_general", lhs, rhs, result,
                    2 * result.size * contracted, 1, ""))
  return tuple(dots)


_STABLEHLO_SCATTER = re.compile(
    r'"stablehlo\.scatter"\(.*?update_window_dims = \[([\d,\s]*)\].*?\}\)\s*:\s*\((.*?)\)\s*->',
    re.DOTALL)


def stablehlo_scatters(text: str) -> tuple[Indexed, ...]:
  """Scatters of a lowered StableHLO module in the dtype the program asks for (the CPU backend
  compiles a bf16 scatter-add as f32, so only this shows the bf16 one there)."""
  scatters = []
  for i, m in enumerate(_STABLEHLO_SCATTER.finditer(text)):
    window = {int(d) for d in m.group(1).split(",") if d.strip()}
    types = [_tensor(t) for t in re.findall(r"tensor<([^>]*)>", m.group(2))]
    operand, updates = types[0], types[-1]  # (inputs..., indices, updates...)
    rows = math.prod(n for d, n in enumerate(updates.shape) if d not in window)
    scatters.append(Indexed(f"scatter.{i}", operand.dtype, operand, updates, rows, 1, ""))
  return tuple(scatters)


def _figures(compiled) -> tuple[Memory, float | None]:
  """`memory_analysis()` and `cost_analysis()` flops, None for what the backend cannot give."""
  errors = (NotImplementedError, RuntimeError, jax.errors.JaxRuntimeError)
  try:
    stats = compiled.memory_analysis()
  except errors:
    stats = None
  def get(name):
    return getattr(stats, name, None)
  memory = Memory(get("temp_size_in_bytes"), get("argument_size_in_bytes"),
                  get("output_size_in_bytes"), get("alias_size_in_bytes"),
                  get("generated_code_size_in_bytes"))
  try:
    cost = compiled.cost_analysis()
  except errors:
    cost = None
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
    cost = cost[0] if cost else None
  flops = cost.get("flops") if isinstance(cost, dict) else None
  return memory, None if flops is None else float(flops)


def digest(fn_or_stage, *args, **kwargs) -> ProgramDigest:
  """Lowers and compiles `fn(*args, **kwargs)` (jitted here if it is not) and digests it; or
  digests a `jax.stages.Lowered` / `Compiled` given alone."""
  lowered = None
  if isinstance(fn_or_stage, jax.stages.Compiled):
    compiled = fn_or_stage
  else:
    if isinstance(fn_or_stage, jax.stages.Lowered):
      lowered = fn_or_stage
    else:
      fn = fn_or_stage if hasattr(fn_or_stage, "lower") else jax.jit(fn_or_stage)
      lowered = fn.lower(*args, **kwargs)
    compiled = lowered.compile()
  result = digest_hlo_text(compiled.as_text() or "")
  text = None if lowered is None else lowered.as_text()
  memory, flops = _figures(compiled)
  return dataclasses.replace(
      result, memory=memory, cost_flops=flops,
      lowered_dots=None if text is None else stablehlo_dots(text),
      lowered_scatters=None if text is None else stablehlo_scatters(text))


@dataclasses.dataclass(frozen=True)
class Residual:
  shape: tuple[int, ...]
  dtype: str
  source: str  # "argument <i>", "constant", "literal" or the primitive that made it

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * jax.numpy.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Residuals:
  entries: tuple[Residual, ...]  # what the backward pass keeps from the forward pass

  @property
  def total_bytes(self) -> int:
    return sum(r.nbytes for r in self.entries)


def saved_residuals(fn: Callable, *args) -> Residuals:
  """The residuals that `jax.vjp(fn, *args)` keeps (shapes, dtypes, sources).

  Uses `jax.ad_checkpoint.saved_residuals` where this JAX exports it; otherwise (JAX 0.10 keeps
  it private) does what it does: traces `jax.vjp` and reads which values of the forward
  program the returned backward function closes over."""
  public = getattr(jax.ad_checkpoint, "saved_residuals", None)
  if public is not None:
    return Residuals(tuple(Residual(tuple(aval.shape), str(aval.dtype), src)
                           for aval, src in public(fn, *args)))
  leaves, tree = jax.tree.flatten(args)

  def backward_of(*flat):
    return jax.vjp(lambda *a: fn(*jax.tree.unflatten(tree, a)), *flat)[1]

  jaxpr = jax.make_jaxpr(backward_of)(*leaves).jaxpr  # its outputs: the closure's arrays
  producer = {v: e.primitive.name for e in jaxpr.eqns for v in e.outvars}
  argument = {v: i for i, v in enumerate(jaxpr.invars)}
  constants = set(jaxpr.constvars)
  entries = []
  for v in jaxpr.outvars:
    if isinstance(v, jax.extend.core.Literal):
      source = "literal"
    elif v in argument:
      source = f"argument {argument[v]}"
    elif v in constants:
      source = "constant"
    else:
      source = producer.get(v, "unknown")
    entries.append(Residual(tuple(v.aval.shape), str(v.aval.dtype), source))
  return Residuals(tuple(entries))

