"""The collectives of a compiled SPMD program: kind, bytes per device, how often they run, and
which partitions each one joins, read from the optimized HLO text (`compiled.as_text()`).

A figure is per device and per execution, as the program digest's are; `executions` multiplies
in the known trip counts of the loops around it (a scanned layer stack runs its all-gathers once
per layer). Bytes count what one device holds of the exchanged value, not what a particular
algorithm sends on the wire: an all-gather's result, a reduce-scatter's operand, an all-reduce's
value (a ring all-reduce puts about twice that on the wire). Asynchronous pairs count once, at
their `-start`.

Between the slices of a multi-slice TPU system the compiler emits no collective but host
transfers that the MegaScale runtime carries over the data-center network (a `send` and a
`recv` each, `_xla_megascale_transfer_type="ALL_REDUCE"`): each send counts as one collective
of kind `dcn all-reduce` (its payload's bytes), and it crosses slices by definition.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

from diloco.programs import hlo_text

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
         "ragged-all-to-all")
_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
          "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
# The mesh form: `replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}` (optionally with
# `<=[dims]T(perm)` after the bracket for a device order other than 0..n-1): groups are the
# devices that differ only along the named axes.
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?)?"
                   r"\s*\{([^}]*)\}")
_LISTED = re.compile(r"(replica_groups|source_target_pairs)=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_MEGASCALE = '_xla_host_transfer_handler_name="xla_megascale_runtime"'
_MEGASCALE_TYPE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')


@dataclasses.dataclass(frozen=True)
class Collective:
  name: str
  kind: str  # one of KINDS
  bytes: int  # per device, per execution (module docstring)
  executions: int
  dtypes: tuple[str, ...]
  # The partitions that exchange with each other, one tuple per group (a permute's
  # source-target pairs); () when every partition takes part.
  groups: tuple[tuple[int, ...], ...]
  op_name: str
  dcn: bool = False  # between slices, over the data-center network (module docstring)

  @property
  def bytes_per_call(self) -> int:
    return self.bytes * self.executions


def dtype_bytes(dtype: str) -> int:
  """Bytes of one element of an HLO dtype (sub-byte types count as one)."""
  return _BYTES.get(dtype, 4)


def _size(arrays) -> int:
  return sum(math.prod(a.shape) * dtype_bytes(a.dtype) for a in arrays)


def _iota(dims: list[int], perm: str | None) -> np.ndarray:
  ids = np.arange(math.prod(dims)).reshape(dims)
  return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def _groups(attributes: str) -> tuple[tuple[int, ...], ...]:
  mesh = _MESH.search(attributes)
  if mesh:
    axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
    sizes = [int(n) for _, n in axes]
    order = (_iota([int(d) for d in mesh.group(2).split(",")], mesh.group(3)).reshape(sizes)
             if mesh.group(2) else np.arange(math.prod(sizes)).reshape(sizes))
    grouped = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in mesh.group(4)]
    rest = [i for i in range(len(axes)) if i not in grouped]
    width = math.prod(sizes[i] for i in grouped)
    return tuple(tuple(int(i) for i in row)
                 for row in order.transpose(rest + grouped).reshape(-1, width))
  iota = _IOTA.search(attributes)
  if iota:
    count, size = int(iota.group(1)), int(iota.group(2))
    ids = _iota([int(d) for d in iota.group(3).split(",")], iota.group(4))
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(count, size))
  listed = _LISTED.search(attributes)
  if listed:
    return tuple(tuple(int(i) for i in re.findall(r"\d+", g))
                 for g in re.findall(r"\{([\d,\s]*)\}", listed.group(2)))
  return ()


def collectives(text: str) -> tuple[Collective, ...]:
  """Every collective of an optimized HLO module, in program order."""
  instructions, entry, callers = hlo_text.parse_hlo(text)
  runs = hlo_text.program_executions(instructions, entry, callers)

  def operand_bytes(inst) -> int:
    return _size(a for o in inst.operands if o in instructions for a in instructions[o].types)

  found = []
  for inst in instructions.values():
    if inst.opcode == "send" and _MEGASCALE in inst.attributes:
      kind = _MEGASCALE_TYPE.search(inst.attributes)
      kind = "dcn " + (kind.group(1).lower().replace("_", "-") if kind else "transfer")
      payload = [a for a in inst.types[:1]]
      found.append(Collective(inst.name, kind, _size(payload), runs(inst.computation),
                              tuple(a.dtype for a in payload), (), "", dcn=True))
      continue
    kind = inst.opcode.removesuffix("-start")
    if kind not in KINDS or inst.opcode.endswith("-done"):
      continue
    result = _size(inst.types)
    started = inst.opcode.endswith("-start")
    if kind == "reduce-scatter" or (started and kind == "collective-permute"):
      size = operand_bytes(inst)  # a permute-start's result also holds its operand
    elif started and kind == "all-gather":
      size = result - operand_bytes(inst)  # the result tuple holds operands and outputs
    else:
      size = result
    op_name = re.search(r'op_name="([^"]*)"', inst.attributes)
    found.append(Collective(inst.name, kind, size, runs(inst.computation),
                            tuple(sorted({a.dtype for a in inst.types})),
                            _groups(inst.attributes), op_name.group(1) if op_name else ""))
  return tuple(found)


def crosses(collective: Collective, slice_of: Sequence[int]) -> bool:
  """Whether a collective joins partitions of more than one slice; `slice_of[i]` is the slice
  of partition i (every partition takes part when it names no groups)."""
  if collective.dcn:
    return True
  groups = collective.groups or (tuple(range(len(slice_of))),)
  return any(len({slice_of[i] for i in group}) > 1 for group in groups)


def megascale_transfers(text: str) -> set[str]:
  """Names of the instructions (sends, receives and their dones) that carry data between
  slices: host transfers of the program digest that are the network's, not the host's."""
  instructions, _, _ = hlo_text.parse_hlo(text)
  names = {i.name for i in instructions.values() if _MEGASCALE in i.attributes}
  return names | {i.name for i in instructions.values()
                  if i.opcode.endswith("-done") and set(i.operands) & names}


def bytes_by_kind(found: Sequence[Collective]) -> dict[str, int]:
  """Bytes per device per call of the program, by kind (loops' trip counts multiplied in)."""
  out: dict[str, int] = {}
  for c in found:
    out[c.kind] = out.get(c.kind, 0) + c.bytes_per_call
  return dict(sorted(out.items()))
