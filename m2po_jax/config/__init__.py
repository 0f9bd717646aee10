"""The run configuration: typed sections, validation, overrides from files and dotted keys.

The face of `m2po_jax.config`: `from_configdict` builds a validated `Config` from a
ConfigDict (`configs/*.py`); the sections live in `m2po_jax.common.config_schema`, the
validation in `validate`, the overrides in `overrides`, AReaL experiment files in `areal`,
verl's rollout-correction keys in `verl`.
"""

from m2po_jax.common.config_schema import (
    MIN_TEMPERATURE,
    PARAM_DTYPES,
    ActorSection,
    AgentSection,
    CheckpointSection,
    Config,
    EvalSection,
    GenerationSection,
    LoggingSection,
    MeshSection,
    MicroBatchSection,
    ModelSection,
    OptimizerSection,
    RejectionSamplingSection,
    RewardNormSection,
    RolloutCorrectionSection,
    RolloutSection,
    SftSection,
    TaskSection,
)
from m2po_jax.common.errors import ConfigError
from m2po_jax.config.overrides import apply_dotted, apply_overrides, load_overrides
from m2po_jax.config.validate import (
    DERIVED,
    build_library_objects,
    check_moe_settings,
    from_configdict,
    rollout_engine,
    rollout_weight_dtype,
    tool_names,
    validate,
)

__all__ = [
    "DERIVED",
    "MIN_TEMPERATURE",
    "PARAM_DTYPES",
    "ActorSection",
    "AgentSection",
    "CheckpointSection",
    "Config",
    "ConfigError",
    "EvalSection",
    "GenerationSection",
    "LoggingSection",
    "MeshSection",
    "MicroBatchSection",
    "ModelSection",
    "OptimizerSection",
    "RejectionSamplingSection",
    "RewardNormSection",
    "RolloutCorrectionSection",
    "RolloutSection",
    "SftSection",
    "TaskSection",
    "apply_dotted",
    "apply_overrides",
    "build_library_objects",
    "check_moe_settings",
    "from_configdict",
    "load_overrides",
    "rollout_engine",
    "rollout_weight_dtype",
    "tool_names",
    "validate",
]
