"""Behaviour correction of the decoupled loss: the weight rho and AReaL's rejection sampling.

Semantics follow docs/algorithm.md ("The loss") and, where it is silent, AReaL's
`apply_rejection_sampling` (`areal/utils/functional/functional.py`) and
`RejectionSamplingConfig` (`areal/api/cli_args.py`). Deliberate difference: KL metrics use
the sanitised float32 log rho (non-finite -> 0) like the ratio metric (AReaL recomputes
them unsanitised).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from m2po_jax.algorithm.penalties import kl_from_log_ratio
from m2po_jax.common.checks import check_choice, is_number

RS_LEVELS = ("token", "sequence")
RS_ACTIONS = ("mask", "clamp")
RS_METRICS = ("ratio", "kl_k1", "kl_k2", "kl_k3")
RS_AGGS = ("sum", "mean", "max")


def _check_rejection_sampling(rs, where: str) -> None:
    """AReaL's `RejectionSamplingConfig.__post_init__` checks; errors name `<where>.<field>`."""
    check_choice(f"{where}.level", rs.level, RS_LEVELS)
    check_choice(f"{where}.action", rs.action, RS_ACTIONS)
    check_choice(f"{where}.metric", rs.metric, RS_METRICS)
    check_choice(f"{where}.agg", rs.agg, RS_AGGS)
    upper, lower = rs.upper, rs.lower
    if not is_number(upper):
        raise TypeError(f"{where}.upper must be a number, got {upper!r}")
    if lower is not None and not is_number(lower):
        raise TypeError(f"{where}.lower must be a number or None, got {lower!r}")
    if lower is not None and lower > upper:
        raise ValueError(f"{where}.lower ({lower}) must be <= upper ({upper})")
    if rs.metric == "ratio" and upper <= 1.0:
        raise ValueError(f"{where}.upper must be > 1 for metric 'ratio', got {upper}")
    if rs.metric == "ratio" and lower is not None and lower <= 0:
        raise ValueError(f"{where}.lower must be > 0 for metric 'ratio', got {lower}")
    if rs.metric in ("kl_k2", "kl_k3") and upper <= 0:
        raise ValueError(f"{where}.upper must be > 0 for metric {rs.metric!r}, got {upper}")
    if rs.action == "clamp" and rs.metric != "ratio":
        raise ValueError(f"{where}.action 'clamp' needs metric 'ratio', got {rs.metric!r}")


@dataclasses.dataclass(frozen=True)
class RejectionSampling:
    """Behaviour correction of the decoupled loss (AReaL `actor.rejection_sampling`).

    The per-token metric compares the proximal and behaviour policies through
    `log_rho = prox_logp - behav_logp` (float32, non-finite -> 0):
    "ratio" = rho = exp(log_rho); "kl_k1" = log_rho; "kl_k2" = log_rho^2 / 2;
    "kl_k3" = exp(-log_rho) - 1 + log_rho (AReaL's `KLEstimator` with
    log_probs=prox, log_probs_base=behav).

    At `level="sequence"` the token metric is aggregated over each row's mask tokens
    with `agg`. For the ratio metric AReaL aggregates in log space: "sum" =
    exp(sum log_rho), "mean" = exp(mean log_rho) (the geometric mean), "max" = the
    largest token ratio; and the behaviour weight of every token of the row becomes
    the row's geometric mean. KL metrics aggregate arithmetically and keep per-token
    weights. A row without mask tokens aggregates to 0 in the aggregation space.

    action "mask" drops tokens (rows) whose metric lies outside [lower, upper]
    (inclusive; no lower bound when None); "clamp" clamps rho to [lower or 0, upper]
    (at sequence level only in out-of-bounds rows) and keeps every token.

    Validation as in AReaL's `RejectionSamplingConfig.__post_init__`: lower <= upper;
    ratio: upper > 1 and lower > 0; kl_k2 / kl_k3: upper > 0; clamp only with ratio.
    """

    level: str = "token"
    action: str = "mask"
    metric: str = "ratio"
    agg: str = "mean"
    upper: float = 5.0
    lower: float | None = None

    def __post_init__(self):
        _check_rejection_sampling(self, "rejection_sampling")


def build_rejection_sampling(
    section, where: str = "actor.rejection_sampling"
) -> RejectionSampling | None:
    """The correction an `actor.rejection_sampling` config section asks for.

    `section` has the fields of `RejectionSampling` plus `enabled`. The fields are checked
    even when it is disabled (errors name `<where>.<field>`), so that `config.validate`,
    which calls this too, refuses at start-up what the train step would. None when disabled.
    """
    _check_rejection_sampling(section, where)
    if not section.enabled:
        return None
    fields = [f.name for f in dataclasses.fields(RejectionSampling)]
    return RejectionSampling(**{name: getattr(section, name) for name in fields})


def row_sum(x_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Sum over each row's mask tokens, [B, 1]."""
    return jnp.where(mask_BxT, x_BxT, 0.0).sum(-1, keepdims=True)


def row_mean(x_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Mean over each row's mask tokens, [B, 1]; 0 for a row without any."""
    count = mask_BxT.sum(-1, keepdims=True)
    return row_sum(x_BxT, mask_BxT) / jnp.maximum(count, 1)


def behaviour_correction(
    prox_logp_BxT: ArrayLike,
    behav_logp_BxT: ArrayLike,
    mask_BxT: ArrayLike,
    rejection_sampling: RejectionSampling | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Behaviour weights and the tokens that survive rejection sampling.

    `rho = exp(prox_logp - behav_logp)` (float32, no gradient; non-finite log rho
    -> 0), then `rejection_sampling` as described on `RejectionSampling`.

    Args:
      prox_logp_BxT: proximal log-probs, [B, T].
      behav_logp_BxT: behaviour log-probs, [B, T].
      mask_BxT: bool, tokens that count (after M2PO), [B, T].
      rejection_sampling: the correction, or None for plain rho.

    Returns:
      (rho_BxT, keep_BxT, clamped_BxT): the weight (0 outside `keep`), the
      tokens kept (a subset of `mask_BxT`), and the kept tokens whose weight the
      clamp changed.
    """
    prox = jnp.asarray(prox_logp_BxT, jnp.float32)
    behav = jnp.asarray(behav_logp_BxT, jnp.float32)
    mask = jnp.asarray(mask_BxT).astype(bool)
    if not prox.shape == behav.shape == mask.shape or mask.ndim != 2:
        raise ValueError(
            "prox_logp_BxT, behav_logp_BxT and mask_BxT must share one [B, T] shape, got "
            f"{prox.shape}, {behav.shape} and {mask.shape}"
        )
    log_rho = jax.lax.stop_gradient(prox - behav)
    log_rho = jnp.where(jnp.isfinite(log_rho), log_rho, 0.0)
    rho = jnp.exp(log_rho)
    rs = rejection_sampling
    if rs is None:
        return jnp.where(mask, rho, 0.0), mask, jnp.zeros_like(mask)

    if rs.metric == "ratio":
        metric = rho  # sequence level aggregates log rho instead (below), as AReaL
    else:
        metric = kl_from_log_ratio(log_rho, rs.metric.removeprefix("kl_"))
    lower = rs.lower

    def in_bounds(value):
        ok = value <= rs.upper
        return ok if lower is None else ok & (value >= lower)

    raw_rho = rho
    if rs.level == "token":
        ok_BxT = in_bounds(metric)
    else:
        values = log_rho if rs.metric == "ratio" else metric
        if rs.agg == "sum":
            seq = row_sum(values, mask)
        elif rs.agg == "mean":
            seq = row_mean(values, mask)
        else:
            seq = jnp.where(mask, values, -jnp.inf).max(-1, keepdims=True)
            seq = jnp.where(mask.any(-1, keepdims=True), seq, 0.0)
        if rs.metric == "ratio":
            seq = jnp.exp(seq)
            # AReaL: at sequence level the ratio weight is the row's geometric mean.
            rho = raw_rho = jnp.broadcast_to(jnp.exp(row_mean(log_rho, mask)), mask.shape)
        ok_BxT = jnp.broadcast_to(in_bounds(seq), mask.shape)

    if rs.action == "mask":
        keep = mask & ok_BxT
    else:
        keep = mask
        clamped_rho = jnp.clip(rho, 0.0 if lower is None else lower, rs.upper)
        rho = clamped_rho if rs.level == "token" else jnp.where(ok_BxT, rho, clamped_rho)
    clamped = keep & (rho != raw_rho)
    return jnp.where(keep, rho, 0.0), keep, clamped
