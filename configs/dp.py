"""Data-parallel baseline: one learner over every visible device, no syncer.

Run (8 emulated CPU devices, about 5 minutes on 2 cores):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m diloco.main --config=configs/dp.py:small --workdir=runs/dp_small
Presets: tiny (tests, < 1 min), nano and mini (tiny's shape at ~4x fewer and ~4x more parameters), small (CPU, ~6M parameters), cpu (the same model with
the token budget of configs/decoupled.py:cpu, for comparison), m35 (~35.6M parameters,
one GPU), and TPU-sized
gemma_2b / gemma_5b / gemma_9b / moe_2_8b / moe_3_8b, which expect pre-tokenised
shards (`--config.data.path=gs://.../shards`, see scripts/prepare_data.py).
"""

import diloco

_CPU = {
    "tiny": dict(seq_len=64, batch_size=16, steps=60, eval_every=30, lr=3e-3, warmup=10),
    # About 4x fewer parameters than tiny: the smaller size of experiments/scaling/.
    "nano": dict(seq_len=64, batch_size=16, steps=60, eval_every=30, lr=3e-3, warmup=10),
    # About 4x the parameters of tiny: the larger size of experiments/scaling/.
    "mini": dict(seq_len=64, batch_size=16, steps=60, eval_every=30, lr=3e-3, warmup=10),
    "small": dict(seq_len=128, batch_size=16, steps=200, eval_every=50, lr=3e-3, warmup=20),
    # The data-parallel reference for configs/decoupled.py:cpu: the same model, the same
    # tokens per step (4 learners x 8 sequences) and steps.
    "cpu": dict(seq_len=128, batch_size=32, steps=120, eval_every=40, lr=3e-3, warmup=12),
    # ~35.6M parameters on one GPU: 20N tokens at 64 x 512 tokens per step
    # (experiments/scaling/gpu35m.py sets the steps from its --token_fraction).
    "m35": dict(seq_len=512, batch_size=64, steps=21_733, eval_every=1000, lr=2e-3,
                warmup=400),
}
_TPU = ("gemma_2b", "gemma_5b", "gemma_9b", "moe_2_8b", "moe_3_8b")


def get_config(preset: str = "small"):
  if preset not in _CPU and preset not in _TPU:
    raise ValueError(f"configs/dp.py: unknown preset {preset!r}; allowed: "
                     f"{sorted(_CPU) + list(_TPU)}")
  cfg = diloco.base_config("small" if preset == "cpu" else preset)
  if preset in _CPU:
    p = _CPU[preset]
    cfg.data.seq_len = p["seq_len"]
    cfg.train.batch_size = p["batch_size"]
    cfg.train.steps = p["steps"]
    cfg.train.eval_every = p["eval_every"]
    # A checkpoint at every evaluation, following --config.train.eval_every unless overridden.
    cfg.checkpoint.every_steps = cfg.train.get_ref("eval_every").identity()
    cfg.optim.learning_rate = p["lr"]
    cfg.optim.warmup_steps = p["warmup"]
  else:
    # One TPU slice: FSDP over the slice, tensor parallelism inside a host.
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 1, -1, 4
    cfg.data.source = "array_record"
    cfg.data.seq_len = 4096
    cfg.train.batch_size = 256
    # The output head and the loss over 1024 positions of every sequence at a time, as the
    # presets' chunk of 1024 meant when it counted positions (`model.loss_chunk` counts
    # tokens, batch x positions); a number instead bounds a chunk's logits whatever the batch.
    cfg.model.loss_chunk = cfg.train.get_ref("batch_size") * 1024
    cfg.train.steps = 100_000
    cfg.train.eval_every = 1000
    cfg.checkpoint.every_steps = 1000
    cfg.optim.learning_rate = 3e-4
    cfg.optim.warmup_steps = 2000
  return cfg
