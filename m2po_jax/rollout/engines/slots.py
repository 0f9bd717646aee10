"""The continuous engine's device programs: its state and the phases of one batch.

Prefill (`_prefill`: every prompt once, as the static sampler prefills it), start
(`_empty_slots` then `_insert`: the first sequences into free slots), and run (`_run`: one
`lax.while_loop` of insert-when-a-slot-is-free, then `_decode`: one token for every live
slot). A slot holds one sequence: its KV-cache row [P + N (+ extra) columns], its position,
its stop state. Sequence j of unit u draws its token t with
`fold_in(fold_in(keys_U[u], seq_id_J[j]), t)` (`_sequence_keys`) whatever slot it runs in,
and writes it into row j of the output (`_write_tokens`); `_finish` lays the rows out as
`sampling.SampleOutput`. With `turns` (multi-turn episodes) a sequence's stop ends its turn:
the slot is held for the host (`turns.py`). Greedy decoding gives the static sampler's
completions. With `record_experts` (routing replay) a decode step records the experts of
the token it fed at that token's column (`sampling.fed_experts`).
"""

from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp

from m2po_jax.models import model as model_lib
from m2po_jax.rollout import sampling


@flax.struct.dataclass
class _Prefixes:
    """The queued prompts' prefill: keys / values of their P columns, validity, and the
    next-token logits at their last column (each sample's first token is drawn there)."""

    k: tuple[jax.Array, ...]  # per layer [Q, K, P, D]
    v: tuple[jax.Array, ...]
    valid_QxP: jax.Array
    logits_QxV: jax.Array
    prompt_len_Q: jax.Array
    version: jax.Array  # int32 scalar: the weights' version


@flax.struct.dataclass
class _Slots:
    """The decode slots and the output rows (J = prompts * n_samples sequences)."""

    cache: model_lib.KVCache  # [S, K, P + N, D] per layer
    job_S: jax.Array  # int32: sequence in each slot (J = none)
    step_S: jax.Array  # int32: completion tokens the slot's sequence has
    last_token_S: jax.Array
    prompt_len_S: jax.Array
    live_S: jax.Array  # bool: the slot's sequence is still generating
    held_S: jax.Array  # bool: the slot's episode ended a turn and waits for the host (turns)
    next_job_1: jax.Array  # int32 [1]: the next sequence to start (of this device's)
    unit_J: jax.Array  # int32: the unit (batch of a stream) of each sequence: its key
    seq_id_J: jax.Array  # int32: each sequence's id within its unit (the key's fold)
    tokens_JxN: jax.Array
    logp_JxN: jax.Array
    valid_JxN: jax.Array
    sampled_JxN: jax.Array  # bool: drawn by the policy (not appended by the host)
    version_JxN: jax.Array
    stopped_J: jax.Array
    done_J: jax.Array
    decode_steps_1: jax.Array  # int32 [1]: loop counters (one per device when sharded)
    live_steps_1: jax.Array
    experts_JxNxLxK: jax.Array | None = None  # int16: with `record_experts`, -1 = none


def _prefill(params, tokens_QxP, valid_QxP, version, *, model_config, sampling_config):
    """Each prompt once, as the static sampler prefills it (same cache width, same mask)."""
    tokens_QxP, valid_QxP = tokens_QxP.astype(jnp.int32), valid_QxP.astype(bool)
    prompts, width = tokens_QxP.shape
    cache = model_lib.init_cache(model_config, prompts, width + sampling_config.max_new_tokens)
    logits_Qx1xV, cache = model_lib.apply(
        params,
        model_config,
        tokens_QxP,
        model_lib.make_positions(valid_QxP),
        valid_QxP,
        cache,
        0,
        last_only=True,
    )
    return _Prefixes(
        k=tuple(k[:, :, :width] for k in cache.k),
        v=tuple(v[:, :, :width] for v in cache.v),
        valid_QxP=valid_QxP,
        logits_QxV=logits_Qx1xV[:, 0],
        prompt_len_Q=jnp.sum(valid_QxP, axis=-1, dtype=jnp.int32),
        version=version,
    )


def _sequence_keys(keys_U, state, job_L, step_L):
    """The key of a sequence's token t: fold_in(fold_in(its unit's key, its id), t)."""
    job_L = jnp.minimum(job_L, state.done_J.shape[0] - 1)  # dropped lanes: any valid row
    fold = jax.vmap(jax.random.fold_in)
    return fold(fold(keys_U[state.unit_J[job_L]], state.seq_id_J[job_L]), step_L)


def _empty_slots(prefixes, slots: int, unit_J, seq_id_J, model_config, sampling_config, extra=0):
    """Free slots; `extra` cache columns past the completion's (turns: room for a padded
    append near the end of an episode's budget)."""
    jobs = seq_id_J.shape[0]
    width = prefixes.valid_QxP.shape[1]
    new = sampling_config.max_new_tokens
    cache = model_lib.init_cache(model_config, slots, width + new + extra)
    # An empty slot sees one (zero) key column, so its unused attention row stays finite.
    cache = cache.replace(valid_BxS=cache.valid_BxS.at[:, 0].set(True))
    zeros_S = jnp.zeros(slots, jnp.int32)
    return _Slots(
        cache=cache,
        job_S=zeros_S + jobs,
        step_S=zeros_S,
        last_token_S=zeros_S + sampling_config.pad_id,
        prompt_len_S=zeros_S + 1,
        live_S=jnp.zeros(slots, bool),
        held_S=jnp.zeros(slots, bool),
        next_job_1=jnp.zeros(1, jnp.int32),
        unit_J=unit_J.astype(jnp.int32),
        seq_id_J=seq_id_J.astype(jnp.int32),
        tokens_JxN=jnp.full((jobs, new), sampling_config.pad_id, jnp.int32),
        logp_JxN=jnp.zeros((jobs, new), jnp.float32),
        valid_JxN=jnp.zeros((jobs, new), bool),
        sampled_JxN=jnp.zeros((jobs, new), bool),
        version_JxN=jnp.zeros((jobs, new), jnp.int32) + prefixes.version,
        stopped_J=jnp.zeros(jobs, bool),
        done_J=jnp.zeros(jobs, bool),
        decode_steps_1=jnp.zeros(1, jnp.int32),
        live_steps_1=jnp.zeros(1, jnp.int32),
        experts_JxNxLxK=sampling.no_experts(model_config, jobs, new)
        if sampling_config.record_experts
        else None,
    )


def _write_tokens(
    state: _Slots, job_L, step_L, token_L, logp_L, version, stop_L, ends_L, *, turns=False
):
    """Writes each lane's sampled token into its sequence's row (lanes with job J are
    dropped). With `turns` a sequence's end is its turn's: the host ends the episode."""
    at = (job_L, step_L)
    state = state.replace(
        tokens_JxN=state.tokens_JxN.at[at].set(token_L, mode="drop"),
        logp_JxN=state.logp_JxN.at[at].set(logp_L, mode="drop"),
        valid_JxN=state.valid_JxN.at[at].set(True, mode="drop"),
        sampled_JxN=state.sampled_JxN.at[at].set(True, mode="drop"),
        version_JxN=state.version_JxN.at[at].set(version, mode="drop"),
    )
    if turns:
        return state
    return state.replace(
        stopped_J=state.stopped_J.at[job_L].max(stop_L, mode="drop"),
        done_J=state.done_J.at[job_L].max(ends_L, mode="drop"),
    )


def _insert(
    state: _Slots, prefixes: _Prefixes, keys_U, lanes, n_samples, sampling_config, turns=False
):
    """Starts up to `lanes` queued sequences in free slots: copies their prompt's prefill
    into the slot's cache row (clearing the rest of the row) and draws their first token."""
    slots = state.job_S.shape[0]
    jobs = state.done_J.shape[0]
    width = prefixes.valid_QxP.shape[1]
    free_S = ~state.live_S & ~state.held_S
    (slot_L,) = jnp.nonzero(free_S, size=lanes, fill_value=slots)
    job_L = state.next_job_1[0] + jnp.arange(lanes, dtype=jnp.int32)
    use_L = (slot_L < slots) & (job_L < jobs)
    slot_L = jnp.where(use_L, slot_L, slots)  # out of range: the scatters drop the lane
    job_L = jnp.where(use_L, job_L, jobs)
    prompt_L = jnp.minimum(job_L // n_samples, prefixes.valid_QxP.shape[0] - 1)

    def put(cache_SxKxWxD, prefix_QxKxPxD):
        return cache_SxKxWxD.at[slot_L, :, :width].set(prefix_QxKxPxD[prompt_L], mode="drop")

    new = state.cache.valid_BxS.shape[1] - width
    row_valid_LxW = jnp.concatenate(
        [prefixes.valid_QxP[prompt_L], jnp.zeros((lanes, new), bool)], axis=1
    )
    cache = model_lib.KVCache(
        k=tuple(map(put, state.cache.k, prefixes.k)),
        v=tuple(map(put, state.cache.v, prefixes.v)),
        valid_BxS=state.cache.valid_BxS.at[slot_L].set(row_valid_LxW, mode="drop"),
    )
    zero_L = jnp.zeros(lanes, jnp.int32)
    token_L, logp_L = sampling.sample_token(
        prefixes.logits_QxV[prompt_L], _sequence_keys(keys_U, state, job_L, zero_L), sampling_config
    )
    stop_L = sampling.is_stop(token_L, sampling_config.stop_token_ids)
    ends_L = use_L & (stop_L | (sampling_config.max_new_tokens == 1))
    state = _write_tokens(
        state, job_L, zero_L, token_L, logp_L, prefixes.version, use_L & stop_L, ends_L, turns=turns
    )
    if turns:
        state = state.replace(held_S=state.held_S.at[slot_L].set(ends_L, mode="drop"))
    return state.replace(
        cache=cache,
        job_S=state.job_S.at[slot_L].set(job_L, mode="drop"),
        step_S=state.step_S.at[slot_L].set(1, mode="drop"),
        last_token_S=state.last_token_S.at[slot_L].set(token_L, mode="drop"),
        prompt_len_S=state.prompt_len_S.at[slot_L].set(
            prefixes.prompt_len_Q[prompt_L], mode="drop"
        ),
        live_S=state.live_S.at[slot_L].set(~ends_L, mode="drop"),
        next_job_1=state.next_job_1 + jnp.sum(use_L, dtype=jnp.int32),
    )


def _decode(
    state: _Slots, params, keys_U, version, *, model_config, sampling_config, width, turns=False
):
    """One token for every live slot, written into its sequence's row (`width`: the
    prompts' columns). With `turns` a slot whose turn ends is held for the host."""
    live_S = state.live_S
    total = state.cache.valid_BxS.shape[1]
    column_S = jnp.where(live_S, width + state.step_S - 1, total)

    # Attention reads the columns up to the furthest live slot's, bucketed: a long-tailed
    # batch's slots mostly hold short sequences, far from the cache's last column.
    needed = jnp.max(jnp.where(live_S, column_S + 1, 1))
    out = model_lib.apply(
        params,
        model_config,
        state.last_token_S[:, None],
        (state.prompt_len_S + state.step_S - 1)[:, None],
        live_S[:, None],
        state.cache,
        column_S,
        last_only=True,
        columns=model_lib.Columns(needed, sampling.decode_buckets(width, total)),
        return_routing=sampling_config.record_experts,
    )
    job_S = jnp.where(live_S, state.job_S, state.done_J.shape[0])
    if sampling_config.record_experts:  # the fed token's, at its column step - 1
        out, routing = out
        at = (job_S, state.step_S - 1)
        experts = state.experts_JxNxLxK.at[at].set(
            sampling.fed_experts(routing, live_S), mode="drop"
        )
        state = state.replace(experts_JxNxLxK=experts)
    logits_Sx1xV, cache = out
    token_S, logp_S = sampling.sample_token(
        logits_Sx1xV[:, 0], _sequence_keys(keys_U, state, job_S, state.step_S), sampling_config
    )
    stop_S = live_S & sampling.is_stop(token_S, sampling_config.stop_token_ids)
    ends_S = stop_S | (live_S & (state.step_S + 1 >= sampling_config.max_new_tokens))
    state = _write_tokens(
        state, job_S, state.step_S, token_S, logp_S, version, stop_S, ends_S, turns=turns
    )
    if turns:
        state = state.replace(held_S=state.held_S | ends_S)
    return state.replace(
        cache=cache,
        step_S=state.step_S + live_S,
        last_token_S=jnp.where(live_S, token_S, state.last_token_S),
        live_S=live_S & ~ends_S,
        decode_steps_1=state.decode_steps_1 + 1,
        live_steps_1=state.live_steps_1 + jnp.sum(live_S, dtype=jnp.int32),
    )


def _run(
    params,
    state,
    prefixes,
    keys_U,
    max_steps,
    *,
    model_config,
    sampling_config,
    lanes,
    n,
    turns=False,
):
    """Insert, then decode, until every sequence is done or `max_steps` decode steps ran
    (with `turns`: or until a slot's turn ended, for the host to take it)."""
    first = state.decode_steps_1[0]

    def cond(state):
        go = ~_finished(state) & (state.decode_steps_1[0] - first < max_steps)
        return go & ~jnp.any(state.held_S) if turns else go

    def body(state):
        # Most steps free no slot: skip the insert's gathers and scatters then.
        jobs = state.done_J.shape[0] // state.next_job_1.shape[0]
        refill = jnp.any(~state.live_S & ~state.held_S) & (state.next_job_1[0] < jobs)
        state = jax.lax.cond(
            refill,
            lambda s: _insert(s, prefixes, keys_U, lanes, n, sampling_config, turns),
            lambda s: s,
            state,
        )
        return _decode(
            state,
            params,
            keys_U,
            prefixes.version,
            model_config=model_config,
            sampling_config=sampling_config,
            width=prefixes.valid_QxP.shape[1],
            turns=turns,
        )

    return jax.lax.while_loop(cond, body, state)


def _finished(state: _Slots) -> jax.Array:
    """Every sequence started and ended (on every device, for a sharded state)."""
    jobs = state.done_J.shape[0] // state.next_job_1.shape[0]
    return ~jnp.any(state.live_S | state.held_S) & jnp.all(state.next_job_1 >= jobs)


def _finish(state: _Slots, tokens_QxP, valid_QxP, *, n_samples: int):
    """The `SampleOutput` of the finished sequences (rows in prompt order)."""
    repeat = functools.partial(jnp.repeat, repeats=n_samples, axis=0)
    tokens_BxP, valid_BxP = repeat(tokens_QxP.astype(jnp.int32)), repeat(valid_QxP.astype(bool))
    rows, width = tokens_BxP.shape
    completion_len_B = jnp.sum(state.valid_JxN, axis=-1, dtype=jnp.int32)
    out = sampling.SampleOutput(
        tokens_BxT=jnp.concatenate([tokens_BxP, state.tokens_JxN], axis=1),
        valid_BxT=jnp.concatenate([valid_BxP, state.valid_JxN], axis=1),
        behav_logp_BxT=jnp.concatenate(
            [jnp.zeros((rows, width), jnp.float32), state.logp_JxN], axis=1
        ),
        completion_mask_BxT=jnp.concatenate([jnp.zeros((rows, width), bool), state.sampled_JxN], 1),
        prompt_len_B=jnp.sum(valid_BxP, axis=-1, dtype=jnp.int32),
        completion_len_B=completion_len_B,
        stopped_B=state.stopped_J,
        num_steps=jnp.max(completion_len_B),
        experts_BxTxLxK=None
        if state.experts_JxNxLxK is None
        else jnp.concatenate(
            [
                jnp.full(
                    (rows, width) + state.experts_JxNxLxK.shape[2:], -1, sampling.EXPERTS_DTYPE
                ),
                state.experts_JxNxLxK,
            ],
            axis=1,
        ),
    )
    return out, state.version_JxN, (state.decode_steps_1, state.live_steps_1)
