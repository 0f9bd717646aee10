"""The train step's per-block math: the M2PO mask and statistics of a block under
`actor.m2po_scope`, the clip range, the proximal log-probs of a loss pass.

`train_step` calls these on the batch, a minibatch or a micro-batch as `step_plan` says.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m2po_jax.algorithm import diagnostics, masking, proximal, scopes
from m2po_jax.common.types import Minibatch
from m2po_jax.learner.actor_settings import ActorSettings
from m2po_jax.learner.step_plan import StepPlan


def m2po_block(s: ActorSettings, behav, prox, loss_mask, adv, logp=None, layout=None):
    """M2PO mask and statistics parts (`masking.M2PO_PART_KEYS`, and the diagnostics'
    `diagnostics.PART_KEYS`) of one block: the batch, a minibatch or a micro-batch
    (`step_plan.m2po_level`), under `actor.m2po_scope` (`actor_settings.block_mask_settings`:
    without a mask, the statistics only)."""
    mesh = None if layout is None else layout.mesh
    mask, parts = scopes.mask_block(s.mask, behav, prox, loss_mask, adv, logp, mesh)
    variant = s.mask.second_moment if logp is not None else "behav_prox"
    m2 = masking.m2po_second_moment(behav, prox, second_moment=variant, logp=logp)
    log_w = prox.astype(jnp.float32) - behav.astype(jnp.float32)
    return mask, {**parts, **diagnostics.parts(m2, log_w, loss_mask, mask)}


def clip_range(s: ActorSettings, behav, prox, loss_mask, adv):
    """(eps_clip, eps_clip_higher); the authors' capped-mean rule turns tau into [e^-t, e^t].

    The budget applies to m2 = (behav - prox)^2 at the start of the step (in the authors'
    code prox equals behaviour and the ratio is taken against it; here the bound clips
    the decoupled ratio exp(logp - prox)).
    """
    if s.clip_budget is not None:
        m2 = masking.m2po_second_moment(behav, prox)
        candidates = loss_mask
        if s.clip_candidates == "harmful":
            candidates = loss_mask & masking.m2po_harmful_tokens(behav, prox, adv)
        bound = masking.m2po_clip_bound(m2, candidates, jnp.float32(s.clip_budget))
        return 1.0 - jnp.exp(-bound), jnp.exp(bound) - 1.0
    return s.loss.eps_clip, s.loss.eps_clip_higher


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
