"""Batches that flow from the sampler to the train step, as `flax.struct` dataclasses.

Token layout: column t of every `_BxT` array refers to token `tokens_BxT[:, t]`;
`behav_logp_BxT[:, t]` is log p(tokens[:, t] | tokens[:, :t]) under the behaviour
policy (0 where `loss_mask_BxT` is False). Prompts are left-padded to a common
width, completions follow, then right padding.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class PromptGroups:
    """Rows come in consecutive groups of `group_size` completions sharing their first
    `prompt_len` columns (the left-padded prompt), as the sampler writes them.
    `prompt_len=0` promises whole groups only (no shared columns)."""

    prompt_len: int
    group_size: int


@flax.struct.dataclass
class RolloutBatch:
    """What the sampler produced and the task scored, tagged with the policy version that
    produced it: the one record rollouts travel in (sampler -> stale queue -> checkpoint ->
    train step). On the host its fields are numpy arrays."""

    tokens_BxT: jax.Array  # int32
    valid_BxT: jax.Array  # bool: real tokens (prompt or completion), not padding
    behav_logp_BxT: jax.Array  # float32
    loss_mask_BxT: jax.Array  # bool: completion tokens that count in the loss
    prompt_len_B: jax.Array  # int32: real prompt tokens
    completion_len_B: jax.Array  # int32: generated tokens, stop token included
    stopped_B: jax.Array  # bool: the row ended with a stop token
    version_B: jax.Array  # int32: policy version (update count) that started the row
    group_id_B: jax.Array  # int32: rows with equal ids answer the same prompt
    rewards_B: jax.Array  # float32: the task's reward of each completion
    # int32: the version that generated each completion token (a rollout engine that takes
    # weights in flight mixes them within a row); version_B elsewhere
    version_BxT: jax.Array
    # int16 [B, T, L, K]: each generated token's experts per layer at rollout time, -1
    # where not recorded (routing replay, `actor.router_replay`); None when off
    routed_experts_BxTxLxK: jax.Array | None = None

    def arrays(self) -> dict:
        """The fields by name (how checkpoints store a rollout); optional ones only when
        present."""
        fields = (getattr(self, f.name) for f in dataclasses.fields(self))
        names = (f.name for f in dataclasses.fields(self))
        return {name: x for name, x in zip(names, fields, strict=True) if x is not None}

    @classmethod
    def from_arrays(cls, arrays, where: str = "rollout batch") -> RolloutBatch:
        """The record of `arrays` (a mapping with every field's name); `where` names the
        source in the error when fields are missing."""
        names = [f.name for f in dataclasses.fields(cls)]
        if "version_BxT" not in arrays and {"version_B", "tokens_BxT"} <= set(arrays):
            # Stored before per-token versions: every token has its row's version.
            arrays = dict(arrays)
            arrays["version_BxT"] = np.broadcast_to(
                np.asarray(arrays["version_B"])[:, None], np.shape(arrays["tokens_BxT"])
            ).copy()
        optional = {"routed_experts_BxTxLxK"}
        missing = [n for n in names if n not in arrays and n not in optional]
        if missing:
            raise ValueError(f"{where}: lacks {missing} (a rollout batch has {names})")
        return cls(**{n: arrays[n] for n in names if n in arrays})


@flax.struct.dataclass
class TrainBatch:
    """What one train step consumes: a rollout batch and its rewards (advantages come in the step)."""

    tokens_BxT: jax.Array
    valid_BxT: jax.Array
    behav_logp_BxT: jax.Array
    loss_mask_BxT: jax.Array
    rewards_B: jax.Array  # float32 raw task rewards, one per row
    version_B: jax.Array
    version_BxT: jax.Array  # int32: the version that generated each token (`RolloutBatch`)
    routed_experts_BxTxLxK: jax.Array | None = None  # int16: routing replay (`RolloutBatch`)


@flax.struct.dataclass
class Minibatch:
    """The rows one PPO update reads (stacked per minibatch, or one micro-batch of them).

    `prox_BxT` is None where the plan takes the proximal log-probs in the loss pass.
    """

    advantages_BxT: jax.Array  # float32
    behav_BxT: jax.Array  # float32 behaviour log-probs
    loss_mask_BxT: jax.Array  # bool: valid completion tokens
    mask_BxT: jax.Array  # bool: after the M2PO mask taken so far
    prox_BxT: jax.Array | None  # float32 proximal log-probs computed before the loss pass
    tokens_BxT: jax.Array
    valid_BxT: jax.Array
    version_B: jax.Array  # int32 policy version that generated each row
    version_BxT: jax.Array  # int32 policy version that generated each token
    routed_experts_BxTxLxK: jax.Array | None = None  # int16 recorded experts (replay)
