"""Actor losses for off-policy RL of LLMs: decoupled PPO with behaviour correction
(AReaL), dual clip, clip-higher, GSPO sequence-level ratios and SAPO.

Semantics follow docs/algorithm.md ("The loss") and, where it is silent, AReaL's
`areal/utils/functional/functional.py` (`ppo_actor_loss_fn`,
`apply_rejection_sampling`, `_compute_sequence_level_ratio_and_advantages`,
`sapo_loss_fn`) and `RejectionSamplingConfig` in `areal/api/cli_args.py`.

Deliberate differences from AReaL, all documented where they apply:
- `rejection_sampling=None` still multiplies the loss by the behaviour weight
  rho = exp(prox - behav) (AReaL then drops rho). With the decoupled loss off,
  prox := behav so rho = 1 either way.
- KL metrics of the rejection sampling use the sanitised float32 log rho
  (non-finite -> 0) like the ratio metric (AReaL recomputes them unsanitised).
- GSPO's per-sequence mean advantage is masked (AReaL's packed 1-D path; its padded
  2-D path sums the advantages of all positions).
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from m2po_jax.advantages import kl_from_log_ratio

IS_LEVELS = ("token", "sequence")
DENOMINATORS = ("kept", "valid")
RS_LEVELS = ("token", "sequence")
RS_ACTIONS = ("mask", "clamp")
RS_METRICS = ("ratio", "kl_k1", "kl_k2", "kl_k3")
RS_AGGS = ("sum", "mean", "max")


def _is_number(x) -> bool:
    """True for a concrete Python / numpy number (not a bool, not a jax array)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


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
        _check_choice("rejection_sampling.level", self.level, RS_LEVELS)
        _check_choice("rejection_sampling.action", self.action, RS_ACTIONS)
        _check_choice("rejection_sampling.metric", self.metric, RS_METRICS)
        _check_choice("rejection_sampling.agg", self.agg, RS_AGGS)
        if not _is_number(self.upper):
            raise TypeError(f"rejection_sampling.upper must be a number, got {self.upper!r}")
        if self.lower is not None and not _is_number(self.lower):
            raise TypeError(
                f"rejection_sampling.lower must be a number or None, got {self.lower!r}"
            )
        if self.lower is not None and self.lower > self.upper:
            raise ValueError(
                f"rejection_sampling.lower ({self.lower}) must be <= upper ({self.upper})"
            )
        if self.metric == "ratio":
            if self.upper <= 1.0:
                raise ValueError(
                    f"rejection_sampling.upper must be > 1 for metric 'ratio', got {self.upper}"
                )
            if self.lower is not None and self.lower <= 0:
                raise ValueError(
                    f"rejection_sampling.lower must be > 0 for metric 'ratio', got {self.lower}"
                )
        if self.metric in ("kl_k2", "kl_k3") and self.upper <= 0:
            raise ValueError(
                f"rejection_sampling.upper must be > 0 for metric {self.metric!r}, got {self.upper}"
            )
        if self.action == "clamp" and self.metric != "ratio":
            raise ValueError(
                f"rejection_sampling.action 'clamp' needs metric 'ratio', got {self.metric!r}"
            )


def _seq_sum(x_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    return jnp.where(mask_BxT, x_BxT, 0.0).sum(-1, keepdims=True)


def _seq_mean(x_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Mean over each row's mask tokens, [B, 1]; 0 for a row without any."""
    count = mask_BxT.sum(-1, keepdims=True)
    return _seq_sum(x_BxT, mask_BxT) / jnp.maximum(count, 1)


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
            seq = _seq_sum(values, mask)
        elif rs.agg == "mean":
            seq = _seq_mean(values, mask)
        else:
            seq = jnp.where(mask, values, -jnp.inf).max(-1, keepdims=True)
            seq = jnp.where(mask.any(-1, keepdims=True), seq, 0.0)
        if rs.metric == "ratio":
            seq = jnp.exp(seq)
            # AReaL: at sequence level the ratio weight is the row's geometric mean.
            rho = raw_rho = jnp.broadcast_to(jnp.exp(_seq_mean(log_rho, mask)), mask.shape)
        ok_BxT = jnp.broadcast_to(in_bounds(seq), mask.shape)

    if rs.action == "mask":
        keep = mask & ok_BxT
    else:
        keep = mask
        clamped_rho = jnp.clip(rho, 0.0 if lower is None else lower, rs.upper)
        rho = clamped_rho if rs.level == "token" else jnp.where(ok_BxT, rho, clamped_rho)
    clamped = keep & (rho != raw_rho)
    return jnp.where(keep, rho, 0.0), keep, clamped


def _check_inputs(arrays: dict, valid_mask) -> None:
    ref_name, ref = next(iter(arrays.items()))
    if ref.ndim != 2:
        raise ValueError(f"{ref_name} must be 2-D [B, T], got shape {ref.shape}")
    for name, x in list(arrays.items())[1:] + [("valid_mask_BxT", valid_mask)]:
        if x is not None and x.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {x.shape} but {ref_name} has shape {ref.shape}; all "
                "inputs must share one [B, T] shape"
            )
    for name in ("logp_BxT", "prox_logp_BxT", "behav_logp_BxT", "advantages_BxT"):
        if not jnp.issubdtype(arrays[name].dtype, jnp.floating):
            raise TypeError(f"{name} must have a floating dtype, got {arrays[name].dtype}")


def policy_loss(
    logp_BxT: ArrayLike,
    prox_logp_BxT: ArrayLike,
    behav_logp_BxT: ArrayLike,
    advantages_BxT: ArrayLike,
    mask_BxT: ArrayLike,
    *,
    eps_clip: float | jax.Array = 0.2,
    eps_clip_higher: float | jax.Array | None = None,
    c_clip: float | None = None,
    use_decoupled_loss: bool = True,
    importance_sampling_level: str = "token",
    rejection_sampling: RejectionSampling | None = RejectionSampling(),  # noqa: B008 (frozen)
    use_sapo_loss: bool = False,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    denominator: str = "kept",
    valid_mask_BxT: ArrayLike | None = None,
    count: ArrayLike | None = None,
) -> tuple[jax.Array, dict]:
    """Actor loss: AReaL's decoupled PPO (default), GSPO, or SAPO.

    Decoupled PPO, per token (A = advantage, r = exp(logp - prox_logp)):

    `L = max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_higher))`,
    with dual clip (`c_clip > 1`) `L = min(L, c_clip * |A|)` where A < 0, then
    `L *= rho` with `rho = stop_grad(exp(prox_logp - behav_logp))` after
    `rejection_sampling` (see `RejectionSampling`; None keeps plain rho).
    Without the decoupled loss prox := behav (so rho = 1).

    GSPO (`importance_sampling_level="sequence"`): r and A are replaced on each token
    by `exp(mean(logp - prox_logp))` and `mean(A)` over the row's kept tokens.

    SAPO (`use_sapo_loss=True`, needs `use_decoupled_loss=False`): r = exp(logp -
    behav_logp) (or its GSPO form), `gate = (4 / tau) * sigmoid(tau * (r - 1))`,
    tau = sapo_tau_pos where A > 0 else sapo_tau_neg, `L = -gate * stop_grad(A)`
    (AReaL's `sapo_loss_fn`: the gate keeps its gradient). No behaviour correction.

    Aggregation: `loss = sum(L over kept tokens) / n`, with n the number of
    `mask_BxT` tokens (`denominator="kept"`, AReaL: tokens kept after M2PO) or of
    `valid_mask_BxT` tokens (`"valid"`, the paper: before M2PO); tokens rejected by
    the behaviour correction stay in n. n = 0 gives loss 0. An explicit `count` replaces
    n: a micro-batch then contributes its share of a larger batch's loss.

    Args:
      logp_BxT: log-probs under the params being optimised (differentiable), [B, T].
      prox_logp_BxT: log-probs under the params at the start of the step, [B, T].
      behav_logp_BxT: log-probs under the behaviour policy, [B, T].
      advantages_BxT: advantages, [B, T].
      mask_BxT: final token mask (after M2PO); bool or numeric (nonzero = True).
      eps_clip: lower clip range, a Python float in [0, 1) or a traced scalar.
      eps_clip_higher: upper clip range (>= 0); None = eps_clip.
      c_clip: dual-clip factor > 1, or None.
      use_decoupled_loss: AReaL's decoupled PPO; False sets prox := behav.
      importance_sampling_level: "token" or "sequence" (GSPO).
      rejection_sampling: behaviour correction; None disables it.
      use_sapo_loss: SAPO instead of the clipped objective.
      sapo_tau_pos, sapo_tau_neg: SAPO temperatures (> 0).
      denominator: "kept" or "valid".
      valid_mask_BxT: the mask before M2PO; required for denominator "valid".
      count: the denominator n, when it is counted over more tokens than these.

    Returns:
      (loss, stats): a float32 scalar and a dict of float32 scalars. Fractions are
      over the `mask_BxT` tokens (counting only kept tokens in the numerator, as
      AReaL's clip_ratio); weights are over kept tokens (0 if none):
      "actor/loss", "actor/clip_fraction", "actor/clip_low_fraction",
      "actor/clip_high_fraction", "actor/dual_clip_fraction",
      "actor/importance_weight_{min,mean,max}" (r as used in the loss),
      "actor/behav_weight_{mean,max}" (rho after correction),
      "actor/approx_kl" (mean of r - 1 - log r over kept tokens with the token-level
      r = exp(logp - prox_logp): the k3 estimate of KL(prox || theta), >= 0),
      "actor/kept_tokens", "actor/rejected_tokens" (mask tokens dropped by the
      correction), "actor/clamped_tokens" (kept tokens whose rho was clamped).
    """
    _check_choice("importance_sampling_level", importance_sampling_level, IS_LEVELS)
    _check_choice("denominator", denominator, DENOMINATORS)
    if rejection_sampling is not None and not isinstance(rejection_sampling, RejectionSampling):
        raise TypeError(
            "rejection_sampling must be a RejectionSampling or None, got "
            f"{type(rejection_sampling).__name__}"
        )
    if _is_number(eps_clip) and not 0.0 <= eps_clip < 1.0:
        raise ValueError(f"eps_clip must be in [0, 1), got {eps_clip}")
    if _is_number(eps_clip_higher) and eps_clip_higher < 0.0:
        raise ValueError(f"eps_clip_higher must be >= 0 or None, got {eps_clip_higher}")
    if _is_number(c_clip) and c_clip <= 1.0:
        raise ValueError(f"c_clip must be None or > 1, got {c_clip}")
    for name, tau in (("sapo_tau_pos", sapo_tau_pos), ("sapo_tau_neg", sapo_tau_neg)):
        if _is_number(tau) and tau <= 0:
            raise ValueError(f"{name} must be > 0, got {tau}")
    if use_sapo_loss and use_decoupled_loss:
        raise ValueError(
            "use_sapo_loss=True is not compatible with use_decoupled_loss=True; "
            "pass use_decoupled_loss=False (AReaL: actor.use_decoupled_loss=false)"
        )
    if denominator == "valid" and valid_mask_BxT is None and count is None:
        raise ValueError("denominator='valid' needs valid_mask_BxT (the mask before M2PO)")
    arrays = {
        "logp_BxT": jnp.asarray(logp_BxT),
        "prox_logp_BxT": jnp.asarray(prox_logp_BxT),
        "behav_logp_BxT": jnp.asarray(behav_logp_BxT),
        "advantages_BxT": jnp.asarray(advantages_BxT),
        "mask_BxT": jnp.asarray(mask_BxT),
    }
    valid_mask = None if valid_mask_BxT is None else jnp.asarray(valid_mask_BxT)
    _check_inputs(arrays, valid_mask)

    mask = arrays["mask_BxT"].astype(bool)
    logp = arrays["logp_BxT"].astype(jnp.float32)
    behav = jax.lax.stop_gradient(arrays["behav_logp_BxT"].astype(jnp.float32))
    prox = jax.lax.stop_gradient(arrays["prox_logp_BxT"].astype(jnp.float32))
    if use_sapo_loss or not use_decoupled_loss:
        prox = behav
    adv = jax.lax.stop_gradient(arrays["advantages_BxT"].astype(jnp.float32))

    if use_sapo_loss:
        rho, keep, clamped = jnp.where(mask, 1.0, 0.0), mask, jnp.zeros_like(mask)
    else:
        rho, keep, clamped = behaviour_correction(prox, behav, mask, rejection_sampling)

    # Outside `keep` the log-ratio is replaced by 0 so that padding (e.g. -inf
    # log-probs) can produce neither inf in the forward pass nor NaN gradients.
    log_r = jnp.where(keep, logp - prox, 0.0)
    adv = jnp.where(keep, adv, 0.0)
    if importance_sampling_level == "sequence":
        r = jnp.broadcast_to(jnp.exp(_seq_mean(log_r, keep)), keep.shape)
        adv = jnp.broadcast_to(_seq_mean(adv, keep), keep.shape)
    else:
        r = jnp.exp(log_r)

    no_clip = jnp.zeros_like(keep)
    clip_low = clip_high = dual = no_clip
    if use_sapo_loss:
        tau = jnp.where(adv > 0, sapo_tau_pos, sapo_tau_neg)
        per_token = -(4.0 / tau) * jax.nn.sigmoid(tau * (r - 1.0)) * adv
    else:
        eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher
        unclipped = -adv * r
        clipped = -adv * jnp.clip(r, 1.0 - eps_clip, 1.0 + eps_high)
        per_token = jnp.maximum(unclipped, clipped)
        clip_active = unclipped < clipped
        clip_low = clip_active & (adv < 0)  # the r < 1 - eps_clip side binds for A < 0
        clip_high = clip_active & (adv > 0)
        if c_clip is not None:
            bound = c_clip * jnp.abs(adv)
            dual = (adv < 0) & (bound < per_token)
            per_token = jnp.where(adv < 0, jnp.minimum(per_token, bound), per_token)
        per_token = per_token * rho

    if count is None:
        count = mask.sum() if denominator == "kept" else valid_mask.astype(bool).sum()
    loss = jnp.where(keep, per_token, 0.0).sum() / jnp.maximum(count, 1)

    stats = _stats(
        loss=loss,
        mask=mask,
        keep=keep,
        clamped=clamped,
        r=jax.lax.stop_gradient(r),
        rho=rho,
        token_log_r=jax.lax.stop_gradient(log_r),
        flags={
            "actor/clip_fraction": clip_low | clip_high,
            "actor/clip_low_fraction": clip_low,
            "actor/clip_high_fraction": clip_high,
            "actor/dual_clip_fraction": dual,
        },
    )
    return loss, stats


def _stats(*, loss, mask, keep, clamped, r, rho, token_log_r, flags) -> dict:
    n_mask = jnp.maximum(mask.sum(), 1).astype(jnp.float32)
    n_keep = keep.sum()
    any_kept = n_keep > 0
    safe_keep = jnp.maximum(n_keep, 1).astype(jnp.float32)

    def kept_mean(x):
        return jnp.where(keep, x, 0.0).sum() / safe_keep

    def kept_extreme(x, fn, fill):
        return jnp.where(any_kept, fn(jnp.where(keep, x, fill)), 0.0)

    stats = {name: (flag & keep).sum() / n_mask for name, flag in flags.items()}
    stats.update(
        {
            "actor/loss": jax.lax.stop_gradient(loss),
            "actor/importance_weight_min": kept_extreme(r, jnp.min, jnp.inf),
            "actor/importance_weight_mean": kept_mean(r),
            "actor/importance_weight_max": kept_extreme(r, jnp.max, -jnp.inf),
            "actor/behav_weight_mean": kept_mean(rho),
            "actor/behav_weight_max": kept_extreme(rho, jnp.max, -jnp.inf),
            "actor/approx_kl": kept_mean(jnp.expm1(token_log_r) - token_log_r),
            "actor/kept_tokens": n_keep,
            "actor/rejected_tokens": (mask & ~keep).sum(),
            "actor/clamped_tokens": clamped.sum(),
        }
    )
    return {k: jnp.asarray(v, jnp.float32) for k, v in stats.items()}
