"""Tests for m2po_jax.algorithm.advantages against numpy references written from docs/algorithm.md / AReaL."""

import functools
import itertools
import math

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized

from m2po_jax.algorithm.advantages import (
    grpo_token_advantages,
    normalize_advantages,
    normalize_rewards,
    transform_rewards,
)
from m2po_jax.algorithm.penalties import kl_estimate, overlong_penalty

# ----------------------------------------------------------------------------------------
# numpy references with explicit loops
# ----------------------------------------------------------------------------------------


def ref_normalize(x, mask, group_size, mean_level, std_level, loo, unbiased, eps):
    """AReaL Normalization semantics, element by element, in float64."""
    x = np.asarray(x, np.float64)
    B, T = x.shape
    if not mask.any():
        return x

    def groups(level):
        if level == "batch":
            return [list(range(B))]
        return [list(range(g, g + group_size)) for g in range(0, B, group_size)]

    mean = np.zeros_like(x)
    if mean_level is not None:
        for rows in groups(mean_level):
            elems = [(b, t) for b in rows for t in range(T) if mask[b, t]]
            n, total = len(elems), sum(x[e] for e in elems)
            for b in rows:
                for t in range(T):
                    if loo and n == 1:
                        # Ours: a lone element is its own mean (AReaL's mean of the others
                        # is 0 here and keeps x; test_a_single_valid_element_gives_zero).
                        mean[b, t] = x[b, t]
                    elif loo and mean_level == "group" and group_size == 1:
                        mean[b, t] = x[b, t]
                    elif loo:
                        mean[b, t] = 0.0 if n <= 1 else (total - x[b, t]) / (n - 1)
                    else:
                        mean[b, t] = total / n if n else 0.0
    scale = np.ones_like(x)
    if std_level is not None:
        for rows in groups(std_level):
            elems = [(b, t) for b in rows for t in range(T) if mask[b, t]]
            n = len(elems)
            ss = sum((x[e] - mean[e]) ** 2 for e in elems)
            if std_level == "group" and group_size == 1 and unbiased:
                std = 1.0
            elif unbiased:
                std = 1.0 if n <= 1 else math.sqrt(ss / (n - 1))
            else:
                std = 1.0 if n == 0 else math.sqrt(ss / n)
            for b in rows:
                scale[b, :] = std + eps
    return np.where(mask, (x - mean) / scale, 0.0)


def test_a_single_valid_element_gives_zero():
    # Two groups of two rows; group 0 has one valid token (row 1 is empty), group 1 three.
    adv = np.array([[0.0, 0.7, 0.0], [5.0, 5.0, 5.0], [1.0, 2.0, 0.0], [4.0, 0.0, 0.0]])
    mask = np.array([[0, 1, 0], [0, 0, 0], [1, 1, 0], [1, 0, 0]], bool)
    for level, loo in itertools.product(("group",), (False, True)):
        got = np.asarray(
            normalize_advantages(
                adv, mask, mean_level=level, std_level=level, mean_leave1out=loo, group_size=2
            )
        )
        assert got[0, 1] == 0.0, (level, loo)  # nothing to compare the lone token with
        want = ref_normalize(adv, mask, 2, level, level, loo, True, 1e-5)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert np.abs(got[2:]).max() > 0.1  # the other group still normalises
    # AReaL's leave-one-out: the mean of no others is 0 and the std of one element 1, so
    # its value here would be the raw 0.7 / (1 + eps), which moves with the reward's offset.
    areal_value = (0.7 - 0.0) / (1.0 + 1e-5)
    assert abs(areal_value - got[0, 1]) > 0.69
    # A batch with one valid token: the same decision.
    one = np.zeros((2, 3), bool)
    one[1, 2] = True
    out = normalize_advantages(np.full((2, 3), 3.0), one, mean_leave1out=True)
    assert float(np.abs(np.asarray(out)).max()) == 0.0


def ref_kl(logp, ref_logp, estimator):
    d = logp - ref_logp
    return {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[estimator]


def ref_grpo(
    rewards,
    mask,
    group_size,
    kl_ctl=0.0,
    logp=None,
    ref_logp=None,
    kl_estimator="k1",
    kl_clamp=10.0,
    adv_norm=False,
    **norm,
):
    """AReaL's `_compute_advantages` with zero values, discount 1 and lambda 1."""
    opts = dict(
        mean_level="group", std_level="group", mean_leave1out=False, std_unbiased=True, eps=1e-5
    )
    opts.update(norm)
    score = ref_normalize(
        np.asarray(rewards, np.float64)[:, None],
        np.ones((len(rewards), 1), bool),
        group_size,
        opts["mean_level"],
        opts["std_level"],
        opts["mean_leave1out"],
        opts["std_unbiased"],
        opts["eps"],
    )[:, 0]
    B, T = mask.shape
    adv = np.zeros((B, T))
    for b in range(B):
        token_reward = np.zeros(T)
        for t in range(T):
            if mask[b, t] and kl_ctl:
                kl = ref_kl(float(logp[b, t]), float(ref_logp[b, t]), kl_estimator)
                if kl_clamp is not None:
                    kl = min(max(kl, -kl_clamp), kl_clamp)
                token_reward[t] = -kl_ctl * kl
        last = max((t for t in range(T) if mask[b, t]), default=None)
        if last is not None:
            token_reward[last] += score[b]
        running = 0.0
        for t in reversed(range(T)):
            if mask[b, t]:
                running = token_reward[t] + running
                adv[b, t] = running
    if adv_norm:
        adv = ref_normalize(adv, mask, None, "batch", "batch", False, True, 1e-5)
    return adv


LEVELS = ("group", "batch", None)
NORM_COMBOS = list(itertools.product(LEVELS, LEVELS, (False, True), (False, True)))


def combo_name(c):
    return "_".join(str(v) for v in c)


class TransformRewardsTest(parameterized.TestCase):
    def test_bias_scale_clip(self):
        r = np.array([-30.0, -1.0, 0.0, 2.0, 30.0], np.float32)
        out = transform_rewards(r, reward_bias=1.0, reward_scaling=2.0, reward_clip=5.0)
        np.testing.assert_allclose(out, [-5.0, 0.0, 2.0, 5.0, 5.0])
        np.testing.assert_allclose(transform_rewards(r), [-20.0, -1.0, 0.0, 2.0, 20.0])
        self.assertEqual(out.dtype, jnp.float32)

    def test_negative_clip(self):
        with self.assertRaisesRegex(ValueError, "reward_clip must be >= 0, got -1.0"):
            transform_rewards([1.0], reward_clip=-1.0)


class NormalizeRewardsTest(chex.TestCase):
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.3, -2.0, 5.0], np.float32)

    @parameterized.named_parameters((combo_name(c), *c) for c in NORM_COMBOS)
    def test_matches_reference(self, mean_level, std_level, loo, unbiased):
        for group_size in (3, 1):
            got = normalize_rewards(
                self.rewards,
                group_size,
                mean_level=mean_level,
                std_level=std_level,
                mean_leave1out=loo,
                std_unbiased=unbiased,
            )
            want = ref_normalize(
                self.rewards[:, None],
                np.ones((9, 1), bool),
                group_size,
                mean_level,
                std_level,
                loo,
                unbiased,
                1e-5,
            )[:, 0]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(group_size))

    def test_by_hand(self):
        out = normalize_rewards(np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), 2)
        s = math.sqrt(0.5) + 1e-5  # unbiased std of {0, 1}
        np.testing.assert_allclose(out, [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.0, 0.0], rtol=1e-6)
        # leave-one-out over {1, 0, 1}: means (0.5, 1, 0.5), centred (0.5, -1, 0.5), std sqrt(0.75)
        out = normalize_rewards(np.array([1.0, 0.0, 1.0]), 3, mean_leave1out=True)
        s = math.sqrt(0.75) + 1e-5
        np.testing.assert_allclose(out, [0.5 / s, -1.0 / s, 0.5 / s], rtol=1e-6)
        # no std level: no eps either
        np.testing.assert_allclose(
            normalize_rewards(np.array([3.0, 1.0]), 2, std_level=None), [1.0, -1.0]
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_variants(self):
        fn = self.variant(
            functools.partial(
                normalize_rewards, group_size=3, mean_level="batch", mean_leave1out=True
            )
        )
        want = ref_normalize(
            self.rewards[:, None], np.ones((9, 1), bool), 3, "batch", "group", True, True, 1e-5
        )
        np.testing.assert_allclose(fn(self.rewards), want[:, 0], rtol=1e-5, atol=1e-5)

    def test_errors(self):
        with self.assertRaisesRegex(
            ValueError, r"mean_level='prompt' is not one of \['group', 'batch', None\]"
        ):
            normalize_rewards(self.rewards, 3, mean_level="prompt")
        with self.assertRaisesRegex(
            ValueError, r"std_level='none' is not one of \['group', 'batch', None\]"
        ):
            normalize_rewards(self.rewards, 3, std_level="none")
        with self.assertRaisesRegex(ValueError, "batch size 9 is not a multiple of group_size 4"):
            normalize_rewards(self.rewards, 4)
        with self.assertRaisesRegex(ValueError, "group_size must be >= 1, got 0"):
            normalize_rewards(self.rewards, 0)
        with self.assertRaisesRegex(TypeError, "group_size must be a Python int, got float"):
            normalize_rewards(self.rewards, 3.0)
        with self.assertRaisesRegex(ValueError, r"rewards_B must be 1-D \[B\], got shape \(9, 1\)"):
            normalize_rewards(self.rewards[:, None], 3)
        # batch-only levels do not need a dividing group size
        normalize_rewards(self.rewards, 4, mean_level="batch", std_level="batch")


class NormalizeAdvantagesTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        rng = np.random.default_rng(0)
        self.adv = rng.normal(size=(4, 5)).astype(np.float32)
        self.mask = rng.random((4, 5)) < 0.7
        self.mask[0, :] = [True, False, False, False, False]  # a row with one token

    @parameterized.named_parameters((combo_name(c), *c) for c in NORM_COMBOS)
    def test_matches_reference(self, mean_level, std_level, loo, unbiased):
        got = normalize_advantages(
            self.adv,
            self.mask,
            mean_level=mean_level,
            std_level=std_level,
            mean_leave1out=loo,
            std_unbiased=unbiased,
            group_size=2,
        )
        want = ref_normalize(self.adv, self.mask, 2, mean_level, std_level, loo, unbiased, 1e-5)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def test_default_is_batch_masked(self):
        got = normalize_advantages(self.adv, self.mask)
        vals = self.adv[self.mask].astype(np.float64)
        want = np.where(self.mask, (self.adv - vals.mean()) / (vals.std(ddof=1) + 1e-5), 0.0)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    def test_empty_mask_returns_input(self):
        np.testing.assert_array_equal(
            normalize_advantages(self.adv, np.zeros((4, 5), bool)), self.adv
        )

    def test_errors(self):
        with self.assertRaisesRegex(
            ValueError,
            r"adv_BxT and mask_BxT must both be \[B, T\] of one shape, got \(4, 5\) and \(4, 4\)",
        ):
            normalize_advantages(self.adv, self.mask[:, :4])
        with self.assertRaisesRegex(TypeError, "adv_BxT must have a floating dtype, got int32"):
            normalize_advantages(self.adv.astype(np.int32), self.mask)
        with self.assertRaisesRegex(
            ValueError, "group_size is required when mean_level or std_level is 'group'"
        ):
            normalize_advantages(self.adv, self.mask, mean_level="group")
        with self.assertRaisesRegex(ValueError, "batch size 4 is not a multiple of group_size 3"):
            normalize_advantages(self.adv, self.mask, std_level="group", group_size=3)
        with self.assertRaisesRegex(ValueError, r"mean_level='token' is not one of"):
            normalize_advantages(self.adv, self.mask, mean_level="token")


class KLEstimateTest(parameterized.TestCase):
    def test_by_hand(self):
        logp = np.array([[0.0, -1.0]], np.float32)
        ref = np.array([[-0.5, -1.0]], np.float32)  # d = 0.5, 0
        np.testing.assert_allclose(kl_estimate(logp, ref, "k1"), [[0.5, 0.0]])
        np.testing.assert_allclose(kl_estimate(logp, ref, "k2"), [[0.125, 0.0]])
        np.testing.assert_allclose(
            kl_estimate(logp, ref, "k3"), [[math.exp(-0.5) - 0.5, 0.0]], rtol=1e-6
        )
        np.testing.assert_allclose(kl_estimate(logp, ref), [[0.5, 0.0]])  # k1 by default

    def test_errors(self):
        x = np.zeros((2, 2), np.float32)
        with self.assertRaisesRegex(
            ValueError, r"estimator='k4' is not one of \['k1', 'k2', 'k3'\]"
        ):
            kl_estimate(x, x, "k4")
        with self.assertRaisesRegex(
            ValueError, r"logp_BxT and ref_logp_BxT must have one shape, got \(2, 2\) and \(2, 3\)"
        ):
            kl_estimate(x, np.zeros((2, 3), np.float32))
        with self.assertRaisesRegex(
            TypeError, "ref_logp_BxT must have a floating dtype, got int32"
        ):
            kl_estimate(x, x.astype(np.int32))


class OverlongPenaltyTest(parameterized.TestCase):
    def test_by_hand(self):
        # L_max 10, L_cache 4: no penalty up to 6, linear to -factor at 10, -factor beyond
        lengths = np.array([0, 6, 7, 8, 10, 12])
        want = np.array([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]) * 2.0
        np.testing.assert_allclose(overlong_penalty(lengths, 10, 4, 2.0), want)

    def test_errors(self):
        with self.assertRaisesRegex(
            ValueError, r"overlong_tokens must be in \[1, max_new_tokens=10\], got 11"
        ):
            overlong_penalty(np.array([1]), 10, 11, 1.0)
        with self.assertRaisesRegex(
            ValueError, r"overlong_tokens must be in \[1, max_new_tokens=10\], got 0"
        ):
            overlong_penalty(np.array([1]), 10, 0, 1.0)
        with self.assertRaisesRegex(ValueError, "max_new_tokens must be >= 1, got 0"):
            overlong_penalty(np.array([1]), 0, 1, 1.0)
        with self.assertRaisesRegex(TypeError, "max_new_tokens must be a Python int, got float"):
            overlong_penalty(np.array([1]), 10.0, 4, 1.0)
        with self.assertRaisesRegex(ValueError, "penalty_factor must be >= 0, got -1.0"):
            overlong_penalty(np.array([1]), 10, 4, -1.0)


class GrpoTokenAdvantagesTest(chex.TestCase):
    def setUp(self):
        super().setUp()
        rng = np.random.default_rng(1)
        self.rewards = np.array([1.0, 0.0, 0.5, 1.0, 1.0, 1.0], np.float32)
        self.mask = np.zeros((6, 5), bool)
        for b, (start, end) in enumerate([(1, 5), (2, 4), (1, 3), (0, 5), (2, 5), (4, 5)]):
            self.mask[b, start:end] = True
        self.logp = rng.normal(-1.0, 1.0, (6, 5)).astype(np.float32)
        self.ref = (self.logp + rng.normal(0.0, 3.0, (6, 5))).astype(np.float32)

    def test_no_kl_every_token_carries_the_normalised_reward(self):
        got = grpo_token_advantages(self.rewards, self.mask, group_size=3)
        norm = normalize_rewards(self.rewards, 3)
        np.testing.assert_allclose(got, np.where(self.mask, np.asarray(norm)[:, None], 0.0))
        np.testing.assert_allclose(got, ref_grpo(self.rewards, self.mask, 3), rtol=1e-5, atol=1e-6)

    @parameterized.named_parameters(
        ("k1", dict(kl_estimator="k1")),
        ("k2", dict(kl_estimator="k2")),
        ("k3_clamped", dict(kl_estimator="k3", kl_clamp=2.0)),
        ("k3_unclamped", dict(kl_estimator="k3", kl_clamp=None)),
        ("adv_norm", dict(adv_norm=True)),
        ("batch_loo", dict(mean_level="batch", mean_leave1out=True, std_unbiased=False)),
        ("no_norm", dict(mean_level=None, std_level=None)),
    )
    def test_kl_and_options_match_reference(self, options):
        kw = dict(kl_ctl=0.1, logp_BxT=self.logp, ref_logp_BxT=self.ref, **options)
        got = grpo_token_advantages(self.rewards, self.mask, group_size=3, **kw)
        want = ref_grpo(
            self.rewards, self.mask, 3, kl_ctl=0.1, logp=self.logp, ref_logp=self.ref, **options
        )
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def test_kl_by_hand(self):
        # k1 = 1 on every token, kl_ctl 0.1: the token rewards are -0.1 each, summed to the end
        mask = np.ones((2, 3), bool)
        got = grpo_token_advantages(
            np.array([1.0, 0.0]),
            mask,
            group_size=2,
            kl_ctl=0.1,
            logp_BxT=np.zeros((2, 3), np.float32),
            ref_logp_BxT=-np.ones((2, 3), np.float32),
        )
        s = 0.5 / (math.sqrt(0.5) + 1e-5)  # rewards {1, 0}: centred +-0.5, unbiased std sqrt(0.5)
        np.testing.assert_allclose(
            got, [[s - 0.3, s - 0.2, s - 0.1], [-s - 0.3, -s - 0.2, -s - 0.1]], rtol=1e-5
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_variants(self):
        fn = self.variant(
            functools.partial(
                grpo_token_advantages, group_size=3, kl_ctl=0.2, kl_estimator="k2", adv_norm=True
            )
        )
        got = fn(self.rewards, self.mask, logp_BxT=self.logp, ref_logp_BxT=self.ref)
        want = ref_grpo(
            self.rewards,
            self.mask,
            3,
            kl_ctl=0.2,
            logp=self.logp,
            ref_logp=self.ref,
            kl_estimator="k2",
            adv_norm=True,
        )
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def test_errors(self):
        with self.assertRaisesRegex(
            ValueError,
            r"kl_ctl=0.1 needs both logp_BxT and ref_logp_BxT \(got logp_BxT=None, ref_logp_BxT=array\)",
        ):
            grpo_token_advantages(
                self.rewards, self.mask, group_size=3, kl_ctl=0.1, ref_logp_BxT=self.ref
            )
        with self.assertRaisesRegex(
            ValueError,
            r"logp_BxT \(6, 4\) and ref_logp_BxT \(6, 5\) must have the shape of loss_mask_BxT \(6, 5\)",
        ):
            grpo_token_advantages(
                self.rewards,
                self.mask,
                group_size=3,
                kl_ctl=0.1,
                logp_BxT=self.logp[:, :4],
                ref_logp_BxT=self.ref,
            )
        with self.assertRaisesRegex(
            ValueError, r"rewards_B shape \(5,\) does not match loss_mask_BxT shape \(6, 5\)"
        ):
            grpo_token_advantages(self.rewards[:5], self.mask, group_size=3)
        with self.assertRaisesRegex(
            ValueError, r"loss_mask_BxT must be 2-D \[B, T\], got shape \(6,\)"
        ):
            grpo_token_advantages(self.rewards, self.mask[:, 0], group_size=3)
        with self.assertRaisesRegex(
            ValueError, r"kl_estimator='k5' is not one of \['k1', 'k2', 'k3'\]"
        ):
            grpo_token_advantages(self.rewards, self.mask, group_size=3, kl_estimator="k5")
        with self.assertRaisesRegex(ValueError, "kl_clamp must be > 0 or None, got 0.0"):
            grpo_token_advantages(self.rewards, self.mask, group_size=3, kl_clamp=0.0)
        with self.assertRaisesRegex(ValueError, "batch size 6 is not a multiple of group_size 4"):
            grpo_token_advantages(self.rewards, self.mask, group_size=4)


if __name__ == "__main__":
    absltest.main()


@pytest.mark.parametrize("leave1out", [False, True])
def test_equal_values_normalise_to_exactly_zero(leave1out):
    """Values inexact in binary: a float32 mean misses them by an ulp, and dividing by a
    tiny std made it 0.0059 (rewards of 0.7) and 0.0667 (tokens of 2.912561)."""
    rewards = jnp.array([0.7] * 8 + [0.0, 1.0] * 4, jnp.float32)
    out = normalize_rewards(rewards, 8, mean_leave1out=leave1out)
    assert np.all(np.asarray(out[:8]) == 0.0)
    assert np.all(np.abs(np.asarray(out[8:])) > 0.5)  # the other group still normalises
    adv = jnp.full((4, 6), 2.912561, jnp.float32).at[2:].set(jnp.arange(12.0).reshape(2, 6))
    mask = jnp.ones((4, 6), bool).at[0, 4:].set(False)
    out = normalize_advantages(
        adv, mask, mean_level="group", std_level="group", group_size=2, mean_leave1out=leave1out
    )
    assert np.all(np.asarray(out[:2]) == 0.0) and np.abs(np.asarray(out[2:])).max() > 0.5
