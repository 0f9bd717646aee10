"""M2PO token masking: drop the few tokens whose second moment pushes a batch over a threshold.

The default reproduces AReaL's ``actor.m2_threshold`` (see ``docs/algorithm.md``):

    m2_t = (behav_logp_t - prox_logp_t)^2                 (float32)
    keep the largest set of smallest-m2 valid tokens whose mean m2 is < m2_threshold,
    and always keep at least one; invalid tokens stay invalid.

Two exact methods compute it with static shapes, no boolean indexing and no host
round trip: ``"sort"`` (one sort of int32 keys, an ascending cumulative sum) and
``"bisect"`` (sort-free: bisection over the float32 bit pattern of the boundary
value with masked sums). They return the same mask; among tokens tied at the
boundary value the ones with the lowest flat index are kept (AReaL's choice is
arbitrary there, only the count is determined).

Non-finite m2 (a NaN or inf log-prob on a valid token) counts as +inf: larger than
every finite value, so such tokens are masked first.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec
from jax.typing import ArrayLike

METHODS = ("sort", "bisect")
SECOND_MOMENTS = ("behav_prox", "current_behav", "prox_current")
STOP_RULES = ("lt", "le")
CANDIDATES = ("all", "harmful")
SCOPES = ("global", "row")

_INF_BITS = 0x7F800000  # float32 +inf as int32
_INACTIVE = 0x7FFFFFFF  # larger than every non-negative float32 pattern: sorts after +inf
# Bisect passes view the values as [rows, 128] and reduce over rows first: on XLA:CPU
# that vectorises, 2-4x faster than one flat reduction.
_LANES = 128
_BISECT_STEPS = 31  # ceil(log2(_INF_BITS + 1)): the search interval is [-1, _INF_BITS]


# ----------------------------------------------------------------------------- checks


def _check_choice(name: str, value: object, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not one of {list(valid)}")


def _as_float_array(name: str, x: ArrayLike, what: str = "log-probs") -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array of {what}, got dtype {x.dtype}")
    return x


def _check_same_shape(name: str, x: jax.Array, ref_name: str, ref: jax.Array) -> None:
    if x.shape != ref.shape:
        raise ValueError(
            f"{name} has shape {x.shape} but {ref_name} has shape {ref.shape}; they must match"
        )


def _check_nonnegative_scalar(name: str, value: object) -> None:
    """Checks a threshold/budget; only traced values (unknown until run) pass unchecked."""
    if isinstance(value, jax.Array):
        if value.ndim != 0:
            raise ValueError(f"{name} must be a scalar, got shape {value.shape}")
        if isinstance(value, jax.core.Tracer) or not value.is_fully_addressable:
            return
        value = np.asarray(value)  # concrete: checked like a numpy scalar
    if isinstance(value, (numbers.Real, np.ndarray, np.generic)):
        arr = np.asarray(value)
        if arr.shape != ():
            raise ValueError(f"{name} must be a scalar, got shape {arr.shape}")
        if arr.dtype == bool or not np.issubdtype(arr.dtype, np.number):
            raise TypeError(f"{name} must be a real number, got {value!r}")
        if np.isnan(arr) or arr < 0:
            raise ValueError(f"{name} must be >= 0 (or None to disable), got {value!r}")
        return
    raise TypeError(
        f"{name} must be a real number, a jax scalar or None, got {type(value).__name__}"
    )


def _log_ratio_pair(
    behav_logp: jax.Array, prox_logp: jax.Array, second_moment: str, logp: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """(newer, older) log-probs whose difference is the log importance ratio of the variant."""
    if second_moment == "behav_prox":
        return prox_logp, behav_logp
    if second_moment == "current_behav":
        return logp, behav_logp
    return logp, prox_logp


def _validated_logps(
    behav_logp: ArrayLike,
    prox_logp: ArrayLike,
    second_moment: str,
    logp: ArrayLike | None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    _check_choice("second_moment", second_moment, SECOND_MOMENTS)
    behav_logp = _as_float_array("behav_logp", behav_logp)
    prox_logp = _as_float_array("prox_logp", prox_logp)
    _check_same_shape("prox_logp", prox_logp, "behav_logp", behav_logp)
    if second_moment != "behav_prox":
        if logp is None:
            raise ValueError(f"second_moment={second_moment!r} needs logp= (current log-probs)")
    if logp is not None:
        logp = _as_float_array("logp", logp)
        _check_same_shape("logp", logp, "behav_logp", behav_logp)
    return behav_logp, prox_logp, logp


# ----------------------------------------------------------------------------- building blocks


def m2po_second_moment(
    behav_logp: ArrayLike,
    prox_logp: ArrayLike,
    *,
    second_moment: str = "behav_prox",
    logp: ArrayLike | None = None,
) -> jax.Array:
    """Per-token second moment of the log importance ratio, in float32, without gradient.

        "behav_prox"    (AReaL):        m2 = (behav_logp - prox_logp)^2
        "current_behav" (paper):        m2 = (logp - behav_logp)^2
        "prox_current"  (authors' code): m2 = (prox_logp - logp)^2

    Args:
      behav_logp: log-probs of the sampled tokens under the behaviour policy, any shape.
      prox_logp: log-probs under the parameters at the start of the step, same shape.
      second_moment: which pair of log-probs the ratio compares.
      logp: current (differentiable) log-probs; needed by "current_behav" and "prox_current".

    Returns:
      float32 array shaped like ``behav_logp``; inputs are upcast before subtracting and
      the result carries no gradient.
    """
    behav_logp, prox_logp, logp = _validated_logps(behav_logp, prox_logp, second_moment, logp)
    return _second_moment(behav_logp, prox_logp, logp, second_moment)


def m2po_harmful_tokens(
    behav_logp: ArrayLike,
    prox_logp: ArrayLike,
    advantages: ArrayLike,
    *,
    second_moment: str = "behav_prox",
    logp: ArrayLike | None = None,
) -> jax.Array:
    """Tokens whose ratio moves against the trust region (the authors' candidate set).

        harmful = (A > 0 and log r > 0) or (A < 0 and log r < 0),  log r = newer - older

    where (newer, older) is the pair of ``second_moment`` (see ``m2po_second_moment``).
    The authors' code tests r > 1 + 1e-12 and |A| > 1e-12 on float32 tensors, which is
    the sign test above except for |log r| below ~6e-8 (m2 < 4e-15, irrelevant).

    Returns:
      bool array shaped like ``behav_logp``.
    """
    behav_logp, prox_logp, logp = _validated_logps(behav_logp, prox_logp, second_moment, logp)
    advantages = _as_float_array("advantages", advantages, "advantages")
    _check_same_shape("advantages", advantages, "behav_logp", behav_logp)
    return _harmful(behav_logp, prox_logp, logp, advantages, second_moment)


def _log_ratio(behav_logp, prox_logp, logp, second_moment):
    newer, older = _log_ratio_pair(behav_logp, prox_logp, second_moment, logp)
    return lax.stop_gradient(newer.astype(jnp.float32) - older.astype(jnp.float32))


def _second_moment(behav_logp, prox_logp, logp, second_moment):
    log_ratio = _log_ratio(behav_logp, prox_logp, logp, second_moment)
    return log_ratio * log_ratio


def _harmful(behav_logp, prox_logp, logp, advantages, second_moment):
    log_ratio = _log_ratio(behav_logp, prox_logp, logp, second_moment)
    adv = lax.stop_gradient(advantages)
    return ((adv > 0) & (log_ratio > 0)) | ((adv < 0) & (log_ratio < 0))


def _sort_keys(m2: jax.Array, active: jax.Array) -> jax.Array:
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


def _explicit_sharding(x: jax.Array) -> PartitionSpec | None:
    """The PartitionSpec of x when its type carries a sharding (mesh axes of type Explicit)."""
    spec = jax.typeof(x).sharding.spec
    return spec if any(axis is not None for axis in spec) else None


def _gathered(x: jax.Array) -> jax.Array:
    """x unsharded: the mask is one global ordering, and an explicitly sharded type would
    make sort and reshape refuse it. (Under Auto axes the partitioner does this itself.)"""
    return x if _explicit_sharding(x) is None else jax.sharding.reshard(x, PartitionSpec())


def _kept(key: jax.Array, tau: jax.Array, method: str, stop_rule: str, scope: str) -> jax.Array:
    kept_fn = _kept_by_sort if method == "sort" else _kept_by_bisect
    if scope == "global":
        return kept_fn(key.reshape(-1), tau, stop_rule).reshape(key.shape)
    rows = jax.vmap(kept_fn, in_axes=(0, None, None))
    return rows(key.reshape(key.shape[0], -1), tau, stop_rule).reshape(key.shape)


def _stats(m2: jax.Array, valid: jax.Array, active: jax.Array, mask: jax.Array) -> dict:
    finite = jnp.isfinite(m2)

    def finite_mean(where):
        where = where & finite
        total = jnp.sum(jnp.where(where, m2, 0.0))
        return total / jnp.maximum(jnp.sum(where, dtype=jnp.int32), 1).astype(jnp.float32)

    num_valid = jnp.sum(valid, dtype=jnp.int32)
    masked = jnp.sum(valid & ~mask, dtype=jnp.int32)
    boundary = jnp.max(jnp.where(mask & active & finite, m2, 0.0), initial=0.0)
    return {
        "m2po/masked_tokens": masked,
        "m2po/masked_fraction": masked.astype(jnp.float32)
        / jnp.maximum(num_valid, 1).astype(jnp.float32),
        "m2po/m2_before": finite_mean(valid),
        "m2po/m2_after": finite_mean(mask),
        "m2po/boundary": boundary,
        "m2po/nonfinite_tokens": jnp.sum(valid & ~finite, dtype=jnp.int32),
    }


# ----------------------------------------------------------------------------- public API


def m2po_mask_with_stats(
    behav_logp: ArrayLike,
    prox_logp: ArrayLike,
    loss_mask: ArrayLike,
    m2_threshold: ArrayLike | None,
    *,
    method: str = "sort",
    second_moment: str = "behav_prox",
    stop_rule: str = "lt",
    candidates: str = "all",
    scope: str = "global",
    logp: ArrayLike | None = None,
    advantages: ArrayLike | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """M2PO mask and its statistics, with the published variants as options.

    Over the participating tokens P (valid, and candidates), sorted by m2 ascending:

        k = max(1, max{m <= |P| : mean(m2 of the m smallest) < tau})
        mask = loss_mask, except the |P| - k largest-m2 tokens of P become False

    |P| == 0 or ``m2_threshold=None`` leaves ``loss_mask`` unchanged.

    Args:
      behav_logp: behaviour-policy log-probs of the sampled tokens, any shape, f32 or bf16.
      prox_logp: proximal log-probs (params at the start of the step), same shape.
      loss_mask: valid tokens (bool, or numbers where nonzero means valid), same shape.
      m2_threshold: tau, a Python number or a jax scalar; pass a traced scalar to change
        it without recompiling (a traced value cannot be checked: a negative or NaN one
        keeps exactly one token). None disables M2PO.
      method: "sort" (one sort + cumulative sum) or "bisect" (sort-free, 31 masked-sum
        passes). Same mask; ties at the boundary keep the lowest flat index.
      second_moment: "behav_prox" (AReaL), "current_behav" (paper, needs ``logp``) or
        "prox_current" (authors' code, needs ``logp``); see ``m2po_second_moment``.
      stop_rule: "lt" (AReaL: kept mean < tau) or "le" (paper: kept mean <= tau).
      candidates: "all" valid tokens, or "harmful" (authors' code, needs ``advantages``):
        only valid tokens with (A > 0 and r > 1) or (A < 0 and r < 1), r the ratio of
        ``second_moment``, take part; the others keep their ``loss_mask`` and stay out
        of the mean, exactly as the authors' budget counts harmful tokens only. Tokens
        with non-finite m2 always take part (their ratio's sign means nothing).
      scope: "global" (the whole array is one set) or "row" (each index of the leading
        axis is its own set; needs ndim >= 2). Per-minibatch or per-shard scope: call
        this on each minibatch, or inside ``shard_map`` on the local block.
      logp: current log-probs (gradient is stopped), for the variants that need them.
      advantages: per-token advantages shaped like ``loss_mask``, for "harmful".

    Sharded inputs give the same mask as unsharded ones. Under Explicit mesh axes the
    inputs are gathered for the global ordering and the mask comes back sharded like
    ``loss_mask``.

    Returns:
      ``(mask, stats)``: mask is bool shaped like ``loss_mask``, carrying no gradient.
      stats (scalars): "m2po/masked_tokens" (int32: valid tokens turned off),
      "m2po/masked_fraction" (masked / valid), "m2po/m2_before" and "m2po/m2_after"
      (mean m2 over valid / kept tokens with finite m2; non-finite ones are counted in
      "m2po/nonfinite_tokens" instead), "m2po/boundary" (largest finite m2 among kept
      participating tokens, 0 if none).
    """
    _check_choice("method", method, METHODS)
    _check_choice("stop_rule", stop_rule, STOP_RULES)
    _check_choice("candidates", candidates, CANDIDATES)
    _check_choice("scope", scope, SCOPES)
    behav_logp, prox_logp, logp = _validated_logps(behav_logp, prox_logp, second_moment, logp)
    loss_mask = jnp.asarray(loss_mask)
    _check_same_shape("behav_logp", behav_logp, "loss_mask", loss_mask)
    if candidates == "harmful" and advantages is None:
        raise ValueError("candidates='harmful' needs advantages= (per-token advantages)")
    if advantages is not None:
        advantages = _as_float_array("advantages", advantages, "advantages")
        _check_same_shape("advantages", advantages, "loss_mask", loss_mask)
    if scope == "row" and loss_mask.ndim < 2:
        raise ValueError(f"scope='row' needs inputs with ndim >= 2, got shape {loss_mask.shape}")
    if m2_threshold is not None:
        _check_nonnegative_scalar("m2_threshold", m2_threshold)

    tau = None if m2_threshold is None else jnp.asarray(m2_threshold, jnp.float32)
    return _mask_core(
        behav_logp,
        prox_logp,
        loss_mask,
        tau,
        logp,
        advantages,
        method=method,
        second_moment=second_moment,
        stop_rule=stop_rule,
        candidates=candidates,
        scope=scope,
    )


# Jitted so that eager calls reuse one compilation (the loops and conds inside would
# otherwise be re-traced and re-compiled on every call); inlined under an outer jit.
@functools.partial(
    jax.jit, static_argnames=("method", "second_moment", "stop_rule", "candidates", "scope")
)
def _mask_core(
    behav_logp, prox_logp, loss_mask, tau, logp, advantages, *,
    method, second_moment, stop_rule, candidates, scope,
):  # fmt: skip
    with jax.named_scope("m2po_mask"):
        out_sharding = _explicit_sharding(loss_mask)
        behav_logp, prox_logp, loss_mask, logp, advantages = jax.tree.map(
            _gathered, (behav_logp, prox_logp, loss_mask, logp, advantages)
        )
        m2 = _second_moment(behav_logp, prox_logp, logp, second_moment)
        valid = loss_mask.astype(bool)
        active = valid
        if candidates == "harmful":
            harmful = _harmful(behav_logp, prox_logp, logp, advantages, second_moment)
            active = valid & (harmful | ~jnp.isfinite(m2))
        if tau is None or loss_mask.size == 0:
            mask = valid
        else:
            kept = _kept(_sort_keys(m2, active), tau, method, stop_rule, scope)
            mask = valid & (~active | kept)
        stats = _stats(m2, valid, active, mask)
        if out_sharding is not None:
            mask = jax.sharding.reshard(mask, out_sharding)
        return mask, stats


def m2po_mask(
    behav_logp: ArrayLike,
    prox_logp: ArrayLike,
    loss_mask: ArrayLike,
    m2_threshold: ArrayLike | None,
    *,
    method: str = "sort",
) -> jax.Array:
    """AReaL's M2PO mask over the whole array (the public contract in docs/design.md).

        m2 = (behav_logp - prox_logp)^2 in float32, over tokens with loss_mask True;
        keep the largest set of smallest-m2 tokens with mean m2 < m2_threshold (at
        least one); the other valid tokens become False.

    Args:
      behav_logp: behaviour-policy log-probs, any shape ([T], [B, T], [B, M, T], ...).
      prox_logp: proximal log-probs, same shape.
      loss_mask: valid tokens, same shape.
      m2_threshold: tau (Python number or jax scalar); None returns ``loss_mask``.
      method: "sort" or "bisect" (sort-free, same mask).

    Returns:
      bool array shaped like ``loss_mask``. See ``m2po_mask_with_stats`` for variants.
    """
    return m2po_mask_with_stats(behav_logp, prox_logp, loss_mask, m2_threshold, method=method)[0]


def m2po_clip_bound(m2: ArrayLike, loss_mask: ArrayLike, m2_budget: ArrayLike) -> jax.Array:
    """The authors' capped-mean rule: a log-ratio bound t from a second-moment budget.

        t = sqrt(max{s >= 0 : mean over valid tokens of min(m2, s) <= m2_budget})

    and t = +inf when the plain mean already fits (or there are no valid tokens). The
    caller clips the ratio to [exp(-t), exp(t)]. Exact: the capped mean is piecewise
    linear in s, solved on the segment between two sorted m2 values (the authors' loop
    returns the breakpoint below it, a slightly smaller t). Non-finite m2 counts as
    +inf, so it is always capped. For the authors' recipe pass
    ``m2 = m2po_second_moment(behav, prox, second_moment="prox_current", logp=logp)``
    and ``loss_mask & m2po_harmful_tokens(..., advantages, ...)``.

    Args:
      m2: per-token second moments (>= 0), any shape.
      loss_mask: valid tokens, same shape.
      m2_budget: the budget (Python number or jax scalar; a traced negative one gives 0).

    Returns:
      float32 scalar t >= 0, possibly +inf.
    """
    m2 = _as_float_array("m2", m2, "second moments")
    loss_mask = jnp.asarray(loss_mask)
    _check_same_shape("m2", m2, "loss_mask", loss_mask)
    _check_nonnegative_scalar("m2_budget", m2_budget)
    return _clip_bound_core(m2, loss_mask, jnp.asarray(m2_budget, jnp.float32))


@jax.jit
def _clip_bound_core(m2: jax.Array, loss_mask: jax.Array, budget: jax.Array) -> jax.Array:
    if loss_mask.size == 0:
        return jnp.float32(jnp.inf)
    m2, loss_mask = _gathered(m2), _gathered(loss_mask)
    key_N = _sort_keys(lax.stop_gradient(m2.astype(jnp.float32)), loss_mask.astype(bool))
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
