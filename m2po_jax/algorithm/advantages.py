"""Rewards to per-token advantages for GRPO without a critic (AReaL semantics).

Pipeline, in AReaL's order (`PPOActor._compute_advantages`):

```
rewards_B = rewards_B + overlong_penalty(completion_len_B, ...)   # optional (DAPO)
rewards_B = transform_rewards(rewards_B, reward_bias=..., reward_scaling=..., reward_clip=...)
adv_BxT = grpo_token_advantages(rewards_B, loss_mask_BxT, group_size=n_samples, ...)
```

`grpo_token_advantages` normalises the rewards (`reward_norm`), adds the optional
KL penalty after that normalisation, forms the discount-1 / lambda-1 return, and
optionally normalises the advantages over tokens (`adv_norm`). The KL estimators and the
overlong penalty live in `penalties.py` (importable from here too).
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from m2po_jax.algorithm.penalties import (
    KL_ESTIMATORS,
    _check_float,
    kl_estimate,
)
from m2po_jax.common.checks import check_choice, is_number

NORM_LEVELS = ("group", "batch", None)


def transform_rewards(
    rewards_B: ArrayLike,
    *,
    reward_bias: float = 0.0,
    reward_scaling: float = 1.0,
    reward_clip: float = 20.0,
) -> jax.Array:
    """Shifts, scales and clips rewards (AReaL `actor.reward_{bias,scaling,clip}`).

    `R' = clip((R + reward_bias) * reward_scaling, -reward_clip, reward_clip)`

    Args:
      rewards_B: task rewards, any shape.
      reward_bias: added first.
      reward_scaling: multiplied second.
      reward_clip: symmetric clip bound, >= 0.

    Returns:
      float32 rewards of the same shape.
    """
    if is_number(reward_clip) and reward_clip < 0:
        raise ValueError(f"reward_clip must be >= 0, got {reward_clip}")
    rewards = jnp.asarray(rewards_B, jnp.float32)
    return jnp.clip((rewards + reward_bias) * reward_scaling, -reward_clip, reward_clip)


def _grouped(x_BxN: jax.Array, level: str, group_size: int) -> jax.Array:
    """Views rows as [n_groups, everything in a group] for group / batch statistics."""
    if level == "batch":
        return x_BxN.reshape(1, -1)
    return x_BxN.reshape(x_BxN.shape[0] // group_size, -1)


def _normalize(
    x_BxN: jax.Array,
    mask_BxN: jax.Array,
    *,
    group_size: int | None,
    mean_level: str | None,
    std_level: str | None,
    mean_leave1out: bool,
    std_unbiased: bool,
    eps: float,
) -> jax.Array:
    """AReaL `Normalization.__call__` for a [B, N] array whose rows form groups.

    Mirrors areal/utils/data.py (`Normalization.affine_parameters`, `_compute_mean`,
    `_compute_std`): the std is taken around the chosen centre (per element when
    leave-one-out, zero when `mean_level` is None); a group or batch with at most one
    element has std 1 when unbiased; no std level means divide by exactly 1 (no eps); the
    result is zero outside the mask, and an all-false mask returns `x` unchanged.

    One deliberate difference: a group (or batch) with a single valid element gives 0 with
    leave-one-out, as it does without (its own mean) and as AReaL gives for a row group of
    size 1. AReaL's leave-one-out mean of the others is 0 there, which keeps the raw x: a
    baseline-free advantage that moves with `reward_bias` (docs/algorithm.md).
    """
    shape = x_BxN.shape
    m = mask_BxN.astype(jnp.float32)

    if mean_level is None:
        mean = jnp.zeros(shape, jnp.float32)
    elif mean_level == "group" and group_size == 1 and mean_leave1out:
        mean = x_BxN
    else:
        xg, mg = _grouped(x_BxN, mean_level, group_size), _grouped(m, mean_level, group_size)
        count = mg.sum(-1, keepdims=True)
        total = (xg * mg).sum(-1, keepdims=True)
        plain = total / jnp.maximum(count, 1.0)
        if mean_leave1out:
            loo = (total - xg * mg) / jnp.maximum(count - mg, 1.0)
            meang = jnp.where(count <= 1, 0.0, jnp.where(mg > 0, loo, plain))
        else:
            meang = plain
        mean = jnp.broadcast_to(meang, xg.shape).reshape(shape)

    if std_level is None:
        scale = jnp.ones(shape, jnp.float32)
    elif std_level == "group" and group_size == 1 and std_unbiased:
        scale = jnp.ones(shape, jnp.float32) + eps
    else:
        cg = _grouped((x_BxN - mean) * m, std_level, group_size)
        mg = _grouped(m, std_level, group_size)
        count = mg.sum(-1, keepdims=True)
        sum_sq = (cg**2).sum(-1, keepdims=True)
        if std_unbiased:
            std = jnp.where(count <= 1, 1.0, jnp.sqrt(sum_sq / jnp.maximum(count - 1, 1.0)))
        else:
            std = jnp.where(count == 0, 1.0, jnp.sqrt(sum_sq / jnp.maximum(count, 1.0)))
        scale = jnp.broadcast_to(std, cg.shape).reshape(shape) + eps

    out = (x_BxN - mean) * m / scale
    if mean_level is not None and not (mean_level == "group" and group_size == 1):
        # Equal values centre to exactly 0, as in AReaL: a float32
        # mean of values inexact in binary, e.g. 0.7, misses them by an ulp, which a tiny
        # std would then blow up (0.0059 for eight rewards of 0.7).
        xg, mg = _grouped(x_BxN, mean_level, group_size), _grouped(m, mean_level, group_size)
        high = jnp.max(jnp.where(mg > 0, xg, -jnp.inf), -1, keepdims=True)
        low = jnp.min(jnp.where(mg > 0, xg, jnp.inf), -1, keepdims=True)
        flat = jnp.broadcast_to(high == low, xg.shape).reshape(shape)
        out = jnp.where(flat, 0.0, out)
    return jnp.where(m.sum() == 0, x_BxN, out)


def _check_group_size(group_size, batch: int, needed: bool) -> None:
    if not needed:
        return
    if not isinstance(group_size, numbers.Integral) or isinstance(group_size, bool):
        raise TypeError(f"group_size must be a Python int, got {type(group_size).__name__}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if batch % group_size != 0:
        raise ValueError(
            f"batch size {batch} is not a multiple of group_size {group_size}: rows must be "
            "consecutive groups of group_size completions of one prompt"
        )


def normalize_rewards(
    rewards_B: ArrayLike,
    group_size: int,
    *,
    mean_level: str | None = "group",
    std_level: str | None = "group",
    mean_leave1out: bool = False,
    std_unbiased: bool = True,
    eps: float = 1e-5,
) -> jax.Array:
    """GRPO reward normalisation (AReaL `actor.reward_norm`).

    `(R - mean) / (std + eps)` with statistics over each group of `group_size`
    consecutive rows (`"group"`), the whole batch (`"batch"`), or none (`None`:
    mean 0, resp. std 1 and no eps). With `mean_leave1out` the mean for row i is
    `(sum - R_i) / (n - 1)`; the std is then taken around those per-row means (AReaL
    `_compute_std`). Unbiased std divides by n - 1 and is 1 when n <= 1 (AReaL default
    since v0.3.4). A group of one is centred on itself (result 0), with leave-one-out
    too: there are no others to compare with (AReaL keeps R there; docs/algorithm.md).

    Args:
      rewards_B: one scalar reward per row, shape [B].
      group_size: completions per prompt (AReaL `reward_norm.group_size`,
        `gconfig.n_samples`); B must be a multiple when a level is "group".
      mean_level: "group", "batch" or None.
      std_level: "group", "batch" or None.
      mean_leave1out: leave-one-out mean.
      std_unbiased: divide the variance by n - 1 instead of n.
      eps: added to the std.

    Returns:
      float32 normalised rewards, shape [B].
    """
    check_choice("mean_level", mean_level, NORM_LEVELS)
    check_choice("std_level", std_level, NORM_LEVELS)
    rewards = jnp.asarray(rewards_B)
    if rewards.ndim != 1:
        raise ValueError(f"rewards_B must be 1-D [B], got shape {rewards.shape}")
    _check_group_size(group_size, rewards.shape[0], "group" in (mean_level, std_level))
    x = rewards.astype(jnp.float32)[:, None]
    out = _normalize(
        x,
        jnp.ones_like(x, bool),
        group_size=group_size,
        mean_level=mean_level,
        std_level=std_level,
        mean_leave1out=mean_leave1out,
        std_unbiased=std_unbiased,
        eps=eps,
    )
    return out[:, 0]


def normalize_advantages(
    adv_BxT: ArrayLike,
    mask_BxT: ArrayLike,
    *,
    eps: float = 1e-5,
    mean_level: str | None = "batch",
    std_level: str | None = "batch",
    mean_leave1out: bool = False,
    std_unbiased: bool = True,
    group_size: int | None = None,
) -> jax.Array:
    """Masked advantage normalisation over tokens (AReaL `actor.adv_norm`).

    `(A - mean) / (std + eps)` with mean and std over the mask tokens of the whole
    batch by default (or of groups of `group_size` rows); zero outside the mask.
    Same conventions as `normalize_rewards` (AReaL `Normalization` with a loss mask).
    An all-false mask returns the input unchanged.

    Args:
      adv_BxT: advantages, [B, T].
      mask_BxT: tokens that count, [B, T].
      eps: added to the std.
      mean_level / std_level: "batch" (default), "group" or None.
      mean_leave1out: leave-one-out mean over the tokens.
      std_unbiased: divide the variance by n - 1.
      group_size: rows per group; required when a level is "group".

    Returns:
      float32 normalised advantages, [B, T].
    """
    check_choice("mean_level", mean_level, NORM_LEVELS)
    check_choice("std_level", std_level, NORM_LEVELS)
    adv = jnp.asarray(adv_BxT)
    mask = jnp.asarray(mask_BxT)
    _check_float("adv_BxT", adv)
    if adv.ndim != 2 or adv.shape != mask.shape:
        raise ValueError(
            f"adv_BxT and mask_BxT must both be [B, T] of one shape, got {adv.shape} and "
            f"{mask.shape}"
        )
    needs_group = "group" in (mean_level, std_level)
    if needs_group and group_size is None:
        raise ValueError("group_size is required when mean_level or std_level is 'group'")
    _check_group_size(group_size, adv.shape[0], needs_group)
    return _normalize(
        adv.astype(jnp.float32),
        mask.astype(bool),
        group_size=group_size,
        mean_level=mean_level,
        std_level=std_level,
        mean_leave1out=mean_leave1out,
        std_unbiased=std_unbiased,
        eps=eps,
    )


def grpo_token_advantages(
    rewards_B: ArrayLike,
    loss_mask_BxT: ArrayLike,
    *,
    group_size: int,
    mean_level: str | None = "group",
    std_level: str | None = "group",
    mean_leave1out: bool = False,
    std_unbiased: bool = True,
    eps: float = 1e-5,
    kl_ctl: float = 0.0,
    logp_BxT: ArrayLike | None = None,
    ref_logp_BxT: ArrayLike | None = None,
    kl_estimator: str = "k1",
    kl_clamp: float | None = 10.0,
    adv_norm: bool = False,
) -> jax.Array:
    """Per-token GRPO advantages: normalised sequence reward plus KL return.

    With discount 1, lambda 1 and no critic (AReaL GAE loop with zero values), each
    completion token t of row b gets

    `A[b, t] = R_norm[b] + sum_{t' >= t, mask[b, t']} -kl_ctl * KL[b, t']`

    where `R_norm = normalize_rewards(rewards_B, ...)` and
    `KL = clip(kl_estimate(logp, ref_logp), -kl_clamp, kl_clamp)` (AReaL clamps at
    10). The KL penalty is added *after* reward normalisation, per token, as a reward
    that the return accumulates (AReaL places the task reward on the last completion
    token and the per-token KL rewards on every token, then runs GAE). `adv_norm=True`
    then applies `normalize_advantages` (batch mean/std over mask tokens, unbiased,
    eps 1e-5). Zero outside the mask.

    Args:
      rewards_B: transformed task rewards, [B].
      loss_mask_BxT: completion tokens that count, [B, T].
      group_size: completions per prompt; rows are consecutive groups.
      mean_level, std_level, mean_leave1out, std_unbiased, eps: `normalize_rewards`.
      kl_ctl: KL coefficient (`actor.kl_ctl`; AReaL's default is 0.1, here 0 = off).
      logp_BxT: policy log-probs for the KL (AReaL uses the behaviour log-probs);
        required when kl_ctl != 0.
      ref_logp_BxT: reference-policy log-probs, [B, T]; required when kl_ctl != 0.
      kl_estimator: "k1", "k2" or "k3".
      kl_clamp: symmetric clamp of the per-token KL, None for none.
      adv_norm: normalise the advantages over tokens afterwards.

    Returns:
      float32 advantages, [B, T].
    """
    check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    mask = jnp.asarray(loss_mask_BxT)
    rewards = jnp.asarray(rewards_B)
    if mask.ndim != 2:
        raise ValueError(f"loss_mask_BxT must be 2-D [B, T], got shape {mask.shape}")
    if rewards.shape != mask.shape[:1]:
        raise ValueError(
            f"rewards_B shape {rewards.shape} does not match loss_mask_BxT shape {mask.shape}: "
            "expected one reward per row"
        )
    use_kl = not (is_number(kl_ctl) and kl_ctl == 0)
    if use_kl:
        if logp_BxT is None or ref_logp_BxT is None:
            raise ValueError(
                f"kl_ctl={kl_ctl} needs both logp_BxT and ref_logp_BxT (got "
                f"logp_BxT={'None' if logp_BxT is None else 'array'}, "
                f"ref_logp_BxT={'None' if ref_logp_BxT is None else 'array'})"
            )
        if jnp.shape(logp_BxT) != mask.shape or jnp.shape(ref_logp_BxT) != mask.shape:
            raise ValueError(
                f"logp_BxT {jnp.shape(logp_BxT)} and ref_logp_BxT {jnp.shape(ref_logp_BxT)} "
                f"must have the shape of loss_mask_BxT {mask.shape}"
            )
    if kl_clamp is not None and is_number(kl_clamp) and kl_clamp <= 0:
        raise ValueError(f"kl_clamp must be > 0 or None, got {kl_clamp}")

    mask = mask.astype(bool)
    reward_norm_B = normalize_rewards(
        rewards,
        group_size,
        mean_level=mean_level,
        std_level=std_level,
        mean_leave1out=mean_leave1out,
        std_unbiased=std_unbiased,
        eps=eps,
    )
    adv = jnp.broadcast_to(reward_norm_B[:, None], mask.shape)
    if use_kl:
        kl = kl_estimate(logp_BxT, ref_logp_BxT, kl_estimator)
        if kl_clamp is not None:
            kl = jnp.clip(kl, -kl_clamp, kl_clamp)
        kl_reward = jnp.where(mask, -kl_ctl * kl, 0.0)
        # Reverse cumulative sum along T: the discount-1 return of the KL rewards.
        kl_return = jnp.flip(jnp.cumsum(jnp.flip(kl_reward, -1), -1), -1)
        adv = adv + kl_return
    adv = jnp.where(mask, adv, 0.0)
    if adv_norm:
        adv = normalize_advantages(adv, mask)
    return adv


@dataclasses.dataclass(frozen=True)
class AdvantageSettings:
    """The options of `transform_rewards` and `grpo_token_advantages` as one frozen,
    hashable record (AReaL's `actor.reward_*`, `actor.reward_norm.*`, `actor.kl_ctl`,
    `actor.kl_estimator`, `actor.adv_norm`); checked when built."""

    group_size: int
    reward_bias: float = 0.0
    reward_scaling: float = 1.0
    reward_clip: float = 20.0
    mean_level: str | None = "group"
    std_level: str | None = "group"
    mean_leave1out: bool = False
    std_unbiased: bool = True
    eps: float = 1e-5
    kl_ctl: float = 0.0
    kl_estimator: str = "k1"
    kl_clamp: float | None = 10.0
    adv_norm: bool = False

    def __post_init__(self):
        check_choice("mean_level", self.mean_level, NORM_LEVELS)
        check_choice("std_level", self.std_level, NORM_LEVELS)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if self.reward_clip < 0:
            raise ValueError(f"reward_clip must be >= 0, got {self.reward_clip}")


def token_advantages(
    settings: AdvantageSettings,
    rewards_B: ArrayLike,
    loss_mask_BxT: ArrayLike,
    logp_BxT: ArrayLike | None = None,
    ref_logp_BxT: ArrayLike | None = None,
) -> jax.Array:
    """Raw task rewards to per-token advantages: `transform_rewards`, then
    `grpo_token_advantages`. The KL penalty applies only where reference log-probs are
    given (`ref_logp_BxT`, with `logp_BxT` the policy's: AReaL uses the behaviour's)."""
    s = settings
    rewards = transform_rewards(
        rewards_B,
        reward_bias=s.reward_bias,
        reward_scaling=s.reward_scaling,
        reward_clip=s.reward_clip,
    )
    with_kl = ref_logp_BxT is not None
    return grpo_token_advantages(
        rewards,
        loss_mask_BxT,
        group_size=s.group_size,
        mean_level=s.mean_level,
        std_level=s.std_level,
        mean_leave1out=s.mean_leave1out,
        std_unbiased=s.std_unbiased,
        eps=s.eps,
        kl_ctl=s.kl_ctl if with_kl else 0.0,
        logp_BxT=logp_BxT if with_kl else None,
        ref_logp_BxT=ref_logp_BxT,
        kl_estimator=s.kl_estimator,
        kl_clamp=s.kl_clamp,
        adv_norm=s.adv_norm,
    )
