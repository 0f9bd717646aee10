"""Tests for sharding.py on 8 fake CPU devices (set in conftest.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from m2po_jax.algorithm import masking, scopes
from m2po_jax.common import mesh_axes
from m2po_jax.models import hf, model_config
from m2po_jax.models import model as model_lib
from m2po_jax.parallel import sharding

CFG = model_config.ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2
)
B, T = 8, 8
MESHES = {
    "data8": {"data": 8},
    "fsdp8": {"fsdp": 8},
    "d2f2t2": {"data": 2, "fsdp": 2, "tensor": 2},
}


@pytest.fixture(scope="module")
def ref_params():
    return jax.jit(functools.partial(model_lib.init_params, CFG))(jax.random.key(0))


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    valid = np.ones((B, T), bool)
    valid[::2, :3] = False  # left padding on half the rows
    return tokens, valid


def mesh_of(name):
    return sharding.make_mesh(MESHES[name])


def spec_tree(shardings):
    return jax.tree.map(lambda s: s.spec, shardings)


# ----------------------------------------------------------------------------- mesh


def test_make_mesh_shapes():
    assert dict(sharding.make_mesh({"data": -1}).shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert dict(sharding.make_mesh({"fsdp": 2, "tensor": -1}).shape) == {
        "data": 1,
        "fsdp": 2,
        "tensor": 4,
    }
    mesh = sharding.make_mesh((2, 2, 2))
    assert mesh.axis_names == mesh_axes.MESH_AXES
    assert mesh.devices.size == 8
    mesh4 = sharding.make_mesh({"data": -1}, devices=jax.devices()[:4])
    assert dict(mesh4.shape)["data"] == 4


@pytest.mark.parametrize(
    "shape, match",
    [
        ({"data": 3}, r"mesh size 3 does not equal the device count 8"),
        ({"data": 3, "tensor": -1}, r"use 3 devices, which does not divide the device count 8"),
        ({"data": -1, "tensor": -1}, r"at most one -1"),
        ({"model": 2}, r"unknown mesh axes \['model'\]"),
        ({"data": 0}, r"positive"),
        ((2, 4), r"expected 3 sizes"),
    ],
)
def test_make_mesh_errors(shape, match):
    with pytest.raises(ValueError, match=match):
        sharding.make_mesh(shape)


# ----------------------------------------------------------------------------- specs


def test_train_and_sample_specs():
    mesh = mesh_of("d2f2t2")
    train = spec_tree(sharding.param_shardings(CFG, mesh, sharding.TRAIN_RULES))
    assert train["embedding"] == P("tensor", "fsdp")
    assert train["lm_head"] == P("fsdp", "tensor")
    assert train["layers_0"]["attn"]["q_kernel"] == P("fsdp", "tensor", None)
    assert train["layers_0"]["attn"]["k_kernel"] == P("fsdp", "tensor", None)
    assert train["layers_1"]["attn"]["o_kernel"] == P("tensor", None, "fsdp")
    assert train["layers_0"]["mlp"]["down_kernel"] == P("tensor", "fsdp")
    assert train["final_norm"]["scale"] == P("fsdp")

    sample = spec_tree(sharding.param_shardings(CFG, mesh, sharding.SAMPLE_RULES))
    assert sample["embedding"] == P("tensor", None)
    assert sample["layers_0"]["attn"]["q_kernel"] == P(None, "tensor", None)
    assert sample["layers_0"]["mlp"]["gate_kernel"] == P(None, "tensor")
    assert sample["final_norm"]["scale"] == P(None)
    # Same tree as the params.
    assert jax.tree.structure(train) == jax.tree.structure(
        jax.eval_shape(lambda: model_lib.init_params(CFG, jax.random.key(0)))
    )


def test_indivisible_dims_fall_back_to_replication():
    mesh = sharding.make_mesh({"data": 2, "tensor": 4})
    specs = spec_tree(sharding.param_shardings(CFG, mesh, sharding.TRAIN_RULES))
    assert specs["layers_0"]["attn"]["k_kernel"] == P("fsdp", None, None)  # 2 kv heads, tensor=4
    assert specs["layers_0"]["attn"]["q_kernel"] == P("fsdp", "tensor", None)  # 4 heads
    odd = CFG.replace(intermediate_size=60)  # 60 % 8 != 0
    specs = spec_tree(
        sharding.param_shardings(odd, sharding.make_mesh({"tensor": 8}), sharding.TRAIN_RULES)
    )
    assert specs["layers_0"]["mlp"]["up_kernel"] == P("fsdp", None)
    assert specs["embedding"] == P("tensor", "fsdp")  # 64 % 8 == 0
    # A tuple rule keeps the longest prefix that divides: 2 rows over data=2, fsdp=4.
    mesh24 = sharding.make_mesh({"data": 2, "fsdp": 4})
    assert sharding.logical_to_spec(("batch", None), (2, 5), mesh24, sharding.TRAIN_RULES) == P(
        "data", None
    )
    assert sharding.logical_to_spec(("batch",), (8,), mesh24, sharding.TRAIN_RULES) == P(
        ("data", "fsdp")
    )


def test_batch_and_replicated():
    mesh = mesh_of("d2f2t2")
    assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp"), None)
    assert sharding.batch_sharding(mesh, 3).spec == P(("data", "fsdp"), None, None)
    assert sharding.replicated(mesh).spec == P()
    with pytest.raises(ValueError, match="ndim"):
        sharding.batch_sharding(mesh, 0)


# ----------------------------------------------------------------------------- init / fwd


def test_shard_init_matches_unsharded(ref_params):
    mesh = mesh_of("d2f2t2")
    params = sharding.shard_init(CFG, jax.random.key(0), mesh, sharding.TRAIN_RULES)
    expected = spec_tree(sharding.param_shardings(CFG, mesh, sharding.TRAIN_RULES))
    assert jax.tree.map(lambda a: a.sharding.spec, params) == expected
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    emb = params["embedding"]
    assert emb.addressable_shards[0].data.shape == (32, 16)  # vocab/tensor, embed/fsdp
    q = params["layers_0"]["attn"]["q_kernel"]
    assert q.addressable_shards[0].data.size == q.size // 4


@pytest.fixture(scope="module")
def ref_logits(ref_params, batch):
    tokens, valid = batch
    return jax.jit(functools.partial(model_lib.apply, config=CFG))(
        ref_params, tokens_BxT=tokens, valid_BxT=valid
    )


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_forward_matches_unsharded(ref_params, ref_logits, batch, mesh_name):
    tokens, valid = batch
    want = ref_logits
    mesh = mesh_of(mesh_name)
    pshard = sharding.param_shardings(CFG, mesh, sharding.TRAIN_RULES)
    bshard = sharding.batch_sharding(mesh)
    params = sharding.reshard(ref_params, pshard)
    fwd = jax.jit(
        lambda p, t, v: model_lib.apply(p, CFG, t, valid_BxT=v),
        in_shardings=(pshard, bshard, bshard),
        out_shardings=sharding.batch_sharding(mesh, 3),
    )
    got = fwd(params, tokens, valid)
    assert got.sharding.spec == P(("data", "fsdp"), None, None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_sharded_cached_decode_matches_unsharded(ref_params, batch):
    """Prefill into a KV cache with sample-layout weights and a sharded cache."""
    tokens, valid = batch

    def prefill(p, t, v, cache):
        return model_lib.apply(p, CFG, t, valid_BxT=v, cache=cache, cache_index=0)

    cache = model_lib.init_cache(CFG, B, T + 4)
    want_logits, want_cache = jax.jit(prefill)(ref_params, tokens, valid, cache)
    mesh = mesh_of("d2f2t2")
    pshard = sharding.param_shardings(CFG, mesh, sharding.SAMPLE_RULES)
    cshard = sharding.cache_shardings(CFG, mesh, sharding.SAMPLE_RULES, B, T + 4)
    assert cshard.k[0].spec == P(("data", "fsdp"), "tensor", None, None)
    bshard = sharding.batch_sharding(mesh)
    got_logits, got_cache = jax.jit(
        prefill,
        in_shardings=(pshard, bshard, bshard, cshard),
        out_shardings=(sharding.batch_sharding(mesh, 3), cshard),
    )(sharding.reshard(ref_params, pshard), tokens, valid, sharding.reshard(cache, cshard))
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_cache.k[1]), np.asarray(want_cache.k[1]), atol=1e-5)


def test_sharded_grad_step_matches_unsharded(ref_params, batch):
    tokens, valid = batch
    # At step 1 Adam moves each weight by about lr * sign(grad), so a grad near zero can flip
    # between layouts; lr 1e-3 keeps such flips under the 1e-5 tolerance on params.
    optimizer = optax.adamw(1e-3, weight_decay=0.1)

    def step(params, opt_state, tokens, valid):
        def loss_fn(p):
            logits = model_lib.apply(p, CFG, tokens, valid_BxT=valid)
            logp = model_lib.token_logp(logits, tokens)
            mask = valid & jnp.roll(valid, 1, axis=1)  # predicted token and its context are real
            return -jnp.sum(logp * mask) / jnp.sum(mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    want = jax.jit(step)(ref_params, optimizer.init(ref_params), tokens, valid)

    mesh = mesh_of("d2f2t2")
    pshard = sharding.param_shardings(CFG, mesh, sharding.TRAIN_RULES)
    oshard = sharding.opt_state_shardings(jax.eval_shape(optimizer.init, ref_params), pshard, mesh)
    assert oshard[0].mu["layers_0"]["attn"]["q_kernel"].spec == P("fsdp", "tensor", None)
    assert oshard[0].count.spec == P()
    bshard = sharding.batch_sharding(mesh)
    rep = sharding.replicated(mesh)
    params = sharding.reshard(ref_params, pshard)
    opt_state = jax.jit(optimizer.init, out_shardings=oshard)(params)
    got = jax.jit(
        step,
        in_shardings=(pshard, oshard, bshard, bshard),
        out_shardings=(pshard, oshard, rep, pshard),
    )(params, opt_state, tokens, valid)
    np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got[3]), jax.tree.leaves(want[3]), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
    for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
    assert got[0]["lm_head"].sharding.spec == P("fsdp", "tensor")


def test_reshard_train_sample_roundtrip(ref_params):
    mesh = mesh_of("d2f2t2")
    train = sharding.reshard(ref_params, sharding.param_shardings(CFG, mesh, sharding.TRAIN_RULES))
    sample = sharding.reshard(train, sharding.param_shardings(CFG, mesh, sharding.SAMPLE_RULES))
    back = sharding.reshard(sample, sharding.param_shardings(CFG, mesh, sharding.TRAIN_RULES))
    assert sample["embedding"].sharding.spec == P("tensor", None)
    assert back["embedding"].sharding.spec == P("tensor", "fsdp")
    for a, b, c in zip(*(jax.tree.leaves(t) for t in (ref_params, sample, back)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


# ----------------------------------------------------------------------------- M2PO mask


def numpy_m2po_mask(behav, prox, mask, tau):
    """AReaL's rule from docs/algorithm.md, written as a plain loop."""
    m2 = (behav.astype(np.float32) - prox.astype(np.float32)) ** 2
    idx = np.flatnonzero(mask)
    out = mask.copy()
    if idx.size == 0:
        return out
    order = idx[np.argsort(-m2.ravel()[idx], kind="stable")]
    values = m2.ravel()[order].astype(np.float64)
    k = idx.size - 1
    for i in range(idx.size):
        if values[i:].mean() < tau:
            k = i
            break
    out.ravel()[order[:k]] = False
    return out


@pytest.fixture(scope="module")
def logp_batch():
    rng = np.random.default_rng(1)
    prox = rng.normal(-2.0, 1.0, (B, 16)).astype(np.float32)
    # Heavy-tailed drift, stronger in some rows, so blocks trim different amounts.
    drift = rng.standard_t(2, (B, 16)).astype(np.float32) * 0.1
    drift[:2] *= 6.0
    behav = prox + drift
    mask = rng.random((B, 16)) < 0.8
    return behav, prox, mask


@pytest.mark.parametrize("method", ["sort", "bisect"])
def test_m2po_mask_per_shard_matches_blockwise_reference(logp_batch, method):
    behav, prox, mask = logp_batch
    tau = 0.04
    mesh = mesh_of("d2f2t2")  # 4 batch shards of 2 rows, replicated over tensor
    got = np.asarray(scopes.m2po_mask_per_shard(behav, prox, mask, tau, mesh, method=method))
    want = np.concatenate(
        [
            numpy_m2po_mask(behav[i : i + 2], prox[i : i + 2], mask[i : i + 2], tau)
            for i in range(0, B, 2)
        ]
    )
    np.testing.assert_array_equal(got, want)
    whole = numpy_m2po_mask(behav, prox, mask, tau)
    assert (got != whole).any(), "test data should make per-shard and global masks differ"
    assert not (got & ~mask).any()
    # Inside a jit, with the threshold traced.
    jitted = jax.jit(functools.partial(scopes.m2po_mask_per_shard, mesh=mesh, method=method))
    np.testing.assert_array_equal(np.asarray(jitted(behav, prox, mask, jnp.float32(tau))), want)


def test_m2po_global_mask_on_sharded_input(logp_batch):
    behav, prox, mask = logp_batch
    mesh = mesh_of("d2f2t2")
    bshard = sharding.batch_sharding(mesh)
    args = [jax.device_put(x, bshard) for x in (behav, prox, mask)]
    got = jax.jit(lambda b, p, m: masking.m2po_mask(b, p, m, 0.04))(*args)
    np.testing.assert_array_equal(np.asarray(got), numpy_m2po_mask(behav, prox, mask, 0.04))


def test_m2po_mask_per_shard_errors_and_none(logp_batch):
    behav, prox, mask = logp_batch
    mesh = mesh_of("d2f2t2")
    np.testing.assert_array_equal(
        np.asarray(scopes.m2po_mask_per_shard(behav, prox, mask, None, mesh)), mask
    )
    with pytest.raises(ValueError, match="batch dim 6 is not divisible by the 4 shards"):
        scopes.m2po_mask_per_shard(behav[:6], prox[:6], mask[:6], 0.04, mesh)
    with pytest.raises(ValueError, match="they must match"):
        scopes.m2po_mask_per_shard(behav, prox[:, :4], mask, 0.04, mesh)
    with pytest.raises(ValueError, match="m2_threshold"):
        scopes.m2po_mask_per_shard(behav, prox, mask, -1.0, mesh)
    with pytest.raises(ValueError, match="not in the mesh"):
        scopes.m2po_mask_per_shard(behav, prox, mask, 0.04, mesh, axes=("dp",))


# ----------------------------------------------------------------------------- HF loading


def test_load_pretrained_sharded(tmp_path, ref_params, batch):
    hf.save_pretrained(ref_params, tmp_path, config=CFG)
    mesh = mesh_of("d2f2t2")
    params = sharding.load_pretrained_sharded(tmp_path, CFG, mesh, sharding.TRAIN_RULES)
    want_specs = spec_tree(sharding.param_shardings(CFG, mesh, sharding.TRAIN_RULES))
    assert jax.tree.map(lambda a: a.sharding.spec, params) == want_specs
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    bf16 = sharding.load_pretrained_sharded(
        tmp_path, CFG, mesh, sharding.SAMPLE_RULES, dtype=jnp.bfloat16
    )
    assert bf16["embedding"].dtype == jnp.bfloat16
    assert bf16["embedding"].sharding.spec == P("tensor", None)
    wrong = CFG.replace(intermediate_size=32)
    with pytest.raises(ValueError):
        sharding.load_pretrained_sharded(tmp_path, wrong, mesh, sharding.TRAIN_RULES)


# ----------------------------------------------------------------------------- async publish


@pytest.mark.parametrize("train_shape", [{"data": 4}, {"data": 1, "fsdp": 2, "tensor": 2}])
def test_weights_publish_to_the_rollout_devices_unchanged(ref_params, train_shape):
    """`placement.WeightPublisher`: the learner's params (data-parallel: a copy per train
    device; fsdp x tensor: split) reach the other 4 devices in the sampling layout, equal."""
    from m2po_jax.parallel import placement as placement_lib

    rollout_devices, train_devices = placement_lib.split_devices(4)
    assert [d.id for d in rollout_devices] == [4, 5, 6, 7]
    train = placement_lib.Placement.from_shape(train_shape, CFG, train_devices)
    rollout = placement_lib.Placement(
        sharding.make_mesh({"data": -1, "tensor": 1}, rollout_devices), CFG
    )
    params = train.put_params(jax.device_get(ref_params))
    for dtype in ("", "bfloat16"):
        copies = placement_lib.WeightPublisher(rollout.sample_params, dtype)(params)
        for got, want, target in zip(
            jax.tree.leaves(copies),
            jax.tree.leaves(ref_params),
            jax.tree.leaves(rollout.sample_params),
            strict=True,
        ):
            assert got.sharding == target
            assert {d.id for d in got.devices()} == {4, 5, 6, 7}
            assert got.dtype == (dtype or want.dtype)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(got.dtype)))
    with pytest.raises(ValueError, match="mesh.rollout_devices=8: each process has 8 devices"):
        placement_lib.split_devices(8)


def test_async_on_a_one_device_cpu_says_how_to_get_two(monkeypatch):
    from m2po_jax.parallel import placement as placement_lib

    monkeypatch.setattr(jax, "local_devices", lambda: jax.devices()[:1])
    with pytest.raises(ValueError, match=r"has 1 devices.*xla_force_host_platform_device_count=2"):
        placement_lib.split_devices(0)
