"""Tests for m2po_jax.algorithm.losses against numpy references written from docs/algorithm.md."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.test_util import check_grads

from m2po_jax.algorithm.losses import policy_loss
from m2po_jax.algorithm.rejection import RejectionSampling, behaviour_correction

RS = RejectionSampling


def make_inputs(seed=0, B=4, T=6):
    """Random log-probs with clipping, dual clipping and rejections all present; row 3 empty."""
    rng = np.random.default_rng(seed)
    prox = rng.normal(-1.0, 0.5, (B, T))
    logp = prox + rng.normal(0.0, 0.3, (B, T))
    behav = prox + rng.normal(0.0, 0.6, (B, T))
    adv = rng.normal(0.0, 1.0, (B, T))
    adv[1:3] -= 1.0  # rows with a negative mean advantage, for GSPO's clip and dual clip
    mask = rng.random((B, T)) < 0.8
    mask[3] = False
    valid = mask | (rng.random((B, T)) < 0.5)
    f32 = lambda x: x.astype(np.float32)
    return f32(logp), f32(prox), f32(behav), f32(adv), mask, valid


# ----------------------------------------------------------------------------------------
# numpy reference, written from docs/algorithm.md ("The loss") with explicit loops
# ----------------------------------------------------------------------------------------


def _metric(name, lr):
    return {
        "ratio": math.exp(lr),
        "kl_k1": lr,
        "kl_k2": lr * lr / 2,
        "kl_k3": math.exp(-lr) - 1 + lr,
    }[name]


def _inside(v, rs):
    return v <= rs.upper and (rs.lower is None or v >= rs.lower)


def ref_policy_loss(
    logp,
    prox,
    behav,
    adv,
    mask,
    *,
    eps_clip=0.2,
    eps_clip_higher=None,
    c_clip=None,
    use_decoupled_loss=True,
    importance_sampling_level="token",
    rejection_sampling=RS(),  # noqa: B008 (frozen, hashable)
    use_sapo_loss=False,
    sapo_tau_pos=1.0,
    sapo_tau_neg=1.05,
    denominator="kept",
    valid_mask_BxT=None,
):
    logp, prox, behav, adv = (np.asarray(x, np.float64) for x in (logp, prox, behav, adv))
    B, T = logp.shape
    if use_sapo_loss or not use_decoupled_loss:
        prox = behav
    rows = [[t for t in range(T) if mask[b, t]] for b in range(B)]
    # Behaviour weight and rejection.
    lrho = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            d = float(np.float32(prox[b, t]) - np.float32(behav[b, t]))
            lrho[b, t] = d if math.isfinite(d) else 0.0
    weight = np.exp(lrho)
    keep = mask.copy()
    rs = None if use_sapo_loss else rejection_sampling
    clamp_lo = None if rs is None else (rs.lower if rs.lower is not None else 0.0)
    if rs is not None and rs.level == "token":
        for b in range(B):
            for t in rows[b]:
                if rs.action == "mask":
                    keep[b, t] = _inside(_metric(rs.metric, lrho[b, t]), rs)
                else:
                    weight[b, t] = min(max(weight[b, t], clamp_lo), rs.upper)
    elif rs is not None:
        for b in range(B):
            toks = rows[b]
            vals = [
                lrho[b, t] if rs.metric == "ratio" else _metric(rs.metric, lrho[b, t]) for t in toks
            ]
            if not toks:
                agg = 0.0
            elif rs.agg == "sum":
                agg = sum(vals)
            elif rs.agg == "mean":
                agg = sum(vals) / len(vals)
            else:
                agg = max(vals)
            if rs.metric == "ratio":
                agg = math.exp(agg)
                geo = math.exp(sum(lrho[b, t] for t in toks) / max(len(toks), 1))
                weight[b, :] = geo
            if not _inside(agg, rs):
                for t in toks:
                    if rs.action == "mask":
                        keep[b, t] = False
                    else:
                        weight[b, t] = min(max(weight[b, t], clamp_lo), rs.upper)
    if use_sapo_loss:
        weight[:] = 1.0

    eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher
    total = 0.0
    counts = dict(clip=0, low=0, high=0, dual=0)
    ratios, weights, k3 = [], [], []
    for b in range(B):
        kept = [t for t in rows[b] if keep[b, t]]
        if importance_sampling_level == "sequence" and kept:
            r_seq = math.exp(sum(logp[b, t] - prox[b, t] for t in kept) / len(kept))
            a_seq = sum(adv[b, t] for t in kept) / len(kept)
        for t in kept:
            if importance_sampling_level == "sequence":
                r, a = r_seq, a_seq
            else:
                r, a = math.exp(logp[b, t] - prox[b, t]), adv[b, t]
            if use_sapo_loss:
                tau = sapo_tau_pos if a > 0 else sapo_tau_neg
                loss_t = -(4 / tau) / (1 + math.exp(-tau * (r - 1))) * a
            else:
                clipped = r if eps_clip is None else min(max(r, 1 - eps_clip), 1 + eps_high)
                loss_t = max(-a * r, -a * clipped)
                if -a * clipped > -a * r:
                    counts["clip"] += 1
                    counts["low" if r < 1 - eps_clip else "high"] += 1
                if c_clip is not None and a < 0 and c_clip * abs(a) < loss_t:
                    loss_t = c_clip * abs(a)
                    counts["dual"] += 1
                loss_t *= weight[b, t]
            total += loss_t
            ratios.append(r)
            weights.append(weight[b, t])
            lr_tok = logp[b, t] - prox[b, t]
            k3.append(math.exp(lr_tok) - 1 - lr_tok)
    n_mask = int(mask.sum())
    n = n_mask if denominator == "kept" else int(np.asarray(valid_mask_BxT).sum())
    loss = total / max(n, 1)
    n_keep = int(keep.sum())
    stats = {
        "actor/loss": loss,
        "actor/clip_fraction": counts["clip"] / max(n_mask, 1),
        "actor/clip_low_fraction": counts["low"] / max(n_mask, 1),
        "actor/clip_high_fraction": counts["high"] / max(n_mask, 1),
        "actor/dual_clip_fraction": counts["dual"] / max(n_mask, 1),
        "actor/importance_weight_min": min(ratios, default=0.0),
        "actor/importance_weight_mean": sum(ratios) / max(len(ratios), 1),
        "actor/importance_weight_max": max(ratios, default=0.0),
        "actor/behav_weight_mean": sum(weights) / max(len(weights), 1),
        "actor/behav_weight_max": max(weights, default=0.0),
        "actor/approx_kl": sum(k3) / max(len(k3), 1),
        "actor/kept_tokens": n_keep,
        "actor/rejected_tokens": n_mask - n_keep,
    }
    return loss, stats


CASES = [
    ("default", {}),
    ("no_rejection", dict(rejection_sampling=None)),
    ("clip_higher", dict(eps_clip_higher=0.28)),
    ("dual_clip", dict(c_clip=1.05)),
    ("eps_zero", dict(eps_clip=0.0)),
    ("no_ratio_clip", dict(eps_clip=None)),
    ("no_ratio_clip_dual", dict(eps_clip=None, c_clip=1.05)),
    ("gspo_no_ratio_clip", dict(importance_sampling_level="sequence", eps_clip=None)),
    ("not_decoupled", dict(use_decoupled_loss=False)),
    ("gspo", dict(importance_sampling_level="sequence", eps_clip=0.04)),
    ("gspo_dual_clip", dict(importance_sampling_level="sequence", c_clip=1.05, eps_clip=0.05)),
    (
        "gspo_seq_reject",
        dict(
            importance_sampling_level="sequence", rejection_sampling=RS(level="sequence", upper=1.3)
        ),
    ),
    ("tok_mask_ratio", dict(rejection_sampling=RS(upper=2.0, lower=0.5))),
    ("tok_clamp_ratio", dict(rejection_sampling=RS(action="clamp", upper=2.0, lower=0.5))),
    ("tok_clamp_no_lower", dict(rejection_sampling=RS(action="clamp", upper=1.5))),
    ("seq_mask_mean", dict(rejection_sampling=RS(level="sequence", upper=1.3))),
    ("seq_mask_sum", dict(rejection_sampling=RS(level="sequence", agg="sum", upper=3.0))),
    ("seq_mask_max", dict(rejection_sampling=RS(level="sequence", agg="max", upper=2.1))),
    (
        "seq_clamp_mean",
        dict(rejection_sampling=RS(level="sequence", action="clamp", upper=1.1, lower=0.9)),
    ),
    (
        "seq_clamp_max",
        dict(rejection_sampling=RS(level="sequence", action="clamp", agg="max", upper=1.25)),
    ),
    ("tok_kl_k1", dict(rejection_sampling=RS(metric="kl_k1", upper=0.5, lower=-0.5))),
    ("tok_kl_k2", dict(rejection_sampling=RS(metric="kl_k2", upper=0.2))),
    ("tok_kl_k3", dict(rejection_sampling=RS(metric="kl_k3", upper=0.2))),
    (
        "seq_kl_k3_sum",
        dict(rejection_sampling=RS(level="sequence", metric="kl_k3", agg="sum", upper=0.8)),
    ),
    ("seq_kl_k2_mean", dict(rejection_sampling=RS(level="sequence", metric="kl_k2", upper=0.145))),
    (
        "seq_kl_k1_max",
        dict(rejection_sampling=RS(level="sequence", metric="kl_k1", agg="max", upper=0.75)),
    ),
    ("denominator_valid", dict(denominator="valid")),
    ("sapo", dict(use_sapo_loss=True, use_decoupled_loss=False)),
    (
        "sapo_seq",
        dict(use_sapo_loss=True, use_decoupled_loss=False, importance_sampling_level="sequence"),
    ),
    (
        "sapo_taus",
        dict(use_sapo_loss=True, use_decoupled_loss=False, sapo_tau_pos=2.0, sapo_tau_neg=0.5),
    ),
]

# Which statistic must be non-zero for a case to prove that its option was exercised.
EXERCISED = {
    "default": "actor/clip_fraction",
    "clip_higher": "actor/clip_high_fraction",
    "dual_clip": "actor/dual_clip_fraction",
    "no_ratio_clip_dual": "actor/dual_clip_fraction",
    "gspo_dual_clip": "actor/dual_clip_fraction",
    "gspo_seq_reject": "actor/rejected_tokens",
    "tok_mask_ratio": "actor/rejected_tokens",
    "seq_mask_mean": "actor/rejected_tokens",
    "seq_mask_sum": "actor/rejected_tokens",
    "seq_mask_max": "actor/rejected_tokens",
    "tok_kl_k1": "actor/rejected_tokens",
    "tok_kl_k2": "actor/rejected_tokens",
    "tok_kl_k3": "actor/rejected_tokens",
    "seq_kl_k3_sum": "actor/rejected_tokens",
    "seq_kl_k2_mean": "actor/rejected_tokens",
    "seq_kl_k1_max": "actor/rejected_tokens",
    "gspo": "actor/clip_fraction",
    "tok_clamp_ratio": "actor/clamped_tokens",
    "tok_clamp_no_lower": "actor/clamped_tokens",
    "seq_clamp_mean": "actor/clamped_tokens",
    "seq_clamp_max": "actor/clamped_tokens",
}


# Every case runs eagerly; chex's jit / no-jit variants run on one case per code path.
VARIANT_CASES = (
    "default",
    "gspo_dual_clip",
    "seq_clamp_mean",
    "seq_kl_k3_sum",
    "sapo_seq",
    "denominator_valid",
)


class PolicyLossReferenceTest(chex.TestCase):
    def check_case(self, fn, case, options):
        logp, prox, behav, adv, mask, valid = make_inputs()
        loss, stats = fn(logp, prox, behav, adv, mask, valid_mask_BxT=valid)
        want_loss, want_stats = ref_policy_loss(
            logp, prox, behav, adv, mask, valid_mask_BxT=valid, **options
        )
        np.testing.assert_allclose(loss, want_loss, rtol=2e-5, atol=1e-6)
        for key, want in want_stats.items():
            np.testing.assert_allclose(stats[key], want, rtol=2e-5, atol=1e-6, err_msg=key)
        self.assertEqual(stats["actor/loss"].dtype, jnp.float32)
        if case in EXERCISED:
            key = EXERCISED[case]
            self.assertGreater(float(stats[key]), 0.0, msg=f"{case} did not exercise {key}")

    @parameterized.named_parameters((name, name, options) for name, options in CASES)
    def test_matches_numpy_reference(self, case, options):
        self.check_case(functools.partial(policy_loss, **options), case, options)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        (name, name, options) for name, options in CASES if name in VARIANT_CASES
    )
    def test_variants(self, case, options):
        self.check_case(self.variant(functools.partial(policy_loss, **options)), case, options)

    def test_not_decoupled_ignores_prox(self):
        logp, prox, behav, adv, mask, _ = make_inputs(1)
        a, _ = policy_loss(logp, prox, behav, adv, mask, use_decoupled_loss=False)
        b, _ = policy_loss(logp, prox + 3.0, behav, adv, mask, use_decoupled_loss=False)
        c, _ = policy_loss(logp, behav, behav, adv, mask)
        np.testing.assert_allclose(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-6)

    def test_sapo_ignores_prox_and_rejection(self):
        logp, prox, behav, adv, mask, _ = make_inputs(2)
        kw = dict(use_sapo_loss=True, use_decoupled_loss=False)
        a, _ = policy_loss(logp, prox, behav, adv, mask, **kw)
        b, _ = policy_loss(logp, prox - 5.0, behav, adv, mask, rejection_sampling=None, **kw)
        np.testing.assert_allclose(a, b)

    def test_bf16_inputs_give_float32(self):
        logp, prox, behav, adv, mask, _ = make_inputs(3)
        cast = lambda x: jnp.asarray(x, jnp.bfloat16)
        loss, stats = policy_loss(cast(logp), cast(prox), cast(behav), cast(adv), mask)
        self.assertEqual(loss.dtype, jnp.float32)
        want, _ = ref_policy_loss(
            *(np.asarray(cast(x), np.float64) for x in (logp, prox, behav, adv)), mask
        )
        np.testing.assert_allclose(loss, want, rtol=1e-4)
        grad = jax.grad(lambda lp: policy_loss(lp, prox, behav, adv, mask)[0])(cast(logp))
        self.assertEqual(grad.dtype, jnp.bfloat16)

    def test_traced_clip_range(self):
        logp, prox, behav, adv, mask, _ = make_inputs(4)

        @jax.jit
        def f(eps, eps_high):
            return policy_loss(
                logp, prox, behav, adv, mask, eps_clip=eps, eps_clip_higher=eps_high
            )[0]

        want, _ = ref_policy_loss(logp, prox, behav, adv, mask, eps_clip=0.1, eps_clip_higher=0.3)
        np.testing.assert_allclose(f(jnp.float32(0.1), jnp.float32(0.3)), want, rtol=2e-5)

    def test_vmap_over_batches(self):
        inputs = [make_inputs(s) for s in (5, 6)]
        stacked = [np.stack(xs) for xs in zip(*inputs, strict=True)]
        loss, _ = jax.vmap(lambda *a: policy_loss(*a[:5], valid_mask_BxT=a[5]))(*stacked)
        for i, inp in enumerate(inputs):
            want, _ = ref_policy_loss(*inp[:5])
            np.testing.assert_allclose(loss[i], want, rtol=2e-5, atol=1e-6)


def one(x):
    return np.array([[x]], np.float32)


class HandComputedTest(parameterized.TestCase):
    """Single tokens (prox = behav unless stated) whose losses are worked out by hand."""

    def loss(self, r, a, *, log_rho=0.0, **kw):
        logp = one(math.log(r))
        loss, stats = policy_loss(
            logp, one(0.0), one(-log_rho), one(a), np.ones((1, 1), bool), **kw
        )
        return float(loss), {k: float(v) for k, v in stats.items()}

    def test_clip_high_binds(self):
        loss, stats = self.loss(1.5, 1.0)  # max(-1.5, -1.2)
        self.assertAlmostEqual(loss, -1.2, places=6)
        self.assertEqual(stats["actor/clip_fraction"], 1.0)
        self.assertEqual(stats["actor/clip_high_fraction"], 1.0)
        self.assertEqual(stats["actor/clip_low_fraction"], 0.0)

    def test_clip_low_binds_for_negative_advantage(self):
        loss, stats = self.loss(0.5, -1.0)  # max(0.5, 0.8)
        self.assertAlmostEqual(loss, 0.8, places=6)
        self.assertEqual(stats["actor/clip_low_fraction"], 1.0)

    def test_unclipped_inside_range(self):
        loss, stats = self.loss(1.1, 2.0)
        self.assertAlmostEqual(loss, -2.2, places=5)
        self.assertEqual(stats["actor/clip_fraction"], 0.0)

    def test_clip_higher(self):
        self.assertAlmostEqual(self.loss(1.25, 1.0, eps_clip_higher=0.28)[0], -1.25, places=5)
        self.assertAlmostEqual(self.loss(1.4, 1.0, eps_clip_higher=0.28)[0], -1.28, places=5)
        # the lower side still uses eps_clip
        self.assertAlmostEqual(self.loss(0.7, -1.0, eps_clip_higher=0.28)[0], 0.8, places=5)

    def test_dual_clip_binds_for_negative_advantage(self):
        loss, stats = self.loss(5.0, -1.0, c_clip=3.0)  # min(max(5, 1.2), 3)
        self.assertAlmostEqual(loss, 3.0, places=5)
        self.assertEqual(stats["actor/dual_clip_fraction"], 1.0)
        self.assertAlmostEqual(self.loss(5.0, -1.0)[0], 5.0, places=5)
        # A > 0: min(L, c|A|) never binds
        self.assertAlmostEqual(self.loss(5.0, 1.0, c_clip=3.0)[0], -1.2, places=5)
        loss, stats = self.loss(2.0, -1.0, c_clip=3.0)
        self.assertAlmostEqual(loss, 2.0, places=5)
        self.assertEqual(stats["actor/dual_clip_fraction"], 0.0)

    def test_eps_clip_zero(self):
        self.assertAlmostEqual(self.loss(0.9, 1.0, eps_clip=0.0)[0], -0.9, places=5)
        self.assertAlmostEqual(self.loss(1.1, 1.0, eps_clip=0.0)[0], -1.0, places=5)

    def test_no_ratio_clip(self):
        # eps_clip=None: L = -A * r whatever r is; dual clip still bounds A < 0 tokens.
        loss, stats = self.loss(1.5, 1.0, eps_clip=None)
        self.assertAlmostEqual(loss, -1.5, places=5)
        self.assertEqual(stats["actor/clip_fraction"], 0.0)
        self.assertAlmostEqual(self.loss(0.5, -1.0, eps_clip=None)[0], 0.5, places=5)
        self.assertAlmostEqual(self.loss(5.0, -1.0, eps_clip=None)[0], 5.0, places=5)
        loss, stats = self.loss(5.0, -1.0, eps_clip=None, c_clip=3.0)
        self.assertAlmostEqual(loss, 3.0, places=5)
        self.assertEqual(stats["actor/dual_clip_fraction"], 1.0)

    def test_behaviour_weight_multiplies(self):
        loss, stats = self.loss(1.0, 1.0, log_rho=math.log(2.0))
        self.assertAlmostEqual(loss, -2.0, places=5)
        self.assertAlmostEqual(stats["actor/behav_weight_max"], 2.0, places=5)
        # rejection_sampling=None keeps rho, unbounded
        self.assertAlmostEqual(
            self.loss(1.0, 1.0, log_rho=math.log(8.0), rejection_sampling=None)[0], -8.0, places=4
        )

    def test_clamp_versus_mask(self):
        # token 0: rho = 8 > upper 5; token 1: rho = 1. r = 1, A = 1. Count stays 2.
        logp = np.zeros((1, 2), np.float32)
        behav = np.array([[-math.log(8.0), 0.0]], np.float32)
        adv = np.ones((1, 2), np.float32)
        mask = np.ones((1, 2), bool)
        masked, s = policy_loss(logp, logp, behav, adv, mask, rejection_sampling=RS(action="mask"))
        self.assertAlmostEqual(float(masked), -0.5, places=5)
        self.assertEqual(float(s["actor/rejected_tokens"]), 1.0)
        self.assertEqual(float(s["actor/kept_tokens"]), 1.0)
        clamped, s = policy_loss(
            logp, logp, behav, adv, mask, rejection_sampling=RS(action="clamp")
        )
        self.assertAlmostEqual(float(clamped), -3.0, places=5)  # (-5 - 1) / 2
        self.assertEqual(float(s["actor/clamped_tokens"]), 1.0)
        self.assertEqual(float(s["actor/rejected_tokens"]), 0.0)

    def test_sequence_rejection_uses_geometric_mean(self):
        # one row, rho = [4, 9]: geometric mean 6, sum (product) 36, max 9.
        logp = np.zeros((1, 2), np.float32)
        behav = -np.log(np.array([[4.0, 9.0]], np.float32))
        adv = np.ones((1, 2), np.float32)
        mask = np.ones((1, 2), bool)

        def run(**rs):
            return float(
                policy_loss(
                    logp, logp, behav, adv, mask, rejection_sampling=RS(level="sequence", **rs)
                )[0]
            )

        self.assertAlmostEqual(run(upper=5.0), 0.0)  # 6 > 5: row rejected
        self.assertAlmostEqual(run(upper=6.5), -6.0, places=4)  # both tokens weigh 6
        self.assertAlmostEqual(run(upper=8.0, agg="max"), 0.0)
        self.assertAlmostEqual(run(upper=9.5, agg="max"), -6.0, places=4)
        self.assertAlmostEqual(run(upper=30.0, agg="sum"), 0.0)
        self.assertAlmostEqual(run(upper=5.0, action="clamp"), -5.0, places=4)

    def test_bounds_are_inclusive(self):
        # kl_k1 = prox - behav = 0.5 exactly in float32
        def run(**rs):
            loss, stats = policy_loss(
                one(0.0),
                one(0.5),
                one(0.0),
                one(1.0),
                np.ones((1, 1), bool),
                rejection_sampling=RS(metric="kl_k1", **rs),
            )
            return float(stats["actor/kept_tokens"])

        self.assertEqual(run(upper=0.5), 1.0)
        self.assertEqual(run(upper=0.49), 0.0)
        self.assertEqual(run(upper=1.0, lower=0.5), 1.0)
        self.assertEqual(run(upper=1.0, lower=0.51), 0.0)

    def test_nonfinite_log_rho_is_zero(self):
        prox = np.array([[-1.0, -np.inf, -1.0]], np.float32)
        behav = np.array([[-np.inf, -np.inf, np.nan]], np.float32)  # log rho: +inf, nan, nan
        rho, keep, *_ = behaviour_correction(prox, behav, np.ones((1, 3), bool), RS())
        np.testing.assert_array_equal(rho, 1.0)
        np.testing.assert_array_equal(keep, True)
        loss, _ = policy_loss(one(-1.0), one(-1.0), one(-np.inf), one(1.0), np.ones((1, 1), bool))
        self.assertAlmostEqual(float(loss), -1.0, places=6)

    def test_gspo_by_hand(self):
        # log r = [0.1, 0.3] -> r_seq = exp(0.2) = 1.2214 > 1.2; mean A = 2.
        logp = np.array([[0.1, 0.3]], np.float32)
        zeros = np.zeros((1, 2), np.float32)
        adv = np.array([[1.0, 3.0]], np.float32)
        loss, stats = policy_loss(
            logp, zeros, zeros, adv, np.ones((1, 2), bool), importance_sampling_level="sequence"
        )
        self.assertAlmostEqual(float(loss), -2.4, places=5)
        self.assertAlmostEqual(float(stats["actor/importance_weight_max"]), math.exp(0.2), places=5)
        self.assertEqual(float(stats["actor/clip_fraction"]), 1.0)

    def test_sapo_by_hand(self):
        kw = dict(use_sapo_loss=True, use_decoupled_loss=False)
        self.assertAlmostEqual(self.loss(1.0, 1.0, **kw)[0], -2.0, places=5)  # (4/1) * 0.5
        self.assertAlmostEqual(self.loss(1.0, -1.0, **kw)[0], 2.0 / 1.05, places=5)
        r = 1.5  # gate (4 / 2) * sigmoid(2 * 0.5)
        want = -2.0 / (1.0 + math.exp(-1.0))
        self.assertAlmostEqual(self.loss(r, 1.0, sapo_tau_pos=2.0, **kw)[0], want, places=5)

    def test_denominators(self):
        logp = np.zeros((1, 4), np.float32)
        adv = np.ones((1, 4), np.float32)
        mask = np.array([[True, True, False, False]])
        valid = np.array([[True, True, True, True]])
        kept, _ = policy_loss(logp, logp, logp, adv, mask)
        paper, _ = policy_loss(
            logp, logp, logp, adv, mask, denominator="valid", valid_mask_BxT=valid
        )
        self.assertAlmostEqual(float(kept), -1.0, places=6)
        self.assertAlmostEqual(float(paper), -0.5, places=6)

    def test_kept_denominator_ignores_the_valid_mask_it_is_given(self):
        """As the train step calls it (the mask before M2PO always passed): "kept" divides
        by the tokens M2PO kept, "valid" by the valid ones; tokens the behaviour correction
        rejects stay in either count."""
        zeros = np.zeros((1, 6), np.float32)
        adv = np.array([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]], np.float32)
        behav = zeros.copy()
        behav[0, 2] = -2.0  # rho = e^2 > 5: rejected by the default correction
        valid = np.array([[True, True, True, True, True, False]])  # 5 valid tokens
        kept = np.array([[True, True, True, False, False, False]])  # M2PO kept 3 of them
        args = (zeros, zeros, behav, adv, kept)
        loss, stats = policy_loss(*args, denominator="kept", valid_mask_BxT=valid)
        # r = 1, rho = 1 on tokens 0 and 1; token 2 rejected: -(1 + 2) / 3 kept tokens.
        self.assertAlmostEqual(float(loss), -1.0, places=6)
        self.assertEqual(float(stats["actor/rejected_tokens"]), 1.0)
        self.assertEqual(float(stats["actor/kept_tokens"]), 2.0)
        paper, _ = policy_loss(*args, denominator="valid", valid_mask_BxT=valid)
        self.assertAlmostEqual(float(paper), -3.0 / 5.0, places=6)
        # An explicit count (a micro-batch's share of its minibatch) replaces either.
        share, _ = policy_loss(*args, denominator="kept", valid_mask_BxT=valid, count=6)
        self.assertAlmostEqual(float(share), -0.5, places=6)

    @parameterized.parameters("token", "sequence")
    def test_empty_mask_is_zero_without_nan(self, level):
        logp = np.full((2, 3), -np.inf, np.float32)
        none = np.zeros((2, 3), bool)
        f = lambda lp: policy_loss(
            lp, logp, logp, np.ones((2, 3), np.float32), none, importance_sampling_level=level
        )
        loss, stats = f(logp)
        self.assertEqual(float(loss), 0.0)
        for k, v in stats.items():
            self.assertTrue(np.isfinite(v), k)
        grad = jax.grad(lambda lp: f(lp)[0])(jnp.zeros((2, 3)))
        np.testing.assert_array_equal(grad, 0.0)


class GradientTest(parameterized.TestCase):
    """Gradients w.r.t. logp: finite differences, zero outside the mask and under the clip."""

    def smooth_inputs(self, seed):
        # ratios inside (0.85, 1.15) so that no clip kink is near with eps_clip 0.2
        rng = np.random.default_rng(seed)
        prox = rng.normal(-1.0, 0.5, (3, 5)).astype(np.float32)
        logp = (prox + rng.uniform(-0.15, 0.15, (3, 5))).astype(np.float32)
        behav = (prox + rng.normal(0.0, 0.3, (3, 5))).astype(np.float32)
        adv = rng.normal(0.0, 1.0, (3, 5)).astype(np.float32)
        mask = rng.random((3, 5)) < 0.8
        return logp, prox, behav, adv, mask

    @parameterized.named_parameters(
        ("token", dict()),
        ("sequence", dict(importance_sampling_level="sequence")),
        ("sapo", dict(use_sapo_loss=True, use_decoupled_loss=False)),
        (
            "sapo_sequence",
            dict(
                use_sapo_loss=True, use_decoupled_loss=False, importance_sampling_level="sequence"
            ),
        ),
        ("clamp", dict(rejection_sampling=RS(action="clamp", upper=1.2))),
    )
    def test_check_grads(self, options):
        logp, prox, behav, adv, mask = self.smooth_inputs(0)
        f = jax.jit(lambda lp: policy_loss(lp, prox, behav, adv, mask, **options)[0])
        check_grads(
            f, (jnp.asarray(logp),), order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-3
        )

    def test_check_grads_through_clip_and_dual_clip(self):
        # tokens far on either side of the clip kinks and of the dual-clip kink
        r = np.array([[1.6, 0.5, 1.05, 8.0, 0.9]], np.float32)
        adv = np.array([[1.0, -1.0, 0.5, -1.0, -2.0]], np.float32)
        zeros = np.zeros_like(r)
        f = jax.jit(
            lambda lp: policy_loss(lp, zeros, zeros, adv, np.ones_like(r, bool), c_clip=3.0)[0]
        )
        check_grads(f, (jnp.log(r),), order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-3)

    def test_gradient_is_zero_outside_mask_and_under_clip(self):
        r = np.array([[1.6, 0.5, 1.05, 8.0, 0.9, 1.0]], np.float32)
        adv = np.array([[1.0, -1.0, 0.5, -1.0, -2.0, 3.0]], np.float32)
        mask = np.array([[True, True, True, True, True, False]])
        rho = np.array([[1.0, 1.0, 2.0, 1.0, 0.5, 1.0]], np.float32)
        prox = np.zeros_like(r)
        behav = -np.log(rho)
        logp = np.log(r)
        logp[0, 5] = -np.inf  # padding must not poison the gradient
        grad = jax.grad(lambda lp: policy_loss(lp, prox, behav, adv, mask, c_clip=3.0)[0])(
            jnp.asarray(logp)
        )
        # dL/dlogp = -A * r * rho / n on unclipped tokens, 0 where any clip binds or masked
        n = mask.sum()
        want = np.zeros_like(r)
        for t in (2, 4):
            want[0, t] = -adv[0, t] * r[0, t] * rho[0, t] / n
        np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)

    @parameterized.parameters(
        dict(adv=1.0, eps_clip=0.0, eps_clip_higher=None),
        dict(adv=-1.0, eps_clip=0.0, eps_clip_higher=None),
        dict(adv=1.0, eps_clip=0.2, eps_clip_higher=0.0),
        dict(adv=-1.0, eps_clip=0.2, eps_clip_higher=0.0),
    )
    def test_gradient_at_r_equal_one_on_a_clip_bound_is_areals(
        self, adv, eps_clip, eps_clip_higher
    ):
        """logp = prox = behav = 0, so r = 1 sits on a bound of the clip range (with one
        minibatch the step takes prox from the loss pass: r = 1 on every token). By hand,
        with torch's subgradients (clamp passes the gradient at its bounds, max splits it
        at a tie): loss -A, d loss / d logp = 0.5 (-A) + 0.5 (-A * 1) = -A. jnp.clip's
        halving at each bound gave -0.625 A."""
        zeros = jnp.zeros((1, 1), jnp.float32)
        mask = jnp.ones((1, 1), bool)

        def loss(lp):
            return policy_loss(
                lp, zeros, zeros, jnp.full((1, 1), adv), mask, eps_clip=eps_clip,
                eps_clip_higher=eps_clip_higher, rejection_sampling=None,
            )[0]  # fmt: skip

        self.assertAlmostEqual(float(loss(zeros)), -adv, places=6)
        self.assertAlmostEqual(float(jax.grad(loss)(zeros)[0, 0]), -adv, places=6)

    def test_no_ratio_clip_gradient_is_minus_a_r_rho_on_every_kept_token(self):
        # The paper's M2PO loss: -A * r * rho on the kept tokens, no clip anywhere. With
        # eps_clip=0 the clip range is [1, 1 + 0] and the gradient vanishes wherever it binds.
        rng = np.random.default_rng(7)
        prox = rng.normal(-1.0, 0.5, (3, 6)).astype(np.float32)
        logp = (prox + rng.normal(0.0, 0.5, (3, 6))).astype(np.float32)  # r far from 1
        behav = (prox + rng.normal(0.0, 0.3, (3, 6))).astype(np.float32)
        adv = rng.normal(0.0, 1.0, (3, 6)).astype(np.float32)
        mask = rng.random((3, 6)) < 0.8
        rs = RS(upper=1.5)  # some tokens rejected: they get no gradient

        def grad(**kw):
            f = lambda lp: policy_loss(lp, prox, behav, adv, mask, rejection_sampling=rs, **kw)
            return np.asarray(jax.grad(lambda lp: f(lp)[0])(jnp.asarray(logp)))

        r = np.exp(logp.astype(np.float64) - prox)
        rho = np.exp(prox.astype(np.float64) - behav)
        keep = mask & (rho <= 1.5)
        self.assertTrue(0 < keep.sum() < mask.sum())
        want = np.where(keep, -adv * r * rho / mask.sum(), 0.0)
        np.testing.assert_allclose(grad(eps_clip=None), want, rtol=1e-5, atol=1e-7)
        zero_clip = grad(eps_clip=0.0)
        binds = keep & (np.where(adv > 0, r > 1.0, r < 1.0))  # clip(r, 1, 1) binds
        self.assertTrue(binds.any())
        np.testing.assert_array_equal(zero_clip[binds], 0.0)
        self.assertTrue(np.all(np.abs(want[binds]) > 0))
        np.testing.assert_allclose(zero_clip[~binds], want[~binds], rtol=1e-5, atol=1e-7)

    def test_gradient_zero_for_rejected_tokens(self):
        logp = np.array([[0.05, 0.05]], np.float32)
        behav = np.array([[-3.0, 0.0]], np.float32)  # rho = e^3 > 5: token 0 rejected
        zeros = np.zeros_like(logp)
        adv = np.ones_like(logp)
        grad = jax.grad(lambda lp: policy_loss(lp, zeros, behav, adv, np.ones((1, 2), bool))[0])(
            jnp.asarray(logp)
        )
        self.assertEqual(float(grad[0, 0]), 0.0)
        self.assertAlmostEqual(float(grad[0, 1]), -math.exp(0.05) / 2, places=6)


class ErrorTest(parameterized.TestCase):
    def args(self, **changes):
        x = np.zeros((2, 3), np.float32)
        a = dict(
            logp_BxT=x,
            prox_logp_BxT=x,
            behav_logp_BxT=x,
            advantages_BxT=x,
            mask_BxT=np.ones((2, 3), bool),
        )
        a.update(changes)
        return a

    def test_shape_mismatch_names_both(self):
        with self.assertRaisesRegex(
            ValueError, r"behav_logp_BxT has shape \(2, 4\) but logp_BxT has shape \(2, 3\)"
        ):
            policy_loss(**self.args(behav_logp_BxT=np.zeros((2, 4), np.float32)))
        with self.assertRaisesRegex(ValueError, r"mask_BxT has shape \(3,\)"):
            policy_loss(**self.args(mask_BxT=np.ones(3, bool)))
        with self.assertRaisesRegex(ValueError, r"valid_mask_BxT has shape \(1, 3\)"):
            policy_loss(**self.args(), valid_mask_BxT=np.ones((1, 3), bool))

    def test_not_2d(self):
        with self.assertRaisesRegex(ValueError, r"logp_BxT must be 2-D \[B, T\], got shape \(3,\)"):
            policy_loss(
                **self.args(
                    **{
                        k: np.zeros(3, np.float32)
                        for k in ("logp_BxT", "prox_logp_BxT", "behav_logp_BxT", "advantages_BxT")
                    },
                    mask_BxT=np.ones(3, bool),
                )
            )

    @parameterized.parameters("logp_BxT", "prox_logp_BxT", "behav_logp_BxT", "advantages_BxT")
    def test_float_dtype(self, name):
        with self.assertRaisesRegex(TypeError, f"{name} must have a floating dtype, got int32"):
            policy_loss(**self.args(**{name: np.zeros((2, 3), np.int32)}))

    @parameterized.named_parameters(
        (
            "is_level",
            dict(importance_sampling_level="seq"),
            r"importance_sampling_level='seq' is not one of \['token', 'sequence'\]",
        ),
        (
            "denominator",
            dict(denominator="all"),
            r"denominator='all' is not one of \['kept', 'valid'\]",
        ),
        ("eps_neg", dict(eps_clip=-0.1), r"eps_clip must be in \[0, 1\) or None, got -0.1"),
        ("eps_one", dict(eps_clip=1.0), r"eps_clip must be in \[0, 1\) or None, got 1.0"),
        (
            "eps_high",
            dict(eps_clip_higher=-0.01),
            r"eps_clip_higher must be >= 0 or None, got -0.01",
        ),
        ("c_clip", dict(c_clip=1.0), r"c_clip must be None or > 1, got 1.0"),
        (
            "higher_without_clip",
            dict(eps_clip=None, eps_clip_higher=0.28),
            r"eps_clip_higher=0.28 needs a ratio clip, but eps_clip=None turns it off",
        ),
        ("tau_pos", dict(sapo_tau_pos=0.0), r"sapo_tau_pos must be > 0, got 0.0"),
        ("tau_neg", dict(sapo_tau_neg=-1.0), r"sapo_tau_neg must be > 0, got -1.0"),
        (
            "sapo_decoupled",
            dict(use_sapo_loss=True),
            r"use_sapo_loss=True is not compatible with use_decoupled_loss=True",
        ),
        (
            "valid_needs_mask",
            dict(denominator="valid"),
            r"denominator='valid' needs valid_mask_BxT",
        ),
    )
    def test_option_errors(self, options, message):
        with self.assertRaisesRegex(ValueError, message):
            policy_loss(**self.args(), **options)

    def test_rejection_sampling_type(self):
        with self.assertRaisesRegex(
            TypeError, "rejection_sampling must be a RejectionSampling or None, got dict"
        ):
            policy_loss(**self.args(), rejection_sampling={"upper": 5.0})

    def test_eps_clip_zero_is_allowed(self):
        loss, _ = policy_loss(**self.args(), eps_clip=0.0)
        self.assertEqual(float(loss), 0.0)

    @parameterized.named_parameters(
        (
            "level",
            dict(level="row"),
            ValueError,
            r"rejection_sampling.level='row' is not one of \['token', 'sequence'\]",
        ),
        (
            "action",
            dict(action="drop"),
            ValueError,
            r"rejection_sampling.action='drop' is not one of \['mask', 'clamp'\]",
        ),
        (
            "metric",
            dict(metric="kl"),
            ValueError,
            r"rejection_sampling.metric='kl' is not one of \['ratio', 'kl_k1', 'kl_k2', 'kl_k3'\]",
        ),
        (
            "agg",
            dict(agg="min"),
            ValueError,
            r"rejection_sampling.agg='min' is not one of \['sum', 'mean', 'max'\]",
        ),
        (
            "upper_type",
            dict(upper="5"),
            TypeError,
            r"rejection_sampling.upper must be a number, got '5'",
        ),
        (
            "lower_type",
            dict(lower="1"),
            TypeError,
            r"rejection_sampling.lower must be a number or None, got '1'",
        ),
        (
            "order",
            dict(upper=2.0, lower=3.0),
            ValueError,
            r"rejection_sampling.lower \(3.0\) must be <= upper \(2.0\)",
        ),
        (
            "ratio_upper",
            dict(upper=1.0),
            ValueError,
            r"rejection_sampling.upper must be > 1 for metric 'ratio', got 1.0",
        ),
        (
            "ratio_lower",
            dict(lower=0.0),
            ValueError,
            r"rejection_sampling.lower must be > 0 for metric 'ratio', got 0.0",
        ),
        (
            "kl_upper",
            dict(metric="kl_k3", upper=0.0),
            ValueError,
            r"rejection_sampling.upper must be > 0 for metric 'kl_k3', got 0.0",
        ),
        (
            "clamp_kl",
            dict(action="clamp", metric="kl_k1", upper=1.0),
            ValueError,
            r"rejection_sampling.action 'clamp' needs metric 'ratio', got 'kl_k1'",
        ),
    )
    def test_rejection_sampling_errors(self, fields, error, message):
        with self.assertRaisesRegex(error, message):
            RS(**fields)

    def test_rejection_sampling_is_hashable(self):
        self.assertEqual(hash(RS()), hash(RS()))

    def test_behaviour_correction_shapes(self):
        with self.assertRaisesRegex(
            ValueError,
            r"prox_logp_BxT, behav_logp_BxT and mask_BxT must share one \[B, T\] shape, got "
            r"\(1, 1\), \(1, 2\) and \(1, 1\)",
        ):
            behaviour_correction(
                one(0.0), np.zeros((1, 2), np.float32), np.ones((1, 1), bool), RS()
            )

    def test_behaviour_correction_kl_k1_allows_negative_upper(self):
        rho, keep, *_ = behaviour_correction(
            one(0.0), one(0.5), np.ones((1, 1), bool), RS(metric="kl_k1", upper=-0.4)
        )
        self.assertTrue(bool(keep[0, 0]))  # kl_k1 = -0.5 <= -0.4
        self.assertAlmostEqual(float(rho[0, 0]), math.exp(-0.5), places=6)


if __name__ == "__main__":
    absltest.main()
