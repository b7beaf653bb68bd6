"""Named model sizes. Large ones are only ever built abstractly (`jax.eval_shape`) on CPU.

The dense Gemma-style sizes follow Gemma 2/3 shapes (head_dim 256, GQA with half as many
KV heads, 5 local : 1 global attention, soft-capped logits) with Gemma 3's 262,144-token
SentencePiece vocabulary. `nano`, `tiny`, `mini` and `small` use the byte tokenizer (259 ids,
padded to 384 so that the vocabulary splits over up to 128 tensor-parallel shards).
"""

from __future__ import annotations

import dataclasses

from diloco.errors import ConfigError
from diloco.model.config import ModelConfig

_BYTE_VOCAB = 384
_GEMMA_VOCAB = 262_144
# How the accelerator-sized presets run: bf16 compute over fp32 master weights, layers scanned
# and rematerialised, fused attention where the backend has it, and the 262k-vocabulary head
# and loss 1024 tokens at a time, 1024 positions of one sequence (the whole-sequence float32
# logits would be the largest activation: scripts/bench_loss_chunk.py; configs/dp.py and
# configs/decoupled.py keep 1024 positions of every sequence of their batch).
_ACCELERATOR = {"dtype": "bfloat16", "remat": "full", "scan_layers": True,
                "attention_impl": "auto", "loss_chunk": 1024}

_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=_BYTE_VOCAB, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, mlp_dim=256, attention_pattern="LG", sliding_window=32,
        final_logit_softcap=30.0),
    # About 4x fewer parameters than `tiny` (half the width and a 3x MLP, same depth,
    # vocabulary and attention pattern): the second size of the compute-optimal comparison
    # (experiments/scaling/), whose 20N runs cost a sixteenth of tiny's.
    "nano": ModelConfig(
        vocab_size=_BYTE_VOCAB, embed_dim=32, num_layers=2, num_heads=2, num_kv_heads=1,
        head_dim=16, mlp_dim=96, attention_pattern="LG", sliding_window=32,
        final_logit_softcap=30.0),
    # About 4x the parameters of `tiny` (twice the width, a 4.5x MLP, same depth, vocabulary
    # and attention pattern): the third size of the compute-optimal comparison, whose 20N
    # runs cost about sixteen times tiny's.
    "mini": ModelConfig(
        vocab_size=_BYTE_VOCAB, embed_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=32, mlp_dim=576, attention_pattern="LG", sliding_window=32,
        final_logit_softcap=30.0),
    "tiny_moe": ModelConfig(
        vocab_size=_BYTE_VOCAB, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, mlp_dim=256, attention_pattern="LG", sliding_window=32,
        final_logit_softcap=30.0, num_experts=4, experts_per_token=2, expert_mlp_dim=64),
    "small": ModelConfig(
        vocab_size=_BYTE_VOCAB, embed_dim=256, num_layers=6, num_heads=4, num_kv_heads=2,
        head_dim=64, mlp_dim=1024, attention_pattern="LLG", sliding_window=64,
        final_logit_softcap=30.0),
    # ~35.6M parameters: the size of the DiLoCo scaling-law study's smallest row (Charles et
    # al. 2025, Table 4), Gemma-style, byte vocabulary; bf16 compute for one GPU (its layers
    # are scanned, so depth costs no compile time). experiments/scaling/gpu35m.py trains it.
    "m35": ModelConfig(
        vocab_size=_BYTE_VOCAB, embed_dim=512, num_layers=9, num_heads=8, num_kv_heads=4,
        head_dim=64, mlp_dim=2048, attention_pattern="LLG", sliding_window=256,
        final_logit_softcap=30.0, dtype="bfloat16", scan_layers=True, attention_impl="auto"),
    "gemma_2b": ModelConfig(
        vocab_size=_GEMMA_VOCAB, embed_dim=2304, num_layers=26, num_heads=8, num_kv_heads=4,
        head_dim=256, mlp_dim=9216, attention_pattern="LLLLLG", sliding_window=1024,
        final_logit_softcap=30.0, **_ACCELERATOR),
    "gemma_5b": ModelConfig(
        vocab_size=_GEMMA_VOCAB, embed_dim=3072, num_layers=30, num_heads=16, num_kv_heads=8,
        head_dim=256, mlp_dim=12288, attention_pattern="LLLLLG", sliding_window=1024,
        final_logit_softcap=30.0, **_ACCELERATOR),
    "gemma_9b": ModelConfig(
        vocab_size=_GEMMA_VOCAB, embed_dim=3584, num_layers=42, num_heads=16, num_kv_heads=8,
        head_dim=256, mlp_dim=14336, attention_pattern="LLLLLG", sliding_window=1024,
        final_logit_softcap=30.0, **_ACCELERATOR),
    "moe_2_8b": ModelConfig(
        vocab_size=_GEMMA_VOCAB, embed_dim=2048, num_layers=16, num_heads=16, num_kv_heads=8,
        head_dim=128, mlp_dim=8192, attention_pattern="LLLLLG", sliding_window=1024,
        final_logit_softcap=30.0, num_experts=16, experts_per_token=2, expert_mlp_dim=1280,
        **_ACCELERATOR),
    "moe_3_8b": ModelConfig(
        vocab_size=_GEMMA_VOCAB, embed_dim=2048, num_layers=20, num_heads=16, num_kv_heads=8,
        head_dim=128, mlp_dim=8192, attention_pattern="LLLLLG", sliding_window=1024,
        final_logit_softcap=30.0, num_experts=16, experts_per_token=2, expert_mlp_dim=1536,
        **_ACCELERATOR),
}

NAMES = tuple(_PRESETS)


def get(name: str) -> ModelConfig:
  """The preset called `name` (its `name` field set), or ConfigError listing the presets."""
  if name not in _PRESETS:
    raise ConfigError(f"model preset: unknown {name!r}; allowed: {list(NAMES)}")
  return dataclasses.replace(_PRESETS[name], name=name)
