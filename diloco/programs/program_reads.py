"""Which operations of a compiled step read its large arrays: the passes over memory that the
step makes beside its matmuls, read from the optimized HLO text.

A step's elementwise work (the compute-dtype copies of the parameters, the optimizer's update,
the global norms) is bound by memory, not by FLOPs: each operation of the entry computation
that reads a state array streams it once from HBM. Counting those readers per stored array
checks on the program, not in the Python, what a layout or a metric costs: stacking the scanned
layers must not add a pass over the parameters, nor must the norms the step reports.
"""

from __future__ import annotations

import dataclasses
import functools

from diloco.programs import hlo_text

# Operations that move no data: they name or regroup buffers.
_FREE = ("parameter", "get-tuple-element", "bitcast", "tuple", "constant")


@dataclasses.dataclass(frozen=True)
class Reader:
  """One operation of the entry computation that reads an array."""
  name: str
  opcode: str  # "fusion", "while", a custom call...
  computation: str  # the fused computation a fusion calls ("" otherwise)
  outputs: tuple[hlo_text.Array, ...]
  operands: tuple[str, ...]  # the instructions it reads, by name, each once
  inputs: tuple[tuple[str, hlo_text.Array], ...]  # (operand, array) for each array it reads

  def writes_at_least(self, size: int) -> bool:
    return any(a.size >= size for a in self.outputs)


def entry_readers(text: str) -> tuple[dict[str, tuple[Reader, ...]],
                                      dict[str, hlo_text.Array]]:
  """For each parameter of the entry computation (by name), the operations that read it, and
  each parameter's array. Buffer-naming operations (tuples, bitcasts) are not readers."""
  instructions, entry = _parsed(text)
  ops = [i for i in instructions.values() if i.computation == entry]
  params = {i.name: i.types[0] for i in ops if i.opcode == "parameter" and len(i.types) == 1}
  readers: dict[str, list[Reader]] = {name: [] for name in params}
  for inst in ops:
    if inst.opcode in _FREE:
      continue
    reader = _reader(inst, instructions)
    for operand in dict.fromkeys(inst.operands):
      if operand in readers:
        readers[operand].append(reader)
  return {name: tuple(r) for name, r in readers.items()}, params


def reduction_passes(text: str, min_size: int = 2**20) -> tuple[Reader, ...]:
  """Reductions of the entry computation that read an array of at least `min_size` elements and
  write nothing larger than a sixteenth of it: passes that stream an array only to sum it (a
  norm that no producer of the array computed on the way)."""
  instructions, entry = _parsed(text)
  reducing = {i.computation for i in instructions.values() if i.opcode == "reduce"}
  out = []
  for inst in instructions.values():
    if inst.computation != entry or inst.opcode in _FREE:
      continue
    reader = _reader(inst, instructions)
    largest = max((a.size for _, a in reader.inputs), default=0)
    if (largest >= min_size and not reader.writes_at_least(largest // 16)
        and (inst.opcode == "reduce" or reader.computation in reducing)):
      out.append(reader)
  return tuple(out)


@functools.lru_cache(maxsize=2)
def _parsed(text: str):
  """The instructions and entry of a program, parsed once for its several questions."""
  instructions, entry, _ = hlo_text.parse_hlo(text)
  return instructions, entry


def _reader(inst, instructions) -> Reader:
  operands = tuple(dict.fromkeys(inst.operands))
  inputs = tuple((name, a) for name in operands if name in instructions
                 for a in instructions[name].types)
  called = ""
  if inst.opcode == "fusion" and "calls=" in inst.attributes:
    called = inst.attributes.split("calls=", 1)[1].split(",", 1)[0].strip().lstrip("%")
  return Reader(inst.name, inst.opcode, called, inst.types, operands, inputs)
