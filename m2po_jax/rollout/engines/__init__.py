"""Rollout engines behind one interface (`base.RolloutEngine`), one module per engine and
a registry by `rollout.engine` name (`ENGINES`): `static` (`sampling.generate`),
`continuous` (continuous batching, multi-turn episodes) and `paged` (continuous batching
over a paged KV cache, a group's prompt stored once; multi-turn episodes whose pending
turns do not stop the other sequences).
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
from m2po_jax.rollout.engines.paged import PagedEngine, PagedGeneration, own_pages, pool_pages
from m2po_jax.rollout.engines.static import StaticEngine
from m2po_jax.rollout.engines.turns import Turn, TurnQueue

__all__ = [
    "ENGINES",
    "ContinuousEngine",
    "EngineProgram",
    "Generation",
    "OutputOf",
    "PagedEngine",
    "PagedGeneration",
    "RolloutEngine",
    "StaticEngine",
    "Turn",
    "TurnQueue",
    "WeightSource",
    "engine_class",
    "own_pages",
    "pool_pages",
    "register",
    "row_axes",
]
