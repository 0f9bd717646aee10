"""The actor's options as the train step reads them, built once from the config's actor
section (`ActorSettings.build`) before anything is traced.

Each part is a frozen, hashable record of the algorithm function it configures
(`losses.LossSettings`, `advantages.AdvantageSettings`, `scopes.MaskSettings`), so the
step passes one object where it used to unpack the section into keywords at trace time.
"""

from __future__ import annotations

import dataclasses

from m2po_jax.algorithm import advantages as adv_lib
from m2po_jax.algorithm import losses, rejection, scopes
from m2po_jax.common.config_schema import ActorSection
from m2po_jax.learner.step_plan import m2po_masks


@dataclasses.dataclass(frozen=True)
class ActorSettings:
    section: ActorSection  # what the step plan and the memory model read
    loss: losses.LossSettings
    advantages: adv_lib.AdvantageSettings
    mask: scopes.MaskSettings  # threshold None: M2PO off or clipping, statistics only
    clip_budget: float | None  # the capped-mean rule's tau: it sets the clip range instead
    clip_candidates: str  # the tokens that rule's budget counts ("all" or "harmful")
    temperature: float
    logp_chunk_size: int
    masked_grad_norm: bool = False  # also the masked tokens' gradient (a diagnostic)
    # a mixture of experts: weight of `moe.load_balancing_loss` added to the loss
    # (`model.router_aux_loss_coef`)
    router_aux_loss_coef: float = 0.0

    @classmethod
    def build(cls, actor: ActorSection | ActorSettings) -> ActorSettings:
        """The settings of a config's actor section (settings pass through unchanged)."""
        if isinstance(actor, ActorSettings):
            return actor
        rn = actor.reward_norm
        masks = m2po_masks(actor)
        capped = actor.m2_threshold is not None and not masks
        return cls(
            section=actor,
            loss=losses.LossSettings(
                eps_clip=actor.eps_clip,
                eps_clip_higher=actor.eps_clip_higher,
                c_clip=actor.c_clip,
                use_decoupled_loss=actor.use_decoupled_loss,
                importance_sampling_level=actor.importance_sampling_level,
                # The one builder config.validate runs too: what it accepts, this accepts.
                rejection_sampling=rejection.build_rejection_sampling(actor.rejection_sampling),
                use_sapo_loss=actor.use_sapo_loss,
                sapo_tau_pos=actor.sapo_tau_pos,
                sapo_tau_neg=actor.sapo_tau_neg,
                denominator=actor.loss_denominator,
                rollout_correction=rejection.build_rollout_correction(actor.rollout_correction),
            ),
            advantages=adv_lib.AdvantageSettings(
                group_size=rn.group_size,
                reward_bias=actor.reward_bias,
                reward_scaling=actor.reward_scaling,
                reward_clip=actor.reward_clip,
                mean_level=rn.mean_level,
                std_level=rn.std_level,
                mean_leave1out=rn.mean_leave1out,
                std_unbiased=rn.std_unbiased,
                eps=rn.eps,
                kl_ctl=actor.kl_ctl,
                kl_estimator=actor.kl_estimator,
                adv_norm=actor.adv_norm,
            ),
            mask=block_mask_settings(actor),
            clip_budget=actor.m2_threshold if capped else None,
            clip_candidates=actor.m2po_candidates,
            temperature=actor.temperature,
            logp_chunk_size=actor.logp_chunk_size,
        )


def block_mask_settings(actor: ActorSection) -> scopes.MaskSettings:
    """The mask of each block under `actor.m2po_*`; with M2PO off or the capped-clip rule
    (which clips instead of masking) no mask, and the statistics of m2 = (behav - prox)^2
    over all valid tokens: the second moment is still reported, it is what staleness does.
    """
    if not m2po_masks(actor):
        return scopes.MaskSettings(None, scope=actor.m2po_scope, method=actor.m2po_method)
    return scopes.MaskSettings(
        actor.m2_threshold,
        scope=actor.m2po_scope,
        method=actor.m2po_method,
        second_moment=actor.m2po_second_moment,
        stop_rule=actor.m2po_stop_rule,
        candidates=actor.m2po_candidates,
    )
