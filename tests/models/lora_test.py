"""LoRA: the adapters on the model, merging them, switching them off, and a train step that
trains them alone (the base bit-identical, optimizer state for the adapters only)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from m2po_jax import config as config_lib
from m2po_jax.common.types import TrainBatch
from m2po_jax.configs import arith
from m2po_jax.learner import optim
from m2po_jax.learner import train_step as step_lib
from m2po_jax.models import lora, model_config
from m2po_jax.models import model as model_lib

CONFIG = model_config.ModelConfig(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
ALL = model_config.LORA_TARGETS
LORA = CONFIG.replace(lora_rank=4, lora_alpha=8.0, lora_targets=ALL)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 61, (3, 12)), jnp.int32)
_apply = jax.jit(model_lib.apply, static_argnums=1)


def _flat(params):
    return traverse_util.flatten_dict(params)


def _random_b(params, seed=1, std=0.2):
    """The adapters with B drawn at random (a fresh adapter's B is zero)."""
    rng = np.random.default_rng(seed)
    flat = {
        path: jnp.asarray(rng.normal(0, std, x.shape), x.dtype)
        if path[-1].endswith("_lora_b")
        else x
        for path, x in _flat(params).items()
    }
    return traverse_util.unflatten_dict(flat)


@pytest.fixture(scope="module")
def adapted():
    base = model_lib.init_params(CONFIG, jax.random.key(0))
    return base, _random_b(model_lib.add_adapters(base, LORA, jax.random.key(2)))


def test_rank_and_targets_make_the_adapters_their_names_say():
    cfg = CONFIG.replace(lora_rank=3, lora_targets=("q", "down"))
    flat = _flat(model_lib.init_params(cfg, jax.random.key(0)))
    adapters = {path: x.shape for path, x in flat.items() if lora.is_adapter(path)}
    e, h, d, f = 32, 4, 8, 48
    want = {}
    for i in range(2):
        want[(f"layers_{i}", "attn", "q_lora_a")] = (e, 3)
        want[(f"layers_{i}", "attn", "q_lora_b")] = (3, h, d)
        want[(f"layers_{i}", "mlp", "down_lora_a")] = (f, 3)
        want[(f"layers_{i}", "mlp", "down_lora_b")] = (3, e)
    assert adapters == want
    assert cfg.lora_params() == sum(int(np.prod(s)) for s in adapters.values())
    for path, x in flat.items():
        if path[-1].endswith("_lora_b"):
            np.testing.assert_array_equal(x, 0.0)  # a new adapter changes nothing
        if lora.is_adapter(path):
            assert x.dtype == jnp.float32
    # The base is the same with or without adapters (one key, one model).
    plain = _flat(model_lib.init_params(CONFIG, jax.random.key(0)))
    assert plain.keys() == {p for p in flat if not lora.is_adapter(p)}
    for path, x in plain.items():
        np.testing.assert_array_equal(flat[path], x, err_msg=str(path))
    with pytest.raises(ValueError, match="lora_targets: expected names among"):
        CONFIG.replace(lora_rank=2, lora_targets=("q", "qkv"))


def test_a_merged_model_is_the_base_plus_scaled_b_a_on_every_target(adapted):
    base, params = adapted
    merged, merged_config = lora.merged(params, LORA)
    assert merged_config == CONFIG and not lora.has_adapters(merged)
    flat, out = _flat(params), _flat(merged)
    scale = 8.0 / 4
    for target in ALL:
        module = "attn" if target in ("q", "k", "v", "o") else "mlp"
        for i in range(2):
            at = lambda name, i=i, module=module: np.asarray(flat[(f"layers_{i}", module, name)])
            a, b = at(f"{target}_lora_a"), at(f"{target}_lora_b")
            w = at(f"{target}_kernel")
            # numpy in float64: W + (alpha / r) A B, contracting A's rank axis with B's.
            a64, b64, w64 = (x.astype(np.float64) for x in (a, b, w))
            want = w64 + scale * np.tensordot(a64, b64, axes=([a.ndim - 1], [0]))
            # float32's rounding of r products summed, scaled and added to W: at most
            # (r + 2) unit roundoffs of the magnitudes summed (Higham, Accuracy and Stability
            # of Numerical Algorithms, 3.1), whatever order a machine sums them in.
            size = np.abs(w64) + scale * np.tensordot(
                np.abs(a64), np.abs(b64), axes=([a.ndim - 1], [0])
            )
            bound = (a.shape[-1] + 2) * np.finfo(np.float32).eps / 2 * size
            got = np.asarray(out[(f"layers_{i}", module, f"{target}_kernel")], np.float64)
            assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
            # ... and a wrong product is far outside it (the check can fail).
            assert np.any(np.abs(w64 + 1.01 * (want - w64) - want) > bound)
    logits = _apply(params, LORA, TOKENS)
    np.testing.assert_allclose(_apply(merged, CONFIG, TOKENS), logits, atol=2e-5)
    assert float(jnp.max(jnp.abs(logits - _apply(base, CONFIG, TOKENS)))) > 1e-2
    # alpha scales the adapters' product: twice alpha is twice B.
    twice = LORA.replace(lora_alpha=16.0)
    doubled = traverse_util.unflatten_dict(
        {p: 2 * x if p[-1].endswith("_lora_b") else x for p, x in flat.items()}
    )
    np.testing.assert_allclose(
        _apply(params, twice, TOKENS), _apply(doubled, LORA, TOKENS), atol=2e-5
    )
    # With the adapters off, the model is the base.
    off = lora.adapters_off(params)
    np.testing.assert_allclose(_apply(off, LORA, TOKENS), _apply(base, CONFIG, TOKENS), atol=1e-6)


def _batch(rows=8, prompt=5, new=7, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 61, (rows, prompt + new)).astype(np.int32)
    valid = np.ones_like(tokens, bool)
    loss_mask = valid.copy()
    loss_mask[:, :prompt] = False
    behav = rng.normal(-4.0, 0.3, tokens.shape).astype(np.float32) * loss_mask
    return TrainBatch(
        tokens_BxT=jnp.asarray(tokens),
        valid_BxT=jnp.asarray(valid),
        behav_logp_BxT=jnp.asarray(behav),
        loss_mask_BxT=jnp.asarray(loss_mask),
        rewards_B=jnp.asarray(rng.integers(0, 2, rows), jnp.float32),
        version_B=jnp.zeros(rows, jnp.int32),
        version_BxT=jnp.zeros(tokens.shape, jnp.int32),
    )


def _actor(**changes):
    c = arith.get_config("m2po").to_dict()
    c["actor"]["ppo_n_minibatches"] = 2
    c["actor"]["optimizer"]["lr"] = 1e-2
    for key, value in changes.items():
        c["actor"][key] = value
    return config_lib.from_configdict(c).actor


def test_the_step_trains_the_adapters_alone_and_leaves_the_base_bit_identical(adapted):
    base, _ = adapted
    params = model_lib.add_adapters(base, LORA, jax.random.key(3))  # B = 0, as a run starts
    actor = _actor()
    tx, schedule = optim.make_optimizer(actor.optimizer, 10)
    state = step_lib.init_train_state(jax.tree.map(jnp.copy, params), tx)
    # AdamW's moments cover the adapters only.
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state):
        if leaf.ndim:
            assert jax.tree_util.keystr(path).endswith(("_lora_a']", "_lora_b']")), path
    moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert moments == 2 * LORA.lora_params()
    step = step_lib.make_train_step(LORA, actor, tx, schedule)
    for i in range(2):
        state, metrics = step(state, _batch(seed=i), jax.random.key(i), None)
    assert bool(metrics["train/finite"]) if "train/finite" in metrics else True
    before, after = _flat(params), _flat(state.params)
    assert before.keys() == after.keys()
    for path, x in before.items():
        if lora.is_adapter(path):
            assert not np.array_equal(after[path], x), path  # every adapter trained
        else:
            np.testing.assert_array_equal(after[path], x, err_msg=str(path))


def test_zero_adapters_give_the_full_models_first_step_and_kl_is_against_the_base(adapted):
    base, _ = adapted
    params = model_lib.add_adapters(base, LORA, jax.random.key(3))
    actor = _actor(kl_ctl=0.1, ppo_n_minibatches=1)  # one update: the step's loss is its own
    tx, schedule = optim.make_optimizer(actor.optimizer, 10)
    batch = _batch(seed=4)
    full_state = step_lib.init_train_state(jax.tree.map(jnp.copy, base), tx)
    _, full = step_lib.make_train_step(CONFIG, actor, tx, schedule)(
        full_state, batch, jax.random.key(0), jax.tree.map(jnp.copy, base)
    )
    lora_state = step_lib.init_train_state(jax.tree.map(jnp.copy, params), tx)
    step = step_lib.make_train_step(LORA, actor, tx, schedule)
    lora_state, first = step(lora_state, batch, jax.random.key(0), None)
    for key in ("loss", "m2po/m2_all", "kl/mean"):
        if key in full:
            np.testing.assert_allclose(first[key], full[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert "loss" in full
    # Without a reference given, the KL penalty's reference is the base (adapters off): once
    # the adapters moved, the step equals one given that reference, not the policy itself.
    copy = lambda: jax.tree.map(jnp.copy, lora_state)
    moved = lora_state.params
    _, implicit = step(copy(), batch, jax.random.key(1), None)
    _, explicit = step(copy(), batch, jax.random.key(1), lora.adapters_off(moved))
    _, itself = step(copy(), batch, jax.random.key(1), jax.tree.map(jnp.copy, moved))
    key = "train/adv_abs_mean"
    np.testing.assert_allclose(implicit[key], explicit[key], rtol=1e-6)
    assert abs(float(implicit[key]) - float(itself[key])) > 1e-6


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"model.lora.dropout": 0.05}, "model.lora.dropout=0.05: only 0.0"),
        ({"model.lora.rank": 8, "model.lora.targets": "q,qkv"}, "model.lora.targets='q,qkv'"),
        ({"model.lora.rank": -1}, "model.lora.rank=-1 is out of range"),
        ({"model.lora.rank": 8, "model.lora.alpha": 0.0}, "model.lora.alpha=0.0 is out of range"),
    ],
)
def test_bad_lora_settings_are_named(changes, match):
    c = arith.get_config("m2po")
    config_lib.apply_dotted(c, changes)
    with pytest.raises(config_lib.ConfigError, match=match):
        config_lib.from_configdict(c)


def test_the_config_section_reaches_the_model_config():
    from m2po_jax.trainer import setup

    c = arith.get_config("m2po")
    config_lib.apply_dotted(c, {"model.lora.rank": 8, "model.lora.targets": "q, v,down"})
    m = config_lib.from_configdict(c).model
    got = dataclasses.replace(CONFIG, **setup.lora_fields(m))
    assert (got.lora_rank, got.lora_alpha, got.lora_targets) == (8, 16.0, ("q", "v", "down"))
