"""Every M2PO scope x stop rule x candidates x second moment: refused, or equal to a numpy reference.

The reference is docs/algorithm.md per block: over the participating tokens of one set,
sort m2 ascending (non-finite last, ties by index), keep the longest prefix whose running
mean passes `<` (lt) or `<=` (le) tau, at least one. A set is the whole block, a row, or
a data-parallel shard of the block; a block is the batch, a minibatch or a micro-batch,
depending on where the train step takes the mask. The step's own dispatch
(`step_math.m2po_block`, which `prepare` and `ppo_updates` call) runs every case, with a
real mesh of 8 fake CPU devices (tests/conftest.py) for the shard scope.

Log-probs lie on a 1/8 grid and tau is an odd multiple of 1/128, so every sum and mean
is exact in float32 and float64 alike: masks and statistics must match exactly.
"""

import functools
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax import config as config_lib
from m2po_jax.algorithm import masking, scopes
from m2po_jax.algorithm import masking_stats as masking_stats_lib
from m2po_jax.configs import arith
from m2po_jax.learner import batching, step_math, step_metrics, step_plan
from m2po_jax.learner.actor_settings import ActorSettings
from m2po_jax.parallel import placement as placement_lib
from m2po_jax.parallel import sharding

ROWS, COLS, SHARDS, N_MB, N_MICRO = 32, 6, 8, 2, 2
TAU = 13 / 128
STOP_RULES = ("lt", "le", "capped_clip")
COMBOS = list(
    itertools.product(scopes.M2PO_SCOPES, STOP_RULES, masking.CANDIDATES, masking.SECOND_MOMENTS)
)


def refused_fields(scope, stop_rule, candidates, second_moment):
    """The fields `validate` must name for a combination that cannot work, else None.

    capped_clip masks nothing and clips the ratio with one bound for the whole batch,
    taken from behav and prox once per step (docs/algorithm.md, the capped-mean rule).
    """
    if stop_rule == "capped_clip" and scope != "global":
        return ("actor.m2po_stop_rule", "actor.m2po_scope")
    if stop_rule == "capped_clip" and second_moment != "behav_prox":
        return ("actor.m2po_stop_rule", "actor.m2po_second_moment")
    return None


def expected_level(scope, stop_rule, second_moment):
    """Where docs/algorithm.md says the mask is taken: the blocks of the batch."""
    if stop_rule == "capped_clip":
        return "batch"  # no mask; the statistics once
    if scope in ("minibatch", "microbatch"):
        return scope
    return "batch" if second_moment == "behav_prox" else "minibatch"  # current policy


def config_dict(**actor):
    c = arith.get_config("m2po").to_dict()
    c["actor"].update({"ppo_n_minibatches": N_MB, "m2_threshold": TAU, **actor})
    c["actor"]["mb_spec"] = {"n_mbs": N_MICRO, "max_tokens_per_mb": 0}
    return c


@functools.cache
def data():
    rng = np.random.default_rng(0)
    behav = rng.integers(-40, 0, (ROWS, COLS)).astype(np.float32) / 8
    # Rows 0-7 close to behaviour, the rest further: the sets of every scope differ.
    spread = np.where(np.arange(ROWS)[:, None] < 8, 2, 7)
    prox = behav + rng.integers(-spread, spread + 1, (ROWS, COLS)).astype(np.float32) / 8
    logp = prox + rng.integers(-4, 5, (ROWS, COLS)).astype(np.float32) / 8
    prox[5, :4] = prox[5, 0]  # ties
    behav[5, :4] = behav[5, 0] + 0.75
    adv = rng.integers(-2, 3, (ROWS, COLS)).astype(np.float32)
    loss_mask = rng.random((ROWS, COLS)) < 0.85
    loss_mask[9] = False  # an empty row
    behav[12, 1] = np.nan  # a non-finite valid token
    loss_mask[12, 1] = True
    return behav, prox, logp, adv, loss_mask


@functools.cache
def layout():
    mesh = sharding.make_mesh({"data": 4, "fsdp": 2, "tensor": 1})
    assert sharding.batch_shards(mesh) == SHARDS
    return placement_lib.Layout(mesh)


# ----------------------------------------------------------------------------- numpy reference


def ref_pair(behav, prox, logp, second_moment):
    newer, older = {
        "behav_prox": (prox, behav),
        "current_behav": (logp, behav),
        "prox_current": (logp, prox),
    }[second_moment]
    return newer.astype(np.float64) - older.astype(np.float64)


def ref_kept_set(m2, participating, tau, stop_rule):
    """Kept flags of one set (flat arrays): the longest ascending prefix that passes."""
    kept = np.zeros(m2.size, bool)
    idx = np.flatnonzero(participating)
    if idx.size == 0:
        return kept
    key = np.where(np.isnan(m2), np.inf, m2)
    order = sorted(idx, key=lambda i: (key[i], i))
    with np.errstate(invalid="ignore"):
        means = np.cumsum(key[order]) / np.arange(1, len(order) + 1)
    passes = means < tau if stop_rule == "lt" else means <= tau
    k = max([n + 1 for n in range(len(order)) if passes[n]], default=1)
    kept[order[:k]] = True
    return kept


def ref_block(arrays, tau, scope, stop_rule, candidates, second_moment):
    """(mask, participating, m2) of one block; tau None: nothing masked."""
    behav, prox, logp, adv, loss_mask = arrays
    log_r = ref_pair(behav, prox, logp, second_moment)
    m2 = log_r * log_r
    participating = loss_mask.copy()
    if candidates == "harmful":
        with np.errstate(invalid="ignore"):
            harmful = ((adv > 0) & (log_r > 0)) | ((adv < 0) & (log_r < 0))
        participating &= harmful | ~np.isfinite(m2)
    if tau is None:
        return loss_mask.copy(), participating, m2
    rows = loss_mask.shape[0]
    size = {"row": 1, "shard": rows // SHARDS}.get(scope, rows)
    kept = np.zeros_like(loss_mask)
    for start in range(0, rows, size):
        part = slice(start, start + size)
        flat = ref_kept_set(m2[part].ravel(), participating[part].ravel(), tau, stop_rule)
        kept[part] = flat.reshape(m2[part].shape)
    return loss_mask & (~participating | kept), participating, m2


def ref_stats(masks, participating, m2s, loss_masks):
    """The statistics schema (masking_stats.py) over the union of the blocks."""
    mask, part = np.concatenate(masks), np.concatenate(participating)
    m2, valid = np.concatenate(m2s), np.concatenate(loss_masks)
    finite = np.isfinite(m2)
    kept_m2 = m2[mask & part & finite]
    return {
        "m2po/masked_tokens": int((valid & ~mask).sum()),
        "m2po/masked_fraction": (valid & ~mask).sum() / max(valid.sum(), 1),
        "m2po/m2_before": m2[valid & finite].sum() / max((valid & finite).sum(), 1),
        "m2po/m2_after": m2[mask & finite].sum() / max((mask & finite).sum(), 1),
        "m2po/boundary": kept_m2.max() if kept_m2.size else 0.0,
        "m2po/nonfinite_tokens": int((valid & ~finite).sum()),
    }


def ref_clip_range(behav, prox, adv, loss_mask, tau, candidates):
    """The capped-mean bound t (largest s with mean(min(m2, s)) <= tau), as eps_clip(s)."""
    log_r = ref_pair(behav, prox, None, "behav_prox")
    m2 = np.where(np.isnan(log_r), np.inf, log_r * log_r)
    cand = loss_mask.copy()
    if candidates == "harmful":
        with np.errstate(invalid="ignore"):
            cand &= ((adv > 0) & (log_r > 0)) | ((adv < 0) & (log_r < 0))
    values = np.sort(m2[cand])
    n = values.size
    t = np.inf
    if n and values.mean() > tau:
        for i in range(n):  # i values below s, n - i capped at s
            s = (tau * n - values[:i].sum()) / (n - i)
            if (i == 0 or values[i - 1] <= s) and s <= values[i]:
                t = np.sqrt(max(s, 0.0))
                break
    return 1 - np.exp(-t), np.exp(t) - 1


# ----------------------------------------------------------------------------- the table


def blocks(level):
    """The row indices of each block the step masks separately at `level`."""
    rows = np.arange(ROWS)
    if level == "batch":
        return [rows]
    minibatches = list(rows.reshape(N_MB, -1))
    if level == "minibatch":
        return minibatches
    return [part for mb in minibatches for part in np.asarray(batching.split_rows(mb, N_MICRO))]


def _one_program(settings, with_logp):
    """`step_math.m2po_block` on `layout()`'s 8 devices as one jitted program, waited for
    by the caller: XLA:CPU deadlocks in an all-reduce, now and then, when many eager
    8-device programs are in flight at once (7 of 8 participants arrive; the process
    aborts at the rendezvous' terminate timeout), which eager ops on sharded arrays do."""

    def block(behav, prox, logp, adv, loss_mask):
        logp = logp if with_logp else None
        return step_math.m2po_block(
            settings, behav, prox, loss_mask, adv, logp=logp, layout=layout()
        )

    return jax.jit(block)


@pytest.mark.parametrize("index", range(len(COMBOS)), ids=lambda i: "-".join(COMBOS[i]))
def test_every_combination_is_refused_or_matches_the_reference(index):
    scope, stop_rule, candidates, second_moment = combo = COMBOS[index]
    method = masking.METHODS[index % 2]
    c = config_dict(
        m2po_scope=scope,
        m2po_stop_rule=stop_rule,
        m2po_candidates=candidates,
        m2po_second_moment=second_moment,
        m2po_method=method,
    )
    fields = refused_fields(*combo)
    if fields is not None:
        with pytest.raises(config_lib.ConfigError) as err:
            config_lib.from_configdict(c)
        for field in fields:
            assert field in str(err.value), (field, str(err.value))
        return
    actor = config_lib.from_configdict(c).actor
    level = expected_level(scope, stop_rule, second_moment)
    assert step_plan.m2po_level(actor) == level

    behav, prox, logp, adv, loss_mask = data()
    tau = None if stop_rule == "capped_clip" else TAU
    ref_options = (
        ("behav_prox", "all", "lt") if tau is None else (second_moment, candidates, stop_rule)
    )
    got_parts, ref = [], {"mask": [], "part": [], "m2": [], "valid": []}
    settings = ActorSettings.build(actor)
    block = _one_program(settings, with_logp=level != "batch")  # prepare has no current logp
    for rows in blocks(level):
        arrays = tuple(x[rows] for x in (behav, prox, logp, adv, loss_mask))
        mask, parts = jax.device_get(block(*arrays))
        sm, cand, rule = ref_options
        want, part, m2 = ref_block(arrays, tau, scope, rule, cand, sm)
        np.testing.assert_array_equal(np.asarray(mask), want, err_msg=f"{combo} rows {rows}")
        got_parts.append(parts)
        for key, value in zip(ref, (want, part, m2, arrays[4]), strict=True):
            ref[key].append(value)
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *got_parts)
    stats = masking_stats_lib.finalize_stats(
        step_metrics.combine_stats(stacked, jnp.ones(len(got_parts)))
    )
    assert set(stats) == set(masking_stats_lib.M2PO_STAT_KEYS)
    for key, value in ref_stats(ref["mask"], ref["part"], ref["m2"], ref["valid"]).items():
        np.testing.assert_allclose(stats[key], value, rtol=1e-6, atol=0, err_msg=f"{key} {combo}")
    if tau is not None:
        assert 0 < int(stats["m2po/masked_tokens"]) < loss_mask.sum()
    else:  # the capped-mean rule clips instead: its bound against the reference
        eps = step_math.clip_range(settings, behav, prox, loss_mask, adv)
        want = ref_clip_range(behav, prox, adv, loss_mask, TAU, candidates)
        np.testing.assert_allclose(np.asarray(eps, np.float64), want, rtol=1e-5)


@pytest.mark.parametrize("scope", scopes.M2PO_SCOPES)
def test_m2po_off_reports_the_unmasked_second_moment_on_every_scope(scope):
    actor = config_lib.from_configdict(config_dict(m2po_scope=scope, m2_threshold=None)).actor
    assert step_plan.m2po_level(actor) == "batch"
    behav, prox, logp, adv, loss_mask = data()
    settings = ActorSettings.build(actor)
    mask, parts = jax.device_get(
        _one_program(settings, with_logp=False)(behav, prox, logp, adv, loss_mask)
    )
    np.testing.assert_array_equal(mask, loss_mask)
    want, part, m2 = ref_block(data(), None, scope, "lt", "all", "behav_prox")
    stats = masking_stats_lib.finalize_stats(parts)
    for key, value in ref_stats([want], [part], [m2], [loss_mask]).items():
        np.testing.assert_allclose(stats[key], value, rtol=1e-6, atol=0, err_msg=key)
    assert int(stats["m2po/nonfinite_tokens"]) == 1 and float(stats["m2po/boundary"]) > 0


# ----------------------------------------------------------------------------- the alias


def test_m2po_per_shard_is_a_deprecated_alias_of_the_shard_scope():
    c = config_dict()
    c["mesh"]["m2po_per_shard"] = True
    with pytest.warns(DeprecationWarning, match=r'actor\.m2po_scope="shard"'):
        cfg = config_lib.from_configdict(c)
    assert cfg.actor.m2po_scope == "shard"
    c["actor"]["m2po_scope"] = "shard"
    with pytest.warns(DeprecationWarning):
        assert config_lib.from_configdict(c).actor.m2po_scope == "shard"
    for scope in ("row", "minibatch", "microbatch"):
        c["actor"]["m2po_scope"] = scope
        with pytest.raises(config_lib.ConfigError, match=rf"m2po_per_shard.*m2po_scope='{scope}'"):
            config_lib.from_configdict(c)
    c["mesh"]["m2po_per_shard"] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning without the alias
        assert config_lib.from_configdict(c).actor.m2po_scope == "microbatch"


def test_shard_scope_on_one_batch_shard_is_the_global_scope():
    behav, prox, _, _, loss_mask = data()
    one = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": -1})
    shard, shard_parts = scopes.m2po_mask_scoped(
        behav, prox, loss_mask, TAU, scope="shard", mesh=one
    )
    whole, whole_parts = masking.m2po_mask_with_parts(behav, prox, loss_mask, TAU)
    np.testing.assert_array_equal(shard, whole)
    for key in masking_stats_lib.M2PO_PART_KEYS:
        np.testing.assert_array_equal(shard_parts[key], whole_parts[key], err_msg=key)
    with pytest.raises(ValueError, match="batch dim 12 is not divisible by the 8 shards"):
        scopes.m2po_mask_scoped(
            behav[:12], prox[:12], loss_mask[:12], TAU, scope="shard", mesh=layout().mesh
        )
    with pytest.raises(ValueError, match=r"scope='batch' is not one of \['global', 'shard'"):
        scopes.m2po_mask_scoped(behav, prox, loss_mask, TAU, scope="batch")


def test_the_data_tells_every_option_apart():
    """Guards the table: on this batch each option changes the reference mask somewhere."""
    arrays = data()

    def mask(scope="global", rule="lt", cand="all", sm="behav_prox"):
        return ref_block(arrays, TAU, scope, rule, cand, sm)[0]

    for a, b in [
        (mask("global"), mask("row")),
        (mask("global"), mask("shard")),
        (mask("row"), mask("shard")),
        (mask("shard", "lt"), mask("shard", "le")),
        (mask("row", "lt"), mask("row", "le")),
        (mask(cand="all"), mask(cand="harmful")),
        (mask("shard", cand="all"), mask("shard", cand="harmful")),
        (mask(sm="behav_prox"), mask(sm="current_behav")),
        (mask(sm="current_behav"), mask(sm="prox_current")),
    ]:
        assert (a != b).any()
    minibatch = [
        ref_block(tuple(x[r] for x in arrays), TAU, "global", "lt", "all", "behav_prox")[0]
        for r in blocks("minibatch")
    ]
    assert (np.concatenate(minibatch) != mask()).any()
