"""Where the proximal log-probs come from (AReaL's `actor.prox_logp_method`).

The decoupled loss compares the current policy with the proximal one, the params at the
start of the step. "recompute" runs the trunk once more, without gradient, over the batch;
with one PPO minibatch the train step instead takes them from the loss's own forward pass
(gradient stopped): before the first update the current params are the proximal ones, so
that is exact and costs nothing. "loglinear" skips the extra pass in every case by
interpolating between the behaviour log-probs and the current ones by policy version:

    alpha = clip((v_theta - 1 - v_behav) / (v_theta - v_behav), 0, 1)   (0 if v_theta == v_behav)
    prox ~ behav + alpha * (logp_theta - behav)

with v_theta the version of the params being trained (the step) and v_behav the row's
version. It is exact for on-policy rows (alpha = 0 and the behaviour policy is the proximal
one); for a row k >= 1 versions stale it places the proximal policy a fraction (k - 1) / k
of the way from behaviour to current, which assumes the policy moved evenly: an
approximation. "metrics" recomputes and also reports the approximation's error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

PROX_LOGP_METHODS = ("recompute", "loglinear", "metrics")


def loglinear_alpha(version_B: ArrayLike, current_version: ArrayLike) -> jax.Array:
    """Per-row interpolation weight, float32 [B] (AReaL's `compute_prox_logp_approximations`)."""
    behav = jnp.asarray(version_B, jnp.float32)
    theta = jnp.asarray(current_version, jnp.float32)
    gap = theta - behav
    alpha = jnp.where(gap > 0, (theta - 1.0 - behav) / jnp.where(gap > 0, gap, 1.0), 0.0)
    return jnp.clip(alpha, 0.0, 1.0)


def loglinear_prox(
    behav_logp_BxT: ArrayLike,
    logp_BxT: ArrayLike,
    version_B: ArrayLike,
    current_version: ArrayLike,
) -> jax.Array:
    """prox ~ behav + alpha * (logp - behav), float32, gradient stopped (see module doc)."""
    behav = jnp.asarray(behav_logp_BxT, jnp.float32)
    logp = jax.lax.stop_gradient(jnp.asarray(logp_BxT, jnp.float32))
    if behav.shape != logp.shape or behav.ndim != 2:
        raise ValueError(
            f"behav_logp_BxT {behav.shape} and logp_BxT {logp.shape} must share one [B, T] shape"
        )
    alpha = loglinear_alpha(version_B, current_version)
    if alpha.shape != behav.shape[:1]:
        raise ValueError(f"version_B has shape {alpha.shape}; expected ({behav.shape[0]},)")
    return behav + alpha[:, None] * (logp - behav)


def approximation_stats(approx_BxT, prox_BxT, behav_BxT, mask_BxT) -> dict:
    """How far the approximation is from the recomputed proximal log-probs, over `mask`.

    "prox/loglinear_abs_error": mean |approx - prox|; "prox/loglinear_weight_error": mean
    |exp(approx - behav) - exp(prox - behav)| (the behaviour weight rho's error).
    """
    mask = jnp.asarray(mask_BxT, bool)
    n = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)

    def mean(x):
        return jnp.sum(jnp.where(mask, x, 0.0)) / n

    weight_error = jnp.abs(jnp.exp(approx_BxT - behav_BxT) - jnp.exp(prox_BxT - behav_BxT))
    return {
        "prox/loglinear_abs_error": mean(jnp.abs(approx_BxT - prox_BxT)),
        "prox/loglinear_weight_error": mean(weight_error),
    }
