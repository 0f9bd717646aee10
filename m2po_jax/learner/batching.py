"""Static-shape splits of a batch's rows: micro-batch counts (AReaL's `mb_spec`) and the
strided row split that keeps every device's rows on that device."""

from __future__ import annotations

import math

import jax
import numpy as np


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


def split_rows(x: jax.Array, n: int, block: int = 1) -> jax.Array:
    """[R, ...] -> [n, R / n, ...] taking every n-th block of `block` rows into one part.

    Part i holds blocks i, i + n, i + 2n, ... (rows i, i + n, ... when `block` is 1): a
    row-sharded array keeps each device's rows on that device in every part, so a scan
    over the parts needs no communication. `block` keeps groups of consecutive rows (the
    samples of one prompt) together.
    """
    rows = x.shape[0]
    if rows % (n * block):
        raise ValueError(
            f"rows: {rows} rows do not split into {n} equal parts of whole {block}-row blocks"
        )
    parts = x.reshape((rows // (n * block), n, block) + x.shape[1:]).swapaxes(0, 1)
    return parts.reshape((n, rows // n) + x.shape[1:])


def merge_rows(x: jax.Array, block: int = 1) -> jax.Array:
    """The inverse of `split_rows`: [n, R / n, ...] -> [R, ...]."""
    n, part = x.shape[:2]
    blocks = x.reshape((n, part // block, block) + x.shape[2:]).swapaxes(0, 1)
    return blocks.reshape((n * part,) + x.shape[2:])


MIN_COMPLETION_WIDTH = 16


def completion_width(longest: int, max_new_tokens: int) -> int:
    """The completion columns a train step runs over: a bucket >= `longest`, <= the buffer.

    Buckets are 16, 24, 32, 48, 64, 96, ... (powers of two and 1.5x powers of two), then
    `max_new_tokens` itself: at most two compiled shapes per doubling of the length, and
    at most a third of the columns are padding (beyond the longest completion).
    """
    if not 0 <= longest <= max_new_tokens:
        raise ValueError(f"longest={longest} must be in [0, max_new_tokens={max_new_tokens}]")
    width = MIN_COMPLETION_WIDTH
    while width < longest:
        width = width * 3 // 2 if width & (width - 1) == 0 else width * 4 // 3
    return min(width, max_new_tokens)


def longest_completion(valid_BxT, prompt_len: int) -> int:
    """Columns after `prompt_len` up to the last one holding a real token in any row."""
    used = np.asarray(valid_BxT)[:, prompt_len:].any(axis=0)
    return int(used.nonzero()[0].max()) + 1 if used.any() else 0


def trim_completions(
    arrays: dict, prompt_len: int, max_new_tokens: int, longest: int | None = None
) -> tuple[dict, int]:
    """Cuts every [B, prompt_len + max_new_tokens, ...] array of `arrays` to the bucket of the
    longest completion (`completion_width`); other arrays pass through.

    `arrays["valid_BxT"]` marks real tokens; completion columns past the bucket must hold
    none. `longest`: the longest completion when the rows are one process's share of a
    batch (every process must cut to the same width); default: these rows' own.
    Returns (trimmed arrays, completion width).
    """
    valid = arrays["valid_BxT"]
    total = prompt_len + max_new_tokens
    if valid.shape[1] != total:
        raise ValueError(
            f"valid_BxT has {valid.shape[1]} columns; expected prompt_len + max_new_tokens = "
            f"{prompt_len} + {max_new_tokens}"
        )
    if longest is None:
        longest = longest_completion(valid, prompt_len)
    width = completion_width(longest, max_new_tokens)
    end = prompt_len + width
    trimmed = {
        name: x[:, :end] if getattr(x, "ndim", 0) >= 2 and x.shape[1] == total else x
        for name, x in arrays.items()
    }
    return trimmed, width


def check_prompt_groups(tokens_BxT, valid_BxT, prompt_len: int, group_size: int) -> None:
    """Raises ValueError unless rows come in groups of `group_size` consecutive rows with
    the same first `prompt_len` columns (tokens and validity), as the sampler writes them:
    the promise the train step's shared-prompt forward pass relies on."""
    tokens, valid = np.asarray(tokens_BxT), np.asarray(valid_BxT)
    rows = tokens.shape[0]
    if group_size < 1 or rows % group_size:
        raise ValueError(f"{rows} rows do not form whole groups of group_size={group_size}")
    for name, x in (("tokens", tokens), ("valid", valid)):
        groups = x[:, :prompt_len].reshape(rows // group_size, group_size, prompt_len)
        differ = (groups != groups[:, :1]).any(axis=(1, 2))
        if differ.any():
            g = int(differ.nonzero()[0][0])
            raise ValueError(
                f"rows {g * group_size}..{(g + 1) * group_size - 1} should share one prompt "
                f"(group_size={group_size}) but their first {prompt_len} {name} columns differ"
            )
