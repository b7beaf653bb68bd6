"""The grid sweep: model size x method x M x K x H from one config (docs/design.md 5).

Command (the CPU grid: 17 tiny runs of about a minute and 5 small runs of 4-7 minutes, about
45 minutes on an idle 2-core CPU, hours on a shared one; resumable: rerun it and finished
points are reused; `--only=size=tiny,method=dp,method=decoupled` runs a part of it, `--jobs=2`
two runs at a time):

    python -m experiments.sweep.run

It runs every CPU point (sizes `tiny` and `small`) as its own `python -m diloco.main` on the
deterministic virtual clock, renders the TPU points (Gemma 2B/5B/9B, MoE 2.8B/3.8B) as JobSet
manifests and launch commands under `experiments/sweep/launch/` without running them, and
regenerates results.json, sweep.png, eval_<size>.png and README.md from the runs' own files.

Grid rules (`grid.expand`), so that every point is a different run:
- All points of one size see the same tokens: every learner takes `steps` steps of
  `global_batch / M` sequences (data-parallel: one learner of `global_batch`).
- `dp` has no M, K or H: one point per size.
- `diloco` (P = 1) and `streaming` (P fragments, alpha = 0.5) are synchronous, K = M: one
  point per (M, H); the K axis does not apply.
- `decoupled` takes every (M, K, H) with K in {1, M} (K = M once when M = 1).
- P is the preset's fragment count, capped at H (a fragment is due at most once a step).

Expected outcome: at equal tokens the data-parallel run reaches the lowest eval loss at these
lengths; synchronous DiLoCo and Streaming DiLoCo are close to each other; Decoupled DiLoCo with
K = M matches Streaming DiLoCo, and with K = 1 trades some loss for never waiting. More
learners (M = 4 vs 2, a smaller batch each) and a longer period H cost loss.
"""

NAME = "sweep"
METHODS = ("dp", "diloco", "streaming", "decoupled")
CONFIGS = {"dp": "configs/dp.py", "diloco": "configs/diloco.py",
           "streaming": "configs/streaming.py", "decoupled": "configs/decoupled.py"}
# K axis values: an integer, or "M" for all learners (sync.quorum = 0).
ALL = "M"

# Sizes that run here. `preset` is the config files' preset of that model size (the decoupled
# `cpu` preset is the small model), `fragments` and `tau` are that preset's P and tau.
CPU_SIZES = {
    "tiny": dict(preset="tiny", steps=64, eval_every=32, warmup=8, global_batch=16,
                 fragments=8, tau=2),
    "small": dict(preset="cpu", steps=120, eval_every=40, warmup=12, global_batch=32,
                  fragments=24, tau=4),
}
CPU_GRID = {
    "tiny": dict(methods=METHODS, M=(2, 4), K=(1, ALL), H=(8, 16)),
    "small": dict(methods=METHODS, M=(4,), K=(1, ALL), H=(24,)),
}

# Sizes that are only rendered: one learner per TPU slice of `tpu_type`, P = H = 24 and
# tau = 2 (the design defaults of the TPU presets).
TPU_SIZES = {
    "gemma_2b": dict(preset="gemma_2b", tpu_type="v5p-64", fragments=24, tau=2),
    "gemma_5b": dict(preset="gemma_5b", tpu_type="v5p-128", fragments=24, tau=2),
    "gemma_9b": dict(preset="gemma_9b", tpu_type="v5p-256", fragments=24, tau=2),
    "moe_2_8b": dict(preset="moe_2_8b", tpu_type="v5p-128", fragments=24, tau=2),
    "moe_3_8b": dict(preset="moe_3_8b", tpu_type="v5p-128", fragments=24, tau=2),
}
TPU_GRID = {size: dict(methods=METHODS, M=(8,), K=(1, ALL), H=(24,)) for size in TPU_SIZES}

# Placeholders in the rendered manifests (the runner's --image, --bucket and --data_path).
IMAGE = "REGISTRY/diloco:latest"
BUCKET = "gs://your-bucket/sweep"
DATA_PATH = "gs://your-bucket/tokens"

COLUMNS = ("size", "method", "M", "K", "H", "P", "tokens", "eval_loss", "initial_loss",
           "goodput", "mean_learners_per_round", "staleness_mean", "bytes_up", "wall_s")
