"""Every attention implementation against the autodiff of a plain per-head softmax.

Paths run here on the CPU: "xla", "dot_product", "chunked", "splash" (Pallas interpret
mode) and the "cudnn" wrapper's masking arguments through `implementation="xla"`; the
cuDNN kernel itself needs a GPU.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax.models import attention as A
from m2po_jax.models import attention_kernels as K
from m2po_jax.models import model_config

TOLS = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def autodiff_attention(q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, allowed_BxTxS, extra_BxTxS=0.0):
    """Plain per-head attention, differentiated by JAX (the reference).

    `extra_BxTxS` is added to the scores of allowed keys (a general additive bias).
    """
    h, k = q_BxTxHxD.shape[2], k_BxKxSxD.shape[1]
    outs = []
    for head in range(h):
        kv = head // (h // k)
        scores = jnp.einsum("btd,bsd->bts", q_BxTxHxD[:, :, head], k_BxKxSxD[:, kv])
        scores = scores / math.sqrt(q_BxTxHxD.shape[-1]) + extra_BxTxS
        probs = jax.nn.softmax(jnp.where(allowed_BxTxS, scores, -1e30), axis=-1)
        outs.append(jnp.einsum("bts,bsd->btd", probs, v_BxKxSxD[:, kv]))
    return jnp.stack(outs, axis=2)


def span_via_xla(q, k, v, mask):
    """The "cudnn" path's arguments, run by jax.nn.dot_product_attention's XLA version."""
    return K.span_attention(q, k, v, mask.start_B, mask.length_B, implementation="xla")


def run(impl, q, k, v, valid_BxT, key_valid_BxS, q_start=0, block=3):
    """`attend` by name; "cudnn_args" is the cudnn wrapper run through XLA."""
    if impl == "cudnn_args":
        return span_via_xla(q, k, v, A.make_mask("cudnn", valid_BxT, key_valid_BxS))
    mask = A.make_mask(impl, valid_BxT, key_valid_BxS, q_start)
    return A.attend(impl, q, k, v, mask, block_size=block)


def padded_rows(b, t):
    """valid [B, T]: full, left-padded, left- and right-padded, and all padding."""
    valid = np.ones((b, t), bool)
    valid[1, :3] = False
    valid[2, :2] = False
    valid[2, -2:] = False
    valid[3, :] = False
    return valid


def qkv(seed, b, t, s, heads, kv_heads, d, dtype):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, heads, d))
    k = jax.random.normal(keys[1], (b, kv_heads, s, d))
    v = jax.random.normal(keys[2], (b, kv_heads, s, d))
    cotangent = jax.random.normal(keys[3], (b, t, heads, d))
    return [x.astype(dtype) for x in (q, k, v)], cotangent.astype(dtype)


def values_and_vjps(f, args, cotangents):
    """f(*args) and its vjp of each cotangent, as one compiled program: eager autodiff
    dispatches every op on its own (suite time)."""

    def both(args, cotangents):
        out, vjp = jax.vjp(f, *args)
        return out, [vjp(ct) for ct in cotangents]

    return jax.jit(both)(args, cotangents)


def check_against_reference(ours, allowed, valid_q_BxT, args, cotangent, tol):
    """Values on real queries, and gradients with the cotangent of padding queries zero
    (the model never reads their outputs); all gradients finite for any cotangent."""

    def ref(q, k, v):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return autodiff_attention(*f32, allowed).astype(q.dtype)

    dtype = args[0].dtype
    masked = jnp.where(valid_q_BxT[:, :, None, None], cotangent, 0).astype(dtype)
    out, (grads, any_grads) = values_and_vjps(ours, args, [masked, cotangent])
    ref_out, (ref_grads,) = values_and_vjps(ref, args, [masked])
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert np.isfinite(np.float32(out)).all()
    real = np.asarray(valid_q_BxT)
    np.testing.assert_allclose(np.float32(out)[real], np.float32(ref_out)[real], atol=tol, rtol=tol)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == dtype
        np.testing.assert_allclose(np.float32(got), np.float32(want), atol=tol, rtol=tol)
    assert all(np.isfinite(np.float32(g)).all() for g in any_grads)


SELF_IMPLS = ["xla", "dot_product", "chunked", "cudnn_args", "splash"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (3, 3)])
@pytest.mark.parametrize("impl", SELF_IMPLS)
def test_self_attention_matches_autodiff(impl, heads, kv_heads, dtype):
    b, t, d = 4, 8, 8  # t = 8 with block 3: several key blocks and a padded last one
    args, cotangent = qkv(heads * 10 + kv_heads, b, t, t, heads, kv_heads, d, dtype)
    valid = jnp.asarray(padded_rows(b, t))
    allowed = jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]
    ours = functools.partial(run, impl, valid_BxT=valid, key_valid_BxS=valid)
    check_against_reference(ours, allowed, valid, args, cotangent, TOLS[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", ["xla", "dot_product", "chunked"])
def test_cached_attention_matches_autodiff(impl, dtype):
    """Queries at the end of a longer cache (prefill of a chunk, or decode with t = 1)."""
    b, t, s, d, heads, kv_heads = 3, 3, 7, 8, 4, 2
    args, cotangent = qkv(11, b, t, s, heads, kv_heads, d, dtype)
    key_valid = np.ones((b, s), bool)
    key_valid[1, :3] = False  # left padding
    key_valid[2, :] = False  # no real key at all: uniform, not NaN
    key_valid = jnp.asarray(key_valid)
    q_start = s - t
    allowed = (jnp.arange(s)[None, :] <= jnp.arange(q_start, s)[:, None])[None]
    allowed = allowed & key_valid[:, None, :]
    valid_q = key_valid[:, q_start:]
    ours = functools.partial(
        run, impl, valid_BxT=valid_q, key_valid_BxS=key_valid, q_start=jnp.int32(q_start)
    )
    check_against_reference(ours, allowed, valid_q, args, cotangent, TOLS[dtype])


@pytest.mark.parametrize("extra", [False, True], ids=["mask_bias", "plus_finite_bias"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (3, 3)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_grouped_attention_value_and_vjp_match_autodiff(heads, kv_heads, dtype, extra):
    """The "xla" path with any bias, every query row and cotangent included."""
    b, t, s, d = 3, 5, 7, 8  # s > t: queries at the end of a longer cache
    args, cotangent = qkv(heads * 10 + kv_heads, b, t, s, heads, kv_heads, d, dtype)
    causal_TxS = np.arange(s)[None, :] <= np.arange(s - t, s)[:, None]
    key_valid_BxS = np.ones((b, s), bool)
    key_valid_BxS[1, :3] = False  # left padding
    key_valid_BxS[2, :] = False  # a row with no real key at all: uniform, not NaN
    allowed = jnp.asarray(causal_TxS[None] & key_valid_BxS[:, None, :])
    # Any finite additive bias on allowed keys (ALiBi-like) must keep its gradient path.
    extra_BxTxS = 0.5 * jax.random.normal(jax.random.key(7), allowed.shape) if extra else 0.0
    bias = A.attention_bias(allowed) + jnp.where(allowed, extra_BxTxS, 0.0)[:, None, None]

    def ours(q, k, v):
        return A.grouped_attention(q, k, v, bias)

    def ref(q, k, v):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return autodiff_attention(*f32, allowed, extra_BxTxS).astype(q.dtype)

    tol = TOLS[dtype]
    out, (grads,) = values_and_vjps(ours, args, [cotangent])
    ref_out, (ref_grads,) = values_and_vjps(ref, args, [cotangent])
    assert out.dtype == dtype
    np.testing.assert_allclose(np.float32(out), np.float32(ref_out), atol=tol, rtol=tol)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == dtype
        np.testing.assert_allclose(np.float32(got), np.float32(want), atol=tol, rtol=tol)


def test_chunked_equals_xla_on_padding_queries_too():
    """Masked keys score the same finite value in both, so even padding rows agree."""
    b, t, heads, kv_heads, d = 4, 8, 4, 2, 8
    args, cotangent = qkv(3, b, t, t, heads, kv_heads, d, jnp.float32)
    valid = jnp.asarray(padded_rows(b, t))
    xla, (want_grads,) = values_and_vjps(
        functools.partial(run, "xla", valid_BxT=valid, key_valid_BxS=valid), args, [cotangent]
    )
    ch, (got_grads,) = values_and_vjps(
        functools.partial(run, "chunked", valid_BxT=valid, key_valid_BxS=valid), args, [cotangent]
    )
    np.testing.assert_allclose(ch, xla, atol=2e-5, rtol=2e-5)
    for got, want in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_chunked_never_materialises_the_score_matrix():
    b, t, heads, kv_heads, d = 1, 1024, 4, 2, 16
    args, cotangent = qkv(5, b, t, t, heads, kv_heads, d, jnp.float32)
    valid = jnp.ones((b, t), bool)

    def temp_bytes(impl, block):
        def loss(q, k, v):
            mask = A.make_mask(impl, valid, valid)
            return jnp.sum(A.attend(impl, q, k, v, mask, block_size=block) * cotangent)

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    scores = b * heads * t * t * 4  # one float32 [B, H, T, S]
    assert temp_bytes("xla", 512) >= scores
    assert temp_bytes("chunked", 128) < scores / 2


def test_resolve(monkeypatch):
    assert A.resolve("auto", jnp.float32, 64) == "xla"  # the CPU
    assert A.resolve("auto", jnp.bfloat16, 64) == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert A.resolve("auto", jnp.bfloat16, 128) == "cudnn"
    assert A.resolve("auto", jnp.float16, 64) == "cudnn"
    assert A.resolve("auto", jnp.float32, 64) == "xla"
    assert A.resolve("auto", jnp.bfloat16, 12) == "xla"  # not a multiple of 8
    assert A.resolve("auto", jnp.bfloat16, 64, cached=True) == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert A.resolve("auto", jnp.float32, 64) == "splash"
    assert A.resolve("splash", jnp.float32, 64, cached=True) == "xla"
    assert A.resolve("chunked", jnp.float32, 64, cached=True) == "chunked"
    assert A.resolve("dot_product", jnp.float32, 64, cached=True) == "dot_product"
    with pytest.raises(ValueError, match="attention: unknown implementation 'flash'"):
        A.resolve("flash", jnp.float32, 64)


MODEL_IMPLS = ["dot_product", "chunked", "cudnn_args", "splash"]


@pytest.mark.parametrize("impl", MODEL_IMPLS)
def test_model_logits_and_grads_agree_across_implementations(impl, monkeypatch):
    from m2po_jax.models import model as M

    if impl == "cudnn_args":  # the "cudnn" path with the kernel swapped for XLA
        span = K.span_attention
        monkeypatch.setattr(K, "span_attention", lambda *args: span(*args[:5], "xla"))
    config = model_config.ModelConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, attention_block_size=4,
    )  # fmt: skip
    shapes = jax.eval_shape(lambda: M.init_params(config, jax.random.key(0)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (0.2 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)
    tokens = rng.integers(0, 61, (3, 10))
    valid = np.ones((3, 10), bool)
    valid[1, :2] = False  # left-padded prompt
    valid[2, :5] = False
    valid[2, -2:] = False  # and a completion that ended early

    # A row's first real token is predicted by a padding query, whose output differs by
    # implementation; like the trainer's completion-only loss mask, score only the others.
    scored = valid.copy()
    scored[:, 1:] &= valid[:, :-1]

    def loss(params, config):
        logits = M.apply(params, config, tokens, None, valid)
        return -jnp.sum(M.token_logp(logits, tokens) * scored), logits

    step = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (value, logits), grads = step(params, config.replace(attention="xla"))
    (value_i, logits_i), grads_i = step(params, config.replace(attention=impl.split("_args")[0]))
    np.testing.assert_allclose(np.asarray(logits_i)[valid], np.asarray(logits)[valid], atol=2e-5)
    np.testing.assert_allclose(value_i, value, rtol=2e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5), grads_i, grads
    )
    assert np.isfinite(np.asarray(logits_i)).all()


@pytest.mark.parametrize(
    "shape,heads,kv_heads",
    [((2, 2, 2), 4, 2), ((1, 2, 2), 4, 1), ((2, 1, 1), 3, 3)],
    ids=["rows_and_kv_heads", "kv_repeated", "rows_only"],
)
def test_splash_inside_shard_map_equals_one_device(shape, heads, kv_heads):
    """Splash with the mesh in context runs per device block (rows over data x fsdp, heads
    over tensor; kv heads repeated when tensor does not divide them): output and gradients
    equal the unsharded kernel's."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from m2po_jax.parallel import sharding

    devices = jax.devices()[: int(np.prod(shape))]
    mesh = sharding.make_mesh(dict(zip(("data", "fsdp", "tensor"), shape, strict=True)), devices)
    b, t, d = 4, 8, 8
    args, cotangent = qkv(7, b, t, t, heads, kv_heads, d, jnp.float32)
    valid = jnp.asarray(padded_rows(b, t))
    mask = A.make_mask("splash", valid, valid)

    def loss(q, k, v):
        return jnp.sum(A.attend("splash", q, k, v, mask, 128) * cotangent)

    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    sharded = jax.jit(sharding.on_mesh(jax.value_and_grad(loss, argnums=(0, 1, 2)), mesh))
    lowered = sharded.lower(*[jax.device_put(x, rows) for x in args])
    assert "shard_map" in lowered.as_text() or "sdy.manual_computation" in lowered.as_text()
    got = lowered.compile()(*[jax.device_put(x, rows) for x in args])
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)


def test_the_mesh_in_context_decides_auto(monkeypatch):
    """Attention "auto" and Pallas' interpret mode follow the mesh a program is traced for,
    not the host's default backend."""
    from m2po_jax.models import attention_kernels as K
    from m2po_jax.parallel import sharding

    mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert A.resolve("auto", jnp.float32, 64) == "splash"  # no mesh: the default backend
    seen = []
    traced = sharding.on_mesh(
        lambda x: seen.append((K.target_platform(), A.resolve("auto", jnp.float32, 64))) or x,
        mesh,
    )
    jax.jit(traced)(jnp.zeros(2))
    assert seen == [("cpu", "xla")]
