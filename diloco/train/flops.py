"""FLOPs of one train step per token, counted the ways that MFU and HFU figures are quoted, so a
speed figure says which count it divides: PaLM's (full attention), MaxText's (causal and
windowed attention) and the hardware's (plus what remat recomputes)."""

from __future__ import annotations

from diloco.model import transformer
from diloco.model.config import ModelConfig

# Remat policies that keep no activation of a layer: its whole forward runs again.
_RECOMPUTE_ALL = ("full", "nothing_saveable")


def matmul_params(cfg: ModelConfig) -> int:
  """Parameters a token multiplies through (the active experts and the tied output head;
  norms and the MoE router left out, as the PaLM count leaves them)."""
  counts = transformer.param_counts(cfg)
  norms = cfg.num_layers * (4 * cfg.embed_dim + 2 * cfg.head_dim) + cfg.embed_dim
  router = cfg.num_layers * cfg.embed_dim * cfg.num_experts
  return counts["active"] - norms - router  # the embedding stays: it is the head


def layer_kinds(cfg: ModelConfig) -> str:
  """One letter per layer, L (sliding window) or G (global): the pattern repeated cyclically."""
  pattern = cfg.attention_pattern
  return "".join(pattern[i % len(pattern)] for i in range(cfg.num_layers))


def attended_pairs(seq_len: int, window: int | None = None) -> int:
  """(query, key) pairs of one causal sequence: position i sees min(i + 1, window) keys."""
  w = seq_len if window is None else min(window, seq_len)
  return w * (w + 1) // 2 + (seq_len - w) * w


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool) -> float:
  """Attention score and value matmuls, forward and backward (3 x 4 x heads x head_dim per
  attended key), per token. `causal=False`: every layer sees the whole sequence (PaLM);
  True: each layer's exact causal (and, for L layers, windowed) pairs, as MaxText counts."""
  per_key = 12.0 * cfg.num_heads * cfg.head_dim
  if not causal:
    return per_key * cfg.num_layers * seq_len
  pairs = sum(attended_pairs(seq_len, cfg.sliding_window if kind == "L" else None)
              for kind in layer_kinds(cfg))
  return per_key * pairs / seq_len


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """PaLM's count: 6 x matmul parameters plus full, non-causal attention."""
  return 6.0 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len, causal=False)


def causal_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """MaxText's count: 6 x matmul parameters plus causal, windowed attention."""
  return 6.0 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len, causal=True)


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, attention_resolved: str,
                              batch_size: int = 1) -> tuple[float | None, str]:
  """FLOPs per token that the step runs again for its backward pass, and which estimate it is.

  Layers: "none" recomputes nothing; "full" and "nothing_saveable" the layer's whole forward;
  "dots_with_no_batch_dims_saveable" keeps the projections and recomputes the attention
  matmuls (they have batch dimensions); "dots_saveable" keeps every matmul, but a cuDNN
  attention is a custom call, not a dot, so it runs again. "offload_dots" moves the same values
  as "dots_with_no_batch_dims_saveable" to the host instead of keeping them. "save_attention"
  keeps the attention output and recomputes the rest of the layer; the attention itself runs
  again for its backward either way (cuDNN's keeps its statistics unnamed, XLA's needs the
  probabilities), so it counts as the whole forward; "save_dots_and_attention" as the dots
  policy. Other policies: (None, "unknown"). The chunked loss (`loss_chunk` tokens, so
  `loss_chunk // batch_size` positions, below the length) recomputes the head on every padded
  chunk.
  Elementwise work (norms, softmax, activations) is not counted in either direction.
  """
  head = cfg.vocab_size * cfg.embed_dim
  attention_forward = attention_flops_per_token(cfg, seq_len, causal=True) / 3.0
  layer_forward = 2.0 * (matmul_params(cfg) - head) + attention_forward
  remat = cfg.remat
  if remat == "none":
    extra, label = 0.0, "none"
  elif remat in _RECOMPUTE_ALL:
    extra, label = layer_forward, "layer_forward"
  elif remat in ("dots_with_no_batch_dims_saveable", "offload_dots",
                 "save_dots_and_attention"):
    extra, label = attention_forward, "attention_forward"
  elif remat == "save_attention":
    extra, label = layer_forward, "layer_forward (the attention output kept)"
  elif remat == "dots_saveable":
    if attention_resolved == "cudnn":
      extra, label = attention_forward, "attention_forward (cudnn is not a dot)"
    else:
      extra, label = 0.0, "elementwise_only"
  else:
    return None, f"unknown ({remat})"
  chunk = cfg.loss_chunk and max(1, cfg.loss_chunk // batch_size)
  if chunk and chunk < seq_len:
    padded = -(-seq_len // chunk) * chunk
    # The head's forward once more, plus forward and backward over the padding.
    extra += 8.0 * head * padded / seq_len - 6.0 * head
    label += "+head_forward"
  return extra, label
