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

from m2po_jax.algorithm import losses
from m2po_jax.common.config_schema import ActorSection
from m2po_jax.common.types import TrainBatch
from m2po_jax.learner import batching, logprobs, memory, step_math
from m2po_jax.learner.step_metrics import combine_stats, step_metrics
from m2po_jax.learner.step_plan import StepPlan, plan_step
from m2po_jax.models import model_config as model_config_lib
from m2po_jax.parallel import sharding


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
    prox_BxT: jax.Array | None  # float32 proximal log-probs; None: the loss pass takes them
    advantages_BxT: jax.Array
    loss_mask_BxT: jax.Array  # valid completion tokens
    mask_BxT: jax.Array  # after the batch-level M2PO mask (loss_mask if it is taken later)
    entropy_BxT: jax.Array | None  # of the proximal policy; None: the loss pass reports it
    eps_clip: Any  # a float, or a traced scalar under the capped-mean rule
    eps_clip_higher: Any
    m2_parts: dict  # batch-level M2PO statistics parts ({} when the mask is taken later)


def prepare(
    params,
    batch: TrainBatch,
    ref_params=None,
    *,
    model_config: model_config_lib.ModelConfig,
    actor: ActorSection,
    plan: StepPlan,
    layout=None,
    shared: logprobs.SharedPrompt | None = None,
) -> Prepared:
    """Proximal (and reference) log-probs, advantages and the batch-level M2PO mask.

    The proximal log-probs are recomputed without gradient only where `plan` says so
    ("pass"), minibatches x micro-batches parts at a time, so no pass is larger than a
    training micro-batch. `shared`: rows come in groups sharing a prompt (each prompt
    then runs once). `layout` (`placement.Layout`) keeps
    regrouped rows on their devices and gives the mesh of the "shard" M2PO scope.
    """
    temperature, chunk = actor.temperature, actor.logp_chunk_size
    n_parts = plan.n_minibatches * plan.n_micro
    loss_mask = batch.loss_mask_BxT
    behav = batch.behav_logp_BxT.astype(jnp.float32)
    tokens, valid = batch.tokens_BxT, batch.valid_BxT
    prox, entropy = None, None
    if plan.prox_source == "pass":
        prox, entropy = logprobs.micro_batched_logp(
            params, model_config, tokens, valid, temperature, chunk, n_parts, layout, shared
        )
    elif plan.prox_source == "behav":
        prox = behav
    ref_logp = None
    if ref_params is not None and actor.kl_ctl > 0:
        ref_logp, _ = logprobs.micro_batched_logp(
            ref_params, model_config, tokens, valid, temperature, chunk, n_parts, layout, shared
        )
    advantages = step_math.token_advantages(actor, batch.rewards_B, loss_mask, behav, ref_logp)
    mask, m2_parts = loss_mask, {}
    # Without a mask the second moment is still reported, from wherever prox is known.
    if plan.mask_at == "prepare" or (plan.mask_at == "none" and prox is not None):
        mask, m2_parts = step_math.m2po_block(
            actor,
            behav,
            prox,
            loss_mask,
            advantages,
            threshold=step_math.threshold(actor),
            layout=layout,
        )
    eps_clip, eps_clip_higher = actor.eps_clip, actor.eps_clip_higher
    if prox is not None:
        eps_clip, eps_clip_higher = step_math.clip_range(actor, behav, prox, loss_mask, advantages)
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


def _permutation(rng, rows: int, block: int) -> jax.Array:
    """A random order of the rows that keeps each block of `block` consecutive rows whole."""
    order = jax.random.permutation(rng, rows // block)
    return (order[:, None] * block + jnp.arange(block)[None, :]).reshape(-1)


def ppo_updates(
    params,
    opt_state,
    batch: TrainBatch,
    prep: Prepared,
    rng: jax.Array,
    *,
    model_config: model_config_lib.ModelConfig,
    actor: ActorSection,
    tx: optax.GradientTransformation,
    plan: StepPlan,
    version: jax.Array | int = 0,
    layout=None,
):
    """`ppo_n_minibatches` optimizer updates, each accumulating its gradient over
    `plan.n_micro` micro-batches (`lax.scan` in `lax.scan`); returns (params, opt_state,
    stats per minibatch, valid tokens per minibatch).

    Each micro-batch's loss is divided by the whole minibatch's token count, so the summed
    gradient is the unsplit minibatch's. Where the mask is taken inside the loss (see
    `step_plan`) the loss uses its own denominator and is weighted by its share of the
    minibatch's valid tokens: AReaL's `_apply_m2po_masking` per micro-batch and its
    `loss_weight_fn`; with one micro-batch that is the minibatch's own loss. Where the
    plan takes the proximal log-probs from the loss pass, they are its log-probs with the
    gradient stopped (or AReaL's loglinear approximation from them, `version` being the
    policy version of `params`). A non-finite minibatch leaves params and optimizer state
    untouched (the other minibatches of the step still apply).
    """
    temperature, chunk = actor.temperature, actor.logp_chunk_size
    n_mb, n_micro = plan.n_minibatches, plan.n_micro
    rows = batch.tokens_BxT.shape[0]
    perm = _permutation(rng, rows, plan.perm_block)
    fields = {
        "tokens": batch.tokens_BxT,
        "valid": batch.valid_BxT,
        "behav": prep.behav_BxT,
        "adv": prep.advantages_BxT,
        "loss_mask": prep.loss_mask_BxT,
        "mask": prep.mask_BxT,
        "version": batch.version_B,
    }
    if prep.prox_BxT is not None:
        fields["prox"] = prep.prox_BxT
    constrain = layout.rows if layout is not None else (lambda x, row_axis=0: x)
    minibatches = jax.tree.map(
        lambda x: constrain(x[perm].reshape((n_mb, rows // n_mb) + x.shape[1:]), 1), fields
    )
    threshold, rejection = step_math.threshold(actor), step_math.rejection(actor)
    mask_in_loss = plan.mask_at == "loss"
    with_entropy = prep.entropy_BxT is None

    def loss_fn(params, mb, count, weight):
        logp, entropy = logprobs.policy_logp(
            params,
            model_config,
            mb["tokens"],
            mb["valid"],
            temperature,
            chunk,
            with_entropy,
            plan.loss_prompt,
        )
        logp_now = jax.lax.stop_gradient(logp)
        prox, stats = step_math.loss_pass_prox(plan, mb, logp_now, entropy, version)
        mask = mb["mask"]
        if mask_in_loss or "prox" not in mb:
            kept, m2_parts = step_math.m2po_block(
                actor,
                mb["behav"],
                prox,
                mb["loss_mask"],
                mb["adv"],
                logp=logp_now,
                threshold=threshold,
                layout=layout,
            )
            mask = kept if mask_in_loss else mask
            stats.update(m2_parts)
        loss, loss_stats = losses.policy_loss(
            logp,
            prox,
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
        return loss * weight, {**loss_stats, **stats}

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def minibatch_update(carry, mb):
        params, opt_state = carry
        m2_parts = {}
        if plan.mask_at == "minibatch":
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
                    plan.loss_prompt,
                )
            mb["mask"], m2_parts = step_math.m2po_block(
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
            split = lambda x: constrain(batching.split_rows(x, n_micro, plan.micro_block), 1)  # noqa: E731
            micro = jax.tree.map(split, mb)
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
    model_config: model_config_lib.ModelConfig,
    actor: ActorSection,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    layout=None,
    prompt_len: int | None = None,
    group_size: int | None = None,
    fuse_prox: bool = True,
) -> tuple[TrainState, dict]:
    """One RL update of `state` on `batch`: `prepare`, `ppo_updates`, `step_metrics`.

    What runs follows `step_plan.plan_step` for the batch's static shape: micro-batches
    per minibatch (`actor.mb_spec`), where the proximal log-probs come from
    (metric `train/prox_pass` is 1 when a separate forward pass computed them) and where
    the M2PO mask is taken. `prompt_len` / `group_size`: the rows come in groups of
    `group_size` sharing their first `prompt_len` columns (as the sampler writes them);
    minibatches and micro-batches then hold whole groups and each prompt runs once.
    `fuse_prox=False` keeps the separate proximal pass (the reference path).
    `layout` (`placement.Layout`) keeps rows and weights laid out for the mesh and gives
    the mesh of the "shard" M2PO scope (without it that scope is one shard: "global").
    """
    rows, seq_len = batch.tokens_BxT.shape
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1]) if layout is None else layout.mesh
    plan = plan_step(
        actor,
        rows,
        seq_len,
        prompt_len=prompt_len,
        group_size=group_size,
        fuse_prox=fuse_prox,
        batch_shards=sharding.batch_shards(mesh),
        blocks_pay=memory.blocks_pay_fn(model_config, mesh, actor.logp_chunk_size),
    )
    prep = prepare(
        state.params,
        batch,
        ref_params,
        model_config=model_config,
        actor=actor,
        plan=plan,
        layout=layout,
        # The batch's own order: groups are whole.
        shared=plan.batch_prompt,
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
        plan=plan,
        version=state.step,
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
        state, new_state.params, prep, mb_stats, mb_valid, all_finite, schedule, plan
    )
    metrics["train/nonfinite_steps"] = new_state.nonfinite_steps
    return new_state, metrics


def make_train_step(
    model_config,
    actor: ActorSection,
    tx,
    schedule,
    *,
    jit_kwargs=None,
    layout=None,
    prompt_len: int | None = None,
    group_size: int | None = None,
    fuse_prox: bool = True,
):
    """`train_step` with static settings bound, under one `jax.jit` (state donated)."""
    step = functools.partial(
        train_step,
        model_config=model_config,
        actor=actor,
        tx=tx,
        schedule=schedule,
        layout=layout,
        prompt_len=prompt_len,
        group_size=group_size,
        fuse_prox=fuse_prox,
    )
    return jax.jit(step, donate_argnums=(0,), **(jit_kwargs or {}))
