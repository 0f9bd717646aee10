"""The RL optimizer (`m2po_jax.learner.optim`): the learning-rate schedules by hand, and AdamW with
global-norm clipping against an explicit optax chain."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from m2po_jax.config import OptimizerSection
from m2po_jax.learner import optim

LR = 0.01


def _opt(**changes) -> OptimizerSection:
    fields = dict(
        lr=LR,
        weight_decay=0.0,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        gradient_clipping=1.0,
        lr_scheduler_type="constant",
        warmup_steps_proportion=0.0,
        min_lr_ratio=0.0,
    )
    fields.update(changes)
    return OptimizerSection(**fields)


def _by_hand(kind: str, t: int, total: int, proportion: float, ratio: float) -> float:
    """The schedule written out: warm-up steps = proportion x total, lr rising linearly
    from 0 to the peak over them; then the decay over the remaining steps towards
    peak x min_lr_ratio, held there once the steps are done."""
    peak, low = LR, LR * ratio
    warmup = int(proportion * total)  # truncated (AReaL: int(proportion * total_train_steps))
    if t < warmup:
        return peak * t / warmup
    decay = total - warmup
    s = min(t - warmup, decay)
    if kind == "constant":
        return peak
    if kind == "linear":
        return peak - (peak - low) * s / decay
    return low + (peak - low) * 0.5 * (1.0 + math.cos(math.pi * s / decay))


# (total updates, warm-up proportion, min_lr_ratio): 20 x 0.25 = 5 warm-up steps, 15 decay.
# 10 x 0.35 = 3.5: 3 warm-up steps (rounding would give 4).
SETTINGS = [(20, 0.0, 0.0), (20, 0.25, 0.0), (20, 0.25, 0.1), (10, 0.0, 0.3), (10, 0.35, 0.1)]


@pytest.mark.parametrize("kind", optim.LR_SCHEDULER_TYPES)
@pytest.mark.parametrize("total, proportion, ratio", SETTINGS)
def test_schedule_matches_the_formula_at_every_step(kind, total, proportion, ratio):
    schedule = optim.make_schedule(
        _opt(lr_scheduler_type=kind, warmup_steps_proportion=proportion, min_lr_ratio=ratio),
        total,
    )
    got = [float(schedule(t)) for t in range(total + 3)]  # past the end: the final value
    want = [_by_hand(kind, t, total, proportion, ratio) for t in range(total + 3)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


def test_schedule_landmarks_by_hand():
    """The same schedules at their landmarks, as plain numbers (lr 0.01, 20 updates)."""
    kw = dict(warmup_steps_proportion=0.25, min_lr_ratio=0.1)

    def at(kind, t):
        return float(optim.make_schedule(_opt(lr_scheduler_type=kind, **kw), 20)(t))

    for kind in optim.LR_SCHEDULER_TYPES:
        # Warm-up: 5 steps from 0 to the peak.
        assert at(kind, 0) == 0.0
        assert at(kind, 2) == pytest.approx(0.004, rel=1e-6)
        assert at(kind, 5) == pytest.approx(0.01, rel=1e-6)
    assert at("constant", 20) == pytest.approx(0.01, rel=1e-6)
    # Linear: peak 0.01 to 0.001 over 15 steps; halfway (step 12.5) is 0.0055.
    assert at("linear", 8) == pytest.approx(0.01 - 0.009 * 3 / 15, rel=1e-5)
    assert at("linear", 20) == pytest.approx(0.001, rel=1e-5)  # lr x min_lr_ratio, not 0
    assert at("linear", 25) == pytest.approx(0.001, rel=1e-5)
    # Cosine: 0.001 + 0.009 x 0.5 (1 + cos(pi s / 15)); s = 7.5 would be the midpoint.
    assert at("cosine", 10) == pytest.approx(0.001 + 0.009 * 0.5 * (1 + math.cos(math.pi / 3)))
    assert at("cosine", 20) == pytest.approx(0.001, rel=1e-5)
    # min_lr_ratio 0: both decays end at 0.
    for kind in ("linear", "cosine"):
        end = optim.make_schedule(_opt(lr_scheduler_type=kind), 20)(20)
        assert float(end) == pytest.approx(0.0, abs=1e-12)


def test_schedule_refuses_an_unknown_type():
    with pytest.raises(ValueError, match="lr_scheduler_type='step'"):
        optim.make_schedule(_opt(lr_scheduler_type="step"), 10)


def _hand_schedule(t):
    """Linear warm-up over 2 of 8 updates to 0.01, then linear decay to 0.001 (the
    settings of `OPT` below), written without optax."""
    t = jnp.asarray(t, jnp.float32)
    warm = LR * t / 2
    decay = LR - (LR - 0.001) * jnp.minimum(t - 2, 6) / 6
    return jnp.where(t < 2, warm, decay)


OPT = dict(
    weight_decay=0.1,
    beta1=0.8,
    beta2=0.95,
    eps=1e-6,
    lr_scheduler_type="linear",
    warmup_steps_proportion=0.25,
    min_lr_ratio=0.1,
)
TOTAL = 8


def _params():
    return {"w": jnp.array([[0.5, -1.0], [2.0, 0.25]]), "b": jnp.array([0.1, -0.3, 0.7])}


def _grads(step):
    """Gradients whose global norm is far above the clip (1.0) and differs per step, so
    clipping changes Adam's updates (Adam alone is nearly invariant to one common scale)."""
    rng = np.random.default_rng(step)
    scale = [3.0, 40.0, 7.0, 200.0, 12.0, 5.0][step]
    return {
        "w": jnp.asarray(rng.normal(0, 1, (2, 2)) * scale, jnp.float32),
        "b": jnp.asarray(rng.normal(0, 1, (3,)) * scale, jnp.float32),
    }


def _run(tx, steps=6):
    params = _params()
    state = tx.init(params)

    @jax.jit
    def update(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for step in range(steps):
        grads = _grads(step)
        assert float(optax.tree.norm(grads)) > 2.0
        params, state = update(grads, state, params)
    return params


def _reference(clip):
    adamw = optax.adamw(
        _hand_schedule, b1=OPT["beta1"], b2=OPT["beta2"], eps=OPT["eps"], weight_decay=0.1
    )
    return optax.chain(optax.clip_by_global_norm(clip), adamw) if clip else adamw


def _assert_trees_close(got, want, atol=1e-6):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=atol)


def _max_diff(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_optimizer_is_adamw_after_global_norm_clipping():
    tx, schedule = optim.make_optimizer(_opt(gradient_clipping=1.0, **OPT), TOTAL)
    np.testing.assert_allclose(
        [float(schedule(t)) for t in range(TOTAL)], [float(_hand_schedule(t)) for t in range(TOTAL)],
        rtol=1e-6,
    )  # fmt: skip
    got = _run(tx)
    _assert_trees_close(got, _run(_reference(1.0)))
    # The comparison has power: without the clip the params end elsewhere.
    assert _max_diff(got, _run(_reference(0.0))) > 1e-3
    # The train step's re-export is the same builder.
    assert optim.make_optimizer is optim.make_optimizer


def test_gradient_clipping_zero_means_no_clip():
    tx, _ = optim.make_optimizer(_opt(gradient_clipping=0.0, **OPT), TOTAL)
    got = _run(tx)
    _assert_trees_close(got, _run(_reference(0.0)))
    assert _max_diff(got, _run(_reference(1.0))) > 1e-3
