"""How a learner takes a merged fragment, and how it ends its run: the `receipt` group of the
configuration (docs/design.md 2.3, "Receipt" and "Final sync").

The modes (`Learner._apply` does the arithmetic on the learner's devices):
  overwrite:  theta_p = G_p. The paper's rule; the tau steps made on p since the delivery are
              dropped (the next delivery starts counting from zero).
  mix:        theta_p = alpha * theta_p + (1 - alpha) * G_p (Streaming DiLoCo).
  keep_local: theta_p = G_p + (theta_p - reference_p), where the reference is theta_p as it
              was delivered (or, with no delivery since the last receipt, the G_p received
              then). The steps made since are kept and counted, so the learner's next delivery
              carries them to the syncer: the overlap tau then throws no work away.
A learner that joins (or rejoins) always overwrites: its own values are only its init.

The group is the learner's, declared here beside the learner that reads it; the syncer reads
only `final_sync` (its last rounds wait for the learners' final deliveries).
"""

from __future__ import annotations

from diloco.settings import FRACTION, OneOf, frozen, require, setting

RECEIPT_MODES = ("overwrite", "mix", "keep_local")
OVERWRITE, MIX, KEEP_LOCAL = RECEIPT_MODES

# Fields that sat in the `sync` group before this one existed, as a run's config.json of then
# names them: {old sync field: receipt field} (read back by `diloco.config.run_config`).
FORMER_SYNC_FIELDS = {"receipt": "mode", "mixing_alpha": "mixing_alpha",
                      "final_sync": "final_sync", "reset_moments": "reset_moments"}


@frozen
class ReceiptConfig:
  """How a learner takes merged fragments (the modes above) and leaves its run."""
  # overwrite | mix | keep_local (the module docstring).
  mode: str = setting(OVERWRITE, OneOf(RECEIPT_MODES))
  # alpha of the "mix" receipt.
  mixing_alpha: float = setting(0.0, FRACTION)
  # A learner that finishes (or retires on purpose) delivers every fragment at its last step,
  # and that fragment's last round waits for every live learner (bounded by the heartbeat
  # timeout): the final G, its eval and the export hold every learner's last step.
  final_sync: bool = True
  # Zero the AdamW moments of a fragment's tensors when its merged values arrive.
  reset_moments: bool = False

  def check(self) -> None:
    require(self.mode == MIX or self.mixing_alpha == 0, "receipt.mixing_alpha",
            f"only applies with receipt.mode='mix', got mode={self.mode!r}")
