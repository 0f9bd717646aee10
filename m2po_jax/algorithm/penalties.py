"""The two penalties GRPO rewards can carry: KL to a reference policy, and DAPO's overlong one.

`kl_estimate` is added to the normalised rewards per token when `actor.kl_ctl > 0`
(`advantages.grpo_token_advantages`); `overlong_penalty` to the task rewards before they
are transformed. Both are re-exported by `advantages.py`.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from m2po_jax.common.checks import check_choice, is_number

KL_ESTIMATORS = ("k1", "k2", "k3")


def _check_float(name: str, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")


def kl_from_log_ratio(log_ratio: ArrayLike, estimator: str = "k1") -> jax.Array:
    """Schulman's KL estimators from `d = l - l_ref` (float32).

    k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d (AReaL `KLEstimator`, also used
    by its rejection-sampling KL metrics). Raises ValueError on an unknown name.
    """
    check_choice("estimator", estimator, KL_ESTIMATORS)
    d = jnp.asarray(log_ratio, jnp.float32)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d**2
    return jnp.expm1(-d) + d


def kl_estimate(logp_BxT: ArrayLike, ref_logp_BxT: ArrayLike, estimator: str = "k1") -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs.

    With `d = logp - ref_logp` (float32):
    k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d  ( = exp(l_ref - l) - 1 - (l_ref - l) ).

    Args:
      logp_BxT: log-probs under the policy (AReaL passes the behaviour log-probs).
      ref_logp_BxT: log-probs under the reference policy, same shape.
      estimator: "k1", "k2" or "k3".

    Returns:
      float32 per-token estimates, same shape.
    """
    check_choice("estimator", estimator, KL_ESTIMATORS)
    logp, ref = jnp.asarray(logp_BxT), jnp.asarray(ref_logp_BxT)
    _check_float("logp_BxT", logp)
    _check_float("ref_logp_BxT", ref)
    if logp.shape != ref.shape:
        raise ValueError(
            f"logp_BxT and ref_logp_BxT must have one shape, got {logp.shape} and {ref.shape}"
        )
    return kl_from_log_ratio(logp.astype(jnp.float32) - ref.astype(jnp.float32), estimator)


def overlong_penalty(
    completion_len_B: ArrayLike,
    max_new_tokens: int,
    overlong_tokens: int,
    penalty_factor: float,
) -> jax.Array:
    """DAPO soft overlong punishment, to be added to the task reward.

    With `L_max = max_new_tokens`, `L_cache = overlong_tokens`:
    0 for `len <= L_max - L_cache`; `(L_max - L_cache - len) / L_cache * factor`
    for `L_max - L_cache < len <= L_max` (reaching `-factor` at the cap); `-factor`
    beyond (DAPO; AReaL's `reward_overlong_penalty` is the same formula up to the cap
    and unbounded past it, which cannot happen when lengths are capped).
    AReaL applies it before `transform_rewards` (`actor.overlong_reward_penalty`).

    Args:
      completion_len_B: generated tokens per row (int or float), [B].
      max_new_tokens: L_max (`gconfig.max_new_tokens`), > 0.
      overlong_tokens: L_cache (`actor.overlong_tokens`), in [1, max_new_tokens].
      penalty_factor: `actor.overlong_penalty_factor`, >= 0.

    Returns:
      float32 non-positive penalties, [B].
    """
    for name, v in (("max_new_tokens", max_new_tokens), ("overlong_tokens", overlong_tokens)):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool):
            raise TypeError(f"{name} must be a Python int, got {type(v).__name__}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 1 <= overlong_tokens <= max_new_tokens:
        raise ValueError(
            f"overlong_tokens must be in [1, max_new_tokens={max_new_tokens}], got "
            f"{overlong_tokens}"
        )
    if is_number(penalty_factor) and penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    length = jnp.asarray(completion_len_B).astype(jnp.float32)
    exceed = length - (max_new_tokens - overlong_tokens)
    penalty = -exceed / overlong_tokens * penalty_factor
    return jnp.clip(penalty, -penalty_factor, 0.0)
