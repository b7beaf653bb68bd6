"""Grid points of the sweep: expansion with the pruning rules of `config.py`, and filters.

A point is one (size, method, M, K, H); `dp` has no M, K or H (None). `expand` applies the
rules once, so the runner, the renderer and the tests see the same points.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from experiments.harness import Run
from experiments.sweep import config

AXES = ("size", "method", "M", "K", "H")
SYNCHRONOUS = ("diloco", "streaming")


@dataclasses.dataclass(frozen=True)
class Point:
  size: str
  method: str
  M: int | None = None
  K: int | None = None
  H: int | None = None
  P: int | None = None

  @property
  def label(self) -> str:
    """Unique and readable: it names the run's directory and the table's rows."""
    if self.method == "dp":
      return f"{self.size} dp"
    return f"{self.size} {self.method} M={self.M} K={self.K} H={self.H}"

  @property
  def slug(self) -> str:
    """The label as a DNS-label-safe name for manifests and files."""
    if self.method == "dp":
      return f"{self.size}-dp".replace("_", "-")
    return f"{self.size}-{self.method}-m{self.M}-k{self.K}-h{self.H}".replace("_", "-")


def expand(grid: Mapping[str, Mapping], sizes: Mapping[str, Mapping]) -> list[Point]:
  """Every distinct point of `grid` (size -> axis values), in size, method, M, H, K order.

  ValueError for a method, size or H that cannot run (H <= tau, K > M, unknown names)."""
  points = []
  for size, axes in grid.items():
    if size not in sizes:
      raise ValueError(f"grid size {size!r} has no settings; known: {sorted(sizes)}")
    for method in axes["methods"]:
      if method not in config.METHODS:
        raise ValueError(f"grid method {method!r} unknown; allowed: {config.METHODS}")
      if method == "dp":
        points.append(Point(size, "dp"))
        continue
      for m in axes["M"]:
        for h in axes["H"]:
          if h <= sizes[size]["tau"]:
            raise ValueError(f"{size}: H={h} must exceed the preset's tau="
                             f"{sizes[size]['tau']} (docs/design.md 2.3)")
          p = 1 if method == "diloco" else min(sizes[size]["fragments"], h)
          quorums = [m] if method in SYNCHRONOUS else [m if k == config.ALL else k
                                                      for k in axes["K"]]
          for k in dict.fromkeys(quorums):  # K = 1 and K = M coincide when M = 1
            if not 1 <= k <= m:
              raise ValueError(f"{size} {method}: K={k} must be in [1, M={m}]")
            points.append(Point(size, method, m, k, h, p))
  return points


def parse_only(text: str) -> dict[str, set[str]]:
  """`size=tiny,method=dp,method=decoupled` -> {axis: values}: OR within an axis, AND across."""
  wanted: dict[str, set[str]] = {}
  for item in filter(None, (s.strip() for s in (text or "").split(","))):
    axis, sep, value = item.partition("=")
    if not sep or not value:
      raise ValueError(f"--only: {item!r} is not AXIS=VALUE (axes: {', '.join(AXES)})")
    if axis not in AXES:
      raise ValueError(f"--only: unknown axis {axis!r}; allowed: {', '.join(AXES)}")
    wanted.setdefault(axis, set()).add(value)
  return wanted


def select(points: Sequence[Point], wanted: Mapping[str, Iterable[str]]) -> list[Point]:
  """The points matching every axis of `wanted`; ValueError for a value on no point.

  `K=M` matches the points whose quorum is all learners. A point without the axis (dp has no
  M, K or H) matches any filter on it: it is the baseline of every M, K and H."""
  def values(p: Point, axis: str) -> set[str] | None:
    v = getattr(p, axis)
    if v is None:
      return None
    return {str(v), config.ALL} if axis == "K" and v == p.M else {str(v)}

  for axis, chosen in wanted.items():
    known = set().union(*(values(p, axis) or set() for p in points))
    unknown = set(chosen) - known
    if unknown:
      raise ValueError(f"--only: {axis}={sorted(unknown)[0]} is on no point of this grid; "
                       f"{axis} takes {sorted(known)}")
  return [p for p in points
          if all(values(p, a) is None or values(p, a) & set(c) for a, c in wanted.items())]


def run_of(point: Point, seed: int = 0, steps: int | None = None) -> Run:
  """The CPU run of a point: equal tokens per size, the virtual clock, the method's config.

  `steps` shortens every run (smoke tests); evaluation then happens at the end and halfway."""
  s = config.CPU_SIZES[point.size]
  steps = steps or s["steps"]
  learners = point.M or 1
  over = [("learners.virtual_clock", True), ("log.tensorboard", False),
          ("train.steps", steps), ("train.eval_every", s["eval_every"] if steps == s["steps"]
                                   else max(steps // 2, 1)),
          ("train.batch_size", s["global_batch"] // learners),
          # batch x eval batches: every point of a size scores the same held-out windows.
          ("train.eval_batches", 4 * learners),
          ("optim.warmup_steps", min(s["warmup"], steps // 2))]
  if point.method != "dp":
    over += [("learners.count", point.M), ("sync.period", point.H),
             ("sync.num_fragments", point.P)]
  if point.method == "decoupled":
    over.append(("sync.quorum", 0 if point.K == point.M else point.K))
  return Run(point.label, f"{config.CONFIGS[point.method]}:{s['preset']}", seed, tuple(over))
