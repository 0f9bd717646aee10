"""The rollout correction's weights (m2po_jax.algorithm.rejection.RolloutCorrection) against a
numpy reference written from its docstring, its statistics, and the combinations it refuses."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax.algorithm import losses
from m2po_jax.algorithm.rejection import (
    RejectionSampling,
    RolloutCorrection,
    behaviour_correction,
)

# Hand-made [4, 5]: row 0 ordinary, row 1 a non-finite log rho (-> 0) and padding, row 2 no
# loss tokens, row 3 log rho 8 on three tokens (sum 24: verl's clip to 20 applies).
PROX = np.array(
    [
        [-1.0, -0.5, -2.0, -1.2, -0.3],
        [-1.0, -np.inf, -0.7, -1.0, -1.0],
        [-0.2, -0.4, -0.6, -0.8, -1.0],
        [-1.0, -1.0, -1.0, -1.0, -1.0],
    ],
    np.float32,
)
BEHAV = np.array(
    [
        [-1.5, -0.1, -2.3, -0.2, -0.3],
        [-0.4, -np.inf, -1.9, -1.0, -1.0],
        [-0.1, -0.9, -0.6, -0.3, -1.0],
        [-9.0, -9.0, -9.0, -1.0, -1.0],
    ],
    np.float32,
)
MASK = np.array(
    [
        [True, True, True, True, False],
        [True, True, True, False, False],
        [False, False, False, False, False],
        [True, True, True, False, False],
    ]
)
# For the loss, whose ratio logp - prox must be finite: log rho [1, 1] is then +inf (-> 0).
PROX_F = np.where(np.isfinite(PROX), PROX, -1.0).astype(np.float32)
LEVELS = ("token", "sequence", "geometric", "none")


def ref_weights(prox, behav, mask, level, threshold, keep=None):
    """(weight, truncated, untruncated) per token, one row at a time; `keep`: the tokens
    rejection sampling kept (default: all of `mask`), the rows' weights still over `mask`."""
    keep = mask if keep is None else keep
    w = np.zeros(mask.shape)
    raw = np.zeros(mask.shape)
    cut = np.zeros(mask.shape, bool)
    for b in range(mask.shape[0]):
        lr = [
            float(p) - float(q) if math.isfinite(float(p) - float(q)) else 0.0
            for p, q in zip(prox[b], behav[b], strict=True)
        ]
        toks = [lr[t] for t in range(mask.shape[1]) if mask[b, t]]
        for t in range(mask.shape[1]):
            if not keep[b, t]:
                continue
            if level == "token":
                v = math.exp(lr[t])
            elif level == "sequence":
                v = math.exp(min(max(sum(toks), -20.0), 20.0))
            elif level == "geometric":
                v = math.exp(min(max(sum(toks) / len(toks), -20.0), 20.0))
            else:
                v = 1.0
            raw[b, t] = v
            cut[b, t] = threshold is not None and v > threshold
            w[b, t] = v if threshold is None else min(v, threshold)
    return w, cut, raw


# (none, a threshold) is refused: nothing to truncate (test_refused_combinations).
CASES = [(level, t) for level in LEVELS for t in (None, 1.5) if level != "none" or t is None]


@pytest.mark.parametrize("level, threshold", CASES)
def test_each_level_and_truncation_against_numpy(level, threshold):
    got = behaviour_correction(PROX, BEHAV, MASK, None, RolloutCorrection(level, threshold))
    w, cut, raw = ref_weights(PROX, BEHAV, MASK, level, threshold)
    np.testing.assert_allclose(got.weight_BxT, w, rtol=1e-6)  # exp of float32 sums: 1 ulp
    np.testing.assert_allclose(got.untruncated_BxT, raw, rtol=1e-6)
    np.testing.assert_array_equal(got.truncated_BxT, cut)
    np.testing.assert_array_equal(got.keep_BxT, MASK)
    if level == "sequence":  # row 3: exp(24) clipped to exp(20), then maybe truncated
        assert float(got.untruncated_BxT[3, 0]) == pytest.approx(math.exp(20.0), rel=1e-6)
    if threshold is not None and level != "none":
        assert cut.any() and (~cut & MASK).any()  # the example cuts some tokens, not all


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_row_weights_compose_with_token_rejection(level):
    """Rejection decides which tokens are kept; the row's weight is still over its mask."""
    rs = RejectionSampling(upper=1.5, lower=0.6)
    got = behaviour_correction(PROX, BEHAV, MASK, rs, RolloutCorrection(level, 3.0))
    with np.errstate(invalid="ignore"):  # -inf - -inf
        lr = np.where(np.isfinite(PROX - BEHAV), PROX - BEHAV, 0.0)
    keep = MASK & (np.exp(lr) <= 1.5) & (np.exp(lr) >= 0.6)
    assert (MASK & ~keep).any()
    np.testing.assert_array_equal(got.keep_BxT, keep)
    w, cut, _ = ref_weights(PROX, BEHAV, MASK, level, 3.0, keep=keep)
    np.testing.assert_allclose(got.weight_BxT, w, rtol=1e-6)
    np.testing.assert_array_equal(got.truncated_BxT, cut)


@pytest.mark.parametrize(
    "rs",
    [
        None,
        RejectionSampling(),
        RejectionSampling(level="sequence"),
    ],
    ids=["no_rejection", "token_mask", "sequence_ratio"],
)
def test_token_without_threshold_keeps_rho_bit_for_bit(rs):
    """The default is rho as before: a threshold above every weight cuts nothing, and
    under jit the weight, loss and gradient equal the default's bit for bit (a clamp
    refuses a threshold; the pre-change code gave these losses and gradients bit for bit,
    checked once when the rollout correction was added)."""
    got = jax.jit(lambda p, q: behaviour_correction(p, q, MASK, rs))(PROX, BEHAV)
    huge = RolloutCorrection("token", float(np.finfo(np.float32).max))
    with_huge = jax.jit(lambda p, q: behaviour_correction(p, q, MASK, rs, huge))(PROX, BEHAV)
    np.testing.assert_array_equal(got.weight_BxT, with_huge.weight_BxT)
    assert not np.asarray(with_huge.truncated_BxT).any()
    if rs is None:  # plainly exp(sanitised log rho) on the mask
        log_rho = jnp.asarray(PROX) - BEHAV
        lr = jnp.where(jnp.isfinite(log_rho), log_rho, 0.0)
        np.testing.assert_array_equal(got.weight_BxT, jnp.where(MASK, jnp.exp(lr), 0.0))

    rng = np.random.default_rng(0)
    logp = (PROX_F + rng.normal(0, 0.3, PROX.shape)).astype(np.float32)
    adv = rng.normal(0, 1, PROX.shape).astype(np.float32)

    def loss(lp, rc):
        kwargs = {} if rc is None else {"rollout_correction": rc}
        return losses.policy_loss(lp, PROX_F, BEHAV, adv, MASK, rejection_sampling=rs, **kwargs)[0]

    default = jax.jit(jax.value_and_grad(lambda lp: loss(lp, None)))(logp)
    explicit = jax.jit(jax.value_and_grad(lambda lp: loss(lp, huge)))(logp)
    np.testing.assert_array_equal(default[0], explicit[0])
    np.testing.assert_array_equal(default[1], explicit[1])


def test_loss_weighs_each_token_by_the_weight():
    """At logp = prox (r = 1) with no clip binding, L = -A * w summed over kept tokens / n."""
    adv = np.linspace(-1.0, 1.0, PROX.size).reshape(PROX.shape).astype(np.float32)
    for level in LEVELS:
        rc = RolloutCorrection(level, None if level == "none" else 1.5)
        loss, stats = losses.policy_loss(
            PROX_F, PROX_F, BEHAV, adv, MASK, rejection_sampling=None, rollout_correction=rc
        )
        w, cut, raw = ref_weights(PROX_F, BEHAV, MASK, level, rc.is_threshold)
        np.testing.assert_allclose(loss, (-adv * w)[MASK].sum() / MASK.sum(), rtol=1e-5)
        n = MASK.sum()
        assert float(stats["rollout_corr/truncated_tokens"]) == cut.sum()
        assert float(stats["rollout_corr/is_truncated_fraction"]) == pytest.approx(cut.sum() / n)
        assert float(stats["rollout_corr/is_mean"]) == pytest.approx(raw[MASK].mean(), rel=1e-6)
        assert float(stats["actor/behav_weight_mean"]) == pytest.approx(w[MASK].mean(), rel=1e-6)


def test_truncation_counts_by_hand():
    # log rho = log 3, log 0.5, log 2.5, log 1 (padding excluded); threshold 2: two cut.
    prox = np.log(np.array([[3.0, 0.5, 2.5, 1.0, 9.0]], np.float32))
    behav = np.zeros((1, 5), np.float32)
    mask = np.array([[True, True, True, True, False]])
    _, stats = losses.policy_loss(
        prox, prox, behav, np.ones((1, 5), np.float32), mask,
        rejection_sampling=None, rollout_correction=RolloutCorrection("token", 2.0),
    )  # fmt: skip
    assert float(stats["rollout_corr/truncated_tokens"]) == 2.0
    assert float(stats["rollout_corr/is_truncated_fraction"]) == 0.5
    assert float(stats["rollout_corr/is_mean"]) == pytest.approx((3 + 0.5 + 2.5 + 1) / 4)
    assert float(stats["actor/behav_weight_mean"]) == pytest.approx((2 + 0.5 + 2 + 1) / 4)


def test_gspo_composes_with_a_sequence_weight():
    """GSPO's r and A are per row, the weight multiplies after: L = -mean(A) * w per token."""
    adv = np.full(PROX.shape, 0.5, np.float32)
    loss, _ = losses.policy_loss(
        PROX_F, PROX_F, BEHAV, adv, MASK, importance_sampling_level="sequence",
        rejection_sampling=None, rollout_correction=RolloutCorrection("geometric"),
    )  # fmt: skip
    w, _, _ = ref_weights(PROX_F, BEHAV, MASK, "geometric", None)
    np.testing.assert_allclose(loss, -0.5 * w[MASK].sum() / MASK.sum(), rtol=1e-6)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: RolloutCorrection("row"), r"rollout_correction\.is_level='row' is not one of"),
        (lambda: RolloutCorrection("token", 0.0), r"is_threshold must be > 0 and finite or None, got 0\.0"),
        (lambda: RolloutCorrection("token", math.inf), r"is_threshold must be > 0 and finite"),
        (lambda: RolloutCorrection("none", 2.0), r"is_threshold=2\.0 truncates a weight that is_level='none' sets to 1"),
        (
            lambda: losses.LossSettings(use_decoupled_loss=False, rollout_correction=RolloutCorrection("sequence")),
            r"^rollout_correction \(is_level='sequence', is_threshold=None\) weighs the decoupled loss's behaviour ratio, which use_decoupled_loss=False",
        ),
        (
            lambda: losses.LossSettings(use_decoupled_loss=False, use_sapo_loss=True, rollout_correction=RolloutCorrection("token", 2.0)),
            r"which use_sapo_loss=True does not have",
        ),
        (
            lambda: losses.LossSettings(rejection_sampling=RejectionSampling(action="clamp"), rollout_correction=RolloutCorrection("token", 2.0)),
            r"rollout_correction\.is_threshold=2\.0 and rejection_sampling\.action='clamp' are two truncations of one weight",
        ),
        (
            lambda: losses.LossSettings(rejection_sampling=RejectionSampling(action="clamp"), rollout_correction=RolloutCorrection("none")),
            r"rejection_sampling\.action='clamp' clamps the token weight rho, which rollout_correction\.is_level='none' replaces",
        ),
        (
            lambda: losses.LossSettings(rejection_sampling=RejectionSampling(level="sequence"), rollout_correction=RolloutCorrection("geometric")),
            r"AReaL's sequence ratio already replaces rho by the row's geometric mean",
        ),
        (
            lambda: behaviour_correction(PROX, BEHAV, MASK, RejectionSampling(level="sequence"), RolloutCorrection("sequence")),
            r"is_level='sequence' with rejection_sampling level='sequence', metric='ratio'",
        ),
    ],
)  # fmt: skip
def test_refused_combinations(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_accepted_combinations():
    # A sequence rejection by a KL metric keeps per-token weights: any level composes;
    # AReaL's sequence ratio composes with no weight (none) and with a truncated token one.
    for rs, rc in [
        (RejectionSampling(level="sequence", metric="kl_k1", upper=0.5), RolloutCorrection("sequence", 2.0)),
        (RejectionSampling(level="sequence"), RolloutCorrection("none")),
        (RejectionSampling(level="sequence"), RolloutCorrection("token", 1.2)),
        (RejectionSampling(action="clamp"), RolloutCorrection()),
        (None, RolloutCorrection("geometric", 1.1)),
    ]:  # fmt: skip
        losses.LossSettings(rejection_sampling=rs, rollout_correction=rc)
    with pytest.raises(TypeError, match="rollout_correction must be a RolloutCorrection, got dict"):
        losses.LossSettings(rollout_correction={"is_level": "token"})
