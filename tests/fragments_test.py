"""Tests of diloco.fragments: packing schemes, schedule, tree flattening."""

import itertools
import math
import random

import numpy as np
import pytest
from absl import logging

from diloco import fragments


def gemma_like_shapes(num_layers=26, d=2304, f=9216, heads=8, kv=4, hd=256, vocab=256128):
  """A Gemma-2-2B-like tensor list (shapes only)."""
  shapes = {"embedder/embedding": (vocab, d), "final_norm/scale": (d,)}
  for i in range(num_layers):
    pre = f"layers/{i}"
    shapes.update({
        f"{pre}/attn/q_DNH": (d, heads, hd), f"{pre}/attn/k_DKH": (d, kv, hd),
        f"{pre}/attn/v_DKH": (d, kv, hd), f"{pre}/attn/o_NHD": (heads, hd, d),
        f"{pre}/mlp/gate_DF": (d, f), f"{pre}/mlp/up_DF": (d, f), f"{pre}/mlp/down_FD": (f, d),
        f"{pre}/pre_attn_norm/scale": (d,), f"{pre}/post_attn_norm/scale": (d,),
        f"{pre}/pre_mlp_norm/scale": (d,), f"{pre}/post_mlp_norm/scale": (d,)})
  return shapes


def _all_paths(plan):
  return [q for frag in plan.fragments for q in frag]


def _oracle_balanced(sizes, num):
  """Greedy packing written out plainly: scan the fragments' loads for each tensor."""
  def natural(q):
    return [int(c) if c.isdigit() else c for c in q.split("/")]
  order = sorted(sizes, key=lambda q: (-sizes[q], [(0, c) if isinstance(c, int) else (1, c)
                                                   for c in natural(q)]))
  groups = [[] for _ in range(num)]
  for q in order:
    loads = [sum(sizes[x] for x in g) for g in groups]
    groups[loads.index(min(loads))].append(q)
  return [set(g) for g in groups]


@pytest.mark.parametrize("seed", range(6))
def test_balanced_matches_brute_force_oracle(seed):
  rng = random.Random(seed)
  n = rng.randint(3, 7)
  sizes = {f"layers/{i}/w{j}": rng.choice([1, 2, 3, 5, 8, 8, 13])
           for i, j in zip(range(n), itertools.cycle(range(2)))}
  num = rng.randint(2, 3)
  plan = fragments.plan_fragments({q: (s,) for q, s in sizes.items()}, num)
  assert [set(g) for g in plan.fragments] == _oracle_balanced(sizes, num)
  # Greedy LPT is within 4/3 of the best possible max load (checked by exhaustive search).
  best = min(max(sum(sizes[q] for q, k in zip(sizes, assign) if k == frag) for frag in range(num))
             for assign in itertools.product(range(num), repeat=len(sizes)))
  assert max(plan.num_elements) <= math.ceil(4 / 3 * best)


def test_balanced_is_flat_on_gemma_like_model():
  shapes = gemma_like_shapes()
  plan = fragments.plan_fragments(shapes, 24)
  assert plan.num_fragments == 24
  loads = plan.num_elements
  # The embedding (590M) is one whole tensor; the other fragments share the rest evenly.
  emb = plan.fragment_of("embedder/embedding")
  others = [x for p, x in enumerate(loads) if p != emb]
  assert max(others) / min(others) < 1.15
  assert sum(loads) == sum(math.prod(s) for s in shapes.values())
  without_emb = {q: s for q, s in shapes.items() if q != "embedder/embedding"}
  flat = fragments.plan_fragments(without_emb, 24).num_elements
  assert max(flat) / min(flat) < 1.1


@pytest.mark.parametrize("scheme", fragments.SCHEMES)
def test_every_tensor_in_exactly_one_fragment(scheme):
  shapes = gemma_like_shapes(num_layers=5, d=8, f=16, hd=4, vocab=32)
  plan = fragments.plan_fragments(shapes, 4, scheme)
  paths = _all_paths(plan)
  assert sorted(paths) == sorted(shapes) and len(paths) == len(set(paths))
  assert all(plan.fragments) and plan.num_fragments == 4
  assert plan.num_elements == tuple(sum(math.prod(shapes[q]) for q in g) for g in plan.fragments)
  emb = plan.fragment_of("embedder/embedding")
  assert plan.embedding_mask(emb) == tuple(q == "embedder/embedding" for q in plan.fragments[emb])
  assert plan.is_embedding("embedder/embedding") and not plan.is_embedding("final_norm/scale")


@pytest.mark.parametrize("scheme", fragments.SCHEMES)
def test_plan_is_deterministic_and_order_free(scheme):
  shapes = gemma_like_shapes(num_layers=6, d=8, f=16, hd=4, vocab=32)
  items = list(shapes.items())
  random.Random(0).shuffle(items)
  a = fragments.plan_fragments(shapes, 5, scheme)
  b = fragments.plan_fragments(dict(items), 5, scheme)
  assert a == b


def test_layer_scheme_is_contiguous():
  shapes = gemma_like_shapes(num_layers=10, d=8, f=16, hd=4, vocab=32)
  plan = fragments.plan_fragments(shapes, 4, "layer")
  layers_of = [sorted({fragments.layer_index(q) for q in g} - {None}) for g in plan.fragments]
  assert layers_of == [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9]]
  assert "embedder/embedding" in plan.fragments[0]
  assert "final_norm/scale" in plan.fragments[-1]


def test_tensor_scheme_round_robin_in_path_order():
  shapes = {f"layers/{i}/w": (2,) for i in (0, 1, 2, 10, 11)}
  plan = fragments.plan_fragments(shapes, 2, "tensor")
  assert plan.fragments == (("layers/0/w", "layers/2/w", "layers/11/w"),
                            ("layers/1/w", "layers/10/w"))


def test_balanced_ties_go_to_lowest_index_and_by_path():
  shapes = {"b": (4,), "a": (4,), "c": (4,), "d": (2,)}
  plan = fragments.plan_fragments(shapes, 3, embedding_paths=())
  assert plan.fragments == (("a", "d"), ("b",), ("c",))
  assert plan.num_elements == (6, 4, 4)


def test_clamp_warns(monkeypatch):
  messages = []
  monkeypatch.setattr(logging, "warning", lambda msg, *args: messages.append(msg % args))
  shapes = {"embedder/embedding": (8, 2), "layers/0/w": (3,), "layers/1/w": (3,)}
  plan = fragments.plan_fragments(shapes, 24)
  assert plan.num_fragments == 3 and "exceeds" in messages[-1]
  plan = fragments.plan_fragments(shapes, 3, "layer")
  assert plan.num_fragments == 2 and "layers" in messages[-1]
  assert plan.fragments == (("embedder/embedding", "layers/0/w"), ("layers/1/w",))
  n = len(messages)
  fragments.plan_fragments(shapes, 2)
  assert len(messages) == n


def test_zero_sized_tensors_leave_no_fragment_empty():
  plan = fragments.plan_fragments({"a": (5,), "b": (0,), "c": (0, 3)}, 3)
  assert all(plan.fragments) and plan.num_elements == (5, 0, 0)


def test_plan_errors():
  with pytest.raises(ValueError, match="balanced"):
    fragments.plan_fragments({"a": (1,)}, 1, "random")
  with pytest.raises(ValueError, match=">= 1"):
    fragments.plan_fragments({"a": (1,)}, 0)
  with pytest.raises(ValueError, match="no tensors"):
    fragments.plan_fragments({}, 1)


def test_shapes_from_arrays():
  plan = fragments.plan_fragments({"a": np.zeros((2, 3)), "b": np.zeros(4)}, 2)
  assert plan.num_elements == (6, 4)


# ---- Schedule. ----

def test_schedule_p_equals_h_one_fragment_per_step():
  h = p = 24
  for t in range(1, 5 * h + 1):
    due = fragments.due_fragments(t, h, p)
    assert due == [t % h]


@pytest.mark.parametrize("h,p", [(24, 24), (24, 5), (7, 3), (5, 8), (1, 4), (30, 1)])
def test_each_fragment_due_once_every_h_steps(h, p):
  steps = {k: [] for k in range(p)}
  for t in range(1, 6 * h + 1):
    for k in fragments.due_fragments(t, h, p):
      steps[k].append(t)
      assert fragments.is_due(k, t, h, p)
  for k in range(p):
    assert len(steps[k]) == 6
    assert all(b - a == h for a, b in zip(steps[k], steps[k][1:]))
    assert steps[k][0] % h == fragments.fragment_offset(k, h, p) == k * h // p


def test_offsets_spread_evenly():
  assert [fragments.fragment_offset(k, 24, 4) for k in range(4)] == [0, 6, 12, 18]
  assert fragments.due_fragments(6, 24, 4) == [1]
  assert fragments.due_fragments(24, 24, 4) == [0]
  assert fragments.due_fragments(5, 24, 4) == []


def test_schedule_validation():
  with pytest.raises(ValueError, match="H"):
    fragments.due_fragments(1, 0, 4)
  with pytest.raises(ValueError, match="P"):
    fragments.due_fragments(1, 4, 0)
  with pytest.raises(ValueError, match="from 1"):
    fragments.due_fragments(0, 4, 4)
  with pytest.raises(ValueError, match="out of range"):
    fragments.fragment_offset(4, 4, 4)


# ---- Tree flattening. ----

def test_flatten_unflatten_roundtrip():
  tree = {"embedder": {"embedding": 1}, "layers": {0: {"attn": {"q": 2}}, 11: {"mlp": {"d": 3}}},
          "final_norm": {"scale": 4}}
  flat = fragments.flatten_tree(tree)
  assert flat == {"embedder/embedding": 1, "layers/0/attn/q": 2, "layers/11/mlp/d": 3,
                  "final_norm/scale": 4}
  assert fragments.unflatten_tree(flat) == tree


def test_flatten_errors():
  with pytest.raises(ValueError, match="'/'"):
    fragments.flatten_tree({"a/b": 1})
  with pytest.raises(ValueError, match="leaf"):
    fragments.unflatten_tree({"a": 1, "a/b": 2})


def test_cohort_step_is_the_median_of_the_peers():
  assert fragments.cohort_step([]) == 0
  assert fragments.cohort_step([5]) == 5
  assert fragments.cohort_step([9, 3, 7]) == 7
  assert fragments.cohort_step([2, 4]) == 4  # the upper median of an even count
  # A joiner placed at the cohort step is in phase with its peers.
  assert fragments.aligned_phase(fragments.cohort_step([13, 13, 21]), [13, 13, 21], 8) == 0
