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
from m2po_jax import batching, logprobs, losses, masking, scopes
from m2po_jax import model as model_lib
from m2po_jax.config import ActorSection
from m2po_jax.optim import (  # noqa: F401 (public here too)
    LR_SCHEDULER_TYPES,
    make_optimizer,
    make_schedule,
)
from m2po_jax.step_metrics import combine_stats, step_metrics  # noqa: F401 (public here too)
from m2po_jax.types import TrainBatch


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32: RL updates done = the policy version of `params`
    params: Any
    opt_state: Any
    nonfinite_steps: jax.Array  # int32: consecutive steps skipped for non-finite values


def init_train_state(params, tx) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        nonfinite_steps=jnp.zeros((), jnp.int32),
    )


@flax.struct.dataclass
class Prepared:
    """Everything the PPO updates need that is fixed for the whole step."""

    behav_BxT: jax.Array  # float32 behaviour log-probs
    prox_BxT: jax.Array  # float32 proximal log-probs (params at the start of the step)
    advantages_BxT: jax.Array
    loss_mask_BxT: jax.Array  # valid completion tokens
    mask_BxT: jax.Array  # after the batch-level M2PO mask (loss_mask if it is taken later)
    entropy_BxT: jax.Array  # of the proximal policy
    eps_clip: Any  # a float, or a traced scalar under the capped-mean rule
    eps_clip_higher: Any
    m2_parts: dict  # batch-level M2PO statistics parts ({} when the mask is taken later)


def _m2po(actor: ActorSection, behav, prox, loss_mask, adv, logp=None, threshold=None, layout=None):
    """M2PO mask and statistics parts (`masking.M2PO_PART_KEYS`) of one block: the batch,
    a minibatch or a micro-batch (see `_m2po_level`), under `actor.m2po_scope`.

    With M2PO off or the capped-clip rule (which clips instead of masking) the mask is
    `loss_mask` and the parts are those of m2 = (behav - prox)^2 over all valid tokens:
    the second moment is still reported, it is what staleness does.
    """
    on = actor.m2_threshold is not None and actor.m2po_stop_rule != "capped_clip"
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


def _m2po_level(actor: ActorSection) -> str:
    """Which blocks `_m2po` runs on: "batch" (in `prepare`), "minibatch" or "microbatch".

    Per minibatch when the scope says so or when the second moment needs the current
    policy, which changes after each minibatch's update (then scopes "global" and
    "shard" mean the minibatch and its shards). Without a mask: once, on the batch.
    """
    if actor.m2_threshold is None or actor.m2po_stop_rule == "capped_clip":
        return "batch"
    if actor.m2po_scope == "microbatch":
        return "microbatch"
    if actor.m2po_scope == "minibatch" or actor.m2po_second_moment != "behav_prox":
        return "minibatch"
    return "batch"


def _threshold(actor: ActorSection):
    return None if actor.m2_threshold is None else jnp.float32(actor.m2_threshold)


def _clip_range(actor: ActorSection, behav, prox, loss_mask, adv):
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
        bound = masking.m2po_clip_bound(m2, candidates, _threshold(actor))
        return 1.0 - jnp.exp(-bound), jnp.exp(bound) - 1.0
    return actor.eps_clip, actor.eps_clip_higher


def _advantages(actor: ActorSection, rewards_B, loss_mask, behav, ref_logp):
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


def prepare(
    params,
    batch: TrainBatch,
    ref_params=None,
    *,
    model_config: model_lib.ModelConfig,
    actor: ActorSection,
    n_parts: int = 1,
    layout=None,
) -> Prepared:
    """Proximal (and reference) log-probs, advantages and the batch-level M2PO mask.

    The log-probs are recomputed without gradient, `n_parts` groups of rows at a time
    (the trainer passes minibatches x micro-batches, so no pass is larger than a
    training micro-batch). `layout` (`placement.Layout`) keeps regrouped rows on their
    devices and gives the mesh of the "shard" M2PO scope.
    """
    temperature, chunk = actor.temperature, actor.logp_chunk_size
    loss_mask = batch.loss_mask_BxT
    behav = batch.behav_logp_BxT.astype(jnp.float32)
    tokens, valid = batch.tokens_BxT, batch.valid_BxT
    prox, entropy = logprobs.micro_batched_logp(
        params, model_config, tokens, valid, temperature, chunk, n_parts, layout
    )
    if not actor.recompute_logprob:
        prox = behav
    ref_logp = None
    if ref_params is not None and actor.kl_ctl > 0:
        ref_logp, _ = logprobs.micro_batched_logp(
            ref_params, model_config, tokens, valid, temperature, chunk, n_parts, layout
        )
    advantages = _advantages(actor, batch.rewards_B, loss_mask, behav, ref_logp)
    threshold = _threshold(actor)
    mask, m2_parts = loss_mask, {}
    if _m2po_level(actor) == "batch":
        mask, m2_parts = _m2po(
            actor, behav, prox, loss_mask, advantages, threshold=threshold, layout=layout
        )
    eps_clip, eps_clip_higher = _clip_range(actor, behav, prox, loss_mask, advantages)
    return Prepared(
        behav_BxT=behav,
        prox_BxT=prox,
        advantages_BxT=advantages,
        loss_mask_BxT=loss_mask,
        mask_BxT=mask,
        entropy_BxT=entropy,
        eps_clip=eps_clip,
        eps_clip_higher=eps_clip_higher,
        m2_parts=m2_parts,
    )


def _rejection(actor: ActorSection) -> losses.RejectionSampling | None:
    # The one builder config.validate runs too: what it accepts, this accepts.
    return losses.build_rejection_sampling(actor.rejection_sampling)


def ppo_updates(
    params,
    opt_state,
    batch: TrainBatch,
    prep: Prepared,
    rng: jax.Array,
    *,
    model_config: model_lib.ModelConfig,
    actor: ActorSection,
    tx: optax.GradientTransformation,
    n_micro: int = 1,
    layout=None,
):
    """`ppo_n_minibatches` optimizer updates, each accumulating its gradient over `n_micro`
    micro-batches (`lax.scan` in `lax.scan`); returns (params, opt_state, stats per minibatch).

    Each micro-batch's loss is divided by the whole minibatch's token count, so the summed
    gradient is the unsplit minibatch's. Under `m2po_scope="microbatch"` the mask is taken
    inside each micro-batch's loss, which then uses its own denominator and is weighted by its share of the minibatch's valid tokens: AReaL's
    `_apply_m2po_masking` per micro-batch and its `loss_weight_fn`.
    A non-finite minibatch leaves params and optimizer state untouched (the other
    minibatches of the step still apply).
    """
    temperature, chunk = actor.temperature, actor.logp_chunk_size
    n_mb = actor.ppo_n_minibatches
    rows = batch.tokens_BxT.shape[0]
    perm = jax.random.permutation(rng, rows)
    fields = {
        "tokens": batch.tokens_BxT,
        "valid": batch.valid_BxT,
        "behav": prep.behav_BxT,
        "prox": prep.prox_BxT,
        "adv": prep.advantages_BxT,
        "loss_mask": prep.loss_mask_BxT,
        "mask": prep.mask_BxT,
    }
    constrain = layout.rows if layout is not None else (lambda x, row_axis=0: x)
    minibatches = jax.tree.map(
        lambda x: constrain(x[perm].reshape((n_mb, rows // n_mb) + x.shape[1:]), 1), fields
    )
    threshold, rejection = _threshold(actor), _rejection(actor)
    level = _m2po_level(actor)
    # Where the mask is taken inside the loss (a micro-batch at a time) and where before
    # the micro-batches are split (a minibatch at a time).
    mask_in_loss = level == "microbatch" or (level == "minibatch" and n_micro == 1)
    mask_before_split = level == "minibatch" and not mask_in_loss

    def loss_fn(params, mb, count, weight):
        logp, _ = logprobs.sequence_logp(
            params, model_config, mb["tokens"], mb["valid"], temperature, chunk, False
        )
        mask, m2_parts = mb["mask"], {}
        if mask_in_loss:
            mask, m2_parts = _m2po(
                actor,
                mb["behav"],
                mb["prox"],
                mb["loss_mask"],
                mb["adv"],
                logp=jax.lax.stop_gradient(logp),
                threshold=threshold,
                layout=layout,
            )
        loss, stats = losses.policy_loss(
            logp,
            mb["prox"],
            mb["behav"],
            mb["adv"],
            mask,
            eps_clip=prep.eps_clip,
            eps_clip_higher=prep.eps_clip_higher,
            c_clip=actor.c_clip,
            use_decoupled_loss=actor.use_decoupled_loss,
            importance_sampling_level=actor.importance_sampling_level,
            rejection_sampling=rejection,
            use_sapo_loss=actor.use_sapo_loss,
            sapo_tau_pos=actor.sapo_tau_pos,
            sapo_tau_neg=actor.sapo_tau_neg,
            denominator=actor.loss_denominator,
            valid_mask_BxT=mb["loss_mask"],
            count=count,
        )
        return loss * weight, {**stats, **m2_parts}

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def minibatch_update(carry, mb):
        params, opt_state = carry
        m2_parts = {}
        if mask_before_split:
            logp_now = None
            if actor.m2po_second_moment != "behav_prox":
                logp_now, _ = logprobs.micro_batched_logp(
                    params,
                    model_config,
                    mb["tokens"],
                    mb["valid"],
                    temperature,
                    chunk,
                    n_micro,
                    layout,
                )
            mb["mask"], m2_parts = _m2po(
                actor,
                mb["behav"],
                mb["prox"],
                mb["loss_mask"],
                mb["adv"],
                logp_now,
                threshold,
                layout,
            )
        n_valid = jnp.sum(mb["loss_mask"])
        count = None
        if not mask_in_loss:
            count = jnp.sum(mb["mask"] if actor.loss_denominator == "kept" else mb["loss_mask"])

        def accumulate(grads, part):
            part_valid = jnp.sum(part["loss_mask"])
            weight = part_valid / jnp.maximum(n_valid, 1) if mask_in_loss else 1.0
            (loss, stats), part_grads = grad_fn(params, part, count, weight)
            grads = jax.tree.map(lambda g, p: g + p.astype(g.dtype), grads, part_grads)
            return grads, (loss, stats, part_valid)

        if n_micro == 1:  # no accumulator: one gradient-sized buffer less
            (loss, stats), grads = grad_fn(params, mb, count, 1.0)
            part_loss, part_stats, part_valid = jax.tree.map(
                lambda x: x[None], (loss, stats, n_valid)
            )
        else:
            micro = jax.tree.map(lambda x: constrain(batching.split_rows(x, n_micro), 1), mb)
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            grads, (part_loss, part_stats, part_valid) = jax.lax.scan(accumulate, zeros, micro)
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        loss = jnp.sum(part_loss)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def apply_update(operands):
            params, opt_state, grads = operands
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        # A non-finite minibatch touches neither params nor optimizer moments. A `cond`,
        # unlike a select between old and new, updates the state in place.
        params, opt_state = jax.lax.cond(
            finite, apply_update, lambda operands: operands[:2], (params, opt_state, grads)
        )
        stats = {**combine_stats(part_stats, part_valid), **m2_parts}
        stats.update({"loss": loss, "grad_norm": grad_norm, "finite": finite})
        return (params, opt_state), (stats, n_valid)

    (params, opt_state), (stats, mb_valid) = jax.lax.scan(
        minibatch_update, (params, opt_state), minibatches
    )
    return params, opt_state, stats, mb_valid


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
    layout=None,
) -> tuple[TrainState, dict]:
    """One RL update of `state` on `batch`: `prepare`, `ppo_updates`, `step_metrics`.

    Micro-batches per minibatch follow `actor.mb_spec` and the batch's static shape.
    `layout` (`placement.Layout`) keeps rows and weights laid out for the mesh and gives
    the mesh of the "shard" M2PO scope (without it that scope is one shard: "global").
    """
    n_mb = actor.ppo_n_minibatches
    rows, seq_len = batch.tokens_BxT.shape
    mb = actor.mb_spec
    n_micro = batching.micro_batch_count(rows // n_mb, seq_len, mb.n_mbs, mb.max_tokens_per_mb)
    prep = prepare(
        state.params,
        batch,
        ref_params,
        model_config=model_config,
        actor=actor,
        n_parts=n_mb * n_micro,
        layout=layout,
    )
    params, opt_state, mb_stats, mb_valid = ppo_updates(
        state.params,
        state.opt_state,
        batch,
        prep,
        rng,
        model_config=model_config,
        actor=actor,
        tx=tx,
        n_micro=n_micro,
        layout=layout,
    )
    all_finite = jnp.all(mb_stats.pop("finite"))
    new_state = TrainState(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        nonfinite_steps=jnp.where(all_finite, 0, state.nonfinite_steps + 1),
    )
    metrics = step_metrics(
        state, new_state.params, prep, mb_stats, mb_valid, all_finite, schedule, n_mb
    )
    return new_state, metrics


def make_train_step(
    model_config,
    actor: ActorSection,
    tx,
    schedule,
    *,
    jit_kwargs=None,
    layout=None,
):
    """`train_step` with static settings bound, under one `jax.jit` (state donated)."""
    step = functools.partial(
        train_step,
        model_config=model_config,
        actor=actor,
        tx=tx,
        schedule=schedule,
        layout=layout,
    )
    return jax.jit(step, donate_argnums=(0,), **(jit_kwargs or {}))
