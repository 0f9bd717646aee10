"""The pure train step: non-finite guard, M2PO statistics, variants, no recompiles."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from m2po_jax import config as config_lib
from m2po_jax.algorithm import advantages as adv_lib
from m2po_jax.algorithm import diagnostics, losses, masking, masking_stats
from m2po_jax.common.types import TrainBatch
from m2po_jax.configs import arith
from m2po_jax.learner import logprobs, optim
from m2po_jax.learner import train_step as step_lib
from m2po_jax.learner.actor_settings import ActorSettings
from m2po_jax.learner.step_plan import plan_step
from m2po_jax.models import model as model_lib
from m2po_jax.models import model_config as model_config_lib
from m2po_jax.parallel import placement as placement_lib

MODEL = model_config_lib.ModelConfig(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
)


def actor(preset="m2po", reward_norm=None, **changes):
    c = arith.get_config(preset).to_dict()
    c["actor"].update({"ppo_n_minibatches": 2, **changes})
    c["actor"]["reward_norm"].update(reward_norm or {})
    c["actor"]["optimizer"]["lr"] = 1e-3
    return config_lib.from_configdict(c).actor


# Jitted once per batch shape: the eager version dispatches every op on its own.
_sequence_logp = jax.jit(lambda p, t, v: logprobs.sequence_logp(p, MODEL, t, v, 1.0))


def batch(params, off_policy=True, rows=8, prompt=3, new=4, seed=0, lengths=None):
    """`lengths`: each row's completion length (default `new`); padding after it."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, MODEL.vocab_size, (rows, prompt + new)).astype(np.int32)
    lengths = np.full(rows, new) if lengths is None else np.asarray(lengths)
    valid = np.arange(prompt + new)[None, :] < prompt + lengths[:, None]
    tokens = np.where(valid, tokens, 0)
    loss_mask = valid.copy()
    loss_mask[:, :prompt] = False
    prox, _ = _sequence_logp(params, jnp.asarray(tokens), jnp.asarray(valid))
    behav = np.asarray(prox) * loss_mask
    if off_policy:
        behav = behav + rng.normal(0, 0.5, behav.shape).astype(np.float32) * loss_mask
    return TrainBatch(
        tokens_BxT=jnp.asarray(tokens),
        valid_BxT=jnp.asarray(valid),
        behav_logp_BxT=jnp.asarray(behav, jnp.float32),
        loss_mask_BxT=jnp.asarray(loss_mask),
        rewards_B=jnp.asarray(rng.integers(0, 2, rows), jnp.float32),
        version_B=jnp.zeros(rows, jnp.int32),
        version_BxT=jnp.zeros(tokens.shape, jnp.int32),
    )


def setup(a):
    tx, schedule = optim.make_optimizer(a.optimizer, 10)
    params = model_lib.init_params(MODEL, jax.random.key(0))
    # The step donates its state: keep `params` alive for building batches.
    state = step_lib.init_train_state(jax.tree.map(jnp.copy, params), tx)
    step = step_lib.make_train_step(MODEL, a, tx, schedule)
    return params, state, step


def test_non_finite_step_leaves_params_unchanged_and_is_counted():
    params, state, step = setup(actor())
    b = batch(params)
    before = jax.tree.map(np.asarray, state.params)
    bad = b.replace(rewards_B=b.rewards_B.at[0].set(jnp.nan))
    state, metrics = step(state, bad, jax.random.key(0), None)
    assert int(metrics["train/nonfinite"]) == 1
    assert int(state.nonfinite_steps) == 1 and int(state.step) == 1
    for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(x, y)
    state, metrics = step(state, b, jax.random.key(1), None)
    assert int(metrics["train/nonfinite"]) == 0 and int(state.nonfinite_steps) == 0
    moved = [
        np.abs(np.asarray(x) - y).max()
        for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(before), strict=True)
    ]
    assert max(moved) > 1e-4


@jax.custom_vjp
def _nan_gradient(x):
    """The identity, whose gradient is NaN."""
    return x


_nan_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.full_like(g, jnp.nan),))


def _copy(tree):
    return jax.tree.map(np.array, tree)


def _assert_trees_equal(x, y, atol=0.0):
    for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=0, atol=atol)


def test_finite_loss_with_a_non_finite_gradient_is_skipped(monkeypatch):
    # The real step, whose policy loss keeps its value but has a NaN gradient.
    policy_loss = losses.policy_loss_with

    def nan_gradient_loss(*args, **kwargs):
        loss, stats = policy_loss(*args, **kwargs)
        return _nan_gradient(loss), stats

    monkeypatch.setattr(losses, "policy_loss_with", nan_gradient_loss)
    # One minibatch: its loss is finite whatever the guard did with its update.
    params, state, step = setup(actor(ppo_n_minibatches=1))
    before = _copy(state)
    state, metrics = step(state, batch(params), jax.random.key(0), None)
    assert np.isfinite(float(metrics["actor/loss"]))  # the loss is finite ...
    assert not np.isfinite(float(metrics["grad_norm"]))  # ... its gradient is not
    assert int(metrics["train/nonfinite"]) == 1
    assert int(state.nonfinite_steps) == 1 and int(state.step) == 1
    _assert_trees_equal(state.params, before.params)
    _assert_trees_equal(state.opt_state, before.opt_state)


def test_a_non_finite_minibatch_is_skipped_and_the_others_apply():
    """ppo_updates: a non-finite minibatch leaves params and optimizer state untouched,
    the step's other minibatches still apply. Reference: the step of one minibatch on
    the finite minibatch's rows alone (advantages and M2PO mask are per row here)."""
    per_row = {"reward_norm": {"mean_level": None, "std_level": None}, "m2po_scope": "row"}
    a = actor(**per_row)
    params, _, step = setup(a)
    _, ref_state, ref_step = setup(actor(ppo_n_minibatches=1, **per_row))
    initial = _copy(ref_state)
    b = batch(params, seed=4)
    b = b.replace(rewards_B=jnp.asarray([1.0, -0.5, 2.0, -1.0, 0.5, -2.0, 1.5, -1.5]))
    rows = b.tokens_BxT.shape[0]
    key = jax.random.key(2)
    perm = np.asarray(jax.random.permutation(key, rows)).reshape(2, rows // 2)
    for bad, good in ((0, 1), (1, 0)):
        poisoned = b.replace(rewards_B=b.rewards_B.at[perm[bad][0]].set(jnp.nan))
        state, metrics = step(jax.tree.map(jnp.asarray, initial), poisoned, key, None)
        assert int(metrics["train/nonfinite"]) == 1 and int(state.nonfinite_steps) == 1
        alone = jax.tree.map(lambda x, rows=perm[good]: x[rows], b)  # the finite minibatch
        ref, ref_metrics = ref_step(jax.tree.map(jnp.asarray, initial), alone, key, None)
        assert int(ref_metrics["train/nonfinite"]) == 0
        _assert_trees_equal(state.params, ref.params, atol=1e-5)
        _assert_trees_equal(state.opt_state, ref.opt_state, atol=1e-5)
        moved = [
            np.abs(np.asarray(x) - y).max()
            for x, y in zip(
                jax.tree.leaves(state.params), jax.tree.leaves(initial.params), strict=True
            )
        ]
        assert max(moved) > 1e-4  # the finite minibatch did train


def test_m2po_masks_off_policy_tokens_and_reports_the_second_moment():
    params, state, step = setup(actor())
    b = batch(params)
    _, metrics = step(state, b, jax.random.key(0), None)
    prox, _ = _sequence_logp(params, b.tokens_BxT, b.valid_BxT)
    mask = np.asarray(b.loss_mask_BxT)
    m2 = (np.asarray(b.behav_logp_BxT) - np.asarray(prox)) ** 2
    np.testing.assert_allclose(metrics["m2po/m2_before"], m2[mask].mean(), rtol=1e-4)
    assert float(metrics["m2po/masked_fraction"]) > 0
    assert float(metrics["m2po/m2_after"]) < 0.04


def test_on_policy_batch_masks_nothing():
    params, state, step = setup(actor())
    _, metrics = step(state, batch(params, off_policy=False), jax.random.key(0), None)
    assert float(metrics["m2po/masked_fraction"]) == 0
    assert float(metrics["m2po/m2_before"]) < 1e-10


def test_m2po_off_still_reports_the_second_moment():
    params, state, step = setup(actor("stale_grpo"))
    _, metrics = step(state, batch(params), jax.random.key(0), None)
    assert float(metrics["m2po/masked_fraction"]) == 0
    assert float(metrics["m2po/m2_before"]) == pytest.approx(float(metrics["m2po/m2_after"]))
    assert float(metrics["m2po/m2_before"]) > 0.1


@pytest.mark.parametrize("preset", ["paper", "authors"])
def test_published_variants_train(preset):
    params, state, step = setup(actor(preset))
    state, metrics = step(state, batch(params), jax.random.key(0), None)
    assert int(metrics["train/nonfinite"]) == 0
    if preset == "authors":
        low, high = float(metrics["m2po/clip_bound_low"]), float(metrics["m2po/clip_bound_high"])
        assert 0 < low < 1 < high
        np.testing.assert_allclose(low * high, 1.0, rtol=1e-5)  # [e^-t, e^t]
    else:
        assert float(metrics["m2po/masked_fraction"]) > 0


def test_same_shapes_do_not_recompile_and_the_state_is_donated():
    # The trainer's own construction: make_train_step with the placement's shardings,
    # its layout, and the state donated.
    a = actor()
    tx, schedule = optim.make_optimizer(a.optimizer, 10)
    params = model_lib.init_params(MODEL, jax.random.key(0))
    place = placement_lib.Placement.from_shape({"data": 2, "fsdp": 1, "tensor": 1}, MODEL)
    init = functools.partial(step_lib.init_train_state, tx=tx)
    shapes = jax.eval_shape(init, params)
    state = jax.jit(init, out_shardings=place.state_shardings(shapes))(place.put_params(params))
    step = step_lib.make_train_step(
        MODEL,
        a,
        tx,
        schedule,
        jit_kwargs=place.train_step_shardings(state, with_ref=False),
        layout=place.layout,
    )
    for seed in range(3):
        before = state
        state, metrics = step(
            state, place.to_global(batch(params, seed=seed)), jax.random.key(seed), None
        )
        assert int(metrics["train/nonfinite"]) == 0
        assert all(x.is_deleted() for x in jax.tree.leaves(before.params))  # donated
        assert state.params["embedding"].sharding.mesh.shape == place.mesh.shape
    assert step._cache_size() == 1  # one compiled program for three batches


def _mb_actor(preset="m2po", n_mbs=1, max_tokens=0, **changes):
    c = arith.get_config(preset).to_dict()
    c["actor"].update(ppo_n_minibatches=2, logp_chunk_size=5, **changes)
    c["actor"]["mb_spec"] = {"n_mbs": n_mbs, "max_tokens_per_mb": max_tokens}
    c["actor"]["optimizer"]["lr"] = 1e-3
    return config_lib.from_configdict(c).actor


def _two_steps(a, seed=0):
    params, state, step = setup(a)
    metrics = []
    for i in range(2):
        state, m = step(state, batch(params, seed=seed + i), jax.random.key(i), None)
        metrics.append(m)
    return state, metrics


def _assert_same_params(x, y, atol=1e-5):
    for a, b in zip(jax.tree.leaves(x.params), jax.tree.leaves(y.params), strict=True):
        np.testing.assert_allclose(a, b, atol=atol)


@pytest.mark.parametrize(
    "preset,mb_spec",
    [
        ("m2po", {"n_mbs": 2}),
        ("m2po", {"n_mbs": 4}),
        ("m2po", {"max_tokens": 14}),  # 4 rows x 7 tokens per minibatch -> 2 micro-batches
        ("paper", {"n_mbs": 2}),  # per-minibatch mask from the current policy
        ("authors", {"n_mbs": 2}),
        ("stale_grpo", {"n_mbs": 4}),
    ],
)
def test_micro_batched_step_equals_unsplit_step(preset, mb_spec):
    whole, whole_metrics = _two_steps(_mb_actor(preset))
    split, split_metrics = _two_steps(_mb_actor(preset, **mb_spec))
    _assert_same_params(whole, split)
    for name in ("actor/loss", "m2po/masked_fraction", "actor/kept_tokens", "actor/approx_kl"):
        if name in whole_metrics[1]:
            np.testing.assert_allclose(split_metrics[1][name], whole_metrics[1][name], atol=1e-5)
    initial = setup(_mb_actor(preset))[0]
    moved = [
        float(jnp.abs(x - y).max())
        for x, y in zip(jax.tree.leaves(whole.params), jax.tree.leaves(initial), strict=True)
    ]
    assert max(moved) > 1e-4  # the steps did train


def test_microbatch_scope_with_one_micro_batch_is_the_minibatch_scope():
    one, _ = _two_steps(_mb_actor(m2po_scope="microbatch"))
    minibatch, _ = _two_steps(_mb_actor(m2po_scope="minibatch"))
    _assert_same_params(one, minibatch)


def test_microbatch_scope_masks_and_weights_each_micro_batch_like_areal():
    """Reference: one unsplit loss over each minibatch in which micro-batch i (rows i, i+n,
    ...) has its own M2PO mask and denominator, weighted by its share of valid tokens.
    Completions of unequal lengths make those shares unequal (1 / n_micro would not do)."""
    n_micro = 2
    a = _mb_actor(m2po_scope="microbatch", n_mbs=n_micro)
    params, state, step = setup(a)
    b = batch(params, seed=7, lengths=[4, 4, 3, 4, 1, 2, 2, 1])
    new_state, metrics = step(state, b, jax.random.key(3), None)

    tx, _ = optim.make_optimizer(a.optimizer, 10)
    prox, _ = _sequence_logp(params, b.tokens_BxT, b.valid_BxT)
    settings = ActorSettings.build(a)
    adv = adv_lib.token_advantages(settings.advantages, b.rewards_B, b.loss_mask_BxT)
    rows = b.tokens_BxT.shape[0]
    perm = np.asarray(jax.random.permutation(jax.random.key(3), rows))
    ref_params, opt_state = params, tx.init(params)
    masked = 0
    for mb_rows in perm.reshape(2, rows // 2):
        parts = [mb_rows[i::n_micro] for i in range(n_micro)]
        shares = [int(jnp.sum(b.loss_mask_BxT[part])) for part in parts]
        assert shares[0] != shares[1]  # micro-batches weigh differently
        masks = []
        for part in parts:
            masks.append(
                masking.m2po_mask(b.behav_logp_BxT[part], prox[part], b.loss_mask_BxT[part], 0.04)
            )
            masked += int(jnp.sum(b.loss_mask_BxT[part] & ~masks[-1]))

        def loss(p, mb_rows=mb_rows, parts=parts, masks=masks):
            logits = model_lib.apply(
                p, MODEL, b.tokens_BxT[mb_rows], valid_BxT=b.valid_BxT[mb_rows]
            )
            logp = model_lib.token_logp(logits, b.tokens_BxT[mb_rows])
            index = {int(r): j for j, r in enumerate(mb_rows)}
            n_valid = jnp.sum(b.loss_mask_BxT[mb_rows])
            total = 0.0
            for part, mask in zip(parts, masks, strict=True):
                local = np.array([index[int(r)] for r in part])
                part_loss, _ = losses.policy_loss(
                    logp[local],
                    prox[part],
                    b.behav_logp_BxT[part],
                    adv[part],
                    mask,
                    eps_clip=a.eps_clip,
                    rejection_sampling=settings.loss.rejection_sampling,
                )
                total = total + part_loss * jnp.sum(b.loss_mask_BxT[part]) / n_valid
            return total

        grads = jax.jit(jax.grad(loss))(ref_params)  # eager autodiff: minutes
        updates, opt_state = tx.update(grads, opt_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
    assert masked > 0 and int(metrics["m2po/masked_tokens"]) == masked
    for x, y in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)


# ----------------------------------------------------------------------------- M2PO statistics


def _ref_kept(m2, valid, tau):
    """docs/algorithm.md on one set: the longest ascending prefix with mean < tau (>= 1)."""
    idx = np.flatnonzero(valid)
    kept = np.zeros(m2.size, bool)
    if idx.size:
        order = idx[np.argsort(m2.ravel()[idx], kind="stable")]
        means = np.cumsum(m2.ravel()[order]) / np.arange(1, idx.size + 1)
        kept[order[: max([k + 1 for k in range(idx.size) if means[k] < tau], default=1)]] = True
    return kept.reshape(m2.shape)


@pytest.mark.parametrize("n_mbs", [1, 2])  # mask in the loss / before the micro-batch split
def test_minibatch_scope_statistics_combine_exactly(n_mbs):
    """masked_tokens is the sum over minibatches, masked_fraction and the m2 means are
    totals over totals, the boundary the largest of the minibatches'."""
    a = _mb_actor(m2po_scope="minibatch", n_mbs=n_mbs)
    params, state, step = setup(a)
    b = batch(params, seed=3)
    _, metrics = step(state, b, jax.random.key(5), None)
    prox, _ = _sequence_logp(params, b.tokens_BxT, b.valid_BxT)
    m2 = np.square(np.asarray(b.behav_logp_BxT, np.float64) - np.asarray(prox, np.float64))
    valid = np.asarray(b.loss_mask_BxT)
    rows = valid.shape[0]
    perm = np.asarray(jax.random.permutation(jax.random.key(5), rows)).reshape(2, rows // 2)
    masks = [valid[r] & _ref_kept(m2[r], valid[r], 0.04) for r in perm]
    boundaries = [m2[r][mask].max() for r, mask in zip(perm, masks, strict=True)]
    assert boundaries[0] != boundaries[1]  # a weighted mean would not be the max
    kept = np.concatenate(masks)
    m2_p, valid_p = m2[perm.ravel()], valid[perm.ravel()]
    masked = int((valid_p & ~kept).sum())
    assert 0 < masked and int(metrics["m2po/masked_tokens"]) == masked
    np.testing.assert_allclose(metrics["m2po/masked_fraction"], masked / valid.sum(), rtol=1e-6)
    np.testing.assert_allclose(metrics["m2po/m2_before"], m2[valid].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["m2po/m2_after"], m2_p[kept].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["m2po/boundary"], max(boundaries), rtol=1e-5)


STAT_KEYS = {
    "m2po/masked_tokens",
    "m2po/masked_fraction",
    "m2po/m2_before",
    "m2po/m2_after",
    "m2po/boundary",
    "m2po/nonfinite_tokens",
}


@pytest.mark.parametrize(
    "preset, changes",
    [
        ("m2po", {}),
        ("m2po", {"m2po_scope": "row"}),
        ("m2po", {"m2po_scope": "microbatch"}),
        ("paper", {}),  # per minibatch: the current policy
        ("authors", {}),  # capped_clip: no mask
        ("stale_grpo", {}),  # M2PO off
    ],
)
def test_every_path_reports_one_statistics_schema(preset, changes):
    """Same keys everywhere; with no mask: m2 of behav vs prox over valid tokens, the
    boundary its largest finite value, non-finite tokens counted and left out."""
    params, state, step = setup(actor(preset, **changes))
    b = batch(params, seed=2)
    b = b.replace(behav_logp_BxT=b.behav_logp_BxT.at[1, -1].set(jnp.nan))
    _, metrics = step(state, b, jax.random.key(0), None)
    keys = {k for k in metrics if k.startswith("m2po/") and not k.startswith("m2po/clip_")}
    assert keys == STAT_KEYS | {k for k in diagnostics.STAT_KEYS if k.startswith("m2po/")}
    assert set(masking_stats.M2PO_STAT_KEYS) == STAT_KEYS
    assert {"offpolicy/ess", "offpolicy/ess_kept"} <= set(metrics)
    assert int(metrics["m2po/nonfinite_tokens"]) == 1
    if preset in ("authors", "stale_grpo"):
        prox, _ = _sequence_logp(params, b.tokens_BxT, b.valid_BxT)
        m2 = np.square(np.asarray(b.behav_logp_BxT) - np.asarray(prox))
        finite = np.asarray(b.loss_mask_BxT) & np.isfinite(m2)
        assert int(metrics["m2po/masked_tokens"]) == 0
        np.testing.assert_allclose(metrics["m2po/m2_before"], m2[finite].mean(), rtol=1e-5)
        np.testing.assert_allclose(metrics["m2po/m2_after"], m2[finite].mean(), rtol=1e-5)
        np.testing.assert_allclose(metrics["m2po/boundary"], m2[finite].max(), rtol=1e-5)
    else:
        assert int(metrics["m2po/masked_tokens"]) >= 1  # the non-finite token at least


# ----------------------------------------------------------------------------- KL penalty


def test_kl_penalty_reaches_the_step_advantages():
    """actor.kl_ctl > 0 with reference params: the step's advantages are
    grpo_token_advantages with the KL of the behaviour log-probs to the reference's."""
    a = actor(kl_ctl=0.5)
    params, state, step = setup(a)
    ref_params = model_lib.init_params(MODEL, jax.random.key(1))
    b = batch(params, seed=5)
    _, metrics = step(state, b, jax.random.key(0), ref_params)
    assert int(metrics["train/nonfinite"]) == 0

    logits = model_lib.apply(ref_params, MODEL, b.tokens_BxT, valid_BxT=b.valid_BxT)
    ref_logp = model_lib.token_logp(logits, b.tokens_BxT, a.temperature)
    mask = b.loss_mask_BxT
    rn = a.reward_norm

    def advantages(kl_ctl):
        return adv_lib.grpo_token_advantages(
            b.rewards_B,
            mask,
            group_size=rn.group_size,
            mean_level=rn.mean_level,
            std_level=rn.std_level,
            mean_leave1out=rn.mean_leave1out,
            std_unbiased=rn.std_unbiased,
            eps=rn.eps,
            kl_ctl=kl_ctl,
            logp_BxT=b.behav_logp_BxT,
            ref_logp_BxT=ref_logp,
            kl_estimator=a.kl_estimator,
        )

    def abs_mean(adv):
        return float(jnp.sum(jnp.abs(adv) * mask) / jnp.sum(mask))

    with_kl, without_kl = advantages(a.kl_ctl), advantages(0.0)
    assert abs(abs_mean(with_kl) - abs_mean(without_kl)) > 0.02
    np.testing.assert_allclose(metrics["train/adv_abs_mean"], abs_mean(with_kl), rtol=1e-5)
    # Token by token, from the step's own `prepare` under the step's plan.
    plan = plan_step(a, *b.tokens_BxT.shape)
    settings = ActorSettings.build(a)
    prepare = functools.partial(step_lib.prepare, model_config=MODEL, actor=settings, plan=plan)
    prep = jax.jit(prepare)(params, b, ref_params)
    np.testing.assert_allclose(prep.advantages_BxT, with_kl, atol=1e-5)
    assert float(jnp.max(jnp.abs(with_kl - without_kl))) > 0.1


def test_the_kept_denominator_divides_by_the_tokens_m2po_keeps():
    """One minibatch in two micro-batches (the global mask is taken before the loss, whose
    denominator the step then counts), the same first step: the per-token losses summed are
    the same for both denominators, so loss * denominator agrees (kept = valid - masked)."""
    losses_times_count = []
    for denominator in ("kept", "valid"):
        a = actor(
            ppo_n_minibatches=1,
            loss_denominator=denominator,
            mb_spec={"n_mbs": 2, "max_tokens_per_mb": 0},
        )
        params, state, step = setup(a)
        b = batch(params)
        _, metrics = step(state, b, jax.random.key(0), None)
        valid = int(np.asarray(b.loss_mask_BxT).sum())
        masked = int(metrics["m2po/masked_tokens"])
        assert 0 < masked < valid
        count = valid - masked if denominator == "kept" else valid
        losses_times_count.append(float(metrics["loss"]) * count)
    np.testing.assert_allclose(*losses_times_count, rtol=1e-5)


# ----------------------------------------------------------------------------- diagnostics


@pytest.mark.parametrize("n_mbs", [1, 2])
def test_masked_share_of_the_loss_and_gradient_is_that_of_the_masked_tokens(n_mbs):
    """One minibatch at the step's own params: r = 1, so each token's loss is -A * rho
    (rho = exp(prox - behav), 0 where the behaviour correction rejects it); the masked
    tokens are the ones `masking.m2po_mask` drops; their gradient is the policy loss over
    them with the kept tokens' denominator."""
    a = actor(ppo_n_minibatches=1, mb_spec={"n_mbs": n_mbs, "max_tokens_per_mb": 0})
    tx, schedule = optim.make_optimizer(a.optimizer, 10)
    params = model_lib.init_params(MODEL, jax.random.key(0))
    state = step_lib.init_train_state(jax.tree.map(jnp.copy, params), tx)
    step = step_lib.make_train_step(MODEL, a, tx, schedule, masked_grad_norm=True)
    b = batch(params, seed=3)
    _, metrics = step(state, b, jax.random.key(0), None)

    settings = ActorSettings.build(a)
    prox, _ = _sequence_logp(params, b.tokens_BxT, b.valid_BxT)
    behav, valid = b.behav_logp_BxT, b.loss_mask_BxT
    adv = adv_lib.token_advantages(settings.advantages, b.rewards_B, valid, behav, None)
    kept = masking.m2po_mask(behav, prox, valid, a.m2_threshold)
    masked = np.asarray(valid & ~kept)
    assert 0 < masked.sum() < np.asarray(valid).sum()
    rho = np.exp(np.asarray(prox) - np.asarray(behav))
    token_loss = np.where(np.asarray(valid) & (rho <= 5.0), -np.asarray(adv) * rho, 0.0)
    share = np.abs(token_loss[masked]).sum() / np.abs(token_loss).sum()
    np.testing.assert_allclose(metrics["m2po/masked_loss_share"], share, rtol=1e-4)

    def loss_over(tokens, p):
        logp, _ = _sequence_logp(p, b.tokens_BxT, b.valid_BxT)
        count = jnp.sum(kept)
        return losses.policy_loss(logp, prox, behav, adv, tokens, count=count)[0]

    g_masked = jax.grad(functools.partial(loss_over, jnp.asarray(masked)))(params)
    g_all = jax.grad(functools.partial(loss_over, valid))(params)
    np.testing.assert_allclose(
        metrics["m2po/masked_grad_norm"], optax.tree.norm(g_masked), rtol=1e-4
    )
    np.testing.assert_allclose(
        metrics["m2po/masked_grad_share"],
        optax.tree.norm(g_masked) / optax.tree.norm(g_all),
        rtol=1e-4,
    )
    g_kept = jax.grad(functools.partial(loss_over, kept))(params)
    np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(g_kept), rtol=1e-4)


# ----------------------------------------------------------------------- rollout correction


def test_the_step_weighs_the_loss_by_actor_rollout_correction():
    """One minibatch at the step's own params (r = 1), M2PO off (a smaller program): the
    step's loss and truncation count are the library's under actor.rollout_correction
    (each row's product of rho, truncated at 1.5), which differ from the default's."""
    a = actor(
        ppo_n_minibatches=1,
        m2_threshold=None,
        rollout_correction={"is_level": "sequence", "is_threshold": 1.5},
    )
    params, state, step = setup(a)
    b = batch(params, seed=4)
    _, metrics = step(state, b, jax.random.key(0), None)

    settings = ActorSettings.build(a)
    prox, _ = _sequence_logp(params, b.tokens_BxT, b.valid_BxT)
    behav, valid = b.behav_logp_BxT, b.loss_mask_BxT
    adv = adv_lib.token_advantages(settings.advantages, b.rewards_B, valid, behav, None)

    def reference(loss_settings):
        return losses.policy_loss_with(loss_settings, prox, prox, behav, adv, valid)

    want, stats = reference(settings.loss)
    np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5)
    assert (
        int(metrics["rollout_corr/truncated_tokens"])
        == int(stats["rollout_corr/truncated_tokens"])
        > 0
    )
    # Both fields matter: the threshold cut tokens (above), the default weighs otherwise.
    assert abs(float(want) - float(reference(losses.LossSettings())[0])) > 1e-3
