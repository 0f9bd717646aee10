"""The published M2PO (`paper_final`) against a plain numpy transcription of its rule."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax.algorithm import losses, masking, variants
from m2po_jax.config import from_configdict
from m2po_jax.configs import arith
from m2po_jax.learner import step_math
from m2po_jax.learner.actor_settings import ActorSettings

TAU = 0.04


def _numpy_paper_final(behav, logp, adv, valid, tau):
    """Drop the largest m2 among the harmful-quadrant tokens while their mean exceeds tau."""
    log_r = logp.astype(np.float64) - behav
    candidates = valid & (((adv > 0) & (log_r > 0)) | ((adv < 0) & (log_r < 0)))
    m2 = log_r**2
    order = [i for i in np.argsort(m2, axis=None, kind="stable") if candidates.flat[i]]
    kept = list(order)
    while len(kept) > 1 and np.mean(m2.flat[kept]) > tau:
        kept.pop()  # the largest remaining m2
    mask = valid & ~candidates
    mask.flat[kept] = True
    loss = -np.sum(np.where(mask, np.exp(log_r) * adv, 0.0)) / max(valid.sum(), 1)
    return mask, loss


def _batch(seed):
    rng = np.random.default_rng(seed)
    shape = (6, 20)
    behav = -rng.uniform(0.1, 3.0, shape).astype(np.float32)
    logp = (behav + rng.normal(0, 0.35, shape)).astype(np.float32)
    adv = np.repeat(rng.normal(0, 1, (6, 1)), 20, 1).astype(np.float32)
    valid = rng.random(shape) < 0.85
    return behav, logp, adv, valid


def test_the_preset_builds_from_the_cli_config():
    cfg = from_configdict(arith.get_config("paper_final"))
    a = cfg.actor
    assert (a.m2po_second_moment, a.m2po_stop_rule, a.m2po_candidates, a.m2po_scope) == (
        "current_behav",
        "le",
        "harmful",
        "global",
    )
    assert a.eps_clip is None and not a.use_decoupled_loss and a.ppo_n_minibatches == 1
    assert not a.rejection_sampling.enabled


@pytest.mark.parametrize("seed", range(4))
def test_mask_and_loss_match_the_numpy_rule(seed):
    behav, logp, adv, valid = _batch(seed)
    ref_mask, ref_loss = _numpy_paper_final(behav, logp, adv, valid, TAU)
    assert (valid & ~ref_mask).any()  # the data makes the rule drop something

    # The library's named variant.
    mask, _ = masking.m2po_mask_with_stats(
        behav, behav, valid, TAU, logp=logp, advantages=adv, **variants.MASK["paper_final"]
    )
    np.testing.assert_array_equal(mask, ref_mask)

    # The rule has power on this data: all-token candidates or AReaL's behav-prox moment
    # give other masks.
    for other in ("paper", "areal"):
        other_mask, _ = masking.m2po_mask_with_stats(
            behav, behav + 0.3, valid, TAU, logp=logp, advantages=adv, **variants.MASK[other]
        )
        assert (np.asarray(other_mask) != ref_mask).any(), other

    # The train step's dispatch with the preset's actor section. prox differs from behav
    # and must not matter: the ratio is against the behaviour policy.
    actor = from_configdict(arith.get_config("paper_final")).actor
    prox = behav + np.random.default_rng(seed).normal(0, 0.3, behav.shape).astype(np.float32)
    settings = ActorSettings.build(dataclasses.replace(actor, m2_threshold=TAU))
    step_mask, _ = step_math.m2po_block(
        settings, jnp.asarray(behav), jnp.asarray(prox), jnp.asarray(valid), jnp.asarray(adv),
        logp=jnp.asarray(logp),
    )  # fmt: skip
    np.testing.assert_array_equal(step_mask, ref_mask)
    loss, _ = _preset_loss(actor, logp, prox, behav, adv, ref_mask, valid)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)


def _preset_loss(actor, logp, prox, behav, adv, mask, valid):
    """`losses.policy_loss` with the settings the train step takes from `actor`."""
    settings = ActorSettings.build(actor).loss
    return losses.policy_loss_with(settings, logp, prox, behav, adv, mask, valid_mask_BxT=valid)


def test_paper_final_by_hand():
    """Each defining choice of the published rule on six tokens, worked out by hand.

    log r = logp - behav; harmful: A > 0 with log r > 0, or A < 0 with log r < 0.
      row 0: (A, log r) = (+1, +0.5) (+1, +0.5) (-1, 0)  -> m2 0.25, 0.25 (harmful), - (not)
      row 1: (A, log r) = (-1, -2) (+1, -2) padding      -> m2 4 (harmful), - (not)
    The harmful m2 {0.25, 0.25, 4} average 1.5 > tau = 0.25 over the whole batch (global
    scope): the largest (4) goes; {0.25, 0.25} average exactly tau and stay (<= rule; AReaL's
    < would drop one more). The (+1, -2) token has m2 4 but is no candidate: kept. A row
    scope would keep row 1's lone candidate.
    """
    tau = 0.25
    behav = np.array([[-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0]], np.float32)
    logp = np.array([[-0.5, -0.5, -1.0], [-3.0, -3.0, 0.0]], np.float32)
    adv = np.array([[1.0, 1.0, -1.0], [-1.0, 1.0, 0.0]], np.float32)
    valid = np.array([[True, True, True], [True, True, False]])
    prox = behav - 0.7  # ignored: no proximal policy in the published rule
    actor = from_configdict(arith.get_config("paper_final")).actor
    settings = ActorSettings.build(dataclasses.replace(actor, m2_threshold=tau))
    mask, _ = step_math.m2po_block(
        settings, jnp.asarray(behav), jnp.asarray(prox), jnp.asarray(valid), jnp.asarray(adv),
        logp=jnp.asarray(logp),
    )  # fmt: skip
    want = np.array([[True, True, True], [False, True, False]])
    np.testing.assert_array_equal(mask, want)
    np.testing.assert_array_equal(_numpy_paper_final(behav, logp, adv, valid, tau)[0], want)
    # The loss: -exp(log r) A on the kept tokens, no ratio clip (r = e^0.5 and e^-2 pass
    # unclipped), no behaviour weight, over the 5 valid tokens (not the 4 kept).
    loss, stats = _preset_loss(actor, logp, prox, behav, adv, want, valid)
    hand = -(2 * np.exp(0.5) - 1.0 + np.exp(-2.0)) / 5
    np.testing.assert_allclose(loss, hand, rtol=1e-6)
    assert float(stats["actor/clip_fraction"]) == 0.0
    assert float(stats["actor/importance_weight_max"]) == pytest.approx(np.exp(0.5), rel=1e-6)
