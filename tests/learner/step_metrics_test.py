"""The train step's metrics: per-part statistics combined by token counts, and the step's
flat dict, by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax.algorithm import diagnostics, masking_stats
from m2po_jax.learner import step_metrics
from m2po_jax.learner import train_step as step_lib
from m2po_jax.learner.step_plan import StepPlan


def test_combine_stats_weights_means_by_tokens():
    weights = jnp.array([1, 3, 0], jnp.int32)  # tokens per part: unequal, one empty part
    stats = {
        "actor/clip_fraction": jnp.array([0.8, 0.0, 0.5]),
        "train/entropy": jnp.array([2.0, 1.0, 9.0]),
        "actor/kept_tokens": jnp.array([1.0, 2.0, 0.0]),
        "actor/importance_weight_min": jnp.array([0.9, 0.7, 1.0]),
        "actor/importance_weight_max": jnp.array([1.1, 1.4, 1.0]),
    }
    out = step_metrics.combine_stats(stats, weights)
    # (1 x 0.8 + 3 x 0) / 4 = 0.2; a plain mean over parts would be 0.433.
    assert float(out["actor/clip_fraction"]) == pytest.approx(0.2)
    assert float(out["train/entropy"]) == pytest.approx((2.0 + 3 * 1.0) / 4)
    assert float(out["actor/kept_tokens"]) == 3.0  # counts add up
    assert float(out["actor/importance_weight_min"]) == pytest.approx(0.7)
    assert float(out["actor/importance_weight_max"]) == pytest.approx(1.4)
    # No tokens at all: zeros, not NaN.
    empty = step_metrics.combine_stats({"x": jnp.array([1.0, 2.0])}, jnp.zeros(2, jnp.int32))
    assert float(empty["x"]) == 0.0


def test_combine_stats_m2po_parts_equal_the_union():
    rng = np.random.default_rng(0)
    m2 = jnp.asarray(rng.uniform(0, 0.2, (2, 6)), jnp.float32)
    valid = jnp.asarray([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]], bool)
    mask = valid & (m2 < 0.12)
    parts = [masking_stats.stat_parts(m2[i], valid[i], valid[i], mask[i]) for i in range(2)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *parts)
    got = masking_stats.finalize_stats(step_metrics.combine_stats(stacked, jnp.array([5, 2])))
    want = masking_stats.finalize_stats(masking_stats.stat_parts(m2, valid, valid, mask))
    for key in masking_stats.M2PO_STAT_KEYS:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=key)


def _plan(n_minibatches):
    return StepPlan(
        n_minibatches=n_minibatches,
        n_micro=1,
        prox_source="pass",
        mask_at="prepare",
        perm_block=1,
        micro_block=1,
        loss_prompt=None,
        approx_metrics=False,
    )


def test_step_metrics_by_hand():
    loss_mask = jnp.array([[0, 1, 1, 1], [0, 1, 0, 0]], bool)  # 4 completion tokens
    adv = jnp.array([[0.0, 1.0, -2.0, 1.0], [0.0, 4.0, 0.0, 0.0]])
    entropy = jnp.array([[9.0, 1.0, 2.0, 3.0], [9.0, 6.0, 9.0, 9.0]])
    behav = jnp.zeros((2, 4))
    prox = jnp.array([[0.0, 0.5, -0.5, 0.0], [0.0, 1.0, 0.0, 0.0]])
    m2 = (behav - prox) ** 2
    prep = step_lib.Prepared(
        behav_BxT=behav,
        prox_BxT=prox,
        advantages_BxT=adv,
        loss_mask_BxT=loss_mask,
        mask_BxT=loss_mask,
        entropy_BxT=entropy,
        eps_clip=0.2,
        eps_clip_higher=None,
        m2_parts={
            **masking_stats.stat_parts(m2, loss_mask, loss_mask, loss_mask),
            **diagnostics.parts(m2, prox - behav, loss_mask, loss_mask),
        },
    )
    # Two minibatches of 1 and 3 valid tokens.
    mb_stats = {
        "loss": jnp.array([1.0, 3.0]),
        "actor/clip_fraction": jnp.array([1.0, 0.0]),
        "actor/kept_tokens": jnp.array([1.0, 3.0]),
        "actor/importance_weight_max": jnp.array([1.5, 1.2]),
        "grad_norm": jnp.array([4.0, 2.0]),
    }
    state = step_lib.TrainState(
        step=jnp.int32(3), params={"w": jnp.array([3.0, 4.0])}, opt_state=None,
        nonfinite_steps=jnp.int32(0),
    )  # fmt: skip
    params = {"w": jnp.array([6.0, 8.0])}
    schedule = lambda t: 0.5 * t  # noqa: E731
    m = step_metrics.step_metrics(
        state, params, prep, mb_stats, jnp.array([1, 3]), jnp.bool_(True), schedule, _plan(2)
    )
    assert float(m["loss"]) == pytest.approx((1 * 1.0 + 3 * 3.0) / 4)  # not (1 + 3) / 2
    assert float(m["actor/loss"]) == float(m["loss"])
    assert float(m["actor/clip_fraction"]) == pytest.approx(0.25)
    assert float(m["actor/kept_tokens"]) == 4.0
    assert float(m["actor/importance_weight_max"]) == pytest.approx(1.5)
    assert float(m["grad_norm"]) == pytest.approx(3.0)
    assert float(m["train/grad_norm_max"]) == pytest.approx(4.0)
    assert float(m["train/lr"]) == pytest.approx(0.5 * 3 * 2)  # updates done: step x minibatches
    assert int(m["train/tokens"]) == 4
    assert float(m["train/adv_abs_mean"]) == pytest.approx((1 + 2 + 1 + 4) / 4)
    assert float(m["train/entropy"]) == pytest.approx((1 + 2 + 3 + 6) / 4)
    assert float(m["train/behav_prox_abs_diff"]) == pytest.approx((0.5 + 0.5 + 1.0) / 4)
    assert float(m["train/param_norm"]) == pytest.approx(10.0)
    assert int(m["m2po/masked_tokens"]) == 0
    assert float(m["m2po/m2_before"]) == pytest.approx((0.25 + 0.25 + 1.0) / 4)
    assert (int(m["train/nonfinite"]), int(m["train/prox_pass"])) == (0, 1)
    w = np.exp([0.5, -0.5, 0.0, 1.0])  # exp(prox - behav) of the 4 valid tokens
    assert float(m["offpolicy/ess"]) == pytest.approx(w.sum() ** 2 / (4 * (w**2).sum()), rel=1e-5)
    assert float(m["m2po/m2_max"]) == pytest.approx(1.0)
