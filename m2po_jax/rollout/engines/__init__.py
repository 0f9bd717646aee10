"""Rollout engines behind one interface (`base.RolloutEngine`), one module per engine and
a registry by `rollout.engine` name (`ENGINES`): `static` (`sampling.generate`) and
`continuous` (continuous batching, multi-turn episodes).
"""

from m2po_jax.rollout.engines.base import (
    ENGINES,
    EngineProgram,
    Generation,
    OutputOf,
    RolloutEngine,
    WeightSource,
    engine_class,
    register,
)
from m2po_jax.rollout.engines.continuous import ContinuousEngine, row_axes
from m2po_jax.rollout.engines.static import StaticEngine
from m2po_jax.rollout.engines.turns import Turn

__all__ = [
    "ENGINES",
    "ContinuousEngine",
    "EngineProgram",
    "Generation",
    "OutputOf",
    "RolloutEngine",
    "StaticEngine",
    "Turn",
    "WeightSource",
    "engine_class",
    "register",
    "row_axes",
]
