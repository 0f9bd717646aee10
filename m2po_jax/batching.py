"""Static-shape splits of a batch's rows: micro-batch counts (AReaL's `mb_spec`) and the
strided row split that keeps every device's rows on that device."""

from __future__ import annotations

import math

import jax


def micro_batch_count(rows: int, seq_len: int, n_mbs: int = 1, max_tokens_per_mb: int = 0) -> int:
    """Micro-batches per PPO minibatch of `rows` rows of `seq_len` tokens (AReaL's mb_spec).

    At least `n_mbs`, and enough that none holds more than `max_tokens_per_mb` tokens
    (0 = no limit), rounded up to a divisor of `rows`: micro-batches have one static
    shape, so tokens are counted padded (rows x seq_len).
    """
    need = max(n_mbs, 1)
    if max_tokens_per_mb:
        if seq_len > max_tokens_per_mb:
            raise ValueError(
                f"actor.mb_spec.max_tokens_per_mb={max_tokens_per_mb} is below one row's "
                f"{seq_len} tokens (prompt + completion); raise it to at least {seq_len}"
            )
        need = max(need, math.ceil(rows * seq_len / max_tokens_per_mb))
    if need > rows:
        raise ValueError(
            f"actor.mb_spec: {need} micro-batches asked of a minibatch of only {rows} rows"
        )
    return next(n for n in range(need, rows + 1) if rows % n == 0)


def split_rows(x: jax.Array, n: int) -> jax.Array:
    """[R, ...] -> [n, R / n, ...] taking every n-th row into one part.

    Part i holds rows i, i + n, i + 2n, ...: a row-sharded array keeps each device's rows
    on that device in every part, so a scan over the parts needs no communication.
    """
    rows = x.shape[0]
    if rows % n:
        raise ValueError(f"rows: {rows} rows do not split into {n} equal parts")
    return x.reshape((rows // n, n) + x.shape[1:]).swapaxes(0, 1)


def merge_rows(x: jax.Array) -> jax.Array:
    """The inverse of `split_rows`: [n, R / n, ...] -> [R, ...]."""
    return x.swapaxes(0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])
