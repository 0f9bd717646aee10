"""The step diagnostics: m2 quantiles, the ESS of the behaviour weights, the masked share of
the loss, against numpy and hand-computed values; their parts combine across blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax.algorithm import diagnostics

_finalize = jax.jit(lambda m2, log_w, valid, kept: diagnostics.finalize(
    diagnostics.parts(m2, log_w, valid, kept)))  # fmt: skip


def _reference(m2, log_w, valid, kept):
    """The statistics in numpy: exact quantiles (np.quantile), ESS from the weights."""
    m2, log_w = np.asarray(m2, np.float64), np.asarray(log_w, np.float64)
    kept = valid & kept
    finite = m2[valid & np.isfinite(m2)]
    out = {name: np.quantile(finite, q) for name, q in diagnostics.QUANTILES}
    out["m2po/m2_max"] = finite.max()
    for name, where in (("offpolicy/ess", valid), ("offpolicy/ess_kept", kept)):
        w = np.exp(log_w[where])
        out[name] = w.sum() ** 2 / (w.size * (w**2).sum())
    return out


def test_ess_of_known_weights():
    # w = (2, 1, 1): (2 + 1 + 1)^2 / (3 * (4 + 1 + 1)) = 16 / 18; kept (1, 1): 1.
    log_w = jnp.log(jnp.array([2.0, 1.0, 1.0, 7.0]))
    valid = jnp.array([True, True, True, False])
    kept = jnp.array([False, True, True, True])
    got = _finalize(jnp.zeros(4), log_w, valid, kept)
    np.testing.assert_allclose(got["offpolicy/ess"], 16 / 18, rtol=1e-6)
    np.testing.assert_allclose(got["offpolicy/ess_kept"], 1.0, rtol=1e-6)
    # Huge log-weights neither overflow nor lose the ratio: w = (e^200, e^199).
    big = _finalize(jnp.zeros(2), jnp.array([200.0, 199.0]), jnp.ones(2, bool), jnp.ones(2, bool))
    e = np.e
    np.testing.assert_allclose(big["offpolicy/ess"], (e + 1) ** 2 / (2 * (e**2 + 1)), rtol=1e-5)


def test_no_valid_tokens_read_as_on_policy():
    got = _finalize(jnp.ones(3), jnp.ones(3), jnp.zeros(3, bool), jnp.zeros(3, bool))
    assert float(got["offpolicy/ess"]) == 1.0 and float(got["m2po/m2_max"]) == 0.0
    assert float(got["m2po/m2_p50"]) == 0.0


@pytest.mark.parametrize("scale", [1e-6, 0.05, 3.0])
def test_quantiles_are_within_one_bin_of_numpy(scale):
    rng = np.random.default_rng(0)
    m2 = (scale * rng.lognormal(0.0, 2.0, (64, 40))).astype(np.float32)
    valid = rng.random(m2.shape) < 0.8
    kept = rng.random(m2.shape) < 0.9
    log_w = rng.normal(0.0, 0.7, m2.shape).astype(np.float32)
    m2[3, 4] = np.inf  # non-finite m2: left out
    got, want = _finalize(m2, log_w, valid, kept), _reference(m2, log_w, valid, kept)
    factor = 10 ** (1 / diagnostics.BINS_PER_DECADE)
    for name, _ in diagnostics.QUANTILES:
        assert want[name] / factor <= float(got[name]) <= want[name] * factor, name
    assert float(got["m2po/m2_p999"]) <= float(got["m2po/m2_max"])
    np.testing.assert_allclose(got["m2po/m2_max"], want["m2po/m2_max"], rtol=1e-6)
    for name in ("offpolicy/ess", "offpolicy/ess_kept"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5)


def test_on_policy_tokens_have_zero_quantiles():
    m2 = jnp.zeros(1000).at[-2:].set(0.5)  # two tokens in a thousand off-policy
    got = _finalize(m2, jnp.zeros(1000), jnp.ones(1000, bool), jnp.ones(1000, bool))
    assert float(got["m2po/m2_p50"]) == 0.0 and float(got["m2po/m2_p99"]) == 0.0
    # rank 999 of 1000 lies among the two: inside 0.5's bin, never above the maximum
    assert 0.5 / 10 ** (1 / diagnostics.BINS_PER_DECADE) <= float(got["m2po/m2_p999"]) <= 0.5
    assert float(got["m2po/m2_max"]) == 0.5


def test_parts_of_blocks_combine_to_the_parts_of_the_union():
    rng = np.random.default_rng(1)
    m2 = rng.lognormal(-3.0, 2.0, (4, 8, 16)).astype(np.float32)
    log_w = rng.normal(0.0, 2.0, m2.shape).astype(np.float32)
    valid, kept = rng.random(m2.shape) < 0.7, rng.random(m2.shape) < 0.5
    loss = rng.normal(0.0, 1.0, m2.shape).astype(np.float32)

    def parts(i):
        block = diagnostics.parts(m2[i], log_w[i], valid[i], kept[i])
        return {**block, **diagnostics.loss_parts(loss[i], valid[i], kept[i])}

    stacked = jax.tree.map(lambda *x: jnp.stack(x), *[parts(i) for i in range(4)])
    whole = diagnostics.parts(m2, log_w, valid, kept)
    whole.update(diagnostics.loss_parts(loss, valid, kept))
    combined = diagnostics.combine(stacked)
    np.testing.assert_array_equal(combined["diag_parts/m2_hist"], whole["diag_parts/m2_hist"])
    got, want = diagnostics.finalize(combined), diagnostics.finalize(whole)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)


def test_masked_loss_share_of_known_tokens():
    # Per-token losses 1, -3, 2, 4 (the last one padding); tokens 1 and 2 masked:
    # (|-3| + |2|) / (1 + 3 + 2) = 5 / 6.
    loss = jnp.array([1.0, -3.0, 2.0, 4.0])
    valid = jnp.array([True, True, True, False])
    kept = jnp.array([True, False, False, False])
    p = {**diagnostics.parts(jnp.zeros(4), jnp.zeros(4), valid, kept)}
    p.update(diagnostics.loss_parts(loss, valid, kept))
    np.testing.assert_allclose(diagnostics.finalize(p)["m2po/masked_loss_share"], 5 / 6)
