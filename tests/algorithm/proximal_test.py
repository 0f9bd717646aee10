"""The log-linear proximal approximation against AReaL's formula, written in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax.algorithm import proximal


def _alpha_reference(versions, current):
    out = []
    for v in versions:
        diff, gap = current - v, current - 1 - v
        out.append(min(max(gap / diff, 0.0), 1.0) if diff > 0 else 0.0)
    return np.asarray(out, np.float32)


def test_alpha_matches_the_formula():
    versions = np.array([10, 9, 8, 6, 2, 11])  # on-policy, 1, 2, 4, 8 stale, and a newer row
    np.testing.assert_allclose(
        proximal.loglinear_alpha(versions, 10), _alpha_reference(versions, 10), rtol=1e-6
    )
    np.testing.assert_allclose(proximal.loglinear_alpha(versions, 10)[:5], [0, 0, 0.5, 0.75, 0.875])


def test_loglinear_interpolates_and_stops_gradient():
    rng = np.random.default_rng(0)
    behav = -rng.random((4, 6)).astype(np.float32)
    logp = -rng.random((4, 6)).astype(np.float32)
    versions = np.array([5, 4, 3, 1])
    approx = proximal.loglinear_prox(behav, logp, versions, 5)
    alpha = _alpha_reference(versions, 5)[:, None]
    np.testing.assert_allclose(approx, behav + alpha * (logp - behav), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(approx[0], behav[0])  # on-policy row: exactly behaviour
    grad = jax.grad(lambda lp: jnp.sum(proximal.loglinear_prox(behav, lp, versions, 5)))(logp)
    assert float(jnp.abs(grad).max()) == 0.0


def test_exact_on_policy_and_error_reported_when_stale():
    # On-policy, behaviour = proximal: the approximation is the recomputed value.
    rng = np.random.default_rng(1)
    prox = -rng.random((3, 5)).astype(np.float32)
    logp = prox + 0.01 * rng.standard_normal((3, 5)).astype(np.float32)
    mask = np.ones((3, 5), bool)
    on_policy = proximal.loglinear_prox(prox, logp, np.full(3, 7), 7)
    stats = proximal.approximation_stats(on_policy, prox, prox, mask)
    assert float(stats["prox/loglinear_abs_error"]) == 0.0
    # Two versions stale: alpha = 1/2, so the error is half of |prox - behav| plus the move.
    behav = prox - 0.2
    stale = proximal.loglinear_prox(behav, prox, np.full(3, 5), 7)
    stats = proximal.approximation_stats(stale, prox, behav, mask)
    np.testing.assert_allclose(stats["prox/loglinear_abs_error"], 0.1, rtol=1e-5)
    np.testing.assert_allclose(
        stats["prox/loglinear_weight_error"], np.exp(0.2) - np.exp(0.1), rtol=1e-5
    )


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="must share one"):
        proximal.loglinear_prox(np.zeros((2, 3)), np.zeros((2, 4)), np.zeros(2), 1)
    with pytest.raises(ValueError, match="version_B has shape"):
        proximal.loglinear_prox(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros(3), 1)
