"""Runs the `bandwidth` experiment and regenerates its results.json, plots and README.md.

    python -m experiments.bandwidth.run [--preset=smoke] [--outdir=runs/experiments/bandwidth]

See `config.py` for the setting and the expected outcome.
"""

import json
import os

import matplotlib.pyplot as plt  # noqa: E402  (harness selected the Agg backend)
import numpy as np
from absl import app, flags

from diloco.config import run_config
from diloco.distributed import launch_report
from diloco.observe.accounting import read_jsonl
from diloco.sim import bandwidth as sim_bandwidth
from experiments import harness
from experiments.bandwidth import config

GBIT = 1e9


def model() -> tuple[run_config.Config, int]:
  """The base config and N, its parameter count (from the model's abstract shapes)."""
  cfg = run_config.from_config_dict(run_config.load(os.path.join(harness.REPO, config.CONFIG)))
  shapes = launch_report.param_shapes(cfg)
  return cfg, sum(int(np.prod(s)) for s in shapes.values())


def measured_step_s(cfg) -> float:
  """The unthrottled Decoupled run's mean step time, or the pace before it has run."""
  workdir = os.path.join(flags.FLAGS.outdir, "decoupled__s0")
  if not harness.finished(workdir):
    return cfg.learners.min_step_s
  return round(step_rates(workdir)["step_s"], 3)


def step_rates(workdir: str) -> dict:
  """Mean learner step time and steps per second (per learner, from its first to last step)."""
  steps = [r for r in read_jsonl(os.path.join(workdir, "activity.jsonl")) if r["kind"] == "step"]
  rates, durations = [], []
  for m in sorted({r["learner"] for r in steps}):
    mine = [r for r in steps if r["learner"] == m]
    span = max(r["end"] for r in mine) - min(r["start"] for r in mine)
    rates.append(len(mine) / span if span > 0 else 0.0)
    durations += [r["end"] - r["start"] for r in mine]
  return {"steps_per_s": round(float(np.mean(rates)), 3),
          "step_s": float(np.mean(durations)),
          "train_s": max(r["end"] for r in steps) - min(r["start"] for r in steps)}


def figures(run: harness.Run, workdir: str) -> dict:
  overrides = dict(run.overrides)
  acc = json.load(open(os.path.join(workdir, "accounting.json"), encoding="utf-8"))
  rates = step_rates(workdir)
  return {"wan_mbps": overrides.get("store.wan_mbps", 0.0),
          "wan_latency_ms": overrides.get("store.wan_latency_ms", 0.0),
          "steps_per_s": rates["steps_per_s"], "step_s": round(rates["step_s"], 4),
          "round_bytes_up_peak": int(acc["accounting/round_bytes_up_peak"]),
          "round_bytes_down_peak": int(acc["accounting/round_bytes_down_peak"]),
          "load_1m": _load(workdir)}


def _load(workdir: str) -> float | None:
  """The host's 1-minute load average when the run ended (recorded by the harness)."""
  path = os.path.join(workdir, harness.HARNESS_FILE)
  loadavg = json.load(open(path, encoding="utf-8")).get("loadavg") if os.path.exists(path) else None
  return round(loadavg[0], 1) if loadavg else None


def reference(num_params: int, learners: int, cfg: dict, step_s: float) -> list[dict]:
  """Data-parallel across the same islands, and the Decoupled closed form, at `step_s`."""
  dp_bytes = 2.0 * (learners - 1) / learners * num_params * 4  # per island per step, fp32 ring
  closed = sim_bandwidth.estimate(params=num_params, step_time=step_s, datacenters=learners,
                                  fragments=cfg["sync"]["num_fragments"], H=cfg["sync"]["period"],
                                  tau=cfg["sync"]["tau"], bits=32, down_bits=32, dp_bits=32)
  return [{"what": "data-parallel ring all-reduce, fp32 (closed form, per island)",
           "gbps": dp_bytes * 8 / step_s / GBIT, "bytes_per_step": dp_bytes},
          {"what": "Decoupled upload per learner (closed form, diloco.sim.bandwidth, fp32)",
           "gbps": closed.upload_mean_gbps,
           "bytes_per_step": closed.upload_mean_gbps * GBIT / 8 * step_s}]


def measured(run: harness.Run, workdir: str, step_s: float) -> list[dict]:
  """Per-learner Gbit/s of a run, over the learners' training time (first step to last); and
  its largest round (all learners) sent within tau steps of `step_s`: what the syncer's link
  must take in for that round to arrive in time."""
  cfg = json.load(open(os.path.join(workdir, "config.json"), encoding="utf-8"))
  acc = json.load(open(os.path.join(workdir, "accounting.json"), encoding="utf-8"))
  m, tau = cfg["learners"]["count"], cfg["sync"]["tau"]
  train_s = step_rates(workdir)["train_s"]
  steps = train_s / step_s
  up, down = acc["accounting/bytes_up"] / m, acc["accounting/bytes_down"] / m
  peak = acc["accounting/round_bytes_up_peak"]
  return [{"what": f"{run.method}: measured upload per learner (mean)",
           "gbps": up * 8 / train_s / GBIT, "bytes_per_step": up / steps},
          {"what": f"{run.method}: measured download per learner (mean)",
           "gbps": down * 8 / train_s / GBIT, "bytes_per_step": down / steps},
          {"what": f"{run.method}: largest round's upload (all learners) within tau steps",
           "gbps": peak * 8 / (tau * step_s) / GBIT, "bytes_per_step": peak / tau}]


def plot_ledger(rows: list[dict], path: str, step_s: float) -> None:
  fig, ax = plt.subplots(figsize=(10, 3.8))
  colors = ["C3" if "data-parallel" in r["what"] else "C7" if "closed form" in r["what"]
            else "C1" if r["what"].startswith("sync") else "C0" for r in rows]
  ax.barh(range(len(rows)), [r["gbps"] * 1e3 for r in rows], color=colors)
  ax.set_yticks(range(len(rows)), [r["what"] for r in rows], fontsize=7)
  ax.invert_yaxis()
  ax.set_xscale("log")
  ax.set_xlim(left=min(r["gbps"] for r in rows) * 1e3 / 3)
  ax.set_xlabel(f"Mbit/s per island at the measured step time ({step_s:.3f} s), log scale")
  ax.grid(alpha=0.3, axis="x")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_rates(rows: list[dict], path: str) -> None:
  """Steps per second and wait fraction, unthrottled vs WAN, per method."""
  methods = [m for m in ("decoupled", "sync DiLoCo")
             if any(r["method"].split(",")[0] == m for r in rows)]
  fig, (rate_ax, wait_ax) = plt.subplots(1, 2, figsize=(10, 3.5))
  for j, (label, suffix) in enumerate((("no throttle", ""), ("WAN throttle", ", WAN"))):
    values = [next((r for r in rows if r["method"] == m + suffix), None) for m in methods]
    x = np.arange(len(methods)) + 0.38 * (j - 0.5)
    rate_ax.bar(x, [v["steps_per_s"] if v else 0 for v in values], 0.36, label=label)
    wait_ax.bar(x, [v["wait_fraction"] if v else 0 for v in values], 0.36, label=label)
  for ax, title in ((rate_ax, "learner steps per second (each)"), (wait_ax, "wait fraction")):
    ax.set_xticks(range(len(methods)), methods)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
  rate_ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  cfg, num_params = model()
  P = cfg.sync.num_fragments
  # The unthrottled runs first: the throttle is sized on the Decoupled run's measured step
  # time (on a loaded host a step takes longer than its 0.2 s pace, and a throttle sized on
  # the pace would then be too weak to matter).
  plain = [r for r in config.runs(num_params, P, cfg.learners.min_step_s, FLAGS.preset)
           if "WAN" not in r.method and (not FLAGS.only or r.method in FLAGS.only)]
  wall = 0.0 if FLAGS.report_only else harness.run_all(plain, FLAGS.outdir)
  step_s = measured_step_s(cfg)
  runs = [r for r in config.runs(num_params, P, step_s, FLAGS.preset)
          if not FLAGS.only or r.method in FLAGS.only]
  if not FLAGS.report_only:
    wall += harness.run_all([r for r in runs if r not in plain], FLAGS.outdir)
  folder = FLAGS.results_dir
  os.makedirs(folder, exist_ok=True)
  mbps, latency = config.throttle(num_params, P, step_s)
  fragment = num_params * 4 / cfg.sync.num_fragments
  sections = ["## WAN throttle", "",
              f"N = {num_params} parameters, P = {cfg.sync.num_fragments}: one float32 fragment "
              f"is {fragment / 1e3:.1f} kB, the whole model {num_params * 4 / 1e3:.1f} kB. At "
              f"{mbps} Mbit/s a fragment takes {fragment * 8 / (mbps * 1e6):.3f} s "
              f"({config.FRAGMENT_STEPS:g} of the unthrottled Decoupled run's mean step, "
              f"{step_s:.3f} s; the pace is {cfg.learners.min_step_s:g} s), the "
              f"whole model {num_params * 32 / (mbps * 1e6):.3f} s; latency {latency} ms. "
              f"tau = {cfg.sync.tau} steps.", ""]
  base = next((r for r in runs if r.method == "decoupled"), None)
  done = {r.method: r for r in runs if harness.finished(os.path.join(FLAGS.outdir, r.name))}
  results = None
  if base is not None and base.method in done:
    base_dir = os.path.join(FLAGS.outdir, base.name)
    step_s = step_rates(base_dir)["step_s"]
    base_cfg = json.load(open(os.path.join(base_dir, "config.json"), encoding="utf-8"))
    ledger_rows = reference(num_params, base_cfg["learners"]["count"], base_cfg, step_s)
    for method in ("decoupled", "sync DiLoCo"):
      if method in done:
        ledger_rows += measured(done[method], os.path.join(FLAGS.outdir, done[method].name),
                                step_s)
    for r in ledger_rows:
      r["dp_over_this"] = ledger_rows[0]["gbps"] / r["gbps"] if r["gbps"] else None
    plot_ledger(ledger_rows, os.path.join(folder, "ledger.png"), step_s)
    with open(os.path.join(folder, "ledger.json"), "w", encoding="utf-8") as f:
      json.dump({"num_params": num_params, "step_s": step_s, "rows": ledger_rows}, f, indent=2)
    sections += ["## Ledger vs data-parallel (unthrottled runs)", "",
                 f"At the measured step time of the unthrottled Decoupled run ({step_s:.3f} s); "
                 "`dp_over_this` is data-parallel's rate over the row's.", "",
                 harness.table(ledger_rows, ("what", "gbps", "bytes_per_step", "dp_over_this")),
                 "", "![ledger](ledger.png)", ""]
  sections += ["## Step rate under the throttle", "", "![step rates](rates.png)", ""]
  results = harness.report(config.NAME, runs, FLAGS.outdir, folder, columns=config.COLUMNS,
                           wall_s=wall, command="python -m experiments.bandwidth.run",
                           extra=figures, sections=["\n".join(sections)])
  plot_rates(results["rows"], os.path.join(folder, "rates.png"))
  print(harness.table(results["rows"], config.COLUMNS))


def define_flags():
  """The command line (defined only when run as a script, so tests can import this)."""
  harness.define_flags(config.NAME, os.path.dirname(os.path.abspath(__file__)))
  flags.DEFINE_enum("preset", "full", list(config.STEPS), "Run length.")
  flags.DEFINE_multi_string("only", [], "Run only this method (repeatable; default: all of "
                            "them).")


if __name__ == "__main__":
  define_flags()
  app.run(main)
