"""Multi-turn appends: what the continuous engine runs when a turn ends (`episodes`), and
the host's side of turns that every engine shares (`Turn`, `TurnQueue`, `held_turns`).

A slot whose turn ends (a stop token, or the completion budget) is held; the host answers
each held `Turn` with tokens to append or None. `_append` writes the appended tokens into
the sequence's row (valid, not sampled, version -1), runs them through the model into the
slot's own cache row from its own column (`_prefill_rows`: the history is never
recomputed), and draws the next turn's first token with the sequence's key for that
index (`fold_in(fold_in(unit key, sequence id), t)`, as every engine token). `_release`
ends the episodes answered None. Host lanes are padded to powers of two (`_lanes`,
`_bucket`) so few shapes compile.

The host answers turns through `on_turns`: a plain callable `on_turns(turns) -> answers`
(one per turn, in order: the engine waits for all of them), or a `TurnQueue`, whose
`submit(turns)` starts the answers and returns at once and whose `poll(timeout_s)` gives
those ready: the paged engine (`PagedEngine.episodes`) decodes the other sequences while
an answer is pending. `turn_queue` makes a `TurnQueue` of either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from m2po_jax.models import model as model_lib
from m2po_jax.rollout import sampling
from m2po_jax.rollout.engines.slots import _sequence_keys, _Slots, _write_tokens


@dataclasses.dataclass(frozen=True)
class Turn:
    """A turn that ended in a held slot (`ContinuousEngine.episodes`).

    Attributes:
      row: the sequence's output row (prompt b's samples are rows b * n .. b * n + n - 1).
      tokens: the turn's tokens, its stop token included when it has one.
      cut: the turn ended at the completion budget, not at a stop token.
      room: the most tokens an append may add (the budget left for them and one drawn
        token, within `max_append`); 0 = none fit.
    """

    row: int
    tokens: list[int]
    cut: bool
    room: int
    start: int = 0  # the turn's first token's index in the row's completion


Answer = list[int] | None  # token ids to append, or None: the episode ends


@runtime_checkable
class TurnQueue(Protocol):
    """The host's answers to held turns, without blocking the engine.

    `submit(turns)` starts answering them and returns at once; `poll(timeout_s)` returns
    the (turn, answer) pairs ready so far, each once: with `timeout_s` 0 it never waits,
    otherwise it waits up to `timeout_s` seconds (None: without bound) for at least one.
    """

    def submit(self, turns: Sequence[Turn]) -> None: ...

    def poll(self, timeout_s: float | None) -> list[tuple[Turn, Answer]]: ...


class _Answered:
    """A plain `on_turns(turns) -> answers` as a `TurnQueue`: answered at `submit`."""

    def __init__(self, on_turns: Callable[[list[Turn]], Sequence[Answer]]):
        self.on_turns, self.ready = on_turns, []

    def submit(self, turns):
        answers = list(self.on_turns(list(turns)))
        if len(answers) != len(turns):
            raise ValueError(f"on_turns: expected {len(turns)} answers, got {len(answers)}")
        self.ready += zip(turns, answers, strict=True)

    def poll(self, timeout_s):
        ready, self.ready = self.ready, []
        return ready


def turn_queue(on_turns) -> TurnQueue:
    """`on_turns` as a `TurnQueue` (a plain callable answers every turn at `submit`)."""
    return on_turns if isinstance(on_turns, TurnQueue) else _Answered(on_turns)


def held_turns(tokens_JxN, job_H, step_H, turn_start, stop_ids, new: int, extra: int):
    """The `Turn`s of held sequences `job_H` with `step_H` tokens each (host arrays):
    each turn's tokens from `turn_start[job]`; `room` from the budget `new` and the
    largest append `extra`."""
    turns = []
    for row, step in zip(job_H, step_H, strict=True):
        row, step = int(row), int(step)
        start = int(turn_start[row])
        turns.append(
            Turn(
                row=row,
                tokens=tokens_JxN[row, start:step].tolist(),
                cut=int(tokens_JxN[row, step - 1]) not in stop_ids,
                room=max(0, min(new - step - 1, extra)),
                start=start,
            )
        )
    return turns


def check_answer(turn: Turn, delta: Answer) -> None:
    """ValueError unless `delta` is None or 1..`turn.room` tokens."""
    if delta is not None and not 1 <= len(delta) <= turn.room:
        raise ValueError(
            f"on_turns: row {turn.row} appends {len(delta)} tokens; its room is 1..{turn.room}"
        )


def _lanes(slots: list[int], count: int) -> np.ndarray:
    """Slot indices padded with `count` (unused) to a power of two (few compiled shapes)."""
    size = min(1 << max(len(slots) - 1, 0).bit_length(), count)
    lanes = np.full(max(size, len(slots)), count, np.int32)
    lanes[: len(slots)] = slots
    return lanes


def _bucket(n: int, cap: int) -> int:
    """The append width for `n` tokens: a power of two from 8, at most `cap`."""
    return min(max(8, 1 << (n - 1).bit_length()), cap)


def _append(
    params,
    state: _Slots,
    keys_U,
    slot_L,
    delta_LxM,
    len_L,
    version,
    *,
    model_config,
    sampling_config,
    extra: int,
):
    """Appends host tokens to held slots' sequences and resumes them (multi-turn).

    Lane l (slot `slot_L[l]`, out of range = unused) takes `delta_LxM[l, :len_L[l]]`
    (a tool's answer and the next turn's header, rendered by the host): they are written
    into its sequence's row as appended tokens (not sampled, version -1), run through the
    model with the turn's pending last token into the slot's cache row (one prefill of
    len + 1 tokens at the row's own column: the history is never recomputed), and the
    next turn's first token is drawn from the last one's logits. The host guarantees
    that step + len < max_new_tokens and len <= M <= `extra` (the cache's columns past
    the completion's).
    """
    slots = state.job_S.shape[0]
    jobs, new = state.tokens_JxN.shape
    lanes, m = delta_LxM.shape
    width = state.cache.valid_BxS.shape[1] - new - extra
    use_L = slot_L < slots
    s_L = jnp.minimum(slot_L, slots - 1)
    job_L = jnp.where(use_L, state.job_S[s_L], jobs)
    step_L = state.step_S[s_L]  # the sequence's tokens; its last is not in the cache yet
    state = _write_appended(state, job_L, step_L, use_L, delta_LxM, len_L)
    tokens_LxT = jnp.concatenate([state.last_token_S[s_L][:, None], delta_LxM], axis=1)
    t_T = jnp.arange(m + 1, dtype=jnp.int32)
    positions_LxT = (state.prompt_len_S[s_L] + step_L - 1)[:, None] + t_T[None]
    hidden_LxTxE, cache, experts_LxTxLxK = _prefill_rows(
        params,
        state.cache,
        slot_L,
        s_L,
        tokens_LxT,
        positions_LxT,
        t_T[None] <= len_L[:, None],
        width + step_L - 1,
        model_config,
        record=sampling_config.record_experts,
    )
    if sampling_config.record_experts:  # the pending token's (column step - 1); appended: -1
        at = (job_L, step_L - 1)
        fed_LxLxK = experts_LxTxLxK[:, 0].astype(sampling.EXPERTS_DTYPE)
        state = state.replace(
            experts_JxNxLxK=state.experts_JxNxLxK.at[at].set(fed_LxLxK, mode="drop")
        )
    last_LxE = hidden_LxTxE[jnp.arange(lanes), len_L]
    logits_LxV = model_lib.dense(last_LxE, model_lib.head_weight(params, model_config))
    step_L = step_L + len_L  # the drawn token's index
    token_L, logp_L = sampling.sample_token(
        logits_LxV.astype(jnp.float32),
        _sequence_keys(keys_U, state, job_L, step_L),
        sampling_config,
    )
    stop_L = sampling.is_stop(token_L, sampling_config.stop_token_ids)
    ends_L = stop_L | (step_L + 1 >= new)
    state = _write_tokens(
        state, job_L, step_L, token_L, logp_L, version, stop_L, ends_L, turns=True
    )
    return state.replace(
        cache=cache,
        step_S=state.step_S.at[slot_L].set(step_L + 1, mode="drop"),
        last_token_S=state.last_token_S.at[slot_L].set(token_L, mode="drop"),
        live_S=state.live_S.at[slot_L].set(~ends_L, mode="drop"),
        held_S=state.held_S.at[slot_L].set(ends_L, mode="drop"),
    )


def _write_appended(state: _Slots, job_L, step_L, use_L, delta_LxM, len_L) -> _Slots:
    """Writes each lane's appended tokens into its sequence's row from column `step_L`:
    valid, not sampled (no loss), version -1 (padding lanes and columns dropped)."""
    jobs = state.tokens_JxN.shape[0]
    t_M = jnp.arange(delta_LxM.shape[1], dtype=jnp.int32)
    at = (job_L[:, None], step_L[:, None] + t_M[None])
    real_LxM = use_L[:, None] & (t_M[None] < len_L[:, None])
    drop = jnp.where(real_LxM, at[0], jobs)  # padding lanes and columns are dropped
    return state.replace(
        tokens_JxN=state.tokens_JxN.at[drop, at[1]].set(delta_LxM, mode="drop"),
        valid_JxN=state.valid_JxN.at[drop, at[1]].set(True, mode="drop"),
        version_JxN=state.version_JxN.at[drop, at[1]].set(-1, mode="drop"),
    )


def _prefill_rows(
    params,
    cache,
    slot_L,
    s_L,
    tokens_LxT,
    positions_LxT,
    valid_LxT,
    column_L,
    model_config,
    record: bool = False,
):
    """Runs each lane's tokens through the model into its slot's own cache row, from the
    row's column `column_L` (a batch-1 forward per lane, vmapped: the rows write at
    different columns; for a mixture of experts a `lax.map` over the lanes instead, since
    its grouped matmul, `jax.lax.ragged_dot`, has no batching rule for per-lane groups).
    Returns the lanes' hidden states [L, T, E], the updated cache (lanes with slot
    `slot_L` out of range leave it as it was) and, with `record`, the experts the tokens
    ran [L, T, layers, K] (else None)."""

    def one(k_rows, v_rows, valid_row, tokens_T, positions_T, valid_T, column):
        row = model_lib.KVCache(
            k=tuple(k[None] for k in k_rows),
            v=tuple(v[None] for v in v_rows),
            valid_BxS=valid_row[None],
        )
        out = model_lib.apply(
            params,
            model_config,
            tokens_T[None],
            positions_T[None],
            valid_T[None],
            row,
            column,
            hidden_only=True,
            return_routing=record,
        )
        experts_TxLxK = None
        if record:
            out, (_, experts_1xTxLxK) = out
            experts_TxLxK = experts_1xTxLxK[0]
        hidden_1xTxE, row = out
        return (
            hidden_1xTxE[0],
            tuple(k[0] for k in row.k),
            tuple(v[0] for v in row.v),
            row.valid_BxS[0],
            experts_TxLxK,
        )

    rows = lambda x: x[s_L]
    lanes = (
        tuple(map(rows, cache.k)),
        tuple(map(rows, cache.v)),
        rows(cache.valid_BxS),
        tokens_LxT,
        positions_LxT,
        valid_LxT,
        column_L,
    )
    if model_config.is_moe:
        out = jax.lax.map(lambda lane: one(*lane), lanes)
    else:
        out = jax.vmap(one)(*lanes)
    hidden_LxTxE, k_rows, v_rows, valid_rows, experts_LxTxLxK = out
    put = lambda cache_SxKxWxD, rows_L: cache_SxKxWxD.at[slot_L].set(rows_L, mode="drop")
    new_cache = model_lib.KVCache(
        k=tuple(map(put, cache.k, k_rows)),
        v=tuple(map(put, cache.v, v_rows)),
        valid_BxS=put(cache.valid_BxS, valid_rows),
    )
    return hidden_LxTxE, new_cache, experts_LxTxLxK


def _release(state: _Slots, slot_L, stopped_L):
    """Ends the episodes in held slots `slot_L` (out of range = unused): their sequences
    are done (`stopped_L`: ended as the episode should, not cut by a budget) and their
    slots free for the next queued sequence."""
    slots = state.job_S.shape[0]
    jobs = state.done_J.shape[0]
    use_L = slot_L < slots
    job_L = jnp.where(use_L, state.job_S[jnp.minimum(slot_L, slots - 1)], jobs)
    return state.replace(
        held_S=state.held_S.at[slot_L].set(False, mode="drop"),
        job_S=state.job_S.at[slot_L].set(jobs, mode="drop"),
        stopped_J=state.stopped_J.at[job_L].set(stopped_L, mode="drop"),
        done_J=state.done_J.at[job_L].set(True, mode="drop"),
    )
