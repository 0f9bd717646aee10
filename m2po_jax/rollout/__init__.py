"""Rollouts: the jitted sampler that records behaviour log-probs, rollout batches with
their policy versions, and the stale-k queue.

The face of `m2po_jax.rollout` keeps the names of the 0.1 module of that path.
"""

from m2po_jax.rollout.batches import (
    ROLLOUT_KEYS,
    SampledRollout,
    StaleQueue,
    completion_texts,
    encode_prompts,
    generate_rollout,
    sample_rollout,
    score_rollout,
    train_batch,
)

__all__ = [
    "ROLLOUT_KEYS",
    "SampledRollout",
    "StaleQueue",
    "completion_texts",
    "encode_prompts",
    "generate_rollout",
    "sample_rollout",
    "score_rollout",
    "train_batch",
]
