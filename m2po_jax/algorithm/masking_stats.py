"""The M2PO statistics schema, as additive parts that combine exactly across blocks.

One schema on every path (M2PO on at any scope, M2PO off, the capped-clip rule):

| key | meaning |
|---|---|
| `m2po/masked_tokens` | int32: valid tokens the mask turned off (summed over blocks) |
| `m2po/masked_fraction` | masked tokens / valid tokens |
| `m2po/m2_before` | mean m2 over valid tokens whose m2 is finite |
| `m2po/m2_after` | mean m2 over kept tokens whose m2 is finite |
| `m2po/boundary` | largest finite m2 among kept participating tokens (0 if none; with M2PO off, the largest finite m2 of the participating tokens); the max over blocks |
| `m2po/nonfinite_tokens` | int32: valid tokens with non-finite m2 (masked first, left out of the means) |

A mask computed on blocks (rows, shards, minibatches, micro-batches) reports the parts of
each block (`M2PO_PART_KEYS`: counts, sums of m2 and their counts, the boundary);
`combine_stat_parts` (stacked blocks) and `psum_stat_parts` (mesh axes, inside
`shard_map`) add counts and sums and take the max of the boundary, and `finalize_stats`
divides. So combining then finalizing equals finalizing the union of the blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The reported statistics (scalars), the same on every path of the train step.
M2PO_STAT_KEYS = (
    "m2po/masked_tokens",  # int32: valid tokens turned off
    "m2po/masked_fraction",  # masked / valid
    "m2po/m2_before",  # mean m2 over valid tokens with finite m2
    "m2po/m2_after",  # mean m2 over kept tokens with finite m2
    "m2po/boundary",  # largest finite m2 among kept participating tokens (0 if none)
    "m2po/nonfinite_tokens",  # int32: valid tokens with non-finite m2
)
_BOUNDARY = "m2po_parts/boundary"
# Their additive parts: every entry is summed across blocks except the boundary (max).
M2PO_PART_KEYS = (
    "m2po_parts/valid_tokens",
    "m2po_parts/masked_tokens",
    "m2po_parts/nonfinite_tokens",
    "m2po_parts/m2_before_sum",
    "m2po_parts/m2_before_count",
    "m2po_parts/m2_after_sum",
    "m2po_parts/m2_after_count",
    _BOUNDARY,
)


def stat_parts(m2: jax.Array, valid: jax.Array, active: jax.Array, mask: jax.Array) -> dict:
    """Parts of one block: m2 per token, valid / participating (active) / kept flags."""
    finite = jnp.isfinite(m2)
    before, after = valid & finite, mask & finite

    def count(where):
        return jnp.sum(where, dtype=jnp.int32)

    def total(where):
        return jnp.sum(jnp.where(where, m2, 0.0))

    values = (
        count(valid),
        count(valid & ~mask),
        count(valid & ~finite),
        total(before),
        count(before),
        total(after),
        count(after),
        jnp.max(jnp.where(mask & active & finite, m2, 0.0), initial=0.0),
    )
    return dict(zip(M2PO_PART_KEYS, values, strict=True))


def combine_stat_parts(parts: dict[str, jax.Array], axis: int = 0) -> dict[str, jax.Array]:
    """Parts of several blocks stacked on ``axis`` -> the parts of their union (exact).

    Counts and sums add up; the boundary is the maximum.
    """
    return {k: (jnp.max if k == _BOUNDARY else jnp.sum)(v, axis=axis) for k, v in parts.items()}


def psum_stat_parts(parts: dict[str, jax.Array], axis_name) -> dict[str, jax.Array]:
    """``combine_stat_parts`` across the devices of mesh axes ``axis_name`` (in shard_map)."""
    return {
        k: (jax.lax.pmax if k == _BOUNDARY else jax.lax.psum)(v, axis_name)
        for k, v in parts.items()
    }


def finalize_stats(parts: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Additive parts -> the reported ``M2PO_STAT_KEYS``.

    masked_fraction = masked / max(valid, 1)
    m2_before = (sum of finite m2 over valid) / max(their count, 1)
    m2_after  = (sum of finite m2 over kept)  / max(their count, 1)
    """
    (valid, masked, nonfinite, before, n_before, after, n_after, boundary) = (
        parts[k] for k in M2PO_PART_KEYS
    )

    def ratio(x, n):
        return x.astype(jnp.float32) / jnp.maximum(n, 1).astype(jnp.float32)

    values = (masked, ratio(masked, valid), ratio(before, n_before), ratio(after, n_after))
    return dict(zip(M2PO_STAT_KEYS, (*values, boundary, nonfinite), strict=True))
