"""How a learner takes a merged fragment G_p (docs/design.md 2.3, "Receipt").

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

# Owned here, in the vocabulary every layer imports, so that the `sync` group can name them;
# the learner (`Learner._apply`) does the arithmetic on its devices.
RECEIPT_MODES = ("overwrite", "mix", "keep_local")
