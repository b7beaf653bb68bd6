"""A timeline PNG of a run: one lane per learner, merges per fragment on a syncer lane.

Reads the records described in `diloco.observe.accounting` (activity spans and round records). Lanes
draw "step" spans (slowed ones, `slowdown > 1`, in a lighter shade), "wait" grey, "down" red and
"load" orange; a new incarnation of a learner starts with a black tick and an `i<n>` label. The
top lane marks every published round at `published_at`, coloured by fragment, with a height that
grows with the number of admitted learners. Adjacent spans of the same kind closer than 1e-4 of
the time axis are drawn as one bar, so that runs with many thousands of steps stay fast.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

COLORS = {"step": "#2b7bba", "slowed": "#9ecae1", "wait": "#bdbdbd", "down": "#d62728",
          "load": "#ff7f0e"}
LABELS = {"step": "step", "slowed": "step (slowed)", "wait": "wait (for a merge)",
          "down": "down", "load": "load (rejoin)"}
MERGE_GAP = 1e-4  # Spans closer than this fraction of the time axis are drawn as one bar.


def _kind(record: Mapping) -> str:
  if record["kind"] == "step" and record.get("slowdown", 1.0) > 1.0:
    return "slowed"
  return record["kind"]


def merged_bars(spans: Sequence[Mapping], tolerance: float) -> dict[str, list[tuple[float, float]]]:
  """(start, width) bars per drawn kind, adjacent spans of one kind merged.

  Args:
    spans: activity records of one learner.
    tolerance: spans of the same kind separated by at most this many seconds are merged.

  Returns:
    Kind ("step", "slowed", "wait", "down", "load") -> bars for `broken_barh`.
  """
  bars = collections.defaultdict(list)
  last = {}
  for r in sorted(spans, key=lambda r: (r["start"], r["end"])):
    kind = _kind(r)
    cur = last.get(kind)
    if cur is not None and r["start"] - cur[1] <= tolerance:
      cur[1] = max(cur[1], r["end"])
    else:
      cur = [r["start"], r["end"]]
      bars[kind].append(cur)
      last[kind] = cur
    # Another kind in between ends the run of this one.
    for other in list(last):
      if other != kind and last[other][1] <= r["start"]:
        del last[other]
  return {k: [(a, b - a) for a, b in v] for k, v in bars.items()}


def plot_timeline(tape: Sequence[Mapping], activity: Sequence[Mapping], path: str,
                  title: str = "") -> None:
  """Writes the timeline of a run as a PNG to `path` (see module docstring)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from matplotlib.lines import Line2D  # pylint: disable=import-outside-toplevel
  from matplotlib.patches import Patch  # pylint: disable=import-outside-toplevel

  by_learner = collections.defaultdict(list)
  for r in activity:
    by_learner[r["learner"]].append(r)
  learners = sorted(by_learner)
  times = [r["end"] for r in activity] + [r["published_at"] for r in tape]
  t0 = min([r["start"] for r in activity] + [r["published_at"] for r in tape], default=0.0)
  t1 = max(times, default=1.0)
  tolerance = MERGE_GAP * max(t1 - t0, 1e-9)

  n = len(learners)
  fig, ax = plt.subplots(figsize=(12, 2.0 + 0.45 * (n + 1)), layout="constrained")
  for lane, learner in enumerate(learners):
    y = n - 1 - lane
    spans = by_learner[learner]
    for kind, bars in merged_bars(spans, tolerance).items():
      ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=COLORS.get(kind, "black"),
                     linewidth=0)
    starts = {}
    for r in spans:
      inc = r["incarnation"]
      starts[inc] = min(starts.get(inc, r["start"]), r["start"])
    for i, (inc, start) in enumerate(sorted(starts.items(), key=lambda kv: kv[1])):
      if i:
        ax.plot([start, start], [y - 0.45, y + 0.45], color="black", linewidth=1.2)
        ax.text(start, y + 0.42, f"i{inc}", fontsize=7, va="bottom", ha="left")

  y_sync = n + 0.2
  if tape:
    fragments = [r["fragment"] for r in tape]
    cmap = matplotlib.colormaps["viridis"]
    norm = matplotlib.colors.Normalize(0, max(max(fragments), 1))
    most = max(max(len(r["admitted"]) for r in tape), 1)
    half = [0.1 + 0.3 * len(r["admitted"]) / most for r in tape]
    ax.vlines([r["published_at"] for r in tape], [y_sync - h for h in half],
              [y_sync + h for h in half], colors=cmap(norm(fragments)), linewidth=1.2,
              alpha=0.85)
    if max(fragments) > 0:
      mappable = matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap)
      fig.colorbar(mappable, ax=ax, label="fragment", pad=0.01, fraction=0.03)

  ax.set_yticks([y_sync] + [n - 1 - i for i in range(n)],
                ["syncer"] + [f"learner {m}" for m in learners])
  ax.set_ylim(-0.7, y_sync + 0.8)
  ax.set_xlim(t0, t1 + 0.01 * max(t1 - t0, 1e-9))
  ax.set_xlabel("time (s)")
  ax.set_title(title)
  ax.grid(axis="x", alpha=0.3)
  handles = [Patch(color=COLORS[k], label=LABELS[k]) for k in COLORS]
  handles.append(Line2D([], [], color="#440154", marker="|", linestyle="none", markersize=10,
                        label="merge (height: learners admitted)"))
  handles.append(Line2D([], [], color="black", label="new incarnation"))
  fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8,
             frameon=False)
  fig.savefig(path, dpi=110)
  plt.close(fig)
