"""Rollout batches with policy versions, and the stale-k queue.

Stale-k (docs/design.md): a FIFO of k generated batches. Each step generates one batch with
the current params and trains on the batch generated k steps earlier; the queue starts
filled with k batches from the initial params. Every row carries the policy version
that generated it, so staleness is measured, not assumed.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from concurrent import futures

import jax
import numpy as np

from m2po_jax.common.types import RolloutBatch, TrainBatch
from m2po_jax.models.model_config import ModelConfig
from m2po_jax.rollout import episodes as episodes_lib
from m2po_jax.rollout import rewards as rewards_lib
from m2po_jax.rollout import sampling
from m2po_jax.rollout.engines import RolloutEngine, StaticEngine

# Host-side rollouts are `RolloutBatch` records of numpy arrays; checkpoints store their
# fields by these names (and "routed_experts_BxTxLxK" under routing replay only).
ROLLOUT_KEYS = tuple(
    f.name for f in dataclasses.fields(RolloutBatch) if f.name != "routed_experts_BxTxLxK"
)


def encode_prompts(prompts: Sequence[str], tokenizer, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompt ids [B, width]; prompts longer than `width` keep their last tokens."""
    ids = []
    for text in prompts:
        tokens = list(tokenizer.encode(text))
        if not tokens:
            raise ValueError(f"prompt {text!r} encodes to no tokens")
        ids.append(tokens[-width:])
    return sampling.pad_prompts(ids, tokenizer.pad_id, width=width)


def completion_texts(tokens_BxT, loss_mask_BxT, tokenizer, stop_ids: Sequence[int]) -> list[str]:
    """Decoded completions (the `loss_mask_BxT` tokens) without the stop token."""
    texts = []
    for tokens_T, mask_T in zip(tokens_BxT, loss_mask_BxT, strict=True):
        ids = [int(t) for t in tokens_T[mask_T] if int(t) not in stop_ids]
        texts.append(tokenizer.decode(ids))
    return texts


def generate_rollout(
    params,
    model_config: ModelConfig,
    sampling_config: sampling.SamplingConfig,
    examples: Sequence,
    tokenizer,
    reward_fn: Callable,
    rng: jax.Array,
    *,
    n_samples: int,
    version: int,
    max_prompt_len: int,
    placement=None,
    reward_workers: int = 1,
    engine=None,
) -> tuple[RolloutBatch, list[str]]:
    """Samples `n_samples` completions per example and scores them on the host.

    With a `placement` (multi-device or multi-process), each process encodes only its
    share of the prompts; the generated rows are gathered so every process scores the
    whole batch and holds identical host rollouts. (`sample_rollout` then
    `score_rollout`: an async run scores one batch while it generates the next.)
    """
    sampled = sample_rollout(
        params,
        model_config,
        sampling_config,
        examples,
        tokenizer,
        rng,
        n_samples=n_samples,
        version=version,
        max_prompt_len=max_prompt_len,
        placement=placement,
        engine=engine,
    )
    return score_rollout(sampled, reward_fn, reward_workers), sampled.texts


@dataclasses.dataclass(frozen=True)
class SampledRollout:
    """A generated rollout before its rewards: the batch (rewards NaN), the decoded
    completions and the examples they answer (`n_samples` rows each)."""

    batch: RolloutBatch
    texts: list[str]
    examples: Sequence
    n_samples: int
    generation: object = None  # the engine's `Generation` (its decode counters)
    episodes: episodes_lib.EpisodeStats | None = None  # multi-turn rollouts' outcomes


def sample_rollout(
    params,
    model_config: ModelConfig,
    sampling_config: sampling.SamplingConfig,
    examples: Sequence,
    tokenizer,
    rng: jax.Array,
    *,
    n_samples: int,
    version: int,
    max_prompt_len: int,
    placement=None,
    engine: RolloutEngine | None = None,
    weights=None,
    agent: episodes_lib.Agent | None = None,
) -> SampledRollout:
    """The device half of `generate_rollout`: samples and decodes, scores nothing.

    `engine`: a `rollout.engines.RolloutEngine` (None: a `StaticEngine`, i.e.
    `sampling.generate`, of `model_config` and `sampling_config`); `weights`: newer weights
    it may take in flight (`RolloutEngine.generate`). `agent`: multi-turn
    episodes (`rollout.episodes`; the continuous or paged engine, this process's devices): the
    texts are the final assistant turns, the loss mask covers the sampled tokens only, and
    none of an episode out of the loss (`EpisodeStats.masked_B`).
    """
    if engine is None:
        engine = StaticEngine(model_config, sampling_config)
    if agent is not None:
        if placement is not None and jax.process_count() > 1 and placement.mesh is not None:
            if not all(d.process_index == jax.process_index() for d in placement.mesh.devices.flat):
                raise ValueError(
                    "agent: multi-turn rollouts run on each process's own devices "
                    "(rollout.mode='async' in a multi-process run)"
                )
        generation, texts, stats = episodes_lib.run_episodes(
            params,
            sampling_config,
            examples,
            tokenizer,
            rng,
            n_samples=n_samples,
            version=version,
            max_prompt_len=max_prompt_len,
            engine=engine,
            agent=agent,
            weights=weights,
        )
        sampled = _sampled_generation(
            generation, examples, tokenizer, sampling_config, n_samples, version
        )
        batch = episodes_lib.without_masked(sampled.batch, stats)
        return dataclasses.replace(sampled, batch=batch, texts=texts, episodes=stats)
    if placement is None:
        texts_in = [e.prompt for e in examples]
        prompts_BxP, valid_BxP = encode_prompts(texts_in, tokenizer, max_prompt_len)
    else:
        share = placement.local_rows(len(examples))
        local = encode_prompts([e.prompt for e in examples[share]], tokenizer, max_prompt_len)
        prompts_BxP, valid_BxP = placement.from_local(local, len(examples))
    generation = engine.generate(
        params, prompts_BxP, valid_BxP, rng, n_samples=n_samples, version=version, weights=weights
    )
    out = generation.out
    host = jax.device_get(out) if placement is None else placement.to_host(out)
    return _sampled(
        host,
        generation.version_BxN,
        examples,
        tokenizer,
        sampling_config,
        n_samples,
        version,
        generation,
    )


def stream_rollouts(
    params,
    sampling_config: sampling.SamplingConfig,
    batches: Sequence[Sequence],
    tokenizer,
    rngs: Sequence[jax.Array],
    *,
    n_samples: int,
    version: int,
    max_prompt_len: int,
    engine,
    weights=None,
):
    """`sample_rollout` of several batches of examples through one streaming engine call
    (`ContinuousEngine.stream`): yields each batch's `SampledRollout`, in order, as soon as
    its sequences end. Batch i is keyed by `rngs[i]`."""
    units = []
    for examples, rng in zip(batches, rngs, strict=True):
        tokens, valid = encode_prompts([e.prompt for e in examples], tokenizer, max_prompt_len)
        units.append((tokens, valid, rng))
    made = engine.stream(params, units, n_samples=n_samples, version=version, weights=weights)
    for examples, generation in zip(batches, made, strict=True):
        yield _sampled_generation(
            generation, examples, tokenizer, sampling_config, n_samples, version
        )


def _sampled_generation(generation, examples, tokenizer, sampling_config, n_samples, version):
    """The `SampledRollout` of an engine's host `Generation`."""
    return _sampled(
        generation.out,
        generation.version_BxN,
        examples,
        tokenizer,
        sampling_config,
        n_samples,
        version,
        generation,
    )


def _sampled(
    host, version_BxN, examples, tokenizer, sampling_config, n_samples, version, generation
) -> SampledRollout:
    """The `SampledRollout` of host sampler output (rewards NaN)."""
    rows = len(examples) * n_samples
    width = host.tokens_BxT.shape[1] - sampling_config.max_new_tokens
    tokens, loss_mask = (
        np.asarray(host.tokens_BxT, np.int32),
        np.asarray(host.completion_mask_BxT, bool),
    )
    texts = completion_texts(tokens, loss_mask, tokenizer, sampling_config.stop_token_ids)
    batch = RolloutBatch(
        tokens_BxT=tokens,
        valid_BxT=np.asarray(host.valid_BxT, bool),
        behav_logp_BxT=np.asarray(host.behav_logp_BxT, np.float32),
        loss_mask_BxT=loss_mask,
        prompt_len_B=np.asarray(host.prompt_len_B, np.int32),
        completion_len_B=np.asarray(host.completion_len_B, np.int32),
        stopped_B=np.asarray(host.stopped_B, bool),
        version_B=np.full((rows,), version, np.int32),
        group_id_B=np.repeat(np.arange(len(examples), dtype=np.int32), n_samples),
        rewards_B=np.full((rows,), np.nan, np.float32),
        version_BxT=np.concatenate(
            [np.full((rows, width), version, np.int32), np.asarray(version_BxN, np.int32)], 1
        ),
        routed_experts_BxTxLxK=None
        if host.experts_BxTxLxK is None
        else np.asarray(host.experts_BxTxLxK, np.int16),
    )
    return SampledRollout(batch, texts, examples, n_samples, generation)


def score_rollout(sampled: SampledRollout, reward_fn: Callable, workers: int = 1) -> RolloutBatch:
    """The host half of `generate_rollout`: the batch with the reward of every completion.

    `reward_fn` is a `rewards.RewardScorer` (its workers and timeout apply) or a function
    `(example, text) -> float`; then `workers` > 1 scores that many completions at once on
    threads (for rewards that wait on I/O: sandboxes, remote verifiers). The rewards are
    the same and in the same order either way."""
    n = sampled.n_samples
    examples = [sampled.examples[i // n] for i in range(len(sampled.texts))]
    if isinstance(reward_fn, rewards_lib.RewardScorer):
        rewards = reward_fn(examples, sampled.texts)
    else:
        one = lambda i: float(reward_fn(examples[i], sampled.texts[i]))
        rows = range(len(sampled.texts))
        if workers > 1:
            with futures.ThreadPoolExecutor(workers, thread_name_prefix="m2po-reward") as pool:
                rewards = list(pool.map(one, rows))
        else:
            rewards = [one(i) for i in rows]
    batch = sampled.batch.replace(rewards_B=np.asarray(rewards, np.float32))
    if sampled.episodes is not None:  # the environments' own rewards win
        batch = episodes_lib.with_env_rewards(batch, sampled.episodes)
    return batch


def train_batch(host: RolloutBatch) -> TrainBatch:
    """The fields of a host rollout batch that a train step reads (still on the host).

    Raises ValueError if a completion token's behaviour log-prob is not finite.
    """
    behav = host.behav_logp_BxT
    bad = ~np.isfinite(behav) & host.loss_mask_BxT
    if bad.any():
        raise ValueError(
            f"behaviour log-probs: {int(bad.sum())} non-finite values on completion tokens "
            f"(batch of policy version {int(host.version_B[0])})"
        )
    return TrainBatch(
        tokens_BxT=host.tokens_BxT,
        valid_BxT=host.valid_BxT,
        behav_logp_BxT=behav,
        loss_mask_BxT=host.loss_mask_BxT,
        rewards_B=host.rewards_B,
        version_B=host.version_B,
        version_BxT=host.version_BxT,
        routed_experts_BxTxLxK=host.routed_experts_BxTxLxK,
    )


class StaleQueue:
    """FIFO of host rollout batches: push the newest, pop the one made k steps ago."""

    def __init__(self, staleness: int, batches: Sequence[RolloutBatch] = ()):
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.staleness = staleness
        self._batches = collections.deque()
        for batch in batches:
            self.push(batch)

    def __len__(self) -> int:
        return len(self._batches)

    def push(self, batch: RolloutBatch) -> None:
        if not isinstance(batch, RolloutBatch):
            raise TypeError(
                f"the stale queue holds RolloutBatch records, got {type(batch).__name__}"
            )
        self._batches.append(batch)

    def pop(self) -> RolloutBatch:
        """The oldest batch; after a push the queue holds k + 1 and this returns the stale one."""
        if len(self._batches) <= self.staleness:
            raise RuntimeError(
                f"queue holds {len(self._batches)} batches; popping needs more than k="
                f"{self.staleness} (push the current batch first)"
            )
        return self._batches.popleft()

    def state(self) -> list[RolloutBatch]:
        """The batches, oldest first (what a checkpoint stores)."""
        return list(self._batches)
