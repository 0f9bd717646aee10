"""The train step's per-block math: advantages, the M2PO mask and statistics of a block
under `actor.m2po_scope`, the clip range, the behaviour correction's settings.

`train_step` calls these on the batch, a minibatch or a micro-batch as `step_plan` says.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m2po_jax.algorithm import advantages as adv_lib
from m2po_jax.algorithm import masking, proximal, scopes
from m2po_jax.algorithm import rejection as rejection_lib
from m2po_jax.common.config_schema import ActorSection
from m2po_jax.common.types import Minibatch
from m2po_jax.learner.step_plan import StepPlan, m2po_masks


def m2po_block(
    actor: ActorSection, behav, prox, loss_mask, adv, logp=None, threshold=None, layout=None
):
    """M2PO mask and statistics parts (`masking.M2PO_PART_KEYS`) of one block: the batch,
    a minibatch or a micro-batch (`step_plan.m2po_level`), under `actor.m2po_scope`.

    With M2PO off or the capped-clip rule (which clips instead of masking) the mask is
    `loss_mask` and the parts are those of m2 = (behav - prox)^2 over all valid tokens:
    the second moment is still reported, it is what staleness does.
    """
    on = m2po_masks(actor)
    return scopes.m2po_mask_scoped(
        behav,
        prox,
        loss_mask,
        threshold if on else None,
        scope=actor.m2po_scope,
        method=actor.m2po_method,
        second_moment=actor.m2po_second_moment if on else "behav_prox",
        stop_rule=actor.m2po_stop_rule if on else "lt",
        candidates=actor.m2po_candidates if on else "all",
        logp=logp if on else None,
        advantages=adv,
        mesh=None if layout is None else layout.mesh,
    )


def threshold(actor: ActorSection):
    return None if actor.m2_threshold is None else jnp.float32(actor.m2_threshold)


def clip_range(actor: ActorSection, behav, prox, loss_mask, adv):
    """(eps_clip, eps_clip_higher); the authors' capped-mean rule turns tau into [e^-t, e^t].

    The budget applies to m2 = (behav - prox)^2 at the start of the step (in the authors'
    code prox equals behaviour and the ratio is taken against it; here the bound clips
    the decoupled ratio exp(logp - prox)).
    """
    if actor.m2_threshold is not None and actor.m2po_stop_rule == "capped_clip":
        m2 = masking.m2po_second_moment(behav, prox)
        candidates = loss_mask
        if actor.m2po_candidates == "harmful":
            candidates = loss_mask & masking.m2po_harmful_tokens(behav, prox, adv)
        bound = masking.m2po_clip_bound(m2, candidates, threshold(actor))
        return 1.0 - jnp.exp(-bound), jnp.exp(bound) - 1.0
    return actor.eps_clip, actor.eps_clip_higher


def token_advantages(actor: ActorSection, rewards_B, loss_mask, behav, ref_logp):
    rewards = adv_lib.transform_rewards(
        rewards_B,
        reward_bias=actor.reward_bias,
        reward_scaling=actor.reward_scaling,
        reward_clip=actor.reward_clip,
    )
    rn = actor.reward_norm
    return adv_lib.grpo_token_advantages(
        rewards,
        loss_mask,
        group_size=rn.group_size,
        mean_level=rn.mean_level,
        std_level=rn.std_level,
        mean_leave1out=rn.mean_leave1out,
        std_unbiased=rn.std_unbiased,
        eps=rn.eps,
        kl_ctl=actor.kl_ctl if ref_logp is not None else 0.0,
        logp_BxT=behav if ref_logp is not None else None,
        ref_logp_BxT=ref_logp,
        kl_estimator=actor.kl_estimator,
        adv_norm=actor.adv_norm,
    )


def rejection(actor: ActorSection) -> rejection_lib.RejectionSampling | None:
    # The one builder config.validate runs too: what it accepts, this accepts.
    return rejection_lib.build_rejection_sampling(actor.rejection_sampling)


def loss_pass_prox(plan: StepPlan, mb: Minibatch, logp_now, entropy, version) -> tuple:
    """Inside a loss pass: (the proximal log-probs, the pass's statistics).

    prox is `mb.prox_BxT` when computed before the pass, else this pass's log-probs
    `logp_now` (gradient stopped) or AReaL's approximation from them (`version`: the policy
    version of the params). Statistics: the approximation's error (method "metrics"), and
    the entropy (`entropy` not None) and behaviour-proximal gap where no earlier pass
    reported them.
    """
    behav, loss_mask = mb.behav_BxT, mb.loss_mask_BxT
    if plan.prox_source == "loss":
        prox = logp_now
    elif plan.prox_source == "loglinear":
        prox = proximal.loglinear_prox(behav, logp_now, mb.version_B, version)
    else:
        prox = mb.prox_BxT
    stats = {}
    if plan.approx_metrics:
        approx = proximal.loglinear_prox(behav, logp_now, mb.version_B, version)
        stats.update(proximal.approximation_stats(approx, prox, behav, loss_mask))
    n_valid = jnp.maximum(jnp.sum(loss_mask), 1)
    if entropy is not None:
        stats["train/entropy"] = jnp.sum(jax.lax.stop_gradient(entropy) * loss_mask) / n_valid
    if plan.prox_in_loss:
        stats["train/behav_prox_abs_diff"] = jnp.sum(jnp.abs(behav - prox) * loss_mask) / n_valid
    return prox, stats
