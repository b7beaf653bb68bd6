"""Cutting the parameter tree into P fragments, and when each fragment is due (docs/design.md 2.2).

Tensors are addressed by "/"-joined paths (`embedder/embedding`, `layers/3/mlp/down_FD`,
`final_norm/scale`); per-layer tensors contain `layers/<int>/`. Paths are ordered naturally:
components that are integers compare as integers, so `layers/2/...` comes before `layers/10/...`.

Schemes (`plan_fragments`):
- `balanced` (default): whole tensors, sorted by size descending (ties by path), each put into
  the currently lightest fragment (ties: lowest index). Flattest bandwidth.
- `layer`: contiguous runs of layers (the k-th of L layers goes to fragment `k * P // L`); the
  embedding paths go to the first fragment, every other non-layer tensor (final norm, untied
  head, ...) to the last one. Without layers there is one fragment.
- `tensor`: tensors in path order dealt round-robin, tensor i to fragment `i % P`.

Schedule: local steps count completed inner steps, t = 1, 2, ... After completing local step t
a learner delivers fragment p when `t % H == fragment_offset(p, H, P)`, with
`fragment_offset(p, H, P) = p * H // P`. Every fragment is then due exactly once every H steps;
with P = H exactly one fragment is due per step (fragment 0 at t = H, 2H, ..., fragment p > 0 at
t = p, p + H, ...).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from absl import logging

SCHEMES = ("balanced", "layer", "tensor")
DEFAULT_EMBEDDING_PATHS = ("embedder/embedding",)

_LAYER_RE = re.compile(r"(?:^|/)layers/(\d+)/")


def path_sort_key(path: str) -> tuple[tuple[int, int | str], ...]:
  """Natural sort key of a path: integer components compare as integers, before strings."""
  return tuple((0, int(c)) if c.isdigit() else (1, c) for c in path.split("/"))


def layer_index(path: str) -> int | None:
  """The layer number of a per-layer path (`.../layers/<int>/...`), else None."""
  m = _LAYER_RE.search(path)
  return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class FragmentPlan:
  """An assignment of every tensor to exactly one fragment.

  Attributes:
    fragments: per fragment, its tensor paths in natural path order.
    num_elements: per fragment, its number of parameters.
    embedding_paths: the paths flagged as embedding or tied head (merged by weighted mean).
    scheme: the scheme that made the plan.
  """
  fragments: tuple[tuple[str, ...], ...]
  num_elements: tuple[int, ...]
  embedding_paths: frozenset[str]
  scheme: str

  @property
  def num_fragments(self) -> int:
    """P, after clamping."""
    return len(self.fragments)

  def is_embedding(self, path: str) -> bool:
    """Whether `path` is the embedding or a tied head."""
    return path in self.embedding_paths

  def embedding_mask(self, p: int) -> tuple[bool, ...]:
    """Per tensor of fragment p (in order), whether it is flagged as embedding."""
    return tuple(self.is_embedding(path) for path in self.fragments[p])

  def fragment_of(self, path: str) -> int:
    """The fragment that holds `path`."""
    for p, paths in enumerate(self.fragments):
      if path in paths:
        return p
    raise KeyError(f"no fragment holds {path!r}")


def _num_elements(shape: Any) -> int:
  shape = getattr(shape, "shape", shape)
  return int(math.prod(int(d) for d in shape))


def _clamp(requested: int, limit: int, what: str) -> int:
  if requested > limit:
    logging.warning("num_fragments=%d exceeds the number of %s (%d); using %d fragments.",
                    requested, what, limit, limit)
    return limit
  return requested


def _balanced(paths: list[str], sizes: dict[str, int], num: int) -> list[list[str]]:
  """Greedy longest-processing-time packing; ties by path, then by lowest fragment index."""
  # A zero-element tensor weighs 1, so that every fragment receives a tensor.
  order = sorted(paths, key=lambda q: (-sizes[q], path_sort_key(q)))
  heap = [(0, p) for p in range(num)]
  out: list[list[str]] = [[] for _ in range(num)]
  for path in order:
    load, p = heapq.heappop(heap)
    out[p].append(path)
    heapq.heappush(heap, (load + max(sizes[path], 1), p))
  return out


def _by_layer(paths: list[str], num: int, embedding: frozenset[str]) -> list[list[str]]:
  """Contiguous layers per fragment; see the module docstring for non-layer tensors."""
  layers = sorted({layer_index(q) for q in paths if layer_index(q) is not None})
  rank = {layer: k for k, layer in enumerate(layers)}
  out: list[list[str]] = [[] for _ in range(num)]
  for path in paths:
    layer = layer_index(path)
    if layer is not None:
      out[rank[layer] * num // len(layers)].append(path)
    elif path in embedding:
      out[0].append(path)
    else:
      out[-1].append(path)
  return out


def plan_fragments(shapes: Mapping[str, Any], num_fragments: int = 24, scheme: str = "balanced",
                   embedding_paths: Iterable[str] = DEFAULT_EMBEDDING_PATHS) -> FragmentPlan:
  """Cuts a parameter tree into fragments.

  The plan depends only on the set of paths and shapes, not on the mapping's order.

  Args:
    shapes: `{path: shape}` of every parameter tensor (arrays, anything with `.shape`, work too).
    num_fragments: P; clamped, with a logged warning, to the number of tensors (and for `layer`
      to the number of layers, at least 1).
    scheme: `balanced`, `layer` or `tensor` (module docstring).
    embedding_paths: paths merged by weighted mean (embedding, tied head); absent ones are
      ignored.

  Returns:
    A `FragmentPlan` with no empty fragment.

  Raises:
    ValueError: unknown scheme, num_fragments < 1, or no tensors.
  """
  if scheme not in SCHEMES:
    raise ValueError(f"unknown fragment scheme {scheme!r}; allowed: {SCHEMES}")
  if not isinstance(num_fragments, int) or num_fragments < 1:
    raise ValueError(f"num_fragments must be an int >= 1, got {num_fragments!r}")
  if not shapes:
    raise ValueError("no tensors to fragment")
  sizes = {path: _num_elements(shape) for path, shape in shapes.items()}
  paths = sorted(sizes, key=path_sort_key)
  embedding = frozenset(embedding_paths) & frozenset(paths)
  num = _clamp(num_fragments, len(paths), "tensors")
  if scheme == "balanced":
    groups = _balanced(paths, sizes, num)
  elif scheme == "layer":
    num_layers = len({layer_index(q) for q in paths if layer_index(q) is not None})
    num = _clamp(num, max(num_layers, 1), "layers")
    groups = _by_layer(paths, num, embedding)
  else:
    groups = [paths[p::num] for p in range(num)]
  fragments = tuple(tuple(sorted(g, key=path_sort_key)) for g in groups)
  if any(not g for g in fragments):  # guaranteed by construction; fail loudly if not
    raise ValueError(f"empty fragment in plan {fragments}")
  return FragmentPlan(fragments=fragments,
                      num_elements=tuple(sum(sizes[q] for q in g) for g in fragments),
                      embedding_paths=embedding, scheme=scheme)


def _check_schedule(period: int, num_fragments: int) -> None:
  if not isinstance(period, int) or period < 1:
    raise ValueError(f"H (inner steps per fragment sync) must be an int >= 1, got {period!r}")
  if not isinstance(num_fragments, int) or num_fragments < 1:
    raise ValueError(f"P (number of fragments) must be an int >= 1, got {num_fragments!r}")


def fragment_offset(p: int, period: int, num_fragments: int) -> int:
  """The offset `p * H // P` in [0, H) of fragment p's slot (`period` is H)."""
  _check_schedule(period, num_fragments)
  if not 0 <= p < num_fragments:
    raise ValueError(f"fragment {p} out of range [0, {num_fragments})")
  return p * period // num_fragments


def due_fragments(step: int, period: int, num_fragments: int) -> list[int]:
  """Fragments due after completing local step `step` (1-based), in increasing order.

  Fragment p is due when `step % H == p * H // P`.
  """
  _check_schedule(period, num_fragments)
  if not isinstance(step, int) or step < 1:
    raise ValueError(f"local steps are counted from 1, got {step!r}")
  slot = step % period
  return [p for p in range(num_fragments) if p * period // num_fragments == slot]


def aligned_phase(own_step: int, peer_steps: list[int], period: int) -> int:
  """Schedule phase that makes a rejoining learner deliver each slot with its peers.

  A learner that resumes from its checkpoint at `own_step` while its peers are at
  `peer_steps` would deliver fragment p `peer - own (mod H)` steps away from them, more than
  a grace window (at most one step) gathers, until its next restart. Shifting its schedule
  by this phase (`due_fragments(step + phase, ...)`) puts its deliveries back in its peers'
  rounds; every fragment is still due every H steps. 0 without peers.
  """
  if not peer_steps:
    return 0
  return (cohort_step(peer_steps) - own_step) % period


def cohort_step(peer_steps: list[int]) -> int:
  """The step of the live peers' cohort: their median (the upper one of an even count); 0
  without peers. A joining learner with `learners.join_schedule=cohort` starts there."""
  ordered = sorted(peer_steps)
  return ordered[len(ordered) // 2] if ordered else 0


def is_due(p: int, step: int, period: int, num_fragments: int) -> bool:
  """Whether fragment p is due after completing local step `step` (1-based)."""
  if not isinstance(step, int) or step < 1:
    raise ValueError(f"local steps are counted from 1, got {step!r}")
  return step % period == fragment_offset(p, period, num_fragments)


def flatten_tree(tree: Mapping[Any, Any], prefix: str = "") -> dict[str, Any]:
  """Flattens nested dicts to `{path: leaf}` with "/"-joined keys (int keys become digits).

  Leaves are all non-Mapping values; empty sub-dicts vanish. Keys must not contain "/".
  """
  flat: dict[str, Any] = {}
  for key, value in tree.items():
    name = str(key)
    if not name or "/" in name:
      raise ValueError(f"key {key!r} under {prefix!r} is empty or contains '/'")
    path = f"{prefix}/{name}" if prefix else name
    if isinstance(value, Mapping):
      flat.update(flatten_tree(value, path))
    else:
      flat[path] = value
  return flat


def unflatten_tree(flat: Mapping[str, Any]) -> dict[Any, Any]:
  """Inverse of `flatten_tree`: all-digit components become int keys."""
  tree: dict[Any, Any] = {}
  for path, value in flat.items():
    keys = [int(c) if c.isdigit() else c for c in path.split("/")]
    node = tree
    for k in keys[:-1]:
      node = node.setdefault(k, {})
      if not isinstance(node, dict):
        raise ValueError(f"path {path!r} runs through the leaf at {k!r}")
    if keys[-1] in node:
      raise ValueError(f"path {path!r} collides with another path")
    node[keys[-1]] = value
  return tree
