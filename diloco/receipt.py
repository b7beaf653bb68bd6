"""How a learner takes a merged fragment G_p (DESIGN.md 2.3, "Receipt").

Three modes, selected by `sync.receipt`:
  * overwrite:  theta_p = G_p. The paper's rule; the tau steps made on p since the delivery
    are dropped (the next delivery starts counting from zero).
  * mix:        theta_p = alpha * theta_p + (1 - alpha) * G_p (Streaming DiLoCo).
  * keep_local: theta_p = G_p + (theta_p - reference_p), where the reference is theta_p as it
    was delivered (or, with no delivery since the last receipt, the G_p received then). The
    steps made since are kept, and the learner's counters keep counting them, so its next
    delivery carries them to the syncer: the overlap tau then throws no work away.
A learner that joins (or rejoins) always overwrites: its own values are only its init.
"""

from __future__ import annotations

import jax

RECEIPT_MODES = ("overwrite", "mix", "keep_local")


@jax.jit
def mixed(theta: jax.Array, merged: jax.Array, alpha: float) -> jax.Array:
  """`alpha * theta + (1 - alpha) * merged` (the `mix` receipt)."""
  return alpha * theta + (1.0 - alpha) * merged


@jax.jit
def kept_local(theta: jax.Array, merged: jax.Array, reference: jax.Array) -> jax.Array:
  """`merged + (theta - reference)` (the `keep_local` receipt): G plus the local progress made
  since `reference`. Parenthesised as written so the local progress is formed first."""
  return merged + (theta - reference)
