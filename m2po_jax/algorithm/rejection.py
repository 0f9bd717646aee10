"""Behaviour correction of the decoupled loss: AReaL's rejection sampling decides which
tokens are kept, the rollout correction (verl's `algorithm.rollout_correction` importance
weights) the weight of the kept ones.

Semantics follow docs/algorithm.md ("The loss") and, where it is silent, AReaL's
`apply_rejection_sampling` (`areal/utils/functional/functional.py`) and
`RejectionSamplingConfig` (`areal/api/cli_args.py`), and verl's
`compute_rollout_correction_weights` (`verl/trainer/ppo/rollout_corr_helper.py`).
Deliberate differences: KL metrics use the sanitised float32 log rho (non-finite -> 0) like
the ratio metric (AReaL recomputes them unsanitised); the token-level weight is not clamped
to exp(+-20) (verl clamps log rho first; AReaL does not, and the default keeps AReaL's).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from m2po_jax.algorithm.penalties import kl_from_log_ratio
from m2po_jax.common.checks import check_choice, is_number

RS_LEVELS = ("token", "sequence")
RS_ACTIONS = ("mask", "clamp")
RS_METRICS = ("ratio", "kl_k1", "kl_k2", "kl_k3")
RS_AGGS = ("sum", "mean", "max")
IS_WEIGHT_LEVELS = ("token", "sequence", "geometric", "none")
# verl's SAFETY_BOUND: a row's log weight is clipped to [-20, 20] before exp (sequence and
# geometric levels), so a long row's product cannot overflow float32 (exp(89) is inf).
LOG_WEIGHT_BOUND = 20.0


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


def _check_rollout_correction(rc, where: str) -> None:
    """`RolloutCorrection`'s own checks; errors name `<where>.<field>`."""
    check_choice(f"{where}.is_level", rc.is_level, IS_WEIGHT_LEVELS)
    threshold = rc.is_threshold
    if threshold is not None and not is_number(threshold):
        raise TypeError(f"{where}.is_threshold must be a number or None, got {threshold!r}")
    if threshold is not None and not 0.0 < threshold < float("inf"):
        raise ValueError(f"{where}.is_threshold must be > 0 and finite or None, got {threshold}")
    if threshold is not None and rc.is_level == "none":
        raise ValueError(
            f"{where}.is_threshold={threshold} truncates a weight that is_level='none' sets to "
            f"1: set {where}.is_threshold=None or pick an is_level with a weight"
        )


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """The behaviour weight of the tokens rejection sampling keeps (verl's
    `algorithm.rollout_correction`: engine / trainer mismatch and staleness).

    With `log_rho = prox_logp - behav_logp` (float32, non-finite -> 0, no gradient):

    - `is_level="token"`: `rho = exp(log_rho)` per token, AReaL's weight (under AReaL's
      sequence-level ratio rejection the row's geometric mean, see `RejectionSampling`);
    - `"sequence"`: the row's product of token ratios, `exp(clip(sum log_rho, -20, 20))`
      over the row's mask tokens, on each of its tokens (verl's sequence-level IS);
    - `"geometric"`: the row's geometric mean, `exp(clip(mean log_rho, -20, 20))`;
    - `"none"`: 1 (verl's decoupled PPO without a rollout IS weight).

    Sequence and geometric weights are taken in log space with log rho clipped to +-20
    before exp, as verl's (`LOG_WEIGHT_BOUND`); their rows are the mask tokens after M2PO
    and before rejection, as AReaL's geometric mean. `is_threshold` (> 0) truncates the
    weight, `min(weight, is_threshold)` (truncated importance sampling, TIS; verl's
    `rollout_is_threshold`); None keeps it whole (AReaL). The default (token, None) gives
    the loss and gradient the loss gave before this option existed, bit for bit.
    """

    is_level: str = "token"
    is_threshold: float | None = None

    def __post_init__(self):
        _check_rollout_correction(self, "rollout_correction")


def build_rollout_correction(section, where: str = "actor.rollout_correction") -> RolloutCorrection:
    """The weight an `actor.rollout_correction` config section asks for; errors name
    `<where>.<field>` (`config.validate` calls this too)."""
    _check_rollout_correction(section, where)
    return RolloutCorrection(is_level=section.is_level, is_threshold=section.is_threshold)


def check_composition(
    rollout_correction: RolloutCorrection,
    rejection_sampling,
    *,
    use_decoupled_loss: bool = True,
    use_sapo_loss: bool = False,
    prefix: str = "",
) -> None:
    """Refuses a rollout correction that does not compose with the loss's other options;
    errors name `<prefix><field>` (`prefix="actor."` from the config).

    `rejection_sampling` is a `RejectionSampling`, None, or a config section with
    `enabled`. Rules: a weight other than the default needs the decoupled loss without SAPO
    (elsewhere prox := behav and there is no weight); `action="clamp"` sets the weight
    itself, so it takes neither a second truncation (`is_threshold`) nor another weight
    level; AReaL's sequence-level ratio rejection already weighs each token by the row's
    geometric mean, so is_level sequence / geometric cannot replace it. GSPO
    (`importance_sampling_level="sequence"`) composes: it replaces the ratio r and the
    advantage, the weight multiplies the loss after, as verl's GSPO loss does with its
    rollout IS weights.
    """
    rc, rs, p = rollout_correction, rejection_sampling, prefix
    if rs is not None and not getattr(rs, "enabled", True):
        rs = None
    if rc == RolloutCorrection():
        return
    if use_sapo_loss or not use_decoupled_loss:
        what = "use_sapo_loss=True" if use_sapo_loss else "use_decoupled_loss=False"
        raise ValueError(
            f"{p}rollout_correction (is_level={rc.is_level!r}, is_threshold={rc.is_threshold}) "
            f"weighs the decoupled loss's behaviour ratio, which {p}{what} does not have "
            f"(prox := behav): leave {p}rollout_correction at its default"
        )
    if rs is not None and rs.action == "clamp" and rc.is_threshold is not None:
        raise ValueError(
            f"{p}rollout_correction.is_threshold={rc.is_threshold} and "
            f"{p}rejection_sampling.action='clamp' are two truncations of one weight: pick "
            f"one (is_threshold=None, or action='mask')"
        )
    if rs is not None and rs.action == "clamp" and rc.is_level != "token":
        raise ValueError(
            f"{p}rejection_sampling.action='clamp' clamps the token weight rho, which "
            f"{p}rollout_correction.is_level={rc.is_level!r} replaces: use action='mask' "
            "or is_level='token'"
        )
    if (
        rs is not None
        and rs.level == "sequence"
        and rs.metric == "ratio"
        and rc.is_level in ("sequence", "geometric")
    ):
        raise ValueError(
            f"{p}rollout_correction.is_level={rc.is_level!r} with "
            f"{p}rejection_sampling level='sequence', metric='ratio': AReaL's sequence ratio "
            "already replaces rho by the row's geometric mean; use is_level='token' (that "
            "weight) or a KL metric (kl_k1 bounds the row's mean log rho)"
        )


class BehaviourWeights(NamedTuple):
    """What `behaviour_correction` decides, each [B, T]."""

    weight_BxT: jax.Array  # the loss's weight: 0 outside keep_BxT
    keep_BxT: jax.Array  # tokens kept (a subset of the mask)
    clamped_BxT: jax.Array  # kept tokens whose weight rejection sampling's clamp changed
    truncated_BxT: jax.Array  # kept tokens whose weight is_threshold cut
    untruncated_BxT: jax.Array  # the weight before is_threshold (0 outside keep_BxT)


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
    rollout_correction: RolloutCorrection | None = None,
) -> BehaviourWeights:
    """Behaviour weights and the tokens that survive rejection sampling.

    `rho = exp(prox_logp - behav_logp)` (float32, no gradient; non-finite log rho
    -> 0), then `rejection_sampling` as described on `RejectionSampling` (which tokens are
    kept), then `rollout_correction` as described on `RolloutCorrection` (their weight;
    None: the default, rho).

    Args:
      prox_logp_BxT: proximal log-probs, [B, T].
      behav_logp_BxT: behaviour log-probs, [B, T].
      mask_BxT: bool, tokens that count (after M2PO), [B, T].
      rejection_sampling: the rejection, or None for none.
      rollout_correction: the weight of the kept tokens, or None for rho.

    Returns:
      `BehaviourWeights`: the weight (0 outside `keep`), the tokens kept (a subset of
      `mask_BxT`), the kept tokens whose weight the clamp changed, the kept tokens whose
      weight `is_threshold` cut, and the weight before that cut.
    """
    rc = RolloutCorrection() if rollout_correction is None else rollout_correction
    check_composition(rc, rejection_sampling)
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
    rho, keep, clamped = _rejection(log_rho, mask, rejection_sampling)
    if rc.is_level == "sequence":
        log_w = jnp.clip(row_sum(log_rho, mask), -LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)
        rho = jnp.broadcast_to(jnp.exp(log_w), mask.shape)
    elif rc.is_level == "geometric":
        log_w = jnp.clip(row_mean(log_rho, mask), -LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)
        rho = jnp.broadcast_to(jnp.exp(log_w), mask.shape)
    elif rc.is_level == "none":
        rho = jnp.ones(mask.shape, jnp.float32)
    untruncated = jnp.where(keep, rho, 0.0)
    if rc.is_threshold is None:
        return BehaviourWeights(untruncated, keep, clamped, jnp.zeros_like(keep), untruncated)
    truncated = keep & (rho > rc.is_threshold)
    weight = jnp.where(keep, jnp.minimum(rho, rc.is_threshold), 0.0)
    return BehaviourWeights(weight, keep, clamped, truncated, untruncated)


def _rejection(log_rho, mask, rs: RejectionSampling | None):
    """(rho, keep, clamped) of sanitised log rho under `rs` (see `RejectionSampling`);
    rho is not yet zeroed outside keep."""
    rho = jnp.exp(log_rho)
    if rs is None:
        return rho, mask, jnp.zeros_like(mask)

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
    return rho, keep, clamped
