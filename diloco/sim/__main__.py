"""CLI: `python -m diloco.sim --mode=decoupled --chips=1200000 --learners=8 --json`.

Prints a readable summary; with `--json`, one JSON line last (goodput, uptime, mode, chips,
learners, merged-token fraction, staleness, ...). The sync flags build the run's `sync` group
(`diloco.sync.policy.SyncConfig`), so a real run's defaults and rules apply; a bad value is a
one-line error naming its flag.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import app, flags

from diloco.errors import ConfigError
from diloco.sim import engine, params
from diloco.sync.policy import SyncConfig

_D = params.SimConfig()
_F = params.FailureModel()
# The flags that set the `sync` group: flag -> SyncConfig field (P and H keep the simulator's
# flag names).
SYNC_FLAGS = {"quorum": "quorum", "gamma": "gamma", "tau": "tau", "fragments": "num_fragments",
              "inner_steps": "period", "heartbeat_timeout_s": "heartbeat_timeout_s",
              "max_staleness": "max_staleness"}

flags.DEFINE_enum("mode", _D.mode, list(params.MODES), "dp | elastic | decoupled.")
flags.DEFINE_integer("chips", _D.chips, "Chips allocated at the start.")
flags.DEFINE_integer("learners", None, "M Decoupled learners (default 8; 1 for dp and elastic).")
flags.DEFINE_integer("quorum", _D.sync.quorum, "K of the syncer (0 = all learners).")
flags.DEFINE_bool("grace", _D.grace, "Use the adaptive grace window.")
flags.DEFINE_float("gamma", _D.sync.gamma, "Grace-window gain.")
flags.DEFINE_integer("tau", _D.sync.tau, "Bounded overlap, inner steps.")
flags.DEFINE_integer("fragments", _D.sync.num_fragments, "P fragments.")
flags.DEFINE_integer("inner_steps", _D.sync.period, "H inner steps per fragment period.")
flags.DEFINE_list("speeds", [], "Per-learner step-time factors, e.g. 1,1,1.18,1.18.")
flags.DEFINE_float("step_jitter", _D.step_jitter, "Per-step variation j: U(1-j, 1+j).")
flags.DEFINE_float("step_s", _D.step_s, "Nominal inner-step time, seconds.")
flags.DEFINE_float("sync_s", _D.sync_s, "Syncer pull + merge + publish time, seconds.")
flags.DEFINE_float("heartbeat_timeout_s", _D.sync.heartbeat_timeout_s, "Learner liveness timeout.")
flags.DEFINE_integer("max_staleness", _D.sync.max_staleness, "Staleness bound of deliveries.")
flags.DEFINE_integer("window_steps", _D.window_steps, "Steps per sampled round window.")
flags.DEFINE_list("schedule", [], "DAY:DELTA pairs adding (+) or removing (-) learners.")
flags.DEFINE_float("days", _D.days, "Simulated days.")
flags.DEFINE_integer("seed", _D.seed, "Random seed.")
flags.DEFINE_float("mtbi_years", _F.mtbi_years, "Mean time between interruptions per chip.")
flags.DEFINE_integer("slice_chips", _F.slice_chips, "Chips per slice (failure domain).")
flags.DEFINE_float("restart_s", _F.restart_s, "Data-parallel restart time (fitted).")
flags.DEFINE_float("reconfig_s", _F.reconfig_s, "Elastic reconfiguration pause (fitted).")
flags.DEFINE_float("repair_s", _F.repair_s, "Slice repair time (fitted).")
flags.DEFINE_bool("json", False, "Print one JSON line last.")

FLAGS = flags.FLAGS


def config_from_flags() -> params.SimConfig:
  """The run configuration the flags describe."""
  learners = FLAGS.learners or (8 if FLAGS.mode == "decoupled" else 1)
  schedule = []
  for item in FLAGS.schedule:
    day, _, delta = item.partition(":")
    schedule.append((float(day), int(delta)))
  failures = params.FailureModel(mtbi_years=FLAGS.mtbi_years, slice_chips=FLAGS.slice_chips,
                                 restart_s=FLAGS.restart_s, reconfig_s=FLAGS.reconfig_s,
                                 repair_s=FLAGS.repair_s)
  sync = SyncConfig(**{field: FLAGS[flag].value for flag, field in SYNC_FLAGS.items()})
  return params.SimConfig(
      mode=FLAGS.mode, chips=FLAGS.chips, learners=learners, days=FLAGS.days, seed=FLAGS.seed,
      sync=sync, grace=FLAGS.grace,
      speeds=tuple(float(s) for s in FLAGS.speeds), step_jitter=FLAGS.step_jitter,
      step_s=FLAGS.step_s, sync_s=FLAGS.sync_s, window_steps=FLAGS.window_steps,
      schedule=tuple(schedule), failures=failures)


def flag_message(message: str) -> str:
  """A config error about a `sync` field, as the flag that set it: `--inner_steps (sync.period):
  ...`; other messages already name their flag (`SimConfig.step_jitter = ...`)."""
  for flag, field in SYNC_FLAGS.items():
    prefix = f"sync.{field}:"
    if message.startswith(prefix):
      return f"--{flag} (sync.{field}):{message[len(prefix):]}"
  return message


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    cfg = config_from_flags()
  except ConfigError as e:
    sys.exit(f"diloco.sim: error: {flag_message(str(e))}")
  result = engine.simulate(cfg)
  print(result.summary())
  if FLAGS.json:
    print(result.to_json())


if __name__ == "__main__":
  app.run(main)
