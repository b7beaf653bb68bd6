"""Goodput simulator for data-parallel, elastic and Decoupled DiLoCo training (docs/design.md 4).

`simulate(SimConfig(...))` runs one configuration; `python -m diloco.sim --help` is the CLI and
`python -m diloco.sim.bandwidth` the bandwidth model. See `diloco/sim/README.md`.
"""

from diloco.sim.engine import simulate
from diloco.sim.params import FailureModel, SimConfig
from diloco.sim.result import SimResult

__all__ = ["FailureModel", "SimConfig", "SimResult", "simulate"]
