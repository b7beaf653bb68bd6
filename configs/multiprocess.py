"""Decoupled DiLoCo on the multi-process runtime: a syncer and learner processes, one store.

Run locally (3 learner processes with 2 emulated CPU devices each, a syncer process, a
seeded chaos schedule of real signals; a few minutes on 2 cores):
  python -m diloco.main --config=configs/multiprocess.py:tiny --workdir=runs/mp_tiny \\
    --role=launch
Expect: a status line per learner and for the syncer, the chaos events as they fire,
logs/ per process, and accounting.json, loss.png and timeline.png at the end.
Presets: tiny (tests and the demo above), cpu (the small model), and the TPU presets
of configs/decoupled.py, for one learner per slice with the store on GCS: see
docs/scale_out.md and scripts/make_jobset.py.
"""

import os

import diloco


def get_config(preset: str = "tiny"):
  cfg = diloco.load_config_dict(
      os.path.join(os.path.dirname(__file__), "decoupled.py") + ":" + preset)
  cfg.checkpoint.every_steps = 8  # learners resume their own state after a kill
  cfg.checkpoint.max_to_keep = 2
  if preset in ("tiny", "cpu"):
    cfg.learners.count = 3
    cfg.sync.heartbeat_timeout_s = 6.0  # a killed or hung learner is skipped quickly
    # A round trip through the store (write, poll, merge, commit, poll, read) takes 0.15-0.3 s
    # on a local disk, a few tiny steps: overlap that many. The steps between a delivery and
    # its receipt are overwritten by the merged fragment, so H is kept well above tau.
    cfg.sync.tau = 4
    cfg.sync.period = 24
    cfg.log.progress_every_s = 10.0
    # Steps of at least 0.2 s (a tiny step is 0.05-0.3 s here, depending on load): the chaos
    # schedule, in seconds, then hits learners at the same points of training on any host.
    cfg.learners.min_step_s = 0.2
    cfg.launch.devices_per_learner = 2
    cfg.launch.chaos_faults = 10
    cfg.launch.chaos_start_s = 5.0
    cfg.launch.chaos_end_s = 45.0
    # Room for one learner added by the chaos schedule, following --config.learners.count.
    cfg.launch.max_learners = cfg.learners.get_ref("count") + 1
    cfg.launch.timeout_s = 900.0
  if preset == "tiny":
    cfg.train.steps = 160
    cfg.train.eval_every = 40
  else:
    cfg.checkpoint.every_steps = 24
  return cfg
