"""Outer (syncer-side) math of Decoupled DiLoCo on NumPy arrays (docs/design.md 2.4).

Sign convention: the outer gradient (pseudo-gradient) of learner m is
`d_m = anchor - theta_m`, the anchor being the syncer's current global fragment `G`
(or the version the learner started from). A descent step is then `G <- G - lr * d`, so a
learner that moved its parameters away from `G` pulls `G` the same way.

A round of fragment p merges the learners' outer gradients (`merge`: token weights,
radial-directional averaging, the weighted mean for the embedding) and takes an outer SGD step
with Nesterov momentum on `G` (`nesterov`); payloads may be quantised (`quantize`). All of them
stream over the data in cache-sized chunks shared by a few threads (`kernels`; its
`MERGE_THREADS` sets how many).
"""

from diloco.outer.merge import (
    MERGE_METHODS,
    RDA_DIRECTION_EPS,
    WEIGHT_SCHEMES,
    merge_fragment,
    outer_gradient,
    radial_directional_average,
    rebase_delta,
    token_weights,
    weighted_mean,
)
from diloco.outer.nesterov import merge_and_step, nesterov_step
from diloco.outer.quantize import (
    QUANT_BITS,
    QuantizedTensor,
    dequantize,
    packed_size,
    quantize,
    quantize_with_feedback,
)

__all__ = [
    "MERGE_METHODS", "QUANT_BITS", "RDA_DIRECTION_EPS", "WEIGHT_SCHEMES", "QuantizedTensor",
    "dequantize", "merge_and_step", "merge_fragment", "nesterov_step", "outer_gradient",
    "packed_size", "quantize", "quantize_with_feedback", "radial_directional_average", "rebase_delta",
    "token_weights", "weighted_mean",
]
