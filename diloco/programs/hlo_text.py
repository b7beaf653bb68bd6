"""The text of an optimized HLO module (`compiled.as_text()`) as instructions: one parser for
every reader of compiled programs (the program digest, the collectives, the residual reads).

An instruction keeps its result arrays, opcode, operand names and the raw text of its
attributes, which each reader searches for what it needs (`attr`); call edges between
computations give how often each runs (`program_executions`, loop trip counts multiplied in).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-$]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-$]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_OPERAND = re.compile(r"%([\w.\-$]+)")
_CALLEES = re.compile(
    r"\b(calls|to_apply|body|condition|branch_computations|called_computations)="
    r"(\{[^}]*\}|%?[\w.\-$]+)")
_TRIP_COUNT = re.compile(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')
_HOST_MEMORY_SPACE = ":S(5)"  # XLA's memory space of pinned host memory, in a layout


@dataclasses.dataclass(frozen=True)
class Array:
  """One array type of the program: dtype as HLO names it (f32, bf16, s32, ...) and dims."""
  dtype: str
  shape: tuple[int, ...]
  host: bool = False  # laid out in host memory (memory space S(5))

  @property
  def size(self) -> int:
    return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  computation: str
  types: tuple[Array, ...]  # the result: one array, or a tuple's arrays
  opcode: str
  operands: tuple[str, ...]
  attributes: str  # everything after the operand list (dims, targets, metadata, config)


def _split_type(text: str) -> tuple[str, str]:
  """`(shape text, rest)` of an instruction's right-hand side: a tuple type is balanced."""
  if not text.startswith("("):
    head, _, rest = text.partition(" ")
    return head, rest
  inside, rest = _balanced(text[1:])
  return f"({inside})", rest.lstrip()


def _arrays(type_text: str) -> tuple[Array, ...]:
  out = []
  for m in _ARRAY.finditer(type_text):
    dims = tuple(int(d.strip().lstrip("<=")) for d in m.group(2).split(",") if d.strip())
    out.append(Array(m.group(1), dims, _HOST_MEMORY_SPACE in (m.group(3) or "")))
  return tuple(out)


def _balanced(text: str) -> tuple[str, str]:
  """`(inside, after)` of text that starts just after an opening parenthesis."""
  depth = 1
  for i, ch in enumerate(text):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      return text[:i], text[i + 1:]
  return text, ""


def logical_lines(text: str):
  """The text's lines, an instruction whose attributes run over several lines (a TPU kernel's
  `frontend_attributes={kernel_metadata={` ... `}}`) joined into one."""
  pending, depth = [], 0
  for line in text.splitlines():
    if pending:
      pending.append(line)
      depth += line.count("{") - line.count("}")
      if depth <= 0:
        yield " ".join(pending)
        pending = []
      continue
    depth = line.count("{") - line.count("}")
    header = _COMPUTATION.match(line) and "=" not in line.split("(")[0]
    if depth > 0 and not header and _INSTRUCTION.match(line):
      pending = [line]
    else:
      yield line
  if pending:
    yield " ".join(pending)


def parse_hlo(text: str) -> tuple[dict[str, Instruction], str | None, dict[str, list]]:
  """The instructions of an HLO module's text by name, its entry computation, and every
  computation's call sites as `{callee: [(caller instruction, edge kind)]}`."""
  instructions: dict[str, Instruction] = {}
  callers: dict[str, list] = {}
  computation, entry = "", None
  for line in logical_lines(text):
    header = _COMPUTATION.match(line)
    if header and "=" not in line.split("(")[0]:
      computation = header.group(2)
      entry = computation if header.group(1) else entry
      continue
    m = _INSTRUCTION.match(line)
    if not m or not computation:
      continue
    type_text, rest = _split_type(m.group(3))
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
      continue
    inside, attributes = _balanced(rest[op.end():])
    inst = Instruction(m.group(2), computation, _arrays(type_text), op.group(1),
                        tuple(_OPERAND.findall(inside)), attributes)
    instructions[inst.name] = inst
    for kind, callees in _CALLEES.findall(attributes):
      for callee in re.findall(r"[\w.\-$]+", callees):
        callers.setdefault(callee, []).append((inst.name, kind))
  return instructions, entry, callers


def program_executions(instructions, entry, callers) -> Callable[[str], int]:
  """How often each computation runs per call of the entry, from known trip counts."""
  memo: dict[str, int] = {}

  def runs(computation: str) -> int:
    if computation == entry or computation not in callers:
      return 1
    if computation not in memo:
      total = 0
      for caller, kind in callers[computation]:
        inst = instructions[caller]
        trips = 1
        if inst.opcode == "while" and kind == "body":
          trips = trip_count(inst) or 1
        total += runs(inst.computation) * trips
      memo[computation] = max(total, 1)  # HLO has no recursion: callers finish first
    return memo[computation]

  return runs


def trip_count(inst: Instruction) -> int | None:
  m = _TRIP_COUNT.search(inst.attributes)
  return int(m.group(1)) if m else None


def attr(attributes: str, key: str) -> str:
  m = re.search(key + r'="([^"]*)"', attributes)
  return m.group(1) if m else ""
