"""The pure RL train step: proximal log-probs, advantages, M2PO mask, PPO minibatch updates.

`train_step(state, batch, rng, ref_params) -> (state, metrics)` is pure; the static
settings (model config, the actor's `ActorSettings`, optimizer) are bound with
`functools.partial` and the result is compiled once with `jax.jit` (see `make_train_step`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from m2po_jax.algorithm import advantages as adv_lib
from m2po_jax.algorithm import diagnostics, losses, mismatch
from m2po_jax.common.config_schema import ActorSection
from m2po_jax.common.types import Minibatch, PromptGroups, TrainBatch
from m2po_jax.learner import batching, logprobs, memory, step_math
from m2po_jax.learner.actor_settings import ActorSettings
from m2po_jax.learner.step_metrics import combine_stats, step_metrics
from m2po_jax.learner.step_plan import StepPlan, plan_step
from m2po_jax.models import lora, moe
from m2po_jax.models import model_config as model_config_lib
from m2po_jax.parallel import sharding


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32: RL updates done = the policy version of `params`
    params: Any
    opt_state: Any
    nonfinite_steps: jax.Array  # int32: consecutive steps skipped for non-finite values


def init_train_state(params, tx) -> TrainState:
    """Step 0 of `params`; the optimizer state covers the trainable params only (the LoRA
    adapters when `params` has them: `lora.trainable`)."""
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(lora.trainable(params)),
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
    m2_parts: dict  # batch-level M2PO, diagnostics and mismatch parts ({}: taken later)
    # a mixture of experts: the proximal pass's routing (`moe.RoutingSums`), None without it
    prox_routing: Any = None


def prepare(
    params,
    batch: TrainBatch,
    ref_params=None,
    *,
    model_config: model_config_lib.ModelConfig,
    actor: ActorSettings,
    plan: StepPlan,
    layout=None,
    shared: logprobs.SharedPrompt | None = None,
    version: jax.Array | int = 0,
) -> Prepared:
    """Proximal (and reference) log-probs, advantages and the batch-level M2PO mask.

    The proximal log-probs are recomputed without gradient only where `plan` says so
    ("pass"), in parts no larger than a training micro-batch. `shared`: rows come in
    groups sharing a prompt. `layout` (`placement.Layout`): see `train_step`. `version`:
    the policy version of `params` (its tokens are the fresh ones of the mismatch parts)."""
    loss_mask = batch.loss_mask_BxT
    behav = batch.behav_logp_BxT.astype(jnp.float32)

    def logp_pass(p, router=False):  # minibatches x micro-batches parts
        parts, chunk = plan.n_minibatches * plan.n_micro, actor.logp_chunk_size
        tokens, valid, temperature = batch.tokens_BxT, batch.valid_BxT, actor.temperature
        return logprobs.micro_batched_logp(
            p,
            model_config,
            tokens,
            valid,
            temperature,
            chunk,
            parts,
            layout,
            shared,
            routed_experts_BxTxLxK=batch.routed_experts_BxTxLxK,
            router=router,
        )

    prox, entropy, prox_routing = None, None, None
    if plan.prox_source == "pass" and model_config.is_moe:
        prox, entropy, prox_routing = logp_pass(params, router=True)
    elif plan.prox_source == "pass":
        prox, entropy = logp_pass(params)
    if plan.prox_source == "behav":
        prox = behav
    ref_logp = None
    if ref_params is not None and actor.advantages.kl_ctl > 0:
        ref_logp, _ = logp_pass(ref_params)
    advantages = adv_lib.token_advantages(
        actor.advantages, batch.rewards_B, loss_mask, behav, ref_logp
    )
    mask, m2_parts = loss_mask, {}
    # Without a mask the second moment is still reported, from wherever prox is known.
    if plan.mask_at == "prepare" or (plan.mask_at == "none" and prox is not None):
        fresh = _fresh(plan, batch.version_BxT, version)
        mask, m2_parts = step_math.m2po_block(
            actor, behav, prox, loss_mask, advantages, layout=layout, fresh=fresh
        )
    eps_clip, eps_clip_higher = actor.loss.eps_clip, actor.loss.eps_clip_higher
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
        prox_routing=prox_routing,
    )


def _fresh(plan: StepPlan, version_BxT, version) -> jax.Array | None:
    """The tokens `version` generated, where the mismatch parts are reported: only against
    recomputed proximal log-probs (`StepPlan.prox_recomputed`); None elsewhere."""
    return mismatch.fresh_tokens(version_BxT, version) if plan.prox_recomputed else None


def _permutation(rng, rows: int, block: int) -> jax.Array:
    """A random order of the rows that keeps each block of `block` consecutive rows whole."""
    order = jax.random.permutation(rng, rows // block)
    return (order[:, None] * block + jnp.arange(block)[None, :]).reshape(-1)


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
    """What every minibatch update of one step reads besides its params and rows."""

    model_config: model_config_lib.ModelConfig
    actor: ActorSettings
    tx: optax.GradientTransformation
    plan: StepPlan
    layout: Any  # placement.Layout or None
    version: Any  # int32: the policy version of the params the step starts from
    loss: losses.LossSettings  # the actor's, with the step's clip range (traced when capped)
    with_entropy: bool  # the loss pass reports the entropy (no earlier pass did)
    frozen: Any = None  # the params that do not train (the base under LoRA: `lora.split`)

    def model_params(self, trainable):
        """The whole params tree the model runs: the trainable ones with the frozen ones."""
        return lora.merge(trainable, self.frozen)

    def constrain(self, x, row_axis=0):
        """Keep regrouped rows on their devices (no-op without a layout)."""
        return x if self.layout is None else self.layout.rows(x, row_axis)


def minibatches(batch: TrainBatch, prep: Prepared, rng, s: UpdateSettings) -> Minibatch:
    """The batch's rows in a random order of whole `plan.perm_block` blocks, stacked as
    [n_minibatches, rows / n_minibatches, ...]."""
    rows, n_mb = batch.tokens_BxT.shape[0], s.plan.n_minibatches
    perm = _permutation(rng, rows, s.plan.perm_block)
    whole = Minibatch(
        advantages_BxT=prep.advantages_BxT,
        behav_BxT=prep.behav_BxT,
        loss_mask_BxT=prep.loss_mask_BxT,
        mask_BxT=prep.mask_BxT,
        prox_BxT=prep.prox_BxT,
        tokens_BxT=batch.tokens_BxT,
        valid_BxT=batch.valid_BxT,
        version_B=batch.version_B,
        version_BxT=batch.version_BxT,
        routed_experts_BxTxLxK=batch.routed_experts_BxTxLxK,
    )

    return jax.tree.map(
        lambda x: s.constrain(x[perm].reshape((n_mb, rows // n_mb) + x.shape[1:]), 1), whole
    )


def minibatch_loss(params, mb: Minibatch, count, weight, s: UpdateSettings, aux_weight=1.0):
    """The policy loss of one (micro-)batch times `weight`, and its statistics.

    The proximal log-probs are `mb.prox_BxT`, or this pass's log-probs with the gradient
    stopped (or AReaL's loglinear approximation from them); where the plan takes the
    mask here, it is this part's own M2PO mask and the loss its own denominator.

    A mixture of experts replays `mb.routed_experts_BxTxLxK` (None: routes freshly) and
    adds `router_aux_loss_coef` x `moe.load_balancing_loss` over this part's valid tokens
    x `aux_weight` (the part's share of the minibatch's valid tokens); its routing sums
    are the statistic "moe/parts" (`router_metrics`).
    """
    actor, plan = s.actor, s.plan
    out = logprobs.policy_logp(
        s.model_params(params),
        s.model_config,
        mb.tokens_BxT,
        mb.valid_BxT,
        actor.temperature,
        actor.logp_chunk_size,
        s.with_entropy,
        plan.loss_prompt,
        routed_experts_BxTxLxK=mb.routed_experts_BxTxLxK,
        router=s.model_config.is_moe,
    )
    logp, entropy = out[:2]
    aux, router_stats = None, {}  # None: no load-balancing term (the program as without one)
    if s.model_config.is_moe:
        routing = out[2]
        router_stats = {"moe/parts": routing}
        if actor.router_aux_loss_coef:  # off (0): the loss is the policy loss, bit for bit
            aux = actor.router_aux_loss_coef * moe.balancing_loss(routing) * aux_weight
    logp_now = jax.lax.stop_gradient(logp)
    prox, stats = step_math.loss_pass_prox(plan, mb, logp_now, entropy, s.version)
    mask = mb.mask_BxT
    if plan.mask_at == "loss" or plan.prox_in_loss:  # the second moment is known only here
        kept, m2_parts = step_math.m2po_block(
            actor,
            mb.behav_BxT,
            prox,
            mb.loss_mask_BxT,
            mb.advantages_BxT,
            logp=logp_now,
            layout=s.layout,
            fresh=_fresh(plan, mb.version_BxT, s.version),
        )
        mask = kept if plan.mask_at == "loss" else mask
        stats.update(m2_parts)
    loss, loss_stats = losses.policy_loss_with(
        s.loss,
        logp,
        prox,
        mb.behav_BxT,
        mb.advantages_BxT,
        mask,
        valid_mask_BxT=mb.loss_mask_BxT,
        count=count,
    )
    # Each valid token's loss had it been kept: the share the masked ones would carry.
    unmasked, _ = losses.token_losses(
        s.loss, logp_now, prox, mb.behav_BxT, mb.advantages_BxT, mb.loss_mask_BxT
    )
    stats.update(diagnostics.loss_parts(unmasked, mb.loss_mask_BxT, mask))
    stats.update(router_stats)
    if not s.actor.masked_grad_norm:
        total = loss * weight
        return (total if aux is None else total + aux), {**loss_stats, **stats}
    # The masked tokens' loss over the same denominator: its gradient is what M2PO removed.
    if count is None:
        count = jnp.sum(mask if s.loss.denominator == "kept" else mb.loss_mask_BxT)
    masked, _ = losses.policy_loss_with(
        s.loss,
        logp,
        prox,
        mb.behav_BxT,
        mb.advantages_BxT,
        mb.loss_mask_BxT & ~mask,
        valid_mask_BxT=mb.loss_mask_BxT,
        count=count,
    )
    pair = jnp.stack([loss, masked]) * weight
    if aux is not None:
        pair = pair + jnp.stack([aux, 0.0])
    return pair, {**loss_stats, **stats}


def minibatch_mask(params, mb: Minibatch, s: UpdateSettings) -> tuple[Minibatch, dict]:
    """The M2PO mask of the minibatch, taken with the params before its update (the plan's
    `mask_at == "minibatch"`: the scope or the current-policy second moment needs it)."""
    actor, plan = s.actor, s.plan
    logp_now = None
    if actor.mask.second_moment != "behav_prox":
        logp_now, _ = logprobs.micro_batched_logp(
            s.model_params(params),
            s.model_config,
            mb.tokens_BxT,
            mb.valid_BxT,
            actor.temperature,
            actor.logp_chunk_size,
            plan.n_micro,
            s.layout,
            plan.loss_prompt,
            routed_experts_BxTxLxK=mb.routed_experts_BxTxLxK,
        )
    mask, m2_parts = step_math.m2po_block(
        actor,
        mb.behav_BxT,
        mb.prox_BxT,
        mb.loss_mask_BxT,
        mb.advantages_BxT,
        logp_now,
        s.layout,
        fresh=_fresh(plan, mb.version_BxT, s.version),
    )
    return mb.replace(mask_BxT=mask), m2_parts


def accumulated_grads(params, mb: Minibatch, s: UpdateSettings):
    """The minibatch's gradient, summed over `plan.n_micro` micro-batches (`lax.scan`);
    returns (grads, (loss, stats, valid tokens) of each micro-batch, the minibatch's valid
    tokens).

    Each micro-batch's loss is divided by the whole minibatch's token count, so the sum is
    the unsplit minibatch's gradient. Where the mask is taken in the loss, each part has
    its own denominator and weighs its share of the minibatch's valid tokens (AReaL's
    `loss_weight_fn`).
    """
    plan, mask_in_loss = s.plan, s.plan.mask_at == "loss"
    n_valid = jnp.sum(mb.loss_mask_BxT)
    count = None
    if not mask_in_loss:
        count = jnp.sum(mb.mask_BxT if s.loss.denominator == "kept" else mb.loss_mask_BxT)
    grad_fn = _grad_fn(s)
    if plan.n_micro == 1:  # no accumulator: one gradient-sized buffer less
        (loss, stats), grads = grad_fn(params, mb, count, 1.0, s)
        return grads, jax.tree.map(lambda x: x[None], (loss, stats, n_valid)), n_valid

    n_real = jnp.sum(mb.valid_BxT)  # the load-balancing loss's tokens

    def accumulate(grads, part):
        part_valid = jnp.sum(part.loss_mask_BxT)
        weight = part_valid / jnp.maximum(n_valid, 1) if mask_in_loss else 1.0
        aux_weight = jnp.sum(part.valid_BxT) / jnp.maximum(n_real, 1)
        (loss, stats), part_grads = grad_fn(params, part, count, weight, s, aux_weight)
        grads = jax.tree.map(lambda g, p: g + p.astype(g.dtype), grads, part_grads)
        return grads, (loss, stats, part_valid)

    split = lambda x: s.constrain(batching.split_rows(x, plan.n_micro, plan.micro_block), 1)  # noqa: E731
    micro = jax.tree.map(split, mb)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    if s.actor.masked_grad_norm:  # a (kept, masked) pair of gradients
        zeros = (zeros, zeros)
    grads, parts = jax.lax.scan(accumulate, zeros, micro)
    return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, _pair(params, s)), parts, n_valid


def _pair(params, s: UpdateSettings):
    return (params, params) if s.actor.masked_grad_norm else params


def _grad_fn(s: UpdateSettings):
    """`value_and_grad` of `minibatch_loss`; with `masked_grad_norm` the gradients of its
    (kept, masked) pair of losses, ((kept loss, stats), (kept grads, masked grads)), from
    one forward pass and two pullbacks."""
    if not s.actor.masked_grad_norm:
        return jax.value_and_grad(minibatch_loss, has_aux=True)

    def pair_grads(params, mb, count, weight, s, aux_weight=1.0):
        pair, pullback, stats = jax.vjp(
            lambda p: minibatch_loss(p, mb, count, weight, s, aux_weight), params, has_aux=True
        )
        (kept,) = pullback(jnp.array([1.0, 0.0], pair.dtype))
        (masked,) = pullback(jnp.array([0.0, 1.0], pair.dtype))
        return (pair[0], stats), (kept, masked)

    return pair_grads


def guarded_update(params, opt_state, grads, loss, tx: optax.GradientTransformation):
    """One optimizer update where the loss and the gradient are finite; otherwise params
    and optimizer moments stay as they are. Returns (params, opt_state, grad norm, finite).
    """
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def apply_update(operands):
        params, opt_state, grads = operands
        with jax.named_scope("optimizer"):  # the name profiles find it by (rl_profile.py)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

    # A `cond`, unlike a select between old and new, updates the state in place.
    params, opt_state = jax.lax.cond(
        finite, apply_update, lambda operands: operands[:2], (params, opt_state, grads)
    )
    return params, opt_state, grad_norm, finite


def minibatch_update(carry, mb: Minibatch, s: UpdateSettings):
    """One PPO update on one minibatch (a `lax.scan` body over the minibatches)."""
    params, opt_state = carry
    m2_parts = {}
    if s.plan.mask_at == "minibatch":
        mb, m2_parts = minibatch_mask(params, mb, s)
    grads, (part_loss, part_stats, part_valid), n_valid = accumulated_grads(params, mb, s)
    routing = part_stats.pop("moe/parts", None)  # sums: they add up, not average
    loss = jnp.sum(part_loss)
    masked_stats = {}
    if s.actor.masked_grad_norm:
        grads, masked = grads
        masked_norm = optax.tree.norm(masked)
        unmasked = optax.tree.norm(jax.tree.map(jnp.add, grads, masked))
        masked_stats = {
            "m2po/masked_grad_norm": masked_norm,
            "m2po/masked_grad_share": masked_norm / jnp.maximum(unmasked, 1e-30),
        }
    params, opt_state, grad_norm, finite = guarded_update(params, opt_state, grads, loss, s.tx)
    stats = {**combine_stats(part_stats, part_valid), **m2_parts, **masked_stats}
    stats.update({"loss": loss, "grad_norm": grad_norm, "finite": finite})
    if routing is not None:
        stats["moe/parts"] = jax.tree.map(lambda x: jnp.sum(x, axis=0), routing)
    return (params, opt_state), (stats, n_valid)


def ppo_updates(
    params,
    opt_state,
    batch: TrainBatch,
    prep: Prepared,
    rng: jax.Array,
    *,
    model_config: model_config_lib.ModelConfig,
    actor: ActorSettings,
    tx: optax.GradientTransformation,
    plan: StepPlan,
    version: jax.Array | int = 0,
    layout=None,
    frozen=None,
):
    """`ppo_n_minibatches` optimizer updates (`minibatch_update` under `lax.scan`), each
    accumulating its gradient over `plan.n_micro` micro-batches; returns (params,
    opt_state, stats per minibatch, valid tokens per minibatch).

    Where the mask is taken (`prepare`, per minibatch, or in the loss) and where the
    proximal log-probs come from is the plan's (`step_plan`); `version` is the policy
    version of `params` (AReaL's loglinear approximation needs it, and the mismatch parts). A non-finite minibatch
    leaves params and optimizer state untouched; the step's other minibatches still apply.
    `params` are the trainable ones; `frozen` the rest of the model's (`lora.split`), or
    None when every param trains.
    """
    settings = UpdateSettings(
        model_config=model_config,
        actor=actor,
        tx=tx,
        plan=plan,
        layout=layout,
        version=version,
        loss=dataclasses.replace(
            actor.loss, eps_clip=prep.eps_clip, eps_clip_higher=prep.eps_clip_higher
        ),
        with_entropy=prep.entropy_BxT is None,
        frozen=frozen,
    )
    (params, opt_state), (stats, mb_valid) = jax.lax.scan(
        functools.partial(minibatch_update, s=settings),
        (params, opt_state),
        minibatches(batch, prep, rng, settings),
    )
    return params, opt_state, stats, mb_valid


def batch_plan(
    batch: TrainBatch, model_config, actor: ActorSettings, layout, groups, fuse_prox
) -> StepPlan:
    """`step_plan.plan_step` for the batch's static shape on the layout's mesh."""
    rows, seq_len = batch.tokens_BxT.shape
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1]) if layout is None else layout.mesh
    return plan_step(
        actor.section,
        rows,
        seq_len,
        groups=groups,
        fuse_prox=fuse_prox,
        batch_shards=sharding.batch_shards(mesh),
        blocks_pay=memory.blocks_pay_fn(model_config, mesh, actor.logp_chunk_size),
    )


def train_step(
    state: TrainState,
    batch: TrainBatch,
    rng: jax.Array,
    ref_params=None,
    *,
    model_config: model_config_lib.ModelConfig,
    actor: ActorSettings,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    layout=None,
    groups: PromptGroups | None = None,
    fuse_prox: bool = True,
) -> tuple[TrainState, dict]:
    """One RL update of `state` on `batch`: `prepare`, `ppo_updates`, `step_metrics`.

    What runs follows `step_plan.plan_step` for the batch's static shape: micro-batches
    per minibatch (`actor.mb_spec`), where the proximal log-probs come from
    (metric `train/prox_pass` is 1 when a separate forward pass computed them) and where
    the M2PO mask is taken. `groups`: the rows come in groups of `groups.group_size`
    sharing their first `groups.prompt_len` columns (as the sampler writes them);
    minibatches and micro-batches then hold whole groups and each prompt runs once.
    `fuse_prox=False` keeps the separate proximal pass (the reference path). `layout`
    (`placement.Layout`) keeps rows and weights laid out for the mesh and gives the mesh of
    the "shard" M2PO scope (without it that scope is one shard: "global")."""
    plan = batch_plan(batch, model_config, actor, layout, groups, fuse_prox)
    # Under LoRA only the adapters train: the base gets no gradient and no optimizer
    # state, and the KL penalty's reference is the base itself (the adapters off).
    trainable, frozen = lora.split(state.params)
    if ref_params is None and frozen is not None and actor.advantages.kl_ctl > 0:
        ref_params = lora.adapters_off(state.params)
    prep = prepare(
        state.params,
        batch,
        ref_params,
        model_config=model_config,
        actor=actor,
        plan=plan,
        layout=layout,
        shared=plan.batch_prompt,  # the batch's own order: groups are whole
        version=state.step,
    )
    params, opt_state, mb_stats, mb_valid = ppo_updates(
        trainable,
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
        frozen=frozen,
    )
    params = lora.merge(params, frozen)
    all_finite = jnp.all(mb_stats.pop("finite"))
    routing = mb_stats.pop("moe/parts", None)
    version = state.step + 1
    skipped = jnp.where(all_finite, 0, state.nonfinite_steps + 1)
    new_state = TrainState(version, params, opt_state, nonfinite_steps=skipped)
    metrics = step_metrics(
        state, new_state.params, prep, mb_stats, mb_valid, all_finite, schedule, plan
    )
    metrics["train/nonfinite_steps"] = new_state.nonfinite_steps
    if routing is not None:
        routing = jax.tree.map(lambda x: jnp.sum(x, axis=0), routing)
        replay = batch.routed_experts_BxTxLxK is not None
        metrics.update(router_metrics(routing, prep.prox_routing, model_config, replay))
    return new_state, metrics


def router_metrics(
    routing: moe.RoutingSums,
    prox_routing: moe.RoutingSums | None,
    model_config: model_config_lib.ModelConfig,
    replay: bool,
) -> dict:
    """A mixture of experts' step metrics from the training passes' routing (summed over
    the step's minibatches): "moe/load_balancing_loss" (`moe.balancing_loss`),
    "moe/expert_load_max" / "_min" (over layers and experts, `moe.expert_load`: 1 =
    perfectly even), and under routing replay (`replay`) "moe/router_agreement": the share of replayed token-layer pairs whose own
    top-K set is the recorded one (from the proximal pass where one ran, before any
    update; else from the training passes)."""
    load_LxX = moe.expert_load(routing, model_config.num_experts_per_tok)
    metrics = {
        "moe/load_balancing_loss": moe.balancing_loss(routing),
        "moe/expert_load_max": jnp.max(load_LxX),
        "moe/expert_load_min": jnp.min(load_LxX),
    }
    if replay:
        agreement = routing if prox_routing is None else prox_routing
        metrics["moe/router_agreement"] = agreement.agreed / jnp.maximum(agreement.replayed, 1)
    return metrics


def make_train_step(
    model_config,
    actor: ActorSection | ActorSettings,
    tx,
    schedule,
    *,
    jit_kwargs=None,
    layout=None,
    groups: PromptGroups | None = None,
    fuse_prox: bool = True,
    masked_grad_norm: bool = False,
    router_aux_loss_coef: float = 0.0,
):
    """`train_step` with static settings bound, under one `jax.jit` (state donated). The
    actor section's settings are built here, once (`ActorSettings.build`).
    `masked_grad_norm`: also take the gradient of the tokens M2PO masked (one more
    pullback per micro-batch) and report `m2po/masked_grad_norm` and
    `m2po/masked_grad_share` (its norm over the norm of the unmasked loss's gradient).
    `router_aux_loss_coef`: a mixture of experts' load-balancing loss weight."""
    settings = ActorSettings.build(actor)
    if masked_grad_norm:
        settings = dataclasses.replace(settings, masked_grad_norm=True)
    if router_aux_loss_coef:
        settings = dataclasses.replace(settings, router_aux_loss_coef=router_aux_loss_coef)
    step = functools.partial(
        train_step,
        model_config=model_config,
        actor=settings,
        tx=tx,
        schedule=schedule,
        layout=layout,
        groups=groups,
        fuse_prox=fuse_prox,
    )
    mesh = None if layout is None else layout.mesh
    return jax.jit(sharding.on_mesh(step, mesh), donate_argnums=(0,), **(jit_kwargs or {}))
