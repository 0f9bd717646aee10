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
arbitrary there, only the count is determined). The kernels are in
``masking_kernels.py``; this module checks the inputs.

Non-finite m2 (a NaN or inf log-prob on a valid token) counts as +inf: larger than
every finite value, so such tokens are masked first.

Statistics: ``m2po_mask_with_stats`` reports ``M2PO_STAT_KEYS``; ``m2po_mask_with_parts``
returns their additive parts, which combine exactly across blocks (``masking_stats.py``).
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from m2po_jax.algorithm import masking_kernels as kernels
from m2po_jax.algorithm.masking_stats import (
    finalize_stats,
    stat_parts,
)
from m2po_jax.common.checks import check_choice as _check_choice

METHODS = ("sort", "bisect")
SECOND_MOMENTS = ("behav_prox", "current_behav", "prox_current")
STOP_RULES = ("lt", "le")
CANDIDATES = ("all", "harmful")
SCOPES = ("global", "row")  # of one call; minibatch / shard scopes: see m2po_jax.algorithm.scopes


# ----------------------------------------------------------------------------- checks


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


def _validated_logps(behav_logp, prox_logp, second_moment, logp):
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


def check_mask_inputs(
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
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """The checks of `m2po_mask_with_stats` (names, dtypes, shapes, tau), before any work.

    Returns:
      ``(behav_logp, prox_logp, loss_mask, logp, advantages)`` as jax arrays (or None).
    Raises:
      ValueError / TypeError naming the argument and what was expected.
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
    return behav_logp, prox_logp, loss_mask, logp, advantages


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
    return kernels.second_moment(behav_logp, prox_logp, logp, second_moment)


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
    return kernels.harmful(behav_logp, prox_logp, logp, advantages, second_moment)


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
        axis is its own set; needs ndim >= 2). Minibatch, micro-batch and per-shard
        scopes: ``m2po_jax.algorithm.scopes.m2po_mask_scoped``.
      logp: current log-probs (gradient is stopped), for the variants that need them.
      advantages: per-token advantages shaped like ``loss_mask``, for "harmful".

    Sharded inputs give the same mask as unsharded ones. Under Explicit mesh axes the
    inputs are gathered for the global ordering and the mask comes back sharded like
    ``loss_mask``.

    Returns:
      ``(mask, stats)``: mask is bool shaped like ``loss_mask``, carrying no gradient;
      stats holds the scalars ``M2PO_STAT_KEYS``: "m2po/masked_tokens" (int32: valid
      tokens turned off), "m2po/masked_fraction" (masked / valid), "m2po/m2_before" and
      "m2po/m2_after" (mean m2 over valid / kept tokens with finite m2; non-finite ones
      are counted in "m2po/nonfinite_tokens" instead), "m2po/boundary" (largest finite
      m2 among kept participating tokens, 0 if none; with ``m2_threshold=None`` the
      largest finite m2 of the participating tokens).
    """
    mask, parts = m2po_mask_with_parts(
        behav_logp,
        prox_logp,
        loss_mask,
        m2_threshold,
        method=method,
        second_moment=second_moment,
        stop_rule=stop_rule,
        candidates=candidates,
        scope=scope,
        logp=logp,
        advantages=advantages,
    )
    return mask, finalize_stats(parts)


def m2po_mask_with_parts(
    behav_logp: ArrayLike,
    prox_logp: ArrayLike,
    loss_mask: ArrayLike,
    m2_threshold: ArrayLike | None,
    **options,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``m2po_mask_with_stats`` (same keyword options, same checks) with the statistics as
    additive parts (``M2PO_PART_KEYS``), for masks taken on blocks (minibatches,
    micro-batches, shards) whose statistics must combine exactly: ``combine_stat_parts``
    or ``psum_stat_parts``, then ``finalize_stats``.
    """
    arrays = check_mask_inputs(behav_logp, prox_logp, loss_mask, m2_threshold, **options)
    tau = None if m2_threshold is None else jnp.asarray(m2_threshold, jnp.float32)
    static = {k: v for k, v in options.items() if k not in ("logp", "advantages")}
    return _mask_core(*arrays[:3], tau, *arrays[3:], **static)


# Jitted so that eager calls reuse one compilation (the loops and conds inside would
# otherwise be re-traced and re-compiled on every call); inlined under an outer jit.
@functools.partial(
    jax.jit, static_argnames=("method", "second_moment", "stop_rule", "candidates", "scope")
)
def _mask_core(
    behav_logp, prox_logp, loss_mask, tau, logp, advantages, *, method="sort",
    second_moment="behav_prox", stop_rule="lt", candidates="all", scope="global",
):  # fmt: skip
    with jax.named_scope("m2po_mask"):
        out_sharding = kernels.explicit_sharding(loss_mask)
        behav_logp, prox_logp, loss_mask, logp, advantages = (
            kernels.gathered(x) for x in (behav_logp, prox_logp, loss_mask, logp, advantages)
        )
        m2 = kernels.second_moment(behav_logp, prox_logp, logp, second_moment)
        valid = loss_mask.astype(bool)
        active = valid
        if candidates == "harmful":
            harmful = kernels.harmful(behav_logp, prox_logp, logp, advantages, second_moment)
            active = valid & (harmful | ~jnp.isfinite(m2))
        if tau is None or loss_mask.size == 0:
            mask = valid
        else:
            kept = kernels.kept(kernels.sort_keys(m2, active), tau, method, stop_rule, scope)
            mask = valid & (~active | kept)
        parts = stat_parts(m2, valid, active, mask)
        if out_sharding is not None:
            mask = jax.sharding.reshard(mask, out_sharding)
        return mask, parts


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
    return m2po_mask_with_parts(behav_logp, prox_logp, loss_mask, m2_threshold, method=method)[0]


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
    return kernels.clip_bound(m2, loss_mask, jnp.asarray(m2_budget, jnp.float32))
