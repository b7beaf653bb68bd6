"""Writes the experiments' results tables from their own results.json files.

    python -m experiments.summary [--check]

One row per experiment folder with a results.json: its headline figures computed from the rows
(never typed), the commit it was measured at and a link to its README. The long table (every
method's figure) goes to docs/results.md and a short one (the first figures of each headline)
to the top-level README, each between the file's `experiments:begin` and `experiments:end`
markers; `--check` exits 1 if either file is out of date instead.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence

from experiments import harness

BEGIN, END = "<!-- experiments:begin -->", "<!-- experiments:end -->"


def _mean(rows: Sequence[dict], method: str, key: str = "eval_loss") -> float | None:
  values = [r[key] for r in rows if r["method"] == method and r.get(key) is not None]
  return sum(values) / len(values) if values else None


def _by_method(rows: Sequence[dict], key: str = "eval_loss", fmt: str = "{:.3f}") -> str:
  """'method value' for every method (mean over seeds), best first."""
  means = sorted(harness.summarise([r for r in rows if r.get(key) is not None], key),
                 key=lambda s: s[f"{key}_mean"])
  return "; ".join(f"{s['method']} {fmt.format(s[f'{key}_mean'])}" for s in means)


def parity(rows: Sequence[dict]) -> str:
  """The presets' length (methods without a " N steps" suffix), then the longest run pair."""
  longer = [r for r in rows if r["method"].endswith(" steps")]
  rows = [r for r in rows if r not in longer]
  dp = _mean(rows, "data-parallel")
  decoupled = sorted((s for s in harness.summarise(rows)
                      if s["method"].startswith("decoupled") and " M=" not in s["method"]),
                     key=lambda s: s["eval_loss_mean"])
  scratch = [s for s in decoupled if "warm start" not in s["method"]]
  warm = [s for s in decoupled if "warm start" in s["method"]]
  if not dp or not scratch:
    return _by_method(rows)
  text = (f"eval loss: data-parallel {dp:.3f}; best Decoupled from scratch "
          f"({scratch[0]['method']}) {scratch[0]['eval_loss_mean']:.3f}, ratio "
          f"{scratch[0]['eval_loss_mean'] / dp:.3f}")
  if warm:
    text += (f"; warm-started ({warm[0]['method']}) {warm[0]['eval_loss_mean']:.3f}, ratio "
             f"{warm[0]['eval_loss_mean'] / dp:.3f}")
  if longer:
    steps = max(r["steps"] for r in longer)
    pair = {r["method"].split()[0]: r for r in longer if r["steps"] == steps and r["seed"] == 0}
    if {"data-parallel", "decoupled"} <= set(pair):
      dp_long, dec_long = pair["data-parallel"]["eval_loss"], pair["decoupled"]["eval_loss"]
      text += (f"; at {steps} steps: data-parallel {dp_long:.3f}, Decoupled {dec_long:.3f}, "
               f"ratio {dec_long / dp_long:.3f}")
  return text + " (target <= 1.02)"


def heterogeneous(rows: Sequence[dict]) -> str:
  parts = []
  for s in harness.summarise(rows):
    goodput = _mean(rows, s["method"], "goodput")
    parts.append(f"{s['method']}: loss {s['eval_loss_mean']:.3f}, goodput {goodput:.2f}")
  return "; ".join(parts)


def scavenging(rows: Sequence[dict]) -> str:
  parts = []
  for method in ("fixed M=2", "scavenging", "fixed M=4"):
    speedup = _mean(rows, method, "speedup")
    loss = _mean(rows, method)
    if loss is not None:
      parts.append(f"{method}: loss {loss:.3f}"
                   + (f", {speedup:.2f}x faster to M=2's loss" if speedup else ""))
  return "; ".join(parts)


def sweep(rows: Sequence[dict]) -> str:
  """The best point of each method (a method's points differ in M, K and H)."""
  best: dict[str, dict] = {}
  for r in rows:
    if r["method"] not in best or r["eval_loss"] < best[r["method"]]["eval_loss"]:
      best[r["method"]] = r
  return "best point per method: " + "; ".join(
      f"{r.get('point', r['method'])} {r['eval_loss']:.3f}"
      for r in sorted(best.values(), key=lambda r: r["eval_loss"]))


def scaling(rows: Sequence[dict]) -> str:
  from experiments.scaling import report  # pylint: disable=import-outside-toplevel
  return report.headline(list(rows))


HEADLINES: dict[str, Callable[[Sequence[dict]], str]] = {
    "parity": parity, "heterogeneous": heterogeneous, "scavenging": scavenging, "sweep": sweep,
    "scaling": scaling}


def _results(root: str) -> list[tuple[str, dict]]:
  out = []
  for name in sorted(os.listdir(root)):
    path = os.path.join(root, name, "results.json")
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        out.append((name, json.load(f)))
  return out


def _headline(results: dict) -> str:
  return HEADLINES.get(results["experiment"], _by_method)(results["rows"])


def table(root: str, link_prefix: str = "") -> str:
  """Every experiment's whole headline; links relative to a file `link_prefix` away."""
  lines = ["| experiment | headline (from results.json) | runs | commit |", "|---|---|---|---|"]
  for name, results in _results(root):
    lines.append(f"| [`{name}`]({link_prefix}experiments/{name}/README.md) | "
                 f"{_headline(results)} | {len(results['rows'])} | `{results['commit'][:8]}` |")
  return "\n".join(lines)


# What each experiment asks, for the README's short table.
QUESTIONS = {
    "ablations": "which design choice matters (receipt, precision, merge, fragments, tau)",
    "bandwidth": "training over a slow link, synchronous against decoupled",
    "chaos": "quality under real process faults",
    "heterogeneous": "learners of unequal speed: quorum K = M, K = 1, K = 1 + grace",
    "parity": "Decoupled against data-parallel at equal tokens (`small`)",
    "scaling": "the gap to data-parallel at compute-optimal length, M = 1 to 8",
    "scavenging": "adding learners for a while shortens the time to a loss",
    "stale": "stale deliveries: the paper's anchor against rebasing",
    "sweep": "best point per method over M, K and H",
}
SHORT_CLAUSES = 3
# The scaling headline's fourth clause holds the tiny model's gaps, the row's point.
SHORT_CLAUSES_OF = {"scaling": 4}


def short_table(root: str) -> str:
  """One readable row per experiment: its question and the first clauses of its headline."""
  lines = ["| experiment | question | headline (first figures; all in docs/results.md) |",
           "|---|---|---|"]
  for name, results in _results(root):
    clauses = _headline(results).split("; ")
    keep = SHORT_CLAUSES_OF.get(name, SHORT_CLAUSES)
    short = "; ".join(clauses[:keep]) + ("; ..." if len(clauses) > keep else "")
    lines.append(f"| [`{name}`](experiments/{name}/README.md) | {QUESTIONS.get(name, '')} | "
                 f"{short} |")
  return "\n".join(lines)


def update(readme: str, root: str, render: Callable[[str], str] = table) -> str:
  """`readme` with `render(root)` between the markers; ValueError if a marker is missing."""
  if BEGIN not in readme or END not in readme:
    raise ValueError(f"no {BEGIN} ... {END} markers to put the table between")
  head, rest = readme.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  return f"{head}{BEGIN}\n{render(root)}\n{END}{tail}"


def main(argv: list[str]) -> int:
  root = os.path.join(harness.REPO, "experiments")
  targets = [("README.md", short_table), (os.path.join("docs", "results.md"),
                                          lambda r: table(r, link_prefix="../"))]
  stale = []
  for relative, render in targets:
    path = os.path.join(harness.REPO, relative)
    with open(path, encoding="utf-8") as f:
      text = f.read()
    new = update(text, root, render)
    if new == text:
      continue
    if "--check" in argv:
      stale.append(relative)
    else:
      with open(path, "w", encoding="utf-8") as f:
        f.write(new)
  if stale:
    print(f"{', '.join(stale)}: experiment table out of date: python -m experiments.summary")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
