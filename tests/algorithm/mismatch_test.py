"""The engine/trainer mismatch statistics, split by token freshness, against numpy; their
parts combine exactly across blocks; empty subsets read 0."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax.algorithm import mismatch

_stats = jax.jit(mismatch.mismatch_stats)


def np_m2po_kept(m2, valid, tau):
    """AReaL's mask in numpy: the most smallest-m2 valid tokens whose mean m2 is < tau (at
    least one; ties by flat index)."""
    flat, where = m2.ravel(), valid.ravel()
    index = np.flatnonzero(where)
    order = index[np.argsort(flat[index], kind="stable")]
    means = np.cumsum(flat[order]) / np.arange(1, order.size + 1)
    n = max(int((means < tau).sum()), 1) if order.size else 0
    kept = np.zeros(flat.shape, bool)
    kept[order[:n]] = True
    return kept.reshape(m2.shape)


def np_reference(behav, prox, valid, fresh, kept, kept_alone):
    """Every `mismatch.STAT_KEYS` value from its definition, in float64."""
    d = behav.astype(np.float64) - prox.astype(np.float64)
    out = {}
    for sub, where in (("fresh", valid & fresh), ("stale", valid & ~fresh)):
        x = d[where]
        mean = (lambda v: v.mean()) if x.size else (lambda v: 0.0)
        out[f"mismatch/{sub}/tokens"] = x.size
        out[f"mismatch/{sub}/abs_mean"] = mean(np.abs(x))
        out[f"mismatch/{sub}/abs_max"] = np.abs(x).max() if x.size else 0.0
        out[f"mismatch/{sub}/k1"] = mean(x)
        out[f"mismatch/{sub}/k3"] = mean(np.exp(-x) - 1 + x)
        out[f"mismatch/{sub}/m2"] = mean(x**2)
        out[f"mismatch/{sub}/m2po_dropped"] = mean((~kept[where]).astype(float))
    fresh_valid = valid & fresh
    out["mismatch/fresh/m2po_drop_alone"] = (
        (~kept_alone[fresh_valid]).mean() if fresh_valid.any() else 0.0
    )
    out["mismatch/m2_fresh_share"] = (d[fresh_valid] ** 2).sum() / (d[valid] ** 2).sum()
    return out


def mixed_batch(seed=0):
    """8 rows x 12 tokens at step version 5: rows of version 5 (fresh), 3 and 4 (stale),
    and rows whose later tokens came from version 5 (weights taken in flight). Fresh tokens
    differ by engine noise (a few by a lot), stale ones by staleness."""
    rng = np.random.default_rng(seed)
    shape = (8, 12)
    version = np.repeat(np.array([5, 5, 3, 4, 3, 4, 5, 3])[:, None], 12, axis=1)
    version[2, 7:] = version[3, 5:] = 5
    valid = np.zeros(shape, bool)
    for r, n in enumerate((12, 9, 12, 10, 4, 12, 0, 8)):  # row 6: no valid token
        valid[r, :n] = True
    fresh = version == 5
    prox = -rng.uniform(0.1, 4.0, shape).astype(np.float32)
    gap = np.where(fresh, rng.normal(0, 0.02, shape), rng.normal(0, 0.5, shape))
    gap[0, 3], gap[1, 8] = 0.9, -0.7  # engine glitches on fresh tokens
    behav = (prox + gap).astype(np.float32)
    return behav, prox, valid, version, fresh


def test_every_statistic_equals_numpy_on_mixed_versions():
    behav, prox, valid, version, fresh = mixed_batch()
    assert (mismatch.fresh_tokens(version, 5) == fresh).all()
    tau = 0.04
    m2 = (behav.astype(np.float64) - prox) ** 2
    kept = np_m2po_kept(m2, valid, tau)
    kept_alone = np_m2po_kept(m2, valid & fresh, tau)
    got = _stats(behav, prox, valid, fresh, kept, kept_alone)
    want = np_reference(behav, prox, valid, fresh, kept, kept_alone)
    assert set(got) == set(mismatch.STAT_KEYS) == set(want)
    # float32: behav - prox of log-probs above -5 is off by at most half an ulp of 4
    # (2.4e-7) per token, and sums of < 100 terms add a relative 1e-5 at most.
    for key in mismatch.STAT_KEYS:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=5e-7, err_msg=key)
    # The case is not degenerate: both subsets, drops from each, and the glitches alone
    # are past tau.
    assert want["mismatch/fresh/tokens"] > 20 and want["mismatch/stale/tokens"] > 20
    assert 0 < want["mismatch/fresh/m2po_drop_alone"] <= want["mismatch/fresh/m2po_dropped"]
    assert want["mismatch/stale/m2po_dropped"] > 0.2
    assert want["mismatch/stale/m2"] > 5 * want["mismatch/fresh/m2"]


def test_convention_is_kl_behaviour_to_proximal_by_hand():
    # d = behav - prox = (0.5, -0.5): k1 = 0, k3 = mean(exp(-d) - 1 + d).
    behav, prox = jnp.array([-1.0, -2.0]), jnp.array([-1.5, -1.5])
    got = _stats(behav, prox, jnp.ones(2, bool), jnp.ones(2, bool), None, None)
    assert float(got["mismatch/fresh/k1"]) == 0.0
    k3 = (np.exp(-0.5) - 0.5 + np.exp(0.5) + 0.5 - 2) / 2
    np.testing.assert_allclose(got["mismatch/fresh/k3"], k3, rtol=1e-6)
    # One token, behaviour above proximal: k1 = +d (not -d).
    one = _stats(jnp.array([-1.0]), jnp.array([-1.25]), jnp.ones(1, bool), jnp.ones(1, bool))
    assert float(one["mismatch/fresh/k1"]) == 0.25
    assert float(one["mismatch/fresh/abs_max"]) == 0.25
    assert float(one["mismatch/m2_fresh_share"]) == 1.0


def test_empty_subsets_read_zero_and_no_mask_drops_the_mask_keys():
    behav = jnp.array([[-1.0, -2.0, -3.0]])
    prox = jnp.array([[-1.5, -2.0, -9.0]])
    valid = jnp.array([[True, True, False]])
    stale_only = _stats(behav, prox, valid, jnp.zeros_like(valid), valid, valid)
    for key in ("tokens", "abs_mean", "abs_max", "k1", "k3", "m2", "m2po_dropped"):
        assert float(stale_only[f"mismatch/fresh/{key}"]) == 0.0, key
    assert float(stale_only["mismatch/fresh/m2po_drop_alone"]) == 0.0
    assert float(stale_only["mismatch/m2_fresh_share"]) == 0.0
    assert float(stale_only["mismatch/stale/abs_mean"]) == 0.25  # the invalid token left out
    # Nothing valid at all; and no mask: the mask keys are absent, the rest 0.
    nothing = _stats(behav, prox, jnp.zeros_like(valid), jnp.ones_like(valid), None, None)
    assert "mismatch/fresh/m2po_dropped" not in nothing
    assert "mismatch/fresh/m2po_drop_alone" not in nothing
    assert all(np.isfinite(float(v)) and float(v) == 0.0 for v in nothing.values())


def test_parts_of_blocks_combine_to_the_union():
    """Blocks of rows (as minibatches and micro-batches split them): combined parts equal
    the parts of the whole batch; counts and sums add, the maximum is the max."""
    behav, prox, valid, _, fresh = mixed_batch(seed=1)
    kept = np.random.default_rng(2).random(valid.shape) < 0.8
    kept_alone = np.random.default_rng(3).random(valid.shape) < 0.9
    arrays = (behav, prox, valid, fresh, kept, kept_alone)
    blocks = [mismatch.parts(*(a[r] for a in arrays)) for r in (slice(0, 3), slice(3, 8))]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *blocks)
    got = mismatch.finalize(mismatch.combine(stacked))
    want = mismatch.mismatch_stats(*arrays)
    for key in mismatch.STAT_KEYS:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=key)
    assert int(got["mismatch/fresh/tokens"]) + int(got["mismatch/stale/tokens"]) == valid.sum()


def test_inputs_are_checked():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="fresh has shape"):
        mismatch.mismatch_stats(x, x, jnp.ones((2, 3), bool), jnp.ones((3,), bool))
    with pytest.raises(TypeError, match="prox_logp must have a floating dtype"):
        mismatch.mismatch_stats(x, jnp.zeros((2, 3), jnp.int32), x > 0, x > 0)
