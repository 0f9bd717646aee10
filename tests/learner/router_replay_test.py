"""Routing replay (R3) in the trainer's passes, and a mixture of experts' load-balancing
loss in the training loss: against a rollout's recorded experts and behaviour log-probs,
and against `moe.load_balancing_loss` (checked against transformers in moe_test) and its
`jax.grad`."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_moe

from m2po_jax import config as config_lib
from m2po_jax.common.types import Minibatch, TrainBatch
from m2po_jax.configs import arith
from m2po_jax.learner import logprobs, optim
from m2po_jax.learner import train_step as step_lib
from m2po_jax.learner.actor_settings import ActorSettings
from m2po_jax.models import model as model_lib
from m2po_jax.models import moe
from m2po_jax.rollout import sampling

PAD = 63
PROMPTS = [[5, 9, 11, 2], [7, 3], [21, 22, 23], [30]]
TOKENS, VALID = sampling.pad_prompts(PROMPTS, PAD)


def perturbed(params, config, scale: float, seed=1):
    """The params with every router kernel moved by Gaussian noise of `scale` x its std."""
    params = jax.tree.map(jnp.copy, params)
    for i in range(config.num_layers):
        mlp = params[f"layers_{i}"]["mlp"]
        noise = jax.random.normal(jax.random.key(seed + i), mlp["router_kernel"].shape)
        mlp["router_kernel"] = mlp["router_kernel"] + scale * jnp.std(mlp["router_kernel"]) * noise
    return params


def rollout(params, config, new=12):
    settings = sampling.SamplingConfig(max_new_tokens=new, pad_id=PAD, record_experts=True)
    return sampling.generate(params, config, TOKENS, VALID, jax.random.key(4), settings, 2)


@functools.partial(jax.jit, static_argnums=1)
def _routing(params, config, tokens, valid, routed):
    _, routing = model_lib.apply(
        params,
        config,
        tokens,
        valid_BxT=valid,
        routed_experts_BxTxLxK=routed,
        return_routing=True,
    )
    return routing


def forward_experts(params, config, out, routed=None):
    """The experts [B, T, L, K] a training forward over the rollout's rows runs."""
    return np.asarray(_routing(params, config, out.tokens_BxT, out.valid_BxT, routed)[1])


def with_prompt_routing(params, config, out):
    """The rollout's record with its prompt columns filled by the behaviour policy's own
    routing (the engines leave them -1: the trainer routes them freshly)."""
    recorded = np.asarray(out.experts_BxTxLxK)
    prompt = (recorded[..., 0, 0] < 0) & np.asarray(out.valid_BxT)
    own = forward_experts(params, config, out)
    return jnp.asarray(np.where(prompt[..., None, None], own, recorded))


@functools.partial(jax.jit, static_argnums=(1, 5))
def _sequence_logp(params, config, tokens, valid, routed, router=False):
    return logprobs.sequence_logp(
        params, config, tokens, valid, routed_experts_BxTxLxK=routed, router=router
    )


def logp(params, config, out, routed=None):
    return np.asarray(_sequence_logp(params, config, out.tokens_BxT, out.valid_BxT, routed)[0])


def test_a_replayed_forward_runs_the_recorded_experts_whatever_the_router():
    config = tiny_moe.config(2)
    params = tiny_moe.params(config, expert_scale=4.0)
    out = rollout(params, config)
    recorded = np.asarray(out.experts_BxTxLxK)
    at = recorded >= 0
    assert at[..., 0, 0].sum() >= 30
    moved = perturbed(params, config, 1.0)
    fresh = forward_experts(moved, config, out)
    replayed = forward_experts(moved, config, out, out.experts_BxTxLxK)
    np.testing.assert_array_equal(replayed[at], recorded[at])
    # The prompt tokens (before any replayed token: causal) route as the fresh forward's.
    width = TOKENS.shape[1]
    prompt = np.asarray(out.valid_BxT)[:, :width]
    assert not at[:, :width].any()
    np.testing.assert_array_equal(replayed[:, :width][prompt], fresh[:, :width][prompt])
    assert (fresh[at] != recorded[at]).mean() > 0.2  # the perturbation moved the routing
    # The agreement counts the replayed token-layer pairs whose own top-K set is recorded.
    _, _, sums = _sequence_logp(
        moved, config, out.tokens_BxT, out.valid_BxT, out.experts_BxTxLxK, True
    )
    # The router's own choice inside the replayed forward (numpy's top 2 of its logits).
    logits_LxBxTxX, _ = _routing(moved, config, out.tokens_BxT, out.valid_BxT, out.experts_BxTxLxK)
    own = np.argsort(-np.moveaxis(np.asarray(logits_LxBxTxX), 0, 2), axis=-1)[..., :2]
    same = np.all(np.sort(own, -1) == np.sort(recorded, -1), -1)[at[..., 0]]
    assert float(sums.replayed) == at[..., 0].sum()
    assert float(sums.agreed) == same.sum() < same.size


def test_with_one_expert_per_token_replay_gives_the_behaviour_log_probs_after_a_router_update():
    """K = 1 with renormalised gates: the one expert's gate is 1 whatever the router, so a
    replayed forward is the behaviour policy's exactly; without replay the moved router
    sends tokens elsewhere and the ratio is far from 1."""
    config = tiny_moe.config(1)
    params = tiny_moe.params(config, expert_scale=4.0)
    out = rollout(params, config)
    mask = np.asarray(out.completion_mask_BxT)
    behav = np.asarray(out.behav_logp_BxT)
    moved = perturbed(params, config, 1.0)
    routed = with_prompt_routing(params, config, out)
    replayed = logp(moved, config, out, routed) - behav
    fresh = logp(moved, config, out) - behav
    # float32 cached decode against one uncached forward: measured <= 1e-6
    assert np.abs(replayed[mask]).max() < 1e-5
    assert np.abs(fresh[mask]).mean() > 0.05  # measured 0.088
    moved_experts = forward_experts(moved, config, out)[mask]
    assert (moved_experts != np.asarray(routed)[mask]).mean() > 0.3


def test_with_two_experts_per_token_replay_cuts_the_log_ratio():
    """K = 2: the replayed gates follow the moved router (R3), so replay removes only the
    part of the gap from tokens routed elsewhere. Measured on this model (routers x3,
    experts x6) with a 0.3-std router move, the engines' record only (prompts routed
    freshly): mean |log ratio| 0.0131 with replay against 0.0491 without (3.7x; 2.5x at a
    0.1-std move, 2.8x at 1 std)."""
    config = tiny_moe.config(2)
    params = tiny_moe.params(config, router_scale=3.0, expert_scale=6.0)
    out = rollout(params, config)
    mask = np.asarray(out.completion_mask_BxT)
    behav = np.asarray(out.behav_logp_BxT)
    moved = perturbed(params, config, 0.3)
    replayed = np.abs(logp(moved, config, out, out.experts_BxTxLxK) - behav)[mask].mean()
    fresh = np.abs(logp(moved, config, out) - behav)[mask].mean()
    assert fresh > 3 * replayed


def test_the_shared_prompt_pass_replays_and_sums_routing_as_whole_rows_do():
    """`shared_prompt_logp` (each prompt once, completions against it; whole or in length
    blocks) against `sequence_logp` over whole rows: the same log-probs on completion
    tokens and the same routing sums (a prompt counts once per row sharing it)."""
    config = tiny_moe.config(2)
    params = tiny_moe.params(config, router_scale=3.0, expert_scale=4.0)
    groups, n, width, new = 2, 4, 5, 8
    rng = np.random.default_rng(0)
    prompts = np.repeat(rng.integers(1, 60, (groups, width)), n, 0)
    tokens = np.concatenate([prompts, rng.integers(1, 60, (groups * n, new))], 1)
    valid = np.ones(tokens.shape, bool)
    valid[:n, :2] = False  # the first group's prompt is left-padded
    valid[:, width:] = np.arange(new)[None] < rng.integers(1, new + 1, groups * n)[:, None]
    tokens, valid = jnp.asarray(np.where(valid, tokens, 0)), jnp.asarray(valid)
    moved = perturbed(params, config, 0.5)
    _, recorded = _routing(moved, config, tokens, valid, None)
    recorded = jnp.where(valid[..., None, None], recorded, -1).at[:, :width].set(-1)
    whole = _sequence_logp(params, config, tokens, valid, recorded, True)
    completion = np.asarray(valid)[:, width:]
    for blocks in (1, 8):
        shared = jax.jit(
            functools.partial(
                logprobs.shared_prompt_logp,
                config=config,
                prompt_len=width,
                group_size=n,
                length_blocks=blocks,
                router=True,
            )
        )(params, tokens_BxT=tokens, valid_BxT=valid, routed_experts_BxTxLxK=recorded)
        got, want = np.asarray(shared[0])[:, width:], np.asarray(whole[0])[:, width:]
        # float32 sums of <= 48 products, in other orders: measured <= 5e-7
        np.testing.assert_allclose(got[completion], want[completion], atol=1e-5)
        for name, a, b in zip(moe.RoutingSums._fields, shared[2], whole[2], strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, err_msg=name)
        assert float(shared[2].replayed) == completion.sum() * config.num_layers


def _actor(**changes):
    c = arith.get_config("m2po").to_dict()
    c["actor"].update({"ppo_n_minibatches": 1, **changes})
    return ActorSettings.build(config_lib.from_configdict(c).actor)


def _train_batch(params, config, out):
    tokens, valid = out.tokens_BxT, out.valid_BxT
    rows = tokens.shape[0]
    return TrainBatch(
        tokens_BxT=tokens,
        valid_BxT=valid,
        behav_logp_BxT=out.behav_logp_BxT,
        loss_mask_BxT=out.completion_mask_BxT,
        rewards_B=jnp.arange(rows, dtype=jnp.float32) % 2,
        version_B=jnp.zeros(rows, jnp.int32),
        version_BxT=jnp.zeros(tokens.shape, jnp.int32),
        routed_experts_BxTxLxK=out.experts_BxTxLxK,
    )


def test_the_load_balancing_loss_adds_its_weight_times_the_reference_and_its_gradient():
    """The loss pass's loss with coefficient c minus with 0 is c x
    `moe.load_balancing_loss` of a separate forward's router logits over the valid tokens,
    and so are the gradients (`jax.grad` of that reference)."""
    config = tiny_moe.config(2)
    params = tiny_moe.params(config, router_scale=3.0, expert_scale=4.0)
    batch = _train_batch(params, config, rollout(params, config, new=6))
    coef = 0.05
    tx, _ = optim.make_optimizer(_actor().section.optimizer, 1)

    mask = batch.loss_mask_BxT
    mb = Minibatch(
        advantages_BxT=jnp.where(mask, 1.0, 0.0),
        behav_BxT=batch.behav_logp_BxT,
        loss_mask_BxT=mask,
        mask_BxT=mask,
        prox_BxT=batch.behav_logp_BxT,
        tokens_BxT=batch.tokens_BxT,
        valid_BxT=batch.valid_BxT,
        version_B=batch.version_B,
        version_BxT=batch.version_BxT,
        routed_experts_BxTxLxK=batch.routed_experts_BxTxLxK,
    )

    def loss_fn(p, c):
        actor = dataclasses.replace(_actor(), router_aux_loss_coef=c)
        plan = step_lib.batch_plan(batch, config, actor, None, None, True)
        s = step_lib.UpdateSettings(
            model_config=config,
            actor=actor,
            tx=tx,
            plan=plan,
            layout=None,
            version=0,
            loss=actor.loss,
            with_entropy=True,
        )
        loss, _ = step_lib.minibatch_loss(p, mb, jnp.sum(mask), 1.0, s)
        return loss

    def reference(p):
        _, state = model_lib.CausalLM(config).apply(
            {"params": p},
            batch.tokens_BxT,
            None,
            batch.valid_BxT,
            routed_experts_BxTxLxK=batch.routed_experts_BxTxLxK,
            mutable=["intermediates"],
        )
        logits = model_lib.router_logits(state["intermediates"], config)
        return moe.load_balancing_loss(logits, 2, batch.valid_BxT)

    both = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, coef) - loss_fn(p, 0.0)))
    gap, grads = both(params)
    want, want_grads = jax.jit(jax.value_and_grad(reference))(params)
    assert float(want) > 2.0  # not the uniform value K: the routing is uneven
    np.testing.assert_allclose(float(gap), coef * float(want), rtol=1e-4)
    flat, flat_want = jax.tree.leaves(grads), jax.tree.leaves(want_grads)
    for g, w in zip(flat, flat_want, strict=True):
        np.testing.assert_allclose(np.asarray(g), coef * np.asarray(w), atol=2e-6, rtol=1e-3)
    router = grads["layers_0"]["mlp"]["router_kernel"]
    assert float(jnp.abs(router).max()) > 1e-4  # the loss reaches the router


def test_route_replays_recorded_rows_with_the_current_routers_gates():
    """A recorded row keeps its experts, weighted by the current softmax there
    (renormalised); a -1 row routes as without a record."""
    logits = np.log(np.array([[1.0, 4.0, 2.0, 3.0], [1.0, 4.0, 2.0, 3.0]], np.float32))
    recorded = np.array([[0, 2], [-1, -1]], np.int32)
    weights, experts = moe.route(logits, 2, True, recorded_NxK=recorded)
    np.testing.assert_array_equal(np.asarray(experts), [[0, 2], [1, 3]])
    np.testing.assert_allclose(np.asarray(weights), [[1 / 3, 2 / 3], [4 / 7, 3 / 7]], rtol=1e-6)
    weights, _ = moe.route(logits, 2, False, recorded_NxK=recorded)
    np.testing.assert_allclose(np.asarray(weights), [[0.1, 0.2], [0.4, 0.3]], rtol=1e-6)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"actor.router_replay": "rollout"}, "router_replay=rollout: llama is a dense model"),
        ({"actor.router_replay": "always"}, "actor.router_replay"),
        ({"model.router_aux_loss_coef": -0.1}, "model.router_aux_loss_coef"),
    ],
)
def test_config_refuses_replay_on_a_dense_model_and_bad_values(changes, match):
    c = arith.get_config("m2po")
    for key, value in changes.items():
        section, field = key.split(".")
        c[section][field] = value
    with pytest.raises(config_lib.ConfigError, match=match):
        config_lib.from_configdict(c)
