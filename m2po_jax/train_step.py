"""The pure RL train step: proximal log-probs, advantages, M2PO mask, PPO minibatch updates.

`train_step(state, batch, rng, ref_params) -> (state, metrics)` is pure; the static
settings (model config, actor section, optimizer) are bound with `functools.partial`
and the result is compiled once with `jax.jit` (see `make_train_step`).
"""

from __future__ import annotations

import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from m2po_jax import advantages as adv_lib
from m2po_jax import losses, masking
from m2po_jax import model as model_lib
from m2po_jax.config import ActorSection, OptimizerSection
from m2po_jax.types import TrainBatch


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32: RL updates done = the policy version of `params`
    params: Any
    opt_state: Any
    nonfinite_steps: jax.Array  # int32: consecutive steps skipped for non-finite values


def make_schedule(opt: OptimizerSection, total_updates: int) -> optax.Schedule:
    """Learning rate per optimizer update: linear warm-up, then constant / linear / cosine."""
    total_updates = max(int(total_updates), 1)
    warmup = int(round(opt.warmup_steps_proportion * total_updates))
    decay = max(total_updates - warmup, 1)
    end = opt.lr * opt.min_lr_ratio
    if opt.lr_scheduler_type == "constant":
        main = optax.constant_schedule(opt.lr)
    elif opt.lr_scheduler_type == "linear":
        main = optax.linear_schedule(opt.lr, end, decay)
    elif opt.lr_scheduler_type == "cosine":
        main = optax.cosine_decay_schedule(opt.lr, decay, alpha=opt.min_lr_ratio)
    else:
        raise ValueError(
            f"lr_scheduler_type={opt.lr_scheduler_type!r}; expected constant, linear or cosine"
        )
    if warmup == 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, opt.lr, warmup), main], [warmup])


def make_optimizer(opt: OptimizerSection, total_updates: int):
    """AdamW with global-norm clipping; returns (tx, schedule)."""
    schedule = make_schedule(opt, total_updates)
    parts = []
    if opt.gradient_clipping > 0:
        parts.append(optax.clip_by_global_norm(opt.gradient_clipping))
    parts.append(
        optax.adamw(
            schedule, b1=opt.beta1, b2=opt.beta2, eps=opt.eps, weight_decay=opt.weight_decay
        )
    )
    return optax.chain(*parts), schedule


def init_train_state(params, tx) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        nonfinite_steps=jnp.zeros((), jnp.int32),
    )


def sequence_logp(params, model_config, tokens_BxT, valid_BxT, temperature):
    """Per-token log-probs aligned with tokens, and the logits."""
    logits = model_lib.apply(params, model_config, tokens_BxT, valid_BxT=valid_BxT)
    return model_lib.token_logp(logits, tokens_BxT, temperature), logits


def _m2po(actor: ActorSection, behav, prox, loss_mask, adv, logp=None, threshold=None):
    """M2PO mask and stats for one scope, or the mask unchanged when M2PO is off."""
    if actor.m2_threshold is None or actor.m2po_stop_rule == "capped_clip":
        # No mask, but the second moment is still reported: it is what staleness does.
        return loss_mask, _unmasked_stats(behav, prox, loss_mask)
    return masking.m2po_mask_with_stats(
        behav,
        prox,
        loss_mask,
        threshold,
        method=actor.m2po_method,
        second_moment=actor.m2po_second_moment,
        stop_rule=actor.m2po_stop_rule,
        candidates=actor.m2po_candidates,
        scope="row" if actor.m2po_scope == "row" else "global",
        logp=logp,
        advantages=adv,
    )


def _unmasked_stats(behav, prox, loss_mask) -> dict:
    m2 = masking.m2po_second_moment(behav, prox)
    finite = jnp.isfinite(m2) & loss_mask
    mean_m2 = jnp.sum(jnp.where(finite, m2, 0.0)) / jnp.maximum(jnp.sum(finite), 1)
    zero = jnp.zeros((), jnp.float32)
    return {
        "m2po/masked_tokens": zero,
        "m2po/masked_fraction": zero,
        "m2po/m2_before": mean_m2,
        "m2po/m2_after": mean_m2,
    }


def _needs_minibatch_mask(actor: ActorSection) -> bool:
    return actor.m2po_scope == "minibatch" or actor.m2po_second_moment != "behav_prox"


def _clip_range(actor: ActorSection, behav, prox, loss_mask, adv, threshold):
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
        bound = masking.m2po_clip_bound(m2, candidates, threshold)
        return 1.0 - jnp.exp(-bound), jnp.exp(bound) - 1.0
    return actor.eps_clip, actor.eps_clip_higher


def train_step(
    state: TrainState,
    batch: TrainBatch,
    rng: jax.Array,
    ref_params=None,
    *,
    model_config: model_lib.ModelConfig,
    actor: ActorSection,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    mask_fn=None,
) -> tuple[TrainState, dict]:
    """One RL update of `state` on `batch`; see the module docstring.

    `mask_fn`, when given, replaces the global M2PO mask (used for the per-shard scope).
    """
    temperature = actor.temperature
    threshold = None if actor.m2_threshold is None else jnp.float32(actor.m2_threshold)
    loss_mask = batch.loss_mask_BxT
    behav = batch.behav_logp_BxT.astype(jnp.float32)

    prox, logits = sequence_logp(
        state.params, model_config, batch.tokens_BxT, batch.valid_BxT, temperature
    )
    prox = jax.lax.stop_gradient(prox)
    entropy = model_lib.token_entropy(jax.lax.stop_gradient(logits), temperature)
    del logits
    if not actor.recompute_logprob:
        prox = behav

    ref_logp = None
    if ref_params is not None and actor.kl_ctl > 0:
        ref_logp, _ = sequence_logp(
            ref_params, model_config, batch.tokens_BxT, batch.valid_BxT, temperature
        )
        ref_logp = jax.lax.stop_gradient(ref_logp)
    rewards = adv_lib.transform_rewards(
        batch.rewards_B,
        reward_bias=actor.reward_bias,
        reward_scaling=actor.reward_scaling,
        reward_clip=actor.reward_clip,
    )
    rn = actor.reward_norm
    advantages = adv_lib.grpo_token_advantages(
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

    per_minibatch_mask = _needs_minibatch_mask(actor)
    if per_minibatch_mask:
        mask, m2_stats = loss_mask, {}
    elif mask_fn is not None and actor.m2_threshold is not None:
        mask, m2_stats = mask_fn(behav, prox, loss_mask, threshold)
    else:
        mask, m2_stats = _m2po(actor, behav, prox, loss_mask, advantages, threshold=threshold)
    eps_clip, eps_clip_higher = _clip_range(actor, behav, prox, loss_mask, advantages, threshold)

    n_mb = actor.ppo_n_minibatches
    rows = batch.tokens_BxT.shape[0]
    perm = jax.random.permutation(rng, rows)

    def split(x):
        return x[perm].reshape((n_mb, rows // n_mb) + x.shape[1:])

    minibatches = jax.tree.map(
        split,
        {
            "tokens": batch.tokens_BxT,
            "valid": batch.valid_BxT,
            "behav": behav,
            "prox": prox,
            "adv": advantages,
            "loss_mask": loss_mask,
            "mask": mask,
        },
    )
    rs = actor.rejection_sampling
    rejection = (
        losses.RejectionSampling(
            level=rs.level,
            action=rs.action,
            metric=rs.metric,
            agg=rs.agg,
            upper=rs.upper,
            lower=rs.lower,
        )
        if rs.enabled
        else None
    )

    def loss_fn(params, mb):
        logp, _ = sequence_logp(params, model_config, mb["tokens"], mb["valid"], temperature)
        mb_mask, mb_stats = mb["mask"], {}
        if per_minibatch_mask:
            mb_mask, mb_stats = _m2po(
                actor,
                mb["behav"],
                mb["prox"],
                mb["loss_mask"],
                mb["adv"],
                logp=jax.lax.stop_gradient(logp),
                threshold=threshold,
            )
        loss, stats = losses.policy_loss(
            logp,
            mb["prox"],
            mb["behav"],
            mb["adv"],
            mb_mask,
            eps_clip=eps_clip,
            eps_clip_higher=eps_clip_higher,
            c_clip=actor.c_clip,
            use_decoupled_loss=actor.use_decoupled_loss,
            importance_sampling_level=actor.importance_sampling_level,
            rejection_sampling=rejection,
            use_sapo_loss=actor.use_sapo_loss,
            sapo_tau_pos=actor.sapo_tau_pos,
            sapo_tau_neg=actor.sapo_tau_neg,
            denominator=actor.loss_denominator,
            valid_mask_BxT=mb["loss_mask"],
        )
        return loss, {**stats, **mb_stats}

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def update(carry, mb):
        params, opt_state = carry
        (loss, stats), grads = grad_fn(params, mb)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # A non-finite minibatch must not touch params or optimizer moments.
        keep = lambda new, old: jnp.where(finite, new, old)
        params = jax.tree.map(keep, new_params, params)
        opt_state = jax.tree.map(keep, new_opt_state, opt_state)
        stats = {**stats, "loss": loss, "grad_norm": grad_norm, "finite": finite}
        return (params, opt_state), stats

    (params, opt_state), mb_stats = jax.lax.scan(
        update, (state.params, state.opt_state), minibatches
    )
    all_finite = jnp.all(mb_stats.pop("finite"))
    # The whole step is undone if any minibatch was non-finite.
    params = jax.tree.map(lambda new, old: jnp.where(all_finite, new, old), params, state.params)
    opt_state = jax.tree.map(
        lambda new, old: jnp.where(all_finite, new, old), opt_state, state.opt_state
    )
    new_state = TrainState(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        nonfinite_steps=jnp.where(all_finite, 0, state.nonfinite_steps + 1),
    )

    n_valid = jnp.maximum(jnp.sum(loss_mask), 1)
    metrics = {k: jnp.mean(v) for k, v in mb_stats.items()}
    metrics.update(m2_stats)
    metrics.update(
        {
            "train/nonfinite": 1 - all_finite.astype(jnp.int32),
            "train/lr": schedule(state.step * n_mb),
            "train/entropy": jnp.sum(entropy * loss_mask) / n_valid,
            "train/tokens": jnp.sum(loss_mask),
            "train/adv_abs_mean": jnp.sum(jnp.abs(advantages) * loss_mask) / n_valid,
            "train/grad_norm_max": jnp.max(mb_stats["grad_norm"]),
            "train/param_norm": optax.tree.norm(params),
            "train/behav_prox_abs_diff": jnp.sum(jnp.abs(behav - prox) * loss_mask) / n_valid,
        }
    )
    if isinstance(eps_clip, jax.Array):
        metrics["m2po/clip_bound_low"] = 1.0 - eps_clip
        metrics["m2po/clip_bound_high"] = 1.0 + eps_clip_higher
    return new_state, metrics


def make_train_step(
    model_config, actor: ActorSection, tx, schedule, *, jit_kwargs=None, mask_fn=None
):
    """`train_step` with static settings bound, under one `jax.jit` (state donated)."""
    step = functools.partial(
        train_step,
        model_config=model_config,
        actor=actor,
        tx=tx,
        schedule=schedule,
        mask_fn=mask_fn,
    )
    return jax.jit(step, donate_argnums=(0,), **(jit_kwargs or {}))


def sft_loss(params, model_config, tokens_BxT, valid_BxT, target_mask_BxT):
    """Mean negative log-likelihood of the target tokens (supervised warm-up)."""
    logp, _ = sequence_logp(params, model_config, tokens_BxT, valid_BxT, 1.0)
    count = jnp.maximum(jnp.sum(target_mask_BxT), 1)
    return -jnp.sum(logp * target_mask_BxT) / count


def make_sft_step(model_config, tx):
    """Jitted supervised step: (params, opt_state, tokens, valid, target) -> (params, opt_state, loss)."""

    def step(params, opt_state, tokens_BxT, valid_BxT, target_mask_BxT):
        loss, grads = jax.value_and_grad(sft_loss)(
            params, model_config, tokens_BxT, valid_BxT, target_mask_BxT
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))
