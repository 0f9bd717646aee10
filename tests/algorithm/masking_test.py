"""Tests of m2po_jax.algorithm.masking against numpy references written from docs/algorithm.md.

Most data lies on a grid (log-ratios in units of 1/8, thresholds at odd multiples of
1/128): then every sum and mean is exact in float32 and float64 alike, so the JAX
methods must match the reference bit for bit, including which tied token is kept.
"""

import functools
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from m2po_jax.algorithm import masking, scopes
from m2po_jax.algorithm.masking import (
    m2po_clip_bound,
    m2po_harmful_tokens,
    m2po_mask,
    m2po_mask_with_stats,
    m2po_second_moment,
)
from m2po_jax.parallel import sharding

METHODS = ("sort", "bisect")
SIZE = 48  # hypothesis data is padded to one static size so each function compiles once
HYPOTHESIS = settings(max_examples=40, deadline=None, derandomize=True)


# ----------------------------------------------------------------------------- references


def ref_kept(m2, participating, tau, stop_rule="lt"):
    """docs/algorithm.md mask steps 1-4 literally, on flat numpy arrays; returns kept flags.

    Among equal m2 values the highest flat index is masked first (so the lowest is
    kept), the tie-break the JAX methods document.
    """
    m2 = np.where(np.isnan(m2), np.inf, np.asarray(m2, np.float64)).reshape(-1)
    idx = np.flatnonzero(np.asarray(participating).reshape(-1))
    kept = np.ones(m2.size, bool)
    n = idx.size
    if n == 0 or tau is None:
        return kept
    order = sorted(idx, key=lambda i: (m2[i], i), reverse=True)  # descending
    values = m2[order]
    num_to_mask = n - 1
    for i in range(n):
        suffix_mean = np.mean(values[i:]) if np.isfinite(values[i:]).all() else np.inf
        if (suffix_mean < tau) if stop_rule == "lt" else (suffix_mean <= tau):
            num_to_mask = i
            break
    kept[order[:num_to_mask]] = False
    return kept


def ref_mask(behav, prox, loss_mask, tau, stop_rule="lt"):
    m2 = np.square(np.asarray(behav, np.float32) - np.asarray(prox, np.float32))
    valid = np.asarray(loss_mask, bool)
    kept = ref_kept(m2, valid, tau, stop_rule).reshape(valid.shape)
    return valid & kept


def ref_clip_bound(m2, loss_mask, budget):
    """Largest s with mean(min(m2, s)) <= budget by scanning segments; returns sqrt(s)."""
    m2 = np.where(np.isnan(m2), np.inf, np.asarray(m2, np.float64))
    values = np.sort(m2[np.asarray(loss_mask, bool)])
    n = values.size
    if n == 0 or np.mean(values) <= budget:
        return np.inf
    for i in range(n):  # i values below s, n - i capped at s
        s = (budget * n - values[:i].sum()) / (n - i)
        if (i == 0 or values[i - 1] <= s) and s <= values[i]:
            return np.sqrt(max(s, 0.0))
    raise AssertionError("no segment found")


@st.composite
def grid_batches(draw):
    """behav/prox on a 1/8 grid (m2 on a 1/64 grid), a loss_mask, and a tau between grid means.

    Mostly small log-ratios plus outliers, which are sometimes all equal (ties at the
    boundary); padded with invalid tokens to SIZE.
    """
    n = draw(st.integers(1, SIZE))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([0, 1, 3, 10]))
    steps = rng.integers(-spread, spread + 1, n)
    outliers = rng.random(n) < draw(st.sampled_from([0.0, 0.1, 0.3]))
    outlier_step = draw(st.sampled_from([None, 4, 12]))
    steps[outliers] = rng.integers(-40, 41, n)[outliers] if outlier_step is None else outlier_step
    valid = rng.random(n) < draw(st.sampled_from([0.6, 0.9, 1.0]))
    tau = (2 * draw(st.integers(0, 40)) + 1) / 128
    pad = SIZE - n
    prox = np.concatenate([-rng.integers(0, 17, n), np.zeros(pad, np.int64)]) / 8
    behav = prox + np.concatenate([steps, np.full(pad, 40)]) / 8
    loss_mask = np.concatenate([valid, np.zeros(pad, bool)])
    return behav.astype(np.float32), prox.astype(np.float32), loss_mask, np.float32(tau)


@functools.cache
def jitted(method, stop_rule="lt"):
    fn = functools.partial(m2po_mask_with_stats, method=method, stop_rule=stop_rule)
    return jax.jit(fn)


# ----------------------------------------------------------------------------- hand examples


def _pad6(values, fill=0.0):
    """Hand examples share one shape (6,) so they compile once; padding is masked out."""
    values = list(values)
    return jnp.array(values + [fill] * (6 - len(values)), jnp.float32)


def _valid6(num_valid):
    return jnp.arange(6) < num_valid


class HandExamplesTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(method=METHODS)
    def test_examples(self, method):
        mask_fn = self.variant(functools.partial(m2po_mask, method=method))
        zeros, four, tau = jnp.zeros(6), _valid6(4), jnp.float32(0.04)
        # m2 = [1/64] * 4: mean 0.0156 < 0.04, nothing masked.
        np.testing.assert_array_equal(mask_fn(zeros, _pad6([0.125] * 4, 9.0), four, tau), four)
        # m2 = [0, 1/64, 1, 4]: suffix means 1.25, 0.34, 0.0078 -> mask the two largest.
        out = mask_fn(zeros, _pad6([0.0, 0.125, -1.0, 2.0], 9.0), four, tau)
        np.testing.assert_array_equal(out, _valid6(2))
        # Every m2 huge: only the smallest is kept.
        out = mask_fn(zeros, _pad6([3.0, -2.0, 4.0, 5.0]), four, tau)
        np.testing.assert_array_equal(out, [False, True, False, False, False, False])
        # n == 0: loss_mask unchanged.
        none = jnp.zeros(6, bool)
        np.testing.assert_array_equal(mask_fn(zeros, _pad6([3.0, -2.0]), none, tau), none)
        # Invalid tokens are never switched on, and their m2 does not count.
        loss_mask = jnp.array([True, False, True, True, False, True])
        out = mask_fn(zeros, _pad6([0.0, 9.0, 0.125, 0.125, 0.0, 0.125]), loss_mask, tau)
        np.testing.assert_array_equal(out, loss_mask)

    def test_threshold_none_returns_loss_mask(self):
        loss_mask = jnp.array([True, False, True, True, False, True])
        out = m2po_mask(jnp.zeros(6), jnp.full(6, 5.0), loss_mask, None)
        np.testing.assert_array_equal(out, loss_mask)
        self.assertEqual(out.dtype, jnp.bool_)

    @parameterized.product(method=METHODS)
    def test_strict_less_than_and_le_variant(self, method):
        # m2 = [1/4, 1/4], tau = 1/4: the mean equals tau.
        behav, prox, two = jnp.zeros(6), _pad6([0.5, 0.5]), _valid6(2)
        lt, _ = m2po_mask_with_stats(behav, prox, two, 0.25, method=method)
        le, _ = m2po_mask_with_stats(behav, prox, two, 0.25, method=method, stop_rule="le")
        np.testing.assert_array_equal(lt, _valid6(1))  # one kept: the lowest index
        np.testing.assert_array_equal(le, two)

    @parameterized.product(method=METHODS)
    def test_stats(self, method):
        prox = _pad6([0.0, 0.125, -1.0, 2.0, 7.0])
        mask, stats = m2po_mask_with_stats(jnp.zeros(6), prox, _valid6(4), 0.04, method=method)
        np.testing.assert_array_equal(mask, _valid6(2))
        self.assertEqual(stats["m2po/masked_tokens"].dtype, jnp.int32)
        self.assertEqual(int(stats["m2po/masked_tokens"]), 2)
        self.assertAlmostEqual(float(stats["m2po/masked_fraction"]), 0.5)
        self.assertAlmostEqual(float(stats["m2po/m2_before"]), (1 / 64 + 1 + 4) / 4)
        self.assertAlmostEqual(float(stats["m2po/m2_after"]), 1 / 128)
        self.assertAlmostEqual(float(stats["m2po/boundary"]), 1 / 64)
        self.assertEqual(int(stats["m2po/nonfinite_tokens"]), 0)

    @parameterized.product(method=METHODS, shape=[(3, 4), (2, 3, 2)])
    def test_any_shape_is_one_global_set(self, method, shape):
        rng = np.random.default_rng(1)
        prox = rng.integers(-12, 12, shape).astype(np.float32) / 8
        behav = np.zeros(shape, np.float32)
        loss_mask = rng.random(shape) < 0.8
        out = m2po_mask(behav, prox, loss_mask, 0.3, method=method)
        self.assertEqual(out.shape, shape)
        np.testing.assert_array_equal(out, ref_mask(behav, prox, loss_mask, 0.3))
        self.assertLess(int(out.sum()), int(loss_mask.sum()))

    def test_empty_array(self):
        out, stats = m2po_mask_with_stats(jnp.zeros(0), jnp.zeros(0), jnp.zeros(0, bool), 0.04)
        self.assertEqual(out.shape, (0,))
        self.assertEqual(int(stats["m2po/masked_tokens"]), 0)


# ----------------------------------------------------------------------------- properties


@HYPOTHESIS
@given(grid_batches(), st.sampled_from(METHODS), st.sampled_from(("lt", "le")))
def test_matches_reference(batch, method, stop_rule):
    behav, prox, loss_mask, tau = batch
    mask, stats = jitted(method, stop_rule)(behav, prox, loss_mask, tau)
    expected = ref_mask(behav, prox, loss_mask, tau, stop_rule)
    np.testing.assert_array_equal(mask, expected)
    assert int(stats["m2po/masked_tokens"]) == int(loss_mask.sum() - expected.sum())


@HYPOTHESIS
@given(grid_batches(), st.sampled_from(METHODS))
def test_kept_mean_below_tau_and_maximal(batch, method):
    behav, prox, loss_mask, tau = batch
    mask = np.asarray(jitted(method)(behav, prox, loss_mask, tau)[0])
    m2 = np.square(behav - prox).astype(np.float64)
    kept, masked = m2[mask], m2[loss_mask & ~mask]
    if loss_mask.any():
        assert kept.size >= 1
    if kept.size > 1:
        assert kept.mean() < tau
    if masked.size:
        # Adding back the smallest masked token breaks the rule.
        assert np.append(kept, masked.min()).mean() >= tau
        assert masked.min() >= kept.max()


@HYPOTHESIS
@given(grid_batches(), st.sampled_from(METHODS), st.randoms(use_true_random=False))
def test_order_independent(batch, method, random):
    behav, prox, loss_mask, tau = batch
    perm = np.arange(SIZE)
    random.shuffle(perm)
    mask = np.asarray(jitted(method)(behav, prox, loss_mask, tau)[0])
    mask_p = np.asarray(jitted(method)(behav[perm], prox[perm], loss_mask[perm], tau)[0])
    m2 = np.square(behav - prox)
    assert mask.sum() == mask_p.sum()
    np.testing.assert_array_equal(np.sort(m2[mask]), np.sort(m2[perm][mask_p]))


@HYPOTHESIS
@given(grid_batches(), st.integers(0, 40), st.sampled_from(METHODS))
def test_monotone_in_tau(batch, other, method):
    behav, prox, loss_mask, tau = batch
    tau2 = np.float32((2 * other + 1) / 128)
    lo, hi = sorted([tau, tau2])
    kept_lo = np.asarray(jitted(method)(behav, prox, loss_mask, lo)[0])
    kept_hi = np.asarray(jitted(method)(behav, prox, loss_mask, hi)[0])
    assert kept_lo.sum() <= kept_hi.sum()


@HYPOTHESIS
@given(st.integers(0, 2**31 - 1), st.floats(0.001, 0.2), st.integers(1, SIZE))
def test_sort_equals_bisect_on_continuous_data(seed, tau, n):
    """Same count and multiset of kept values on float data (off the grid)."""
    rng = np.random.default_rng(seed)
    behav = rng.normal(-1, 0.5, SIZE).astype(np.float32)
    prox = behav + (0.2 * rng.standard_t(2, SIZE)).astype(np.float32)
    prox[rng.random(SIZE) < 0.2] = behav[0]  # some exact ties, some m2 == 0
    loss_mask = np.arange(SIZE) < n
    tau = np.float32(tau)
    mask_s = np.asarray(jitted("sort")(behav, prox, loss_mask, tau)[0])
    mask_b = np.asarray(jitted("bisect")(behav, prox, loss_mask, tau)[0])
    m2 = np.square(behav - prox)
    assert mask_s.sum() == mask_b.sum()
    np.testing.assert_array_equal(np.sort(m2[mask_s]), np.sort(m2[mask_b]))


# ----------------------------------------------------------------------------- transformations


class TransformTest(parameterized.TestCase):
    def _rows(self):
        rng = np.random.default_rng(2)
        prox = rng.integers(-12, 12, (5, 16)).astype(np.float32) / 8
        prox[1] = 0.75  # a row of exact ties above tau: the tie-splitting path
        prox[2, :8] = 0.0
        loss_mask = rng.random((5, 16)) < 0.85
        loss_mask[3] = False  # an empty row
        return np.zeros((5, 16), np.float32), prox, loss_mask

    @parameterized.product(method=METHODS)
    def test_vmap_rows_and_row_scope(self, method):
        behav, prox, loss_mask = self._rows()
        tau = jnp.float32(0.2)
        per_row = jax.jit(jax.vmap(lambda b, p, m: m2po_mask(b, p, m, tau, method=method)))
        expected = np.stack(
            [ref_mask(b, p, m, 0.2) for b, p, m in zip(behav, prox, loss_mask, strict=True)]
        )
        np.testing.assert_array_equal(per_row(behav, prox, loss_mask), expected)
        mask, stats = m2po_mask_with_stats(behav, prox, loss_mask, tau, method=method, scope="row")
        np.testing.assert_array_equal(mask, expected)
        self.assertEqual(int(stats["m2po/masked_tokens"]), int((loss_mask & ~expected).sum()))
        # The global scope differs from the row scope on this batch.
        self.assertFalse((np.asarray(m2po_mask(behav, prox, loss_mask, tau)) == expected).all())

    @parameterized.product(method=METHODS)
    def test_threshold_change_does_not_retrace(self, method):
        chex.clear_trace_counter()
        behav, prox, loss_mask = self._rows()

        @jax.jit
        @chex.assert_max_traces(n=1)
        def fn(b, p, m, tau):
            return m2po_mask_with_stats(b, p, m, tau, method=method)

        counts = [
            int(fn(behav, prox, loss_mask, jnp.float32(t))[1]["m2po/masked_tokens"])
            for t in (0.01, 0.04, 0.3, 2.0)
        ]
        self.assertEqual(counts, sorted(counts, reverse=True))

        @jax.jit
        @chex.assert_max_traces(n=1)
        def bound(m2, m, budget):
            return m2po_clip_bound(m2, m, budget)

        for budget in (0.01, 0.1, 1.0):
            bound(np.square(prox), loss_mask, jnp.float32(budget))

    @parameterized.product(method=METHODS)
    def test_bf16_inputs_use_float32_m2(self, method):
        # In bf16, -10 - (-5/128) rounds; in float32 it does not.
        behav = jnp.array([-10.0, -1.0, -1.0, -1.0], jnp.bfloat16)
        prox = jnp.array([-5 / 128, -1.0, -1.125, -1.25], jnp.bfloat16)
        m2 = m2po_second_moment(behav, prox)
        self.assertEqual(m2.dtype, jnp.float32)
        exact = np.square(np.asarray(behav, np.float32) - np.asarray(prox, np.float32))
        np.testing.assert_array_equal(m2, exact)
        self.assertNotEqual(float(m2[0]), float(jnp.square(behav - prox)[0]))
        mask = m2po_mask(behav, prox, jnp.ones(4, bool), 0.04, method=method)
        np.testing.assert_array_equal(
            mask,
            ref_mask(behav.astype(np.float32), prox.astype(np.float32), np.ones(4, bool), 0.04),
        )

    @parameterized.product(method=METHODS)
    def test_nonfinite_masked_first_and_counted(self, method):
        behav = jnp.array([0.0, jnp.nan, 0.0, 0.0, 0.0, 0.0])
        prox = jnp.array([0.125, 0.0, -jnp.inf, 0.125, 3.0, jnp.inf])
        loss_mask = jnp.array([True, True, True, True, True, False])
        mask, stats = m2po_mask_with_stats(behav, prox, loss_mask, 100.0, method=method)
        np.testing.assert_array_equal(mask, [True, False, False, True, True, False])
        self.assertEqual(int(stats["m2po/nonfinite_tokens"]), 2)
        self.assertEqual(int(stats["m2po/masked_tokens"]), 2)
        self.assertAlmostEqual(float(stats["m2po/m2_before"]), (2 / 64 + 9) / 3, places=5)
        self.assertAlmostEqual(float(stats["m2po/m2_after"]), (2 / 64 + 9) / 3, places=5)
        # All valid tokens non-finite: exactly one kept, statistics stay finite.
        only_nonfinite = jnp.array([False, True, True, False, False, False])
        mask, stats = m2po_mask_with_stats(behav, prox, only_nonfinite, 0.04, method=method)
        np.testing.assert_array_equal(mask, [False, True, False, False, False, False])
        self.assertTrue(all(np.isfinite(float(v)) for v in stats.values()))

    @parameterized.product(method=METHODS)
    def test_gradient_flows_through_loss_using_mask(self, method):
        # The paper's variant computes the mask from the very logp being differentiated.
        rng = np.random.default_rng(3)
        behav = jnp.asarray(rng.normal(-1, 0.3, (4, 8)), jnp.float32)
        prox = behav + jnp.asarray(rng.normal(0, 0.3, (4, 8)), jnp.float32)
        loss_mask = jnp.ones((4, 8), bool)

        def loss(logp):
            mask, _ = m2po_mask_with_stats(
                behav,
                prox,
                loss_mask,
                0.04,
                method=method,
                second_moment="current_behav",
                logp=logp,
            )
            return jnp.sum(jnp.where(mask, logp, 0.0)), mask

        grad, mask = jax.jit(jax.grad(loss, has_aux=True))(prox + 0.1)
        self.assertTrue(np.isfinite(grad).all())
        self.assertGreater(float(jnp.abs(grad).sum()), 0.0)
        self.assertLess(int(mask.sum()), mask.size)  # the mask did remove tokens
        np.testing.assert_array_equal(grad, mask.astype(jnp.float32))


# ----------------------------------------------------------------------------- variants


class VariantsTest(parameterized.TestCase):
    def _data(self, seed=4, shape=(4, 12)):
        rng = np.random.default_rng(seed)
        behav = rng.integers(-40, 0, shape).astype(np.float32) / 8
        prox = behav + rng.integers(-6, 7, shape).astype(np.float32) / 8
        logp = prox + rng.integers(-6, 7, shape).astype(np.float32) / 8
        adv = rng.integers(-2, 3, shape).astype(np.float32)
        loss_mask = rng.random(shape) < 0.9
        return behav, prox, logp, adv, loss_mask

    @parameterized.parameters(
        ("sort", "behav_prox"), ("bisect", "current_behav"), ("sort", "prox_current")
    )
    def test_second_moment(self, method, second_moment):
        behav, prox, logp, _, loss_mask = self._data()
        newer, older = {
            "behav_prox": (prox, behav),
            "current_behav": (logp, behav),
            "prox_current": (logp, prox),
        }[second_moment]
        m2 = np.square(newer - older)
        np.testing.assert_array_equal(
            m2po_second_moment(behav, prox, second_moment=second_moment, logp=logp), m2
        )
        mask, _ = m2po_mask_with_stats(
            behav, prox, loss_mask, 0.1, method=method, second_moment=second_moment, logp=logp
        )
        expected = loss_mask & ref_kept(m2, loss_mask, 0.1).reshape(m2.shape)
        np.testing.assert_array_equal(mask, expected)

    @parameterized.parameters(("bisect", "behav_prox"), ("sort", "prox_current"))
    def test_harmful_candidates(self, method, second_moment):
        behav, prox, logp, adv, loss_mask = self._data(seed=5)
        prox[0, 0] = np.nan  # non-finite tokens always take part
        newer, older = (prox, behav) if second_moment == "behav_prox" else (logp, prox)
        log_ratio = newer - older
        harmful = np.zeros(adv.shape, bool)
        for i in np.ndindex(adv.shape):  # (A > 0 and r > 1) or (A < 0 and r < 1)
            r = np.exp(log_ratio[i])
            harmful[i] = (adv[i] > 0 and r > 1) or (adv[i] < 0 and r < 1)
        np.testing.assert_array_equal(
            m2po_harmful_tokens(behav, prox, adv, second_moment=second_moment, logp=logp), harmful
        )
        m2 = np.square(log_ratio)
        participating = loss_mask & (harmful | ~np.isfinite(m2))
        tau = 0.05
        mask, stats = m2po_mask_with_stats(
            behav,
            prox,
            loss_mask,
            tau,
            method=method,
            second_moment=second_moment,
            logp=logp,
            candidates="harmful",
            advantages=adv,
        )
        expected = loss_mask & ref_kept(m2, participating, tau).reshape(m2.shape)
        np.testing.assert_array_equal(mask, expected)
        self.assertTrue(np.asarray(mask)[loss_mask & ~participating].all())
        self.assertGreater(int(stats["m2po/masked_tokens"]), 0)
        self.assertEqual(int(stats["m2po/nonfinite_tokens"]), int(loss_mask[0, 0]))

    def test_clip_bound(self):
        m2 = jnp.array([0.0, 1.0, 4.0, 9.0])
        ones = jnp.ones(4, bool)
        # (0 + 1 + 2s) / 4 = 1 on the segment [1, 4]  ->  s = 1.5.
        self.assertAlmostEqual(float(m2po_clip_bound(m2, ones, 1.0)), np.sqrt(1.5), places=6)
        self.assertEqual(float(m2po_clip_bound(m2, ones, 3.5)), np.inf)  # mean 3.5 fits
        self.assertEqual(float(m2po_clip_bound(m2, jnp.zeros(4, bool), 0.1)), np.inf)
        self.assertEqual(float(m2po_clip_bound(m2, ones, 0.0)), 0.0)
        self.assertEqual(float(jax.jit(m2po_clip_bound)(m2, ones, jnp.float32(-1.0))), 0.0)
        # Non-finite m2 is capped like +inf; the padding does not count.
        m2 = jnp.array([jnp.nan, 1.0, jnp.inf, 0.0, 100.0])
        mask = jnp.array([True, True, True, True, False])
        # (0 + s + s + s) / 4 = 0.5 on [0, 1]  ->  s = 2/3.
        self.assertAlmostEqual(float(m2po_clip_bound(m2, mask, 0.5)), np.sqrt(2 / 3), places=6)

    @HYPOTHESIS
    @given(st.integers(0, 2**31 - 1), st.floats(0.0, 0.3), st.integers(0, SIZE))
    def test_clip_bound_matches_reference(self, seed, budget, n):
        rng = np.random.default_rng(seed)
        m2 = np.square(rng.standard_t(2, SIZE) * 0.2).astype(np.float32)
        loss_mask = np.arange(SIZE) < n
        t = float(jax.jit(m2po_clip_bound)(m2, loss_mask, jnp.float32(budget)))
        expected = ref_clip_bound(m2, loss_mask, np.float32(budget))
        if np.isinf(expected):
            assert np.isinf(t)
        else:
            np.testing.assert_allclose(t, expected, rtol=1e-4, atol=1e-6)
            capped = np.minimum(m2[loss_mask].astype(np.float64), t * t).mean()
            np.testing.assert_allclose(capped, budget, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- errors


class ErrorsTest(parameterized.TestCase):
    def test_messages(self):
        z3, z4, m4 = jnp.zeros(3), jnp.zeros(4), jnp.ones(4, bool)
        with pytest.raises(
            ValueError, match=r"prox_logp has shape \(3,\) but behav_logp has shape \(4,\)"
        ):
            m2po_mask(z4, z3, m4, 0.04)
        with pytest.raises(
            ValueError, match=r"behav_logp has shape \(3,\) but loss_mask has shape \(4,\)"
        ):
            m2po_mask(z3, z3, m4, 0.04)
        with pytest.raises(ValueError, match=r"m2_threshold must be >= 0.*-0.1"):
            m2po_mask(z4, z4, m4, -0.1)
        with pytest.raises(ValueError, match=r"m2_threshold must be >= 0"):
            m2po_mask(z4, z4, m4, float("nan"))
        # Concrete jax scalars are checked like Python and numpy ones; only traced ones pass.
        for bad in (jnp.float32(jnp.nan), jnp.float32(-0.1)):
            with pytest.raises(ValueError, match=r"m2_threshold must be >= 0"):
                m2po_mask(z4, z4, m4, bad)
        self.assertEqual(jax.jit(lambda t: m2po_mask(z4, z4, m4, t))(-0.1).shape, (4,))
        with pytest.raises(ValueError, match=r"m2_threshold must be a scalar"):
            m2po_mask(z4, z4, m4, np.array([0.1, 0.2]))
        with pytest.raises(ValueError, match=r"method='quick' is not one of \['sort', 'bisect'\]"):
            m2po_mask(z4, z4, m4, 0.04, method="quick")
        for name, value in [
            ("second_moment", "kl"),
            ("stop_rule", "lte"),
            ("candidates", "some"),
            ("scope", "batch"),
        ]:
            with pytest.raises(ValueError, match=rf"{name}='{value}' is not one of \["):
                m2po_mask_with_stats(z4, z4, m4, 0.04, **{name: value})
        with pytest.raises(TypeError, match=r"behav_logp must be a floating-point array.*int32"):
            m2po_mask(jnp.zeros(4, jnp.int32), z4, m4, 0.04)
        with pytest.raises(TypeError, match=r"prox_logp must be a floating-point"):
            m2po_mask(z4, np.zeros(4, np.int64), m4, 0.04)
        for variant in ("current_behav", "prox_current"):
            with pytest.raises(ValueError, match=rf"second_moment='{variant}' needs logp="):
                m2po_mask_with_stats(z4, z4, m4, 0.04, second_moment=variant)
        with pytest.raises(ValueError, match=r"logp has shape \(3,\) but behav_logp"):
            m2po_mask_with_stats(z4, z4, m4, 0.04, second_moment="current_behav", logp=z3)
        with pytest.raises(ValueError, match=r"candidates='harmful' needs advantages="):
            m2po_mask_with_stats(z4, z4, m4, 0.04, candidates="harmful")
        with pytest.raises(ValueError, match=r"advantages has shape \(3,\) but loss_mask"):
            m2po_mask_with_stats(z4, z4, m4, 0.04, candidates="harmful", advantages=z3)
        with pytest.raises(ValueError, match=r"scope='row' needs inputs with ndim >= 2"):
            m2po_mask_with_stats(z4, z4, m4, 0.04, scope="row")
        with pytest.raises(ValueError, match=r"m2_budget must be >= 0"):
            m2po_clip_bound(z4, m4, -1.0)
        with pytest.raises(ValueError, match=r"m2 has shape \(3,\) but loss_mask has shape \(4,\)"):
            m2po_clip_bound(z3, m4, 0.1)

    def test_public_contract_import(self):
        import m2po_jax

        self.assertIs(m2po_jax.m2po_mask, m2po_mask)
        self.assertIs(m2po_jax.m2po_mask_with_stats, m2po_mask_with_stats)

    def test_checks_run_before_work(self):
        """Bad inputs raise naming the field before any kernel runs or is traced: every
        kernel entry point is replaced by one that records the call and fails."""
        calls = []

        def kernel(*args, **kwargs):
            calls.append(args)
            raise AssertionError("reached the kernel")

        z4, z3, m4 = jnp.zeros(4), jnp.zeros(3), jnp.ones(4, bool)
        z8, m8 = jnp.zeros((8, 2)), jnp.ones((8, 2), bool)
        mesh = sharding.make_mesh({"data": -1})
        cases = [
            (dict(method="quick"), r"method='quick' is not one of"),
            (dict(stop_rule="lte"), r"stop_rule='lte' is not one of"),
            (dict(candidates="harmful"), r"candidates='harmful' needs advantages="),
            (dict(second_moment="current_behav"), r"second_moment='current_behav' needs logp="),
            (dict(m2_threshold=-0.5), r"m2_threshold must be >= 0"),
            (dict(prox=z3), r"prox_logp has shape \([0-9, ]+\) but behav_logp has shape"),
        ]
        patches = (
            mock.patch.object(masking, "_mask_core", kernel),
            mock.patch.object(masking.kernels, "clip_bound", kernel),
            mock.patch.object(scopes, "_per_shard_fn", kernel),
        )
        with patches[0], patches[1], patches[2]:
            for options, message in cases:
                options = dict(options)
                tau, prox = options.pop("m2_threshold", 0.04), options.pop("prox", z4)
                with pytest.raises(ValueError, match=message):
                    m2po_mask_with_stats(z4, prox, m4, tau, **options)
                with pytest.raises(ValueError, match=message):  # at trace time, under jit
                    jax.jit(lambda b, p, o=options, t=tau: m2po_mask_with_stats(b, p, m4, t, **o))(
                        z4, prox
                    )
                prox8 = z8 if prox is z4 else z8[:, :1]
                with pytest.raises(ValueError, match=message):  # before the shard_map
                    scopes.m2po_mask_scoped(z8, prox8, m8, tau, scope="shard", mesh=mesh, **options)
            with pytest.raises(ValueError, match=r"m2_budget must be >= 0"):
                m2po_clip_bound(z4, m4, -1.0)
            with pytest.raises(ValueError, match=r"m2 has shape \(3,\) but loss_mask"):
                m2po_clip_bound(z3, m4, 0.1)
            self.assertEqual(calls, [])
            with pytest.raises(AssertionError, match="reached the kernel"):
                m2po_mask(z4, z4, m4, 0.04)  # a good call does reach it
            self.assertEqual(len(calls), 1)
        # A traced threshold cannot be checked: accepted; a negative one keeps one token.
        out = jax.jit(lambda t: m2po_mask(jnp.zeros(2), jnp.ones(2), jnp.ones(2, bool), t))(-1.0)
        self.assertEqual(int(out.sum()), 1)
