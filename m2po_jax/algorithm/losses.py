"""Actor losses for off-policy RL of LLMs: decoupled PPO with behaviour correction
(AReaL), dual clip, clip-higher, GSPO sequence-level ratios and SAPO.

Semantics follow docs/algorithm.md ("The loss") and, where it is silent, AReaL's
`areal/utils/functional/functional.py` (`ppo_actor_loss_fn`,
`apply_rejection_sampling`, `_compute_sequence_level_ratio_and_advantages`,
`sapo_loss_fn`) and `RejectionSamplingConfig` in `areal/api/cli_args.py`; the rollout
correction's weights follow verl's `algorithm.rollout_correction`.

Deliberate differences from AReaL, all documented where they apply:
- `rejection_sampling=None` still multiplies the loss by the behaviour weight
  rho = exp(prox - behav) (AReaL then drops rho). With the decoupled loss off,
  prox := behav so rho = 1 either way.
- the behaviour correction's own differences: m2po_jax/algorithm/rejection.py.
- GSPO's per-sequence mean advantage is taken over the masked tokens, as AReaL's.
- The ratio clip passes the gradient at its bounds, as `torch.clamp` does (`_clamp`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from m2po_jax.algorithm.rejection import (
    BehaviourWeights,
    RejectionSampling,
    RolloutCorrection,
    behaviour_correction,
    check_composition,
    row_mean,
)
from m2po_jax.common.checks import check_choice, is_number

IS_LEVELS = ("token", "sequence")
DENOMINATORS = ("kept", "valid")


def _checked_inputs(logp, prox, behav, adv, mask, valid):
    """The inputs as arrays after checking them: one [B, T] shape, floating log-probs."""
    logp, prox, behav, adv, mask = map(jnp.asarray, (logp, prox, behav, adv, mask))
    valid = None if valid is None else jnp.asarray(valid)
    if logp.ndim != 2:
        raise ValueError(f"logp_BxT must be 2-D [B, T], got shape {logp.shape}")
    floats = (("prox_logp_BxT", prox), ("behav_logp_BxT", behav), ("advantages_BxT", adv))
    for name, x in (*floats, ("mask_BxT", mask), ("valid_mask_BxT", valid)):
        if x is not None and x.shape != logp.shape:
            raise ValueError(
                f"{name} has shape {x.shape} but logp_BxT has shape {logp.shape}; all "
                "inputs must share one [B, T] shape"
            )
    for name, x in (("logp_BxT", logp), *floats):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    return logp, prox, behav, adv, mask.astype(bool), valid


def _check_options(
    eps_clip, eps_clip_higher, c_clip, sapo_taus, rejection_sampling, rollout_correction
) -> None:
    """Ranges of the concrete scalar options (traced ones are the caller's)."""
    if rejection_sampling is not None and not isinstance(rejection_sampling, RejectionSampling):
        raise TypeError(
            "rejection_sampling must be a RejectionSampling or None, got "
            f"{type(rejection_sampling).__name__}"
        )
    if not isinstance(rollout_correction, RolloutCorrection):
        raise TypeError(
            "rollout_correction must be a RolloutCorrection, got "
            f"{type(rollout_correction).__name__}"
        )
    if eps_clip is None and eps_clip_higher is not None:
        raise ValueError(
            f"eps_clip_higher={eps_clip_higher} needs a ratio clip, but eps_clip=None turns "
            "it off; pass eps_clip_higher=None"
        )
    if is_number(eps_clip) and not 0.0 <= eps_clip < 1.0:
        raise ValueError(f"eps_clip must be in [0, 1) or None, got {eps_clip}")
    if is_number(eps_clip_higher) and eps_clip_higher < 0.0:
        raise ValueError(f"eps_clip_higher must be >= 0 or None, got {eps_clip_higher}")
    if is_number(c_clip) and c_clip <= 1.0:
        raise ValueError(f"c_clip must be None or > 1, got {c_clip}")
    for name, tau in zip(("sapo_tau_pos", "sapo_tau_neg"), sapo_taus, strict=True):
        if is_number(tau) and tau <= 0:
            raise ValueError(f"{name} must be > 0, got {tau}")


def _clamp(x, low, high):
    """`torch.clamp`: the gradient passes wherever low <= x <= high, bounds included
    (`jnp.clip` halves it at each bound it touches: at r = 1 with a zero clip range the PPO
    loss's gradient was 0.625 of AReaL's)."""
    return jnp.where((x >= low) & (x <= high), x, jnp.clip(x, low, high))


def _clipped_objective(r, adv, eps_clip, eps_clip_higher, c_clip):
    """PPO's per-token loss and its clip flags (low, high, dual), before the weight rho.

    `max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_higher))`; eps_clip=None: `-A r`.
    Dual clip then bounds the loss of A < 0 tokens by `c_clip |A|`.
    """
    unclipped = -adv * r
    clip_low = clip_high = dual = jnp.zeros(r.shape, bool)
    per_token = unclipped
    if eps_clip is not None:
        eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher
        clipped = -adv * _clamp(r, 1.0 - eps_clip, 1.0 + eps_high)
        per_token = jnp.maximum(unclipped, clipped)
        clip_active = unclipped < clipped
        clip_low = clip_active & (adv < 0)  # the r < 1 - eps_clip side binds for A < 0
        clip_high = clip_active & (adv > 0)
    if c_clip is not None:
        bound = c_clip * jnp.abs(adv)
        dual = (adv < 0) & (bound < per_token)
        per_token = jnp.where(adv < 0, jnp.minimum(per_token, bound), per_token)
    return per_token, clip_low, clip_high, dual


def _sapo_objective(r, adv, tau_pos, tau_neg):
    """SAPO's per-token loss `-(4 / tau) sigmoid(tau (r - 1)) A`, and no clip flags."""
    tau = jnp.where(adv > 0, tau_pos, tau_neg)
    no_clip = jnp.zeros(r.shape, bool)
    return -(4.0 / tau) * jax.nn.sigmoid(tau * (r - 1.0)) * adv, no_clip, no_clip, no_clip


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The options of `policy_loss` as one frozen record, checked when built (its Args say
    what each means). Hashable, so a jitted step can take it as a static argument; only
    `eps_clip` / `eps_clip_higher` may be traced scalars (the capped-mean rule's range),
    and a record holding one is not hashed."""

    eps_clip: float | jax.Array | None = 0.2
    eps_clip_higher: float | jax.Array | None = None
    c_clip: float | None = None
    use_decoupled_loss: bool = True
    importance_sampling_level: str = "token"
    rejection_sampling: RejectionSampling | None = RejectionSampling()  # noqa: B008 (frozen)
    use_sapo_loss: bool = False
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    denominator: str = "kept"
    rollout_correction: RolloutCorrection = RolloutCorrection()  # noqa: B008 (frozen)

    def __post_init__(self):
        check_choice("importance_sampling_level", self.importance_sampling_level, IS_LEVELS)
        check_choice("denominator", self.denominator, DENOMINATORS)
        taus = (self.sapo_tau_pos, self.sapo_tau_neg)
        _check_options(
            self.eps_clip,
            self.eps_clip_higher,
            self.c_clip,
            taus,
            self.rejection_sampling,
            self.rollout_correction,
        )
        if self.use_sapo_loss and self.use_decoupled_loss:
            raise ValueError(
                "use_sapo_loss=True is not compatible with use_decoupled_loss=True; "
                "pass use_decoupled_loss=False (AReaL: actor.use_decoupled_loss=false)"
            )
        check_composition(
            self.rollout_correction,
            self.rejection_sampling,
            use_decoupled_loss=self.use_decoupled_loss,
            use_sapo_loss=self.use_sapo_loss,
        )


def policy_loss(
    logp_BxT: ArrayLike,
    prox_logp_BxT: ArrayLike,
    behav_logp_BxT: ArrayLike,
    advantages_BxT: ArrayLike,
    mask_BxT: ArrayLike,
    *,
    eps_clip: float | jax.Array | None = 0.2,
    eps_clip_higher: float | jax.Array | None = None,
    c_clip: float | None = None,
    use_decoupled_loss: bool = True,
    importance_sampling_level: str = "token",
    rejection_sampling: RejectionSampling | None = RejectionSampling(),  # noqa: B008 (frozen)
    use_sapo_loss: bool = False,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    denominator: str = "kept",
    rollout_correction: RolloutCorrection = RolloutCorrection(),  # noqa: B008 (frozen)
    valid_mask_BxT: ArrayLike | None = None,
    count: ArrayLike | None = None,
) -> tuple[jax.Array, dict]:
    """Actor loss: AReaL's decoupled PPO (default), GSPO, or SAPO.

    Decoupled PPO, per token (A = advantage, r = exp(logp - prox_logp)):

    `L = max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_higher))`,
    or `L = -A * r` without a ratio clip (`eps_clip=None`: the paper's M2PO variant),
    with dual clip (`c_clip > 1`) `L = min(L, c_clip * |A|)` where A < 0, then
    `L *= w` on the tokens `rejection_sampling` keeps (see `RejectionSampling`; None keeps
    every token), with w the `rollout_correction` weight (see `RolloutCorrection`): by
    default `rho = stop_grad(exp(prox_logp - behav_logp))`, else the row's product or
    geometric mean of rho, or 1, each optionally truncated at `is_threshold`.
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
      eps_clip: lower clip range, a Python float in [0, 1) or a traced scalar; None = no
        ratio clip (then eps_clip_higher must be None; c_clip still applies).
      eps_clip_higher: upper clip range (>= 0); None = eps_clip.
      c_clip: dual-clip factor > 1, or None.
      use_decoupled_loss: AReaL's decoupled PPO; False sets prox := behav.
      importance_sampling_level: "token" or "sequence" (GSPO).
      rejection_sampling: which tokens the behaviour correction keeps; None keeps all.
      use_sapo_loss: SAPO instead of the clipped objective.
      sapo_tau_pos, sapo_tau_neg: SAPO temperatures (> 0).
      denominator: "kept" or "valid".
      rollout_correction: the behaviour weight of the kept tokens (level, truncation).
      valid_mask_BxT: the mask before M2PO; required for denominator "valid".
      count: the denominator n, when it is counted over more tokens than these.

    Returns:
      (loss, stats): a float32 scalar and a dict of float32 scalars. Fractions are
      over the `mask_BxT` tokens (counting only kept tokens in the numerator, as
      AReaL's clip_ratio); weights are over kept tokens (0 if none):
      "actor/loss", "actor/clip_fraction", "actor/clip_low_fraction",
      "actor/clip_high_fraction", "actor/dual_clip_fraction",
      "actor/importance_weight_{min,mean,max}" (r as used in the loss),
      "actor/behav_weight_{mean,max}" (the weight w as the loss takes it),
      "actor/approx_kl" (mean of r - 1 - log r over kept tokens with the token-level
      r = exp(logp - prox_logp): the k3 estimate of KL(prox || theta), >= 0),
      "actor/kept_tokens", "actor/rejected_tokens" (mask tokens dropped by the
      correction), "actor/clamped_tokens" (kept tokens whose rho was clamped),
      "rollout_corr/is_mean" (mean of w before `is_threshold` over kept tokens),
      "rollout_corr/is_truncated_fraction" (share of kept tokens whose w the threshold
      cut), "rollout_corr/truncated_tokens" (their number).
    """
    settings = LossSettings(
        eps_clip=eps_clip,
        eps_clip_higher=eps_clip_higher,
        c_clip=c_clip,
        use_decoupled_loss=use_decoupled_loss,
        importance_sampling_level=importance_sampling_level,
        rejection_sampling=rejection_sampling,
        use_sapo_loss=use_sapo_loss,
        sapo_tau_pos=sapo_tau_pos,
        sapo_tau_neg=sapo_tau_neg,
        denominator=denominator,
        rollout_correction=rollout_correction,
    )
    return policy_loss_with(
        settings,
        logp_BxT,
        prox_logp_BxT,
        behav_logp_BxT,
        advantages_BxT,
        mask_BxT,
        valid_mask_BxT=valid_mask_BxT,
        count=count,
    )


def policy_loss_with(
    settings: LossSettings,
    logp_BxT: ArrayLike,
    prox_logp_BxT: ArrayLike,
    behav_logp_BxT: ArrayLike,
    advantages_BxT: ArrayLike,
    mask_BxT: ArrayLike,
    *,
    valid_mask_BxT: ArrayLike | None = None,
    count: ArrayLike | None = None,
) -> tuple[jax.Array, dict]:
    """`policy_loss` with its options in one `LossSettings` (what the train step calls)."""
    o = settings
    if o.denominator == "valid" and valid_mask_BxT is None and count is None:
        raise ValueError("denominator='valid' needs valid_mask_BxT (the mask before M2PO)")
    logp, prox, behav, adv, mask, valid_mask = _checked_inputs(
        logp_BxT, prox_logp_BxT, behav_logp_BxT, advantages_BxT, mask_BxT, valid_mask_BxT
    )
    per_token, weights, r, log_r, flags = _token_terms(o, logp, prox, behav, adv, mask)
    if count is None:
        count = mask.sum() if o.denominator == "kept" else valid_mask.astype(bool).sum()
    loss = jnp.where(weights.keep_BxT, per_token, 0.0).sum() / jnp.maximum(count, 1)
    return loss, _stats(loss, mask, weights, r, log_r, flags)


def token_losses(
    settings: LossSettings, logp_BxT, prox_logp_BxT, behav_logp_BxT, advantages_BxT, mask_BxT
) -> tuple[jax.Array, jax.Array]:
    """(per-token loss, tokens taking part): what `policy_loss_with` sums over `mask_BxT`
    (ratio, clip, behaviour weight), before the denominator; tokens the behaviour
    correction rejects are not taking part."""
    logp, prox, behav, adv, mask, _ = _checked_inputs(
        logp_BxT, prox_logp_BxT, behav_logp_BxT, advantages_BxT, mask_BxT, None
    )
    per_token, weights, *_ = _token_terms(settings, logp, prox, behav, adv, mask)
    return jnp.where(weights.keep_BxT, per_token, 0.0), weights.keep_BxT


def _token_terms(o: LossSettings, logp, prox, behav, adv, mask):
    """(per-token loss, `BehaviourWeights`, r, log-ratio, clip flags) of checked inputs."""
    logp = logp.astype(jnp.float32)
    behav = jax.lax.stop_gradient(behav.astype(jnp.float32))
    prox = jax.lax.stop_gradient(prox.astype(jnp.float32))
    if o.use_sapo_loss or not o.use_decoupled_loss:
        prox = behav
    adv = jax.lax.stop_gradient(adv.astype(jnp.float32))

    if o.use_sapo_loss:
        ones, no = jnp.where(mask, 1.0, 0.0), jnp.zeros_like(mask)
        weights = BehaviourWeights(ones, mask, no, no, ones)
    else:
        weights = behaviour_correction(
            prox, behav, mask, o.rejection_sampling, o.rollout_correction
        )

    log_r, r, adv = _ratio_and_advantage(
        logp, prox, adv, weights.keep_BxT, o.importance_sampling_level
    )

    if o.use_sapo_loss:
        per_token, clip_low, clip_high, dual = _sapo_objective(
            r, adv, o.sapo_tau_pos, o.sapo_tau_neg
        )
    else:
        per_token, clip_low, clip_high, dual = _clipped_objective(
            r, adv, o.eps_clip, o.eps_clip_higher, o.c_clip
        )
        per_token = per_token * weights.weight_BxT
    flags = {
        "actor/clip_fraction": clip_low | clip_high,
        "actor/clip_low_fraction": clip_low,
        "actor/clip_high_fraction": clip_high,
        "actor/dual_clip_fraction": dual,
    }
    return per_token, weights, r, log_r, flags


def _ratio_and_advantage(logp, prox, adv, keep, level: str):
    """(token log-ratio, r, A) as the loss takes them: per token, or (GSPO, `level`
    "sequence") r = exp(mean log-ratio) and A = mean A over each row's kept tokens."""
    # Outside `keep` the log-ratio is replaced by 0 so that padding (e.g. -inf
    # log-probs) can produce neither inf in the forward pass nor NaN gradients.
    log_r = jnp.where(keep, logp - prox, 0.0)
    adv = jnp.where(keep, adv, 0.0)
    if level == "sequence":
        r = jnp.broadcast_to(jnp.exp(row_mean(log_r, keep)), keep.shape)
        adv = jnp.broadcast_to(row_mean(adv, keep), keep.shape)
    else:
        r = jnp.exp(log_r)
    return log_r, r, adv


def _stats(loss, mask, weights: BehaviourWeights, r, log_r, flags) -> dict:
    keep, rho = weights.keep_BxT, weights.weight_BxT
    r = jax.lax.stop_gradient(r)
    token_log_r = jax.lax.stop_gradient(log_r)
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
            "actor/clamped_tokens": weights.clamped_BxT.sum(),
            "rollout_corr/is_mean": kept_mean(weights.untruncated_BxT),
            "rollout_corr/is_truncated_fraction": weights.truncated_BxT.sum() / safe_keep,
            "rollout_corr/truncated_tokens": weights.truncated_BxT.sum(),
        }
    )
    return {k: jnp.asarray(v, jnp.float32) for k, v in stats.items()}
