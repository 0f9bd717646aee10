"""The train step's paths (`step_plan`): each equals the reference step.

The reference is the step as it was before the fused paths: a separate proximal pass
(`fuse_prox=False`) and every row's whole sequence through the trunk (no `prompt_len`).
The fast path takes the proximal log-probs from the loss pass where the plan allows and
runs each prompt once. Params after two updates must agree within 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax import config as config_lib
from m2po_jax.common.errors import ConfigError
from m2po_jax.common.types import PromptGroups, TrainBatch
from m2po_jax.configs import arith
from m2po_jax.learner import batching, logprobs, optim, step_plan
from m2po_jax.learner import train_step as step_lib
from m2po_jax.models import model as model_lib
from m2po_jax.models import model_config
from tests.algorithm.mismatch_test import np_m2po_kept, np_reference

MODEL = model_config.ModelConfig(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
)
GROUP, PROMPT, NEW, ROWS = 4, 5, 6, 16
SHARED = PromptGroups(PROMPT, GROUP)


def actor(**changes):
    c = arith.get_config("m2po").to_dict()
    mb_spec = changes.pop("n_mbs", 1)
    c["actor"].update(**changes)
    c["actor"]["mb_spec"]["n_mbs"] = mb_spec
    c["actor"]["optimizer"]["lr"] = 1e-3
    return config_lib.from_configdict(c).actor


# Jitted once per batch shape: the eager version dispatches every op on its own.
_sequence_logp = jax.jit(lambda p, t, v: logprobs.sequence_logp(p, MODEL, t, v, 1.0))


def batch(params, stale: int, seed=0):
    """ROWS rows in groups of GROUP sharing a left-padded prompt, as the sampler writes
    them; completions of different lengths, right-padded. `stale` versions behind step 0
    of a state at version `stale` (0: on-policy, behaviour = current policy)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, MODEL.vocab_size, (ROWS, PROMPT + NEW)).astype(np.int32)
    valid = np.ones_like(tokens, bool)
    for g in range(ROWS // GROUP):
        rows = slice(g * GROUP, (g + 1) * GROUP)
        tokens[rows, :PROMPT] = tokens[g * GROUP, :PROMPT]
        valid[rows, : g % 3] = False  # left padding: prompts of 5, 4 and 3 tokens
    tokens[~valid] = 0
    completion = rng.integers(1, NEW + 1, ROWS)
    for r, n in enumerate(completion):
        valid[r, PROMPT + n :] = False
        tokens[r, PROMPT + n :] = 0
    loss_mask = valid.copy()
    loss_mask[:, :PROMPT] = False
    prox, _ = _sequence_logp(params, jnp.asarray(tokens), jnp.asarray(valid))
    behav = np.asarray(prox) * loss_mask
    if stale:
        behav = behav + rng.normal(0, 0.4, behav.shape).astype(np.float32) * loss_mask
    return TrainBatch(
        tokens_BxT=jnp.asarray(tokens),
        valid_BxT=jnp.asarray(valid),
        behav_logp_BxT=jnp.asarray(behav, jnp.float32),
        loss_mask_BxT=jnp.asarray(loss_mask),
        rewards_B=jnp.asarray(rng.integers(0, 2, ROWS), jnp.float32),
        version_B=jnp.zeros(ROWS, jnp.int32),
        version_BxT=jnp.zeros(tokens.shape, jnp.int32),
    )


def run(a, b, stale, steps=2, **kwargs):
    """Params and the metrics of each step after `steps` steps from version `stale`."""
    tx, schedule = optim.make_optimizer(a.optimizer, 10)
    params = model_lib.init_params(MODEL, jax.random.key(0))
    state = step_lib.init_train_state(params, tx).replace(step=jnp.int32(stale))
    step = step_lib.make_train_step(MODEL, a, tx, schedule, **kwargs)
    history = []
    for i in range(steps):
        state, metrics = step(state, b, jax.random.key(i), None)
        history.append(jax.device_get(metrics))
    return jax.device_get(state.params), history


def params0():
    return model_lib.init_params(MODEL, jax.random.key(0))


def assert_close_params(x, y, atol=1e-5):
    for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
        np.testing.assert_allclose(u, v, atol=atol, rtol=0)


CASES = [
    pytest.param(dict(ppo_n_minibatches=n_mb, m2_threshold=tau), stale, id=f"mb{n_mb}-{name}-{s}")
    for n_mb in (1, 2)
    for name, tau in (("m2po", 0.04), ("off", None))
    for stale, s in ((0, "onpolicy"), (2, "stale"))
] + [
    pytest.param(dict(n_mbs=2, m2po_scope="microbatch", m2_threshold=0.04), 2, id="micro2-scope"),
    pytest.param(dict(n_mbs=2, m2_threshold=None), 2, id="micro2-off"),
    pytest.param(dict(n_mbs=2, m2_threshold=0.04), 2, id="micro2-global-keeps-pass"),
    pytest.param(dict(m2po_scope="row", m2_threshold=0.04), 2, id="row"),
]


@pytest.mark.parametrize("changes, stale", CASES)
def test_fast_path_equals_the_reference_step(changes, stale):
    a = actor(**changes)
    b = batch(params0(), stale)
    n_mb = a.ppo_n_minibatches
    # With one minibatch of one micro-batch the reference is the old step exactly (rows
    # permuted one by one); with several, minibatches and micro-batches of whole prompt
    # groups on both sides (which rows share a block matters to a per-block mask).
    ref_groups = PromptGroups(0, GROUP) if n_mb > 1 or a.mb_spec.n_mbs > 1 else None
    ref, ref_m = run(a, b, stale, groups=ref_groups, fuse_prox=False)
    fast, fast_m = run(a, b, stale, groups=SHARED)
    assert_close_params(fast, ref)
    plan = step_plan.plan_step(a, ROWS, PROMPT + NEW, groups=SHARED)
    assert (plan.loss_prompt.prompt_len, plan.loss_prompt.group_size) == (PROMPT, GROUP)
    assert int(fast_m[0]["train/shared_prompt"]) == 1
    assert int(ref_m[0]["train/prox_pass"]) == 1
    assert int(fast_m[0]["train/prox_pass"]) == int(plan.prox_pass)
    expect_pass = n_mb > 1 or changes == dict(n_mbs=2, m2_threshold=0.04)
    assert plan.prox_pass == expect_pass
    # Every token is `stale` versions old: all fresh or all stale, on every path alike.
    sub = "stale" if stale else "fresh"
    assert fast_m[0][f"mismatch/{sub}/tokens"] == fast_m[0]["train/tokens"]
    assert ("mismatch/fresh/m2po_dropped" in fast_m[0]) == (a.m2_threshold is not None)
    keys = ("m2po/m2_before", "m2po/masked_tokens", "train/entropy", "actor/loss")
    for key in (*keys, f"mismatch/{sub}/m2", f"mismatch/{sub}/abs_max"):
        np.testing.assert_allclose(fast_m[0][key], ref_m[0][key], rtol=1e-4, atol=1e-6)
    if n_mb == 1 and "m2po_scope" not in changes:
        # The one-minibatch case really is the fused path and has its metrics.
        np.testing.assert_allclose(
            fast_m[0]["train/behav_prox_abs_diff"], ref_m[0]["train/behav_prox_abs_diff"], atol=1e-6
        )


def test_plan_names_where_prox_and_the_mask_come_from():
    rows, seq = ROWS, PROMPT + NEW

    def plan(**changes):
        p = step_plan.plan_step(actor(**changes), rows, seq)
        return p.prox_source, p.mask_at

    assert plan() == ("loss", "loss")
    assert plan(ppo_n_minibatches=2) == ("pass", "prepare")
    assert plan(m2_threshold=None, n_mbs=2) == ("loss", "none")
    assert plan(n_mbs=2) == ("pass", "prepare")  # global mask over two micro-batches
    assert plan(n_mbs=2, m2po_scope="microbatch") == ("loss", "loss")
    assert plan(ppo_n_minibatches=2, m2po_scope="minibatch") == ("pass", "loss")
    assert plan(m2po_stop_rule="capped_clip", eps_clip=0.2) == ("pass", "none")
    assert plan(prox_logp_method="loglinear", ppo_n_minibatches=2, m2_threshold=None) == (
        "loglinear",
        "none",
    )
    # The mask needs the whole batch's prox first: the approximation cannot skip the pass.
    assert plan(prox_logp_method="loglinear", ppo_n_minibatches=2) == ("pass", "prepare")
    # A per-row mask can wait for each minibatch's loss pass.
    assert plan(prox_logp_method="loglinear", ppo_n_minibatches=2, m2po_scope="row") == (
        "loglinear",
        "loss",
    )
    assert plan(recompute_logprob=False, use_decoupled_loss=False) == ("behav", "prepare")
    ref = step_plan.plan_step(actor(), rows, seq, fuse_prox=False)
    assert (ref.prox_source, ref.mask_at) == ("pass", "prepare")


def test_length_blocks_only_where_every_block_splits_over_the_devices():
    """Blocks of rows by length run where each block holds whole rows on every device;
    a block of fewer rows than devices would run whole on each of them (the real-size
    presets: one row per device per micro-batch)."""
    assert step_plan.length_blocks(64, 1024, batch_shards=8) == 8
    assert step_plan.length_blocks(8, 1024, batch_shards=8) == 1
    assert step_plan.length_blocks(8, 1024, batch_shards=1) == 8
    assert step_plan.length_blocks(16, 1024, batch_shards=4) == 1  # 2 rows per block
    assert step_plan.length_blocks(64, logprobs.MIN_BLOCKED_WIDTH - 1) == 1
    # The plan of a 7B-preset-like minibatch: 128 rows in 16 micro-batches of one group.
    a = actor(n_mbs=16)
    wide = step_plan.plan_step(a, 128, 512 + 1024, groups=PromptGroups(512, 8), batch_shards=8)
    assert wide.loss_prompt == logprobs.SharedPrompt(512, 8, 1) and wide.length_blocks == 1
    one = step_plan.plan_step(a, 128, 512 + 1024, groups=PromptGroups(512, 8))
    assert one.length_blocks == 8 and one.loss_prompt.length_blocks == 8


@pytest.mark.parametrize(
    "changes",
    [
        dict(ppo_n_minibatches=2, m2_threshold=None),
        dict(ppo_n_minibatches=2, m2_threshold=0.04, m2po_scope="row"),
    ],
    ids=["m2po-off", "row-scope"],
)
def test_loglinear_is_exact_on_policy(changes):
    """On-policy rows (version == the state's): alpha = 0 and the behaviour log-probs are
    the proximal ones, so the approximation's two updates equal the recomputed ones."""
    b = batch(params0(), 0)
    ref, _ = run(actor(**changes), b, 0, steps=1, groups=PromptGroups(0, GROUP))
    loglinear = actor(prox_logp_method="loglinear", **changes)
    approx, m = run(loglinear, b, 0, steps=1, groups=PromptGroups(0, GROUP))
    assert int(m[0]["train/prox_loglinear"]) == 1 and int(m[0]["train/prox_pass"]) == 0
    assert_close_params(approx, ref)
    # The approximation is no recompute: no engine/trainer mismatch to report from it.
    assert not [k for k in m[0] if k.startswith("mismatch/")]


def test_loglinear_error_is_reported_against_the_recomputed_values():
    """Rows two versions stale: alpha = (2 - 1) / 2 and, with one minibatch, the current
    log-probs are the proximal ones, so |approx - prox| = (1 - alpha) |prox - behav|."""
    stale = 2
    b = batch(params0(), stale).replace(version_B=jnp.zeros(ROWS, jnp.int32))
    a = actor(prox_logp_method="metrics", m2_threshold=None)
    _, m = run(a, b, stale, steps=1, groups=SHARED)
    prox, _ = _sequence_logp(params0(), b.tokens_BxT, b.valid_BxT)
    mask = np.asarray(b.loss_mask_BxT)
    gap = np.abs(np.asarray(prox) - np.asarray(b.behav_logp_BxT))[mask]
    np.testing.assert_allclose(m[0]["prox/loglinear_abs_error"], 0.5 * gap.mean(), rtol=1e-4)
    assert m[0]["prox/loglinear_abs_error"] > 0.05
    assert int(m[0]["train/prox_loglinear"]) == 0  # "metrics" trains on the recomputed values
    # The approximation itself trains on different values: not the recomputed step.
    ref, _ = run(actor(m2_threshold=None), b, stale, steps=1)
    approx, _ = run(actor(prox_logp_method="loglinear", m2_threshold=None), b, stale, steps=1)
    pairs = zip(jax.tree.leaves(approx), jax.tree.leaves(ref), strict=True)
    diff = max(np.abs(u - v).max() for u, v in pairs)
    assert diff > 1e-5


def test_prox_logp_method_is_checked():
    with pytest.raises(ConfigError, match="actor.prox_logp_method.*'loglinar'"):
        actor(prox_logp_method="loglinar")
    with pytest.raises(ConfigError, match="use_decoupled_loss"):
        actor(prox_logp_method="loglinear", use_decoupled_loss=False, recompute_logprob=False)


def test_minibatches_hold_whole_prompt_groups():
    perm = np.asarray(step_lib._permutation(jax.random.key(3), ROWS, GROUP))
    assert sorted(perm.tolist()) == list(range(ROWS))
    blocks = perm.reshape(-1, GROUP)
    assert (blocks % GROUP == np.arange(GROUP)).all()
    assert (blocks // GROUP == blocks[:, :1] // GROUP).all()
    assert not (perm == np.arange(ROWS)).all()


def test_trimmed_batches_compile_one_program_per_bucket():
    """Batches cut to the bucket of their longest completion (`batching.trim_completions`,
    as the trainer does): seven batches, four buckets, four compiled programs."""
    buffer = 40
    a = actor()
    tx, schedule = optim.make_optimizer(a.optimizer, 10)
    state = step_lib.init_train_state(params0(), tx)
    step = step_lib.make_train_step(MODEL, a, tx, schedule, groups=SHARED)
    rng = np.random.default_rng(0)
    widths = []
    for longest in (5, 12, 20, 30, 17, 40, 3):
        tokens = rng.integers(3, MODEL.vocab_size, (ROWS, PROMPT + buffer)).astype(np.int32)
        tokens[:, :PROMPT] = np.repeat(tokens[::GROUP, :PROMPT], GROUP, axis=0)
        lengths = rng.integers(1, longest + 1, ROWS)
        lengths[0] = longest
        valid = np.arange(PROMPT + buffer)[None, :] < PROMPT + lengths[:, None]
        loss_mask = valid & (np.arange(PROMPT + buffer)[None, :] >= PROMPT)
        host = {
            "tokens_BxT": np.where(valid, tokens, 0),
            "valid_BxT": valid,
            "behav_logp_BxT": np.where(loss_mask, -1.0, 0.0).astype(np.float32),
            "loss_mask_BxT": loss_mask,
            "rewards_B": rng.integers(0, 2, ROWS).astype(np.float32),
            "version_B": np.zeros(ROWS, np.int32),
            "version_BxT": np.zeros(tokens.shape, np.int32),
        }
        trimmed, width = batching.trim_completions(host, PROMPT, buffer)
        assert trimmed["loss_mask_BxT"].sum() == loss_mask.sum()  # no generated token lost
        widths.append(width)
        state, metrics = step(state, TrainBatch(**trimmed), jax.random.key(0), None)
        assert np.isfinite(float(metrics["loss"]))
    assert widths == [16, 16, 24, 32, 24, 40, 16]
    assert step._cache_size() == len(set(widths)) == 4


FRESH_AT = 2  # the state's version in the mismatch tests


def mixed_version_batch(params):
    """`batch` with tokens of versions 0 and 1 (stale) and 2 (fresh at step version 2),
    some rows switching to version 2 mid-completion (weights taken in flight). Fresh
    tokens' behaviour log-probs differ from the recompute by engine-like noise (two by a
    lot), stale ones by more. Returns (batch, fresh_BxT)."""
    b = batch(params, 0)  # behaviour = the recompute at `params`
    rng = np.random.default_rng(7)
    shape = b.tokens_BxT.shape
    version = np.repeat(np.arange(ROWS)[:, None] % 3, shape[1], axis=1).astype(np.int32)
    version[1::4, PROMPT + 2 :] = FRESH_AT
    fresh = version == FRESH_AT
    loss_mask = np.asarray(b.loss_mask_BxT)
    gap = np.where(fresh, rng.normal(0, 0.02, shape), rng.normal(0, 0.4, shape))
    # Two glitches: one past tau on its own, one that only the stale tokens' m2 pushes
    # out (in the other micro-batch of the step's permutation: see the test below).
    gap[tuple(np.argwhere(fresh & loss_mask)[0])] = 1.2
    gap[5, PROMPT] = 0.7
    behav = (np.asarray(b.behav_logp_BxT) + gap * loss_mask).astype(np.float32)
    b = b.replace(
        behav_logp_BxT=jnp.asarray(behav),
        version_B=jnp.asarray(version[:, 0]),
        version_BxT=jnp.asarray(version),
    )
    return b, fresh


def blockwise_kept(m2, valid, tau, blocks):
    """The numpy M2PO mask taken on each block of rows (lists of row indices) on its own."""
    kept = np.zeros(valid.shape, bool)
    for rows in blocks:
        kept[rows] = np_m2po_kept(m2[rows], valid[rows], tau)
    return kept


@pytest.mark.parametrize(
    "changes",
    [
        # One minibatch of two micro-batches: prox from each loss pass, a mask each.
        dict(n_mbs=2, m2po_scope="microbatch"),
        dict(ppo_n_minibatches=2),  # a proximal pass, the mask on the whole batch
    ],
    ids=["loss-pass-micro-batches", "prox-pass-minibatches"],
)
def test_mismatch_metrics_of_the_step_equal_numpy(changes):
    """The step's `mismatch/` metrics against numpy from the recomputed proximal
    log-probs and a numpy M2PO mask of each block the step masks (the whole batch, or each
    micro-batch of the step's permutation)."""
    a = actor(m2_threshold=0.04, **changes)
    b, fresh = mixed_version_batch(params0())
    _, m = run(a, b, FRESH_AT, steps=1, groups=SHARED)
    plan = step_plan.plan_step(a, ROWS, PROMPT + NEW, groups=SHARED)
    assert plan.prox_source == ("pass" if "ppo_n_minibatches" in changes else "loss")
    prox, _ = _sequence_logp(params0(), b.tokens_BxT, b.valid_BxT)
    behav, valid = np.asarray(b.behav_logp_BxT), np.asarray(b.loss_mask_BxT)
    m2 = (behav.astype(np.float64) - np.asarray(prox)) ** 2
    blocks = [np.arange(ROWS)]
    if plan.n_micro > 1:  # the rows of each micro-batch, as the step permutes and splits
        perm = np.asarray(step_lib._permutation(jax.random.key(0), ROWS, plan.perm_block))
        blocks = list(np.asarray(batching.split_rows(perm, plan.n_micro, plan.micro_block)))
    kept = blockwise_kept(m2, valid, a.m2_threshold, blocks)
    kept_alone = blockwise_kept(m2, valid & fresh, a.m2_threshold, blocks)
    want = np_reference(behav, np.asarray(prox), valid, fresh, kept, kept_alone)
    # The recompute differs from `_sequence_logp` by float32 rounding of the forward pass
    # (< 1e-5 per token); the drop fractions are counts and must agree exactly.
    for key in want:
        np.testing.assert_allclose(m[0][key], want[key], rtol=1e-4, atol=2e-5, err_msg=key)
    assert m[0]["mismatch/fresh/tokens"] + m[0]["mismatch/stale/tokens"] == m[0]["train/tokens"]
    dropped = sum(
        m[0][f"mismatch/{s}/m2po_dropped"] * m[0][f"mismatch/{s}/tokens"]
        for s in ("fresh", "stale")
    )
    assert round(dropped) == m[0]["m2po/masked_tokens"]
    assert 0 < want["mismatch/fresh/m2po_drop_alone"] < want["mismatch/fresh/m2po_dropped"]
