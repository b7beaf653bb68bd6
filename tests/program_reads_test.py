"""The readers of a compiled step's arrays: a hand-written program whose passes are known, and
the gemma_2b step an H200 compiled (kept with the device bundle's results), where stacking the
scanned layers and reporting the global norms must cost no pass over the state of their own."""

import collections
import gzip
import os
import re

from diloco.model import presets
from diloco.programs import program_reads

_SMALL = """HloModule step

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%norm (g: f32[2048,1024]) -> f32[] {
  %g = f32[2048,1024]{1,0} parameter(0)
  %sq = f32[2048,1024]{1,0} multiply(%g, %g)
  %zero = f32[] constant(0)
  ROOT %sum = f32[] reduce(%sq, %zero), dimensions={0,1}, to_apply=%add
}

%update (p: f32[2048,1024], g: f32[2048,1024]) -> (f32[2048,1024], f32[2048]) {
  %p = f32[2048,1024]{1,0} parameter(0)
  %g = f32[2048,1024]{1,0} parameter(1)
  %new = f32[2048,1024]{1,0} subtract(%p, %g)
  %zero = f32[] constant(0)
  %partial = f32[2048]{0} reduce(%new, %zero), dimensions={1}, to_apply=%add
  ROOT %t = (f32[2048,1024]{1,0}, f32[2048]{0}) tuple(%new, %partial)
}

%cast (p: f32[2048,1024]) -> bf16[2048,1024] {
  %p = f32[2048,1024]{1,0} parameter(0)
  ROOT %c = bf16[2048,1024]{1,0} convert(%p)
}

ENTRY %main (param: f32[2048,1024], grad: f32[2048,1024]) -> (f32[2048,1024], f32[]) {
  %param = f32[2048,1024]{1,0} parameter(0)
  %grad = f32[2048,1024]{1,0} parameter(1)
  %copy = bf16[2048,1024]{1,0} fusion(%param), kind=kLoop, calls=%cast
  %norm_g = f32[] fusion(%grad), kind=kInput, calls=%norm
  %norm_p = f32[] fusion(%param), kind=kInput, calls=%norm
  %upd = (f32[2048,1024]{1,0}, f32[2048]{0}) fusion(%param, %grad), kind=kInput, calls=%update
  %new = f32[2048,1024]{1,0} get-tuple-element(%upd), index=0
  ROOT %out = (f32[2048,1024]{1,0}, f32[]) tuple(%new, %norm_g)
}
"""


def test_readers_and_reduction_passes_of_a_hand_written_program():
  readers, params = program_reads.entry_readers(_SMALL)
  assert {name: a.shape for name, a in params.items()} == {
      "param": (2048, 1024), "grad": (2048, 1024)}
  assert [r.name for r in readers["param"]] == ["copy", "norm_p", "upd"]  # not the output tuple
  assert [r.name for r in readers["grad"]] == ["norm_g", "upd"]
  assert [r.computation for r in readers["param"]] == ["cast", "norm", "update"]
  # The update reduces too, but writes the whole new array: a partial sum on the way, not a pass.
  passes = program_reads.reduction_passes(_SMALL)
  assert sorted((r.name, r.operands) for r in passes) == [
      ("norm_g", ("grad",)), ("norm_p", ("param",))]
  assert program_reads.reduction_passes(_SMALL, min_size=2048 * 1024 + 1) == ()


_H200 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                     "device", "h200-2026-11-27")


def _h200_text(name):
  with gzip.open(os.path.join(_H200, f"gemma_2b_{name}.hlo.txt.gz"), "rt") as f:
    return f.read()


def _nbytes(array):
  return array.size * {"bf16": 2, "f16": 2, "f32": 4}[array.dtype]


def test_the_h200_gemma_2b_step_spends_no_pass_on_stacking_or_norms():
  """gemma_2b (26 layers, pattern of 6: four scan groups of 6, two layers unrolled), batch 4,
  as an H200 compiled it with the speed switches. Each stored matrix is read twice per step,
  scanned or not: once by the fusion that writes its bf16 copy (for a scanned layer, that cast
  writes straight into the stacked array the scan walks) and once by the update, which also
  writes partial sums (the parameter and update norms). Each moment is read once. No reduction
  reads the stored state, and the gradients are reduced once: the logged gradient norm is the
  clip's."""
  cfg = presets.get("gemma_2b")
  period = len(cfg.attention_pattern)
  groups = cfg.num_layers // period
  text = _h200_text("after")
  readers, params = program_reads.entry_readers(text)
  large = {name: a for name, a in params.items() if a.size >= 2**20}
  stored = {n for n in large if n.startswith("state__params")}
  moments = {n for n in large if "__mu__" in n or "__nu__" in n}
  assert len(stored) == len(moments) // 2 > 100
  table = {n for n in stored if "embedder" in n}
  assert len(table) == 1  # also read by the lookup's gather: its rows, not the table
  def layer(name):
    return int(re.search(r"layers___(\d+)___", name).group(1))
  copies = collections.Counter()
  for name in stored - table:
    shape = large[name].shape
    copy, update = sorted(readers[name], key=lambda r: len(r.outputs))
    assert [a.dtype for a in copy.outputs] == ["bf16"], name
    scanned = layer(name) < groups * period
    assert copy.outputs[0].shape == ((groups, *shape) if scanned else shape), name
    copies[scanned] += 1
    assert any(a.dtype == "f32" and a.shape == shape for a in update.outputs), name
    assert any(a.size < large[name].size // 16 for a in update.outputs), name  # the norms
  matrices = 7  # q, k, v, o, gate, up, down in each layer
  assert copies == {True: matrices * groups * period,
                    False: matrices * (cfg.num_layers - groups * period)}
  assert all(len(readers[name]) == 1 for name in moments)

  passes = program_reads.reduction_passes(text)
  assert not any(set(r.operands) & set(params) for r in passes)
  gradients = {}  # what the moments' updates read besides the state: the gradients
  for name in moments:
    (update,) = readers[name]
    for operand, array in update.inputs:
      if operand not in params and array.size >= 2**20:
        gradients[operand] = _nbytes(array)
  reduced = sum(gradients[o] for r in passes for o in r.operands if o in gradients)
  assert sum(gradients.values()) > 6e9
  assert reduced < 1.05 * sum(gradients.values())

