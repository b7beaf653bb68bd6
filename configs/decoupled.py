"""Decoupled DiLoCo with the design defaults: P = H = 24, tau = 2, K = 1, grace gamma = 0.8.

Run (4 learners x 2 emulated CPU devices, small model, about 10 minutes on 2 cores):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python -m diloco.main --config=configs/decoupled.py:cpu --workdir=runs/decoupled_cpu
Expect: a live status per learner and for the syncer, the global eval/loss falling
like the data-parallel run's, and runs/decoupled_cpu/{loss,timeline}.png plus
accounting.json (goodput, uptime, bandwidth ledger).
Presets: tiny (tests, < 2 min), nano (tiny's run, ~4x fewer parameters), mini (tiny's run, ~4x
more), cpu (above), m35 (~35.6M parameters, every learner on
one GPU: experiments/scaling/gpu35m.py), and TPU-sized gemma_2b / gemma_5b /
gemma_9b / moe_2_8b / moe_3_8b with 8 learners, one slice each (devices are grouped
by slice_index), reading pre-tokenised shards (`--config.data.path=gs://...`).
"""

import diloco

_TPU = ("gemma_2b", "gemma_5b", "gemma_9b", "moe_2_8b", "moe_3_8b")


def get_config(preset: str = "cpu"):
  if preset not in ("tiny", "nano", "mini", "cpu", "m35") + _TPU:
    raise ValueError(f"configs/decoupled.py: unknown preset {preset!r}; allowed: "
                     f"{['tiny', 'nano', 'mini', 'cpu', 'm35', *_TPU]}")
  cfg = diloco.base_config({"tiny": "tiny", "cpu": "small"}.get(preset, preset))
  cfg.learners.count = 4
  # Learners need no train-state checkpoints here (a restarted learner keeps its resume point
  # and loads G); the run checkpoints G, the syncer and those resume points every 32 rounds
  # (about every 8 steps of 4 learners at P = H), and resumes from them when rerun.
  cfg.checkpoint.every_steps = 0
  cfg.checkpoint.every_rounds = 32
  # Receipt: the paper's overwrite (config default). keep_local throws no work away but, with
  # learners of unequal speed under K = 1, trained far worse (docs/design.md 5.1).
  if preset in ("tiny", "nano", "mini"):  # nano, mini: tiny's run at ~4x fewer, more parameters
    cfg.data.seq_len = 64
    cfg.train.batch_size = 8
    cfg.train.steps = 64
    cfg.train.eval_every = 32
    cfg.optim.warmup_steps = 8
    cfg.sync.num_fragments = 8
    cfg.sync.period = 8
  elif preset == "cpu":
    cfg.data.seq_len = 128
    cfg.train.batch_size = 8
    cfg.train.steps = 120
    cfg.train.eval_every = 40
    # 16 batches of 8: the same 128 held-out windows as configs/dp.py:cpu (4 batches of 32),
    # so that the two runs' eval losses are comparable.
    cfg.train.eval_batches = 16
    cfg.optim.warmup_steps = 12
    # Four learners' steps and device-to-host copies share two cores here, so a delivery's
    # values reach the host ~1.8 steps after its delivery point (the `lead_s` of the tape).
    # tau = 2 then leaves the grace window no slack (rounds merge 1.04 learners); tau = 4
    # leaves ~2 steps, so equal learners' deliveries of a slot merge together and nobody
    # waits (BUILD_NOTES "Fidelity"). The design default, tau = 2, stays on the TPU presets.
    cfg.sync.tau = 4
  elif preset == "m35":
    # One GPU holds every learner (their steps take turns on the virtual clock): the
    # scaling-law study's 35M row, D = 20N (experiments/scaling/gpu35m.py).
    cfg.learners.count = 2
    cfg.learners.share_devices = True
    cfg.learners.virtual_clock = True
    cfg.data.seq_len = 512
    cfg.train.batch_size = 32
    cfg.train.steps = 21_733
    cfg.train.eval_every = 1000
    cfg.optim.learning_rate = 2e-3
    cfg.optim.warmup_steps = 400
    cfg.sync.period = 30
    cfg.sync.num_fragments = 6
    cfg.checkpoint.every_rounds = 0
  else:
    cfg.learners.count = 8
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 1, -1, 4
    cfg.data.source = "array_record"
    cfg.data.seq_len = 4096
    cfg.train.batch_size = 64
    # The output head and the loss over 1024 positions of every sequence at a time, as the
    # presets' chunk of 1024 meant when it counted positions (`model.loss_chunk` counts
    # tokens, batch x positions); a number instead bounds a chunk's logits whatever the batch.
    cfg.model.loss_chunk = cfg.train.get_ref("batch_size") * 1024
    cfg.train.steps = 100_000
    cfg.train.eval_every = 1000
    cfg.optim.learning_rate = 3e-4
    cfg.optim.warmup_steps = 2000
    cfg.sync.heartbeat_timeout_s = 120.0
    cfg.log.progress_every_s = 30.0
    cfg.checkpoint.every_rounds = 2000  # G and momentum are 2 x 4 bytes per parameter
  return cfg
