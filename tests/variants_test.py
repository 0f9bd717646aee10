"""The published M2PO (`paper_final`) against a plain numpy transcription of its rule."""

import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax import losses, masking, step_math, variants
from m2po_jax.config import from_configdict
from m2po_jax.configs import arith

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

    # The train step's dispatch with the preset's actor section (prox is unused: the
    # ratio is against the behaviour policy).
    actor = from_configdict(arith.get_config("paper_final")).actor
    step_mask, _ = step_math.m2po_block(
        actor, jnp.asarray(behav), jnp.asarray(behav), jnp.asarray(valid), jnp.asarray(adv),
        logp=jnp.asarray(logp), threshold=jnp.float32(TAU),
    )  # fmt: skip
    np.testing.assert_array_equal(step_mask, ref_mask)

    loss, _ = losses.policy_loss(
        logp,
        behav,
        behav,
        adv,
        ref_mask,
        eps_clip=actor.eps_clip,
        eps_clip_higher=actor.eps_clip_higher,
        c_clip=actor.c_clip,
        use_decoupled_loss=actor.use_decoupled_loss,
        rejection_sampling=None,
        denominator=actor.loss_denominator,
        valid_mask_BxT=valid,
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
