"""The array kernels behind `m2po_jax.algorithm.masking`: unchecked, static-shape, jit-friendly.

`masking.py` holds the public API and its input checks; everything here assumes
checked inputs. Keys are the float32 bit patterns of m2 (m2 >= 0, so integer order is
float order) with inactive tokens pushed past +inf; `kept` finds the boundary by one
sort (`_kept_by_sort`) or by bisection over the bit pattern (`_kept_by_bisect`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

_INF_BITS = 0x7F800000  # float32 +inf as int32
_INACTIVE = 0x7FFFFFFF  # larger than every non-negative float32 pattern: sorts after +inf
# Bisect passes view the values as [rows, 128] and reduce over rows first: on XLA:CPU
# that vectorises, 2-4x faster than one flat reduction.
_LANES = 128
_BISECT_STEPS = 31  # ceil(log2(_INF_BITS + 1)): the search interval is [-1, _INF_BITS]


# ----------------------------------------------------------------------------- per token


def log_ratio_pair(behav_logp, prox_logp, second_moment: str, logp):
    """(newer, older) log-probs whose difference is the log importance ratio of the variant."""
    if second_moment == "behav_prox":
        return prox_logp, behav_logp
    if second_moment == "current_behav":
        return logp, behav_logp
    return logp, prox_logp


def log_ratio(behav_logp, prox_logp, logp, second_moment: str) -> jax.Array:
    newer, older = log_ratio_pair(behav_logp, prox_logp, second_moment, logp)
    return lax.stop_gradient(newer.astype(jnp.float32) - older.astype(jnp.float32))


def second_moment(behav_logp, prox_logp, logp, variant: str) -> jax.Array:
    r = log_ratio(behav_logp, prox_logp, logp, variant)
    return r * r


def harmful(behav_logp, prox_logp, logp, advantages, variant: str) -> jax.Array:
    r = log_ratio(behav_logp, prox_logp, logp, variant)
    adv = lax.stop_gradient(advantages)
    return ((adv > 0) & (r > 0)) | ((adv < 0) & (r < 0))


# ----------------------------------------------------------------------------- the kept set


def sort_keys(m2: jax.Array, active: jax.Array) -> jax.Array:
    """int32 keys ordered like m2 (m2 >= 0, NaN read as +inf); inactive tokens sort last."""
    m2 = jnp.where(jnp.isnan(m2), jnp.inf, m2)
    return jnp.where(active, lax.bitcast_convert_type(m2, jnp.int32), _INACTIVE)


def _passes(mean: jax.Array, tau: jax.Array, stop_rule: str) -> jax.Array:
    return mean < tau if stop_rule == "lt" else mean <= tau


def _keep_first(key_N: jax.Array, v_key: jax.Array, num_keep: jax.Array) -> jax.Array:
    """Keys below v_key, then keys equal to v_key in flat order, num_keep tokens in all."""
    below = key_N < v_key
    tie = key_N == v_key
    ties_to_keep = num_keep - jnp.sum(below, dtype=jnp.int32)
    return below | (tie & (jnp.cumsum(tie, dtype=jnp.int32) <= ties_to_keep))


def _kept_by_sort(key_N: jax.Array, tau: jax.Array, stop_rule: str) -> jax.Array:
    """Longest ascending prefix whose running mean passes (at least one), via one sort."""
    size = key_N.shape[0]
    n = jnp.sum(key_N != _INACTIVE, dtype=jnp.int32)
    # A single int32 operand takes XLA's fast sort path (~7x a float32 total-order sort
    # on CPU); the permutation is never needed because the kept set is decided by
    # comparing each key with the boundary key.
    sorted_key = lax.sort(key_N)
    rank = jnp.arange(1, size + 1, dtype=jnp.int32)
    in_set = rank <= n
    sorted_m2 = jnp.where(in_set, lax.bitcast_convert_type(sorted_key, jnp.float32), 0.0)
    running_mean = jnp.cumsum(sorted_m2) / rank.astype(jnp.float32)
    ok = in_set & _passes(running_mean, tau, stop_rule)
    # max (not count) = AReaL's "first suffix from the top that passes", robust to rounding.
    num_keep = jnp.maximum(jnp.max(jnp.where(ok, rank, 0)), 1)
    v_key = sorted_key[num_keep - 1]
    split_ties = (num_keep < size) & (sorted_key[jnp.minimum(num_keep, size - 1)] == v_key)
    return lax.cond(
        split_ties,
        lambda: _keep_first(key_N, v_key, num_keep),
        lambda: key_N <= v_key,
    )


def _kept_by_bisect(key_N: jax.Array, tau: jax.Array, stop_rule: str) -> jax.Array:
    """Sort-free: bisect the boundary over float32 bit patterns using masked sums.

    For a probe x let h(x) = (sum of m2 < x  +  x) / (count of m2 < x  +  1), the mean
    of the smallest tokens extended by x. h is non-decreasing in x, and the boundary
    value v (largest kept m2) is the largest data value with h(v) passing. Bisection
    finds the largest probe b* that passes; every token with m2 <= b* is kept unless
    the copies of the last value must be split (rare: exact ties at a value >= tau).
    """
    size = key_N.shape[0]
    m2_N = lax.bitcast_convert_type(jnp.minimum(key_N, _INF_BITS), jnp.float32)  # inactive: +inf
    m2_RxL = jnp.pad(m2_N, (0, -size % _LANES), constant_values=jnp.inf).reshape(-1, _LANES)

    def below(probe):
        hit_RxL = m2_RxL < probe
        total = jnp.sum(jnp.sum(jnp.where(hit_RxL, m2_RxL, 0.0), axis=0))
        # float32 partial counts are exact up to 2^24 rows; the total is summed as int32.
        count = jnp.sum(jnp.sum(hit_RxL, axis=0, dtype=jnp.float32).astype(jnp.int32))
        return total, count

    def step(_, carry):
        lo, hi, total_hi, count_hi = carry  # probe lo passes (or lo == -1), probe hi fails
        mid = lo + (hi - lo) // 2
        probe = lax.bitcast_convert_type(mid, jnp.float32)
        total, count = below(probe)
        ok = _passes((total + probe) / (count + 1).astype(jnp.float32), tau, stop_rule)
        live = hi - lo > 1
        up, down = live & ok, live & ~ok
        return (
            jnp.where(up, mid, lo),
            jnp.where(down, mid, hi),
            jnp.where(down, total, total_hi),
            jnp.where(down, count, count_hi),
        )

    total_all, count_all = below(jnp.float32(jnp.inf))
    # Bounds derived from data so that, inside shard_map, the carry varies like the data.
    zero = jnp.zeros_like(count_all)
    init = (zero - 1, zero + _INF_BITS, total_all, count_all)
    b_star, _, total_le, count_le = lax.fori_loop(0, _BISECT_STEPS, step, init)
    keep_all_le = (count_le > 0) & _passes(total_le / count_le.astype(jnp.float32), tau, stop_rule)
    return lax.cond(
        keep_all_le,
        lambda: key_N <= b_star,
        lambda: _split_boundary_ties(key_N, b_star, tau, stop_rule),
    )


def _split_boundary_ties(
    key_N: jax.Array, b_star: jax.Array, tau: jax.Array, stop_rule: str
) -> jax.Array:
    """Slow path of bisect: keep j copies of the boundary value v, j found by bisection."""
    v_le = jnp.max(jnp.where(key_N <= b_star, key_N, -1))
    v_key = jnp.where(v_le >= 0, v_le, jnp.min(key_N))  # none passes: keep the smallest one
    v = lax.bitcast_convert_type(v_key, jnp.float32)
    below = key_N < v_key
    total_lt = jnp.sum(jnp.where(below, lax.bitcast_convert_type(key_N, jnp.float32), 0.0))
    count_lt = jnp.sum(below, dtype=jnp.int32)
    count_eq = jnp.sum(key_N == v_key, dtype=jnp.int32)

    def step(_, carry):
        lo, hi = carry  # lo copies pass (or lo == 1, the forced minimum), hi copies fail
        mid = lo + (hi - lo) // 2
        mean = (total_lt + mid.astype(jnp.float32) * v) / (count_lt + mid).astype(jnp.float32)
        ok = _passes(mean, tau, stop_rule)
        live = hi - lo > 1
        return jnp.where(live & ok, mid, lo), jnp.where(live & ~ok, mid, hi)

    num_ties, _ = lax.fori_loop(0, 32, step, (jnp.ones_like(count_eq), count_eq + 1))
    return _keep_first(key_N, v_key, count_lt + num_ties)


def kept(key: jax.Array, tau: jax.Array, method: str, stop_rule: str, scope: str) -> jax.Array:
    """Kept flags for `sort_keys` output: one set ("global") or one per leading index ("row")."""
    kept_fn = _kept_by_sort if method == "sort" else _kept_by_bisect
    if scope == "global":
        return kept_fn(key.reshape(-1), tau, stop_rule).reshape(key.shape)
    rows = jax.vmap(kept_fn, in_axes=(0, None, None))
    return rows(key.reshape(key.shape[0], -1), tau, stop_rule).reshape(key.shape)


# ----------------------------------------------------------------------------- sharding


def explicit_sharding(x: jax.Array) -> NamedSharding | None:
    """x's sharding when its type carries one (mesh axes of type Explicit), else None."""
    sharding = jax.typeof(x).sharding
    if not isinstance(sharding, NamedSharding) or all(a is None for a in sharding.spec):
        return None
    return sharding


def gathered(x: jax.Array | None) -> jax.Array | None:
    """x unsharded: the mask is one global ordering, and an explicitly sharded type would
    make sort and reshape refuse it. (Under Auto axes the partitioner does this itself.)
    The target names x's own mesh, so no `jax.set_mesh` context is needed."""
    sharding = None if x is None else explicit_sharding(x)
    if sharding is None:
        return x
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, PartitionSpec()))


# ----------------------------------------------------------------------------- clip bound


@jax.jit
def clip_bound(m2: jax.Array, loss_mask: jax.Array, budget: jax.Array) -> jax.Array:
    """`masking.m2po_clip_bound` on checked inputs: the capped-mean bound t, or +inf."""
    if loss_mask.size == 0:
        return jnp.float32(jnp.inf)
    m2, loss_mask = gathered(m2), gathered(loss_mask)
    key_N = sort_keys(lax.stop_gradient(m2.astype(jnp.float32)), loss_mask.astype(bool))
    key_N = key_N.reshape(-1)
    size = key_N.shape[0]
    n = jnp.sum(key_N != _INACTIVE, dtype=jnp.int32)
    rank = jnp.arange(size, dtype=jnp.int32)  # j: tokens strictly before breakpoint s_j
    in_set = rank < n
    sorted_m2 = jnp.where(in_set, lax.bitcast_convert_type(lax.sort(key_N), jnp.float32), 0.0)
    csum = jnp.cumsum(sorted_m2)
    prefix = jnp.concatenate([jnp.zeros(1, jnp.float32), csum[:-1]])  # no inf - inf
    n_f = jnp.maximum(n, 1).astype(jnp.float32)
    capped_mean = (prefix + (n - rank).astype(jnp.float32) * sorted_m2) / n_f
    # i = number of breakpoints s_j at which the capped mean still fits the budget.
    i = jnp.max(jnp.where(in_set & (capped_mean <= budget), rank + 1, 0))
    i_c = jnp.minimum(i, size - 1)
    s = (budget * n_f - prefix[i_c]) / jnp.maximum(n - i, 1).astype(jnp.float32)
    lower = jnp.where(i > 0, sorted_m2[jnp.maximum(i - 1, 0)], 0.0)
    s = jnp.clip(s, lower, sorted_m2[i_c])
    return jnp.where((n == 0) | (i >= n), jnp.inf, jnp.sqrt(jnp.maximum(s, 0.0)))
