"""The Flax causal LM against a float64 numpy reference written from the HF architecture.

Parity with transformers itself lives in hf_test.py; this file needs neither torch nor
a checkpoint.
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from m2po_jax.models import model as M
from m2po_jax.models import model_config, paged, rope

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4)
CONFIGS = {
    "llama_gqa": model_config.ModelConfig(**TINY, num_kv_heads=2),
    "llama3_mqa_tied": model_config.ModelConfig(
        **TINY,
        num_kv_heads=1,
        tie_word_embeddings=True,
        rope_theta=1e4,
        rope_scaling=tuple(
            sorted(
                {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 128,
                }.items()
            )
        ),
    ),
    "qwen2_bias_tied": model_config.ModelConfig(
        **TINY, num_kv_heads=2, model_type="qwen2", attention_bias=True, tie_word_embeddings=True
    ),
    "qwen3_qk_norm": model_config.ModelConfig(
        **TINY, num_kv_heads=2, model_type="qwen3", qk_norm=True, head_dim=12
    ),
}


def random_params(config, seed, scale=0.2):
    """Params large enough that every weight moves the logits (init's 0.02 barely does)."""
    shapes = jax.eval_shape(lambda: M.init_params(config, jax.random.key(0)))
    rng = np.random.default_rng(seed)

    def draw(path, s):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            return (1.0 + 0.3 * rng.standard_normal(s.shape)).astype(s.dtype)
        return (scale * rng.standard_normal(s.shape)).astype(s.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


# ----------------------------------------------------------------------------- reference


def np_inv_freq(config):
    d = config.dim_per_head
    inv = 1.0 / config.rope_theta ** (np.arange(0, d, 2) / d)
    if config.rope_scaling is None:
        return inv
    s = dict(config.rope_scaling)
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
        high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            out.append((1 - smooth) * f / s["factor"] + smooth * f)
    return np.array(out)


def np_rms(x, scale, eps):
    return scale * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def np_rope(x_BxTxHxD, positions_BxT, inv_freq):
    angle = positions_BxT[..., None] * inv_freq
    cos = np.cos(np.concatenate([angle, angle], -1))[:, :, None]
    sin = np.sin(np.concatenate([angle, angle], -1))[:, :, None]
    half = x_BxTxHxD.shape[-1] // 2
    rotated = np.concatenate([-x_BxTxHxD[..., half:], x_BxTxHxD[..., :half]], -1)
    return x_BxTxHxD * cos + rotated * sin


def np_round(x, kv_dtype: str):
    """x through float32 to `kv_dtype` (ml_dtypes) and back to float64; float8 e4m3fn
    clipped to +-448 first, its largest finite value."""
    dtype = np.dtype(getattr(ml_dtypes, kv_dtype))
    x = x.astype(np.float32)
    if kv_dtype == "float8_e4m3fn":
        x = np.clip(x, -448.0, 448.0)
    return x.astype(dtype).astype(np.float64)


def np_forward(params, config, tokens_BxT, valid_BxT):
    """float64 logits; rows of padding queries (no real key before them) are left at 0.
    With `config.kv_dtype`, keys (after RoPE) and values rounded to it (`np_round`)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    c = config
    positions = np.maximum(np.cumsum(valid_BxT, -1) - 1, 0)
    inv_freq = np_inv_freq(c)
    b, t = tokens_BxT.shape
    group = c.num_heads // c.num_kv_heads
    allowed_BxTxS = np.tril(np.ones((t, t), bool))[None] & valid_BxT[:, None, :]
    x = p["embedding"][tokens_BxT]
    for i in range(c.num_layers):
        layer = p[f"layers_{i}"]
        a = layer["attn"]
        h = np_rms(x, layer["input_norm"]["scale"], c.rms_norm_eps)
        q = np.einsum("bte,ehd->bthd", h, a["q_kernel"])
        k = np.einsum("bte,ehd->bthd", h, a["k_kernel"])
        v = np.einsum("bte,ehd->bthd", h, a["v_kernel"])
        if c.attention_bias:
            q, k, v = q + a["q_bias"], k + a["k_bias"], v + a["v_bias"]
        if c.qk_norm:
            q = np_rms(q, a["q_norm"]["scale"], c.rms_norm_eps)
            k = np_rms(k, a["k_norm"]["scale"], c.rms_norm_eps)
        q, k = np_rope(q, positions, inv_freq), np_rope(k, positions, inv_freq)
        if c.kv_dtype:
            k, v = np_round(k, c.kv_dtype), np_round(v, c.kv_dtype)
        out = np.zeros_like(q)
        for head in range(c.num_heads):
            kv = head // group
            scores = np.einsum("btd,bsd->bts", q[:, :, head], k[:, :, kv]) / math.sqrt(q.shape[-1])
            scores = np.where(allowed_BxTxS, scores, -np.inf)
            top = scores.max(-1, keepdims=True)
            w = np.exp(scores - np.where(np.isfinite(top), top, 0))
            w = w / np.maximum(w.sum(-1, keepdims=True), 1e-300)
            out[:, :, head] = np.einsum("bts,bsd->btd", w, v[:, :, kv])
        x = x + np.einsum("bthd,hde->bte", out, a["o_kernel"])
        h = np_rms(x, layer["post_attn_norm"]["scale"], c.rms_norm_eps)
        gate = h @ layer["mlp"]["gate_kernel"]
        x = (
            x
            + (gate / (1 + np.exp(-gate)) * (h @ layer["mlp"]["up_kernel"]))
            @ layer["mlp"]["down_kernel"]
        )
    x = np_rms(x, p["final_norm"]["scale"], c.rms_norm_eps)
    head = p["embedding"].T if c.tie_word_embeddings else p["lm_head"]
    return x @ head


def left_padded(seed, batch=3, length=10, vocab=61):
    """Tokens with left padding [0, 2, 5] and a row whose tail is invalid (finished early)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, length))
    pad = np.array([0, 2, 5])[:batch]
    valid = np.arange(length)[None] >= pad[:, None]
    valid[0, -2:] = False
    return tokens, valid


forward = jax.jit(M.apply, static_argnums=1)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_matches_numpy_reference(name):
    config = CONFIGS[name]
    params = random_params(config, seed=1)
    tokens, valid = left_padded(2)
    ours = np.asarray(forward(params, config, tokens, None, valid))
    ref = np_forward(params, config, tokens, valid)
    assert ours.dtype == np.float32 and ours.shape == (3, 10, config.vocab_size)
    assert np.abs(ref[valid]).max() > 1.0
    np.testing.assert_allclose(ours[valid], ref[valid], atol=2e-4, rtol=0)
    assert np.isfinite(ours).all()


def test_rope_inv_freq_llama3():
    config = CONFIGS["llama3_mqa_tied"]
    ref = np_inv_freq(config)
    # The scaled range spans all three bands, so the comparison covers each branch.
    wavelen = 2 * math.pi / (1.0 / config.rope_theta ** (np.arange(0, 8, 2) / 8))
    assert wavelen.min() < 32 and wavelen.max() > 128 and ((wavelen > 32) & (wavelen < 128)).any()
    np.testing.assert_allclose(np.asarray(rope.rope_inv_freq(config)), ref, rtol=1e-6)


# splash runs the full forward only (cached calls use xla): the two paths must agree.
@pytest.mark.parametrize("attention", ["auto", "dot_product", "chunked", "splash"])
@pytest.mark.parametrize("name", ["qwen3_qk_norm"])
def test_kv_cache_decode_matches_full_forward(name, attention):
    config = CONFIGS[name].replace(attention=attention, attention_block_size=4)
    params = random_params(config, seed=3)
    tokens, valid = left_padded(4)
    positions = M.make_positions(valid)
    prompt_len, total = 6, tokens.shape[1]
    full = np.asarray(forward(params, config, tokens, positions, valid))

    cache = M.init_cache(config, batch=3, max_len=total)
    logits, cache = forward(
        params,
        config,
        tokens[:, :prompt_len],
        positions[:, :prompt_len],
        valid[:, :prompt_len],
        cache,
        0,
    )
    steps = [logits]
    # One 2-token chunk, then single tokens, all through one compiled step.
    col = prompt_len
    for width in (2, 1, 1):
        sl = slice(col, col + width)
        logits, cache = forward(
            params, config, tokens[:, sl], positions[:, sl], valid[:, sl], cache, jnp.int32(col)
        )
        steps.append(logits)
        col += width
    cached = np.concatenate([np.asarray(s) for s in steps], axis=1)
    np.testing.assert_allclose(cached[valid], full[valid], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(cache.valid_BxS), valid)
    assert cache.k[0].shape == (3, config.num_kv_heads, total, config.dim_per_head)


def test_last_only_returns_the_last_column():
    config = CONFIGS["llama_gqa"]
    params = random_params(config, seed=4)
    tokens, valid = left_padded(5)
    full = np.asarray(forward(params, config, tokens, None, valid))
    forward_last = jax.jit(M.apply, static_argnums=1, static_argnames="last_only")
    last = forward_last(params, config, tokens, None, valid, last_only=True)
    assert last.shape == (3, 1, config.vocab_size)
    np.testing.assert_allclose(np.asarray(last), full[:, -1:], atol=1e-5, rtol=0)


def grad_loss(config, tokens, valid):
    """jit(value_and_grad) of the summed token log-prob loss over real tokens."""

    def loss(params):
        logits = M.apply(params, config, tokens, None, valid)
        return -jnp.sum(M.token_logp(logits, tokens) * valid)

    return jax.jit(jax.value_and_grad(loss))


@pytest.mark.parametrize("policy", list(model_config.REMAT_POLICIES))
def test_remat_policies_match_no_remat(policy):
    config = CONFIGS["qwen2_bias_tied"]
    params = random_params(config, seed=5)
    tokens, valid = left_padded(6)
    value, grads = grad_loss(config, tokens, valid)(params)
    remat = config.replace(remat=True, remat_policy=policy)
    value_r, grads_r = grad_loss(remat, tokens, valid)(params)
    np.testing.assert_allclose(value_r, value, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grads_r, grads
    )
    # Padding queries attend to nothing; they must not poison the gradients.
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_remat_policies_trade_memory():
    config = model_config.ModelConfig(
        **{**TINY, "hidden_size": 64, "num_layers": 4}, num_kv_heads=2
    )
    params = random_params(config, seed=5)
    tokens, valid = left_padded(6, batch=3, length=64)

    def temp_bytes(**changes):
        f = grad_loss(config.replace(**changes), tokens, valid)
        return f.lower(params).compile().memory_analysis().temp_size_in_bytes

    # XLA:CPU schedules recomputation with little regard for memory, so only the two ends
    # are compared: full remat against saving everything (or not rematerialising at all).
    full = temp_bytes(remat=True, remat_policy="nothing_saveable")
    assert full < temp_bytes(remat=True, remat_policy="everything_saveable")
    assert full < temp_bytes(remat=False)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logical_axes_cover_every_param(name):
    config = CONFIGS[name]
    specs = M.logical_axes(config)
    shapes = jax.eval_shape(lambda: M.init_params(config, jax.random.key(0)))
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
    assert jax.tree.structure(specs, is_leaf=is_spec) == jax.tree.structure(shapes)
    names = {"vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp"}
    for spec, shape in zip(
        jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(shapes), strict=True
    ):
        assert len(spec) == len(shape.shape)
        assert set(spec) <= names
    assert tuple(specs["layers_0"]["attn"]["k_kernel"]) == ("embed", "kv_heads", "head_dim")


def test_num_params_counts_the_tree():
    for config in CONFIGS.values():
        shapes = jax.eval_shape(lambda c=config: M.init_params(c, jax.random.key(0)))
        assert config.num_params() == sum(math.prod(s.shape) for s in jax.tree.leaves(shapes))


def test_bf16_compute_close_to_f32():
    config = CONFIGS["qwen3_qk_norm"]
    params = random_params(config, seed=7)
    tokens, valid = left_padded(8)
    f32 = np.asarray(forward(params, config, tokens, None, valid))
    bf16 = forward(params, config.replace(dtype="bfloat16"), tokens, None, valid)
    assert bf16.dtype == jnp.float32  # logits are always returned in float32
    err = np.abs(np.asarray(bf16) - f32)[valid].max()
    assert 0 < err < 0.05 * np.abs(f32[valid]).max()

    params_bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    cfg_bf16 = config.replace(dtype="bfloat16", param_dtype="bfloat16")
    out = forward(params_bf16, cfg_bf16, tokens, None, valid)
    assert np.abs(np.asarray(out) - f32)[valid].max() < 0.05 * np.abs(f32[valid]).max()
    init = jax.eval_shape(lambda: M.init_params(cfg_bf16, jax.random.key(0)))
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(init))
    cache = M.init_cache(cfg_bf16, 2, 8)
    assert cache.k[0].dtype == jnp.bfloat16 and len(cache.k) == cfg_bf16.num_layers


@pytest.mark.parametrize(
    "name, kv_dtype, hot",
    [("llama_gqa", "bfloat16", 1.0), ("qwen3_qk_norm", "float8_e4m3fn", 1.0),
     ("llama_gqa", "float8_e4m3fn", 300.0)],
)  # fmt: skip
def test_a_kv_dtype_rounds_keys_after_rope_and_values_and_attends_in_float32(name, kv_dtype, hot):
    """The forward of a config with `kv_dtype` against the float64 reference whose keys
    (after RoPE, and after the Qwen3 key norm) and values are rounded through float32 to
    that dtype, attended in float64: within the float32 tolerance of the plain test, while
    the unrounded reference is farther (measured: 1.4e-6 from the rounded one; 1.2e-2, 0.48
    and 1.9 from the unrounded one). `hot`: layer 0's
    keys that many times larger, its queries as many smaller (the same scores unrounded),
    so that keys reach ~870: past float8's 448, saturated in both (a plain cast: NaN)."""
    config = CONFIGS[name].replace(kv_dtype=kv_dtype)
    params = random_params(config, seed=1)
    attn = params["layers_0"]["attn"]
    attn["k_kernel"], attn["q_kernel"] = attn["k_kernel"] * hot, attn["q_kernel"] / hot
    tokens, valid = left_padded(2)
    ours = np.asarray(forward(params, config, tokens, None, valid))
    assert np.isfinite(ours).all()
    ref = np_forward(params, config, tokens, valid)
    np.testing.assert_allclose(ours[valid], ref[valid], atol=2e-4, rtol=0)
    unrounded = np_forward(params, config.replace(kv_dtype=""), tokens, valid)
    assert np.abs(ours - unrounded)[valid].max() > 1e-3


def test_kv_store_casts_and_saturates_float8():
    """float8 e4m3fn: clipped to +-448 before the cast (a plain cast makes NaN past 464,
    e4m3fn has no infinity), NaN stays NaN; bfloat16: the plain cast; "" (or the compute
    dtype): the array itself. Caches and pools are allocated in the kv dtype."""
    x = jnp.asarray([1.0, 0.3, 447.0, 464.0, 500.0, 1e4, -1e4, jnp.inf, jnp.nan], jnp.float32)
    cfg = CONFIGS["llama_gqa"]
    fp8 = M.kv_store(x, cfg.replace(kv_dtype="float8_e4m3fn"))
    assert fp8.dtype == jnp.float8_e4m3fn
    want = [1.0, 0.3125, 448.0, 448.0, 448.0, 448.0, -448.0, 448.0, np.nan]
    np.testing.assert_array_equal(np.asarray(fp8, np.float32), want)
    assert np.isnan(np.asarray(x.astype(jnp.float8_e4m3fn), np.float32)[4])  # why it clips
    bf16 = M.kv_store(x, cfg.replace(kv_dtype="bfloat16"))
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16), np.asarray(x.astype(jnp.bfloat16)))
    assert M.kv_store(x, cfg) is x
    assert M.kv_store(bf16, cfg.replace(dtype="bfloat16", kv_dtype="bfloat16")) is bf16
    for kv_dtype, dtype in (("", jnp.float32), ("bfloat16", jnp.bfloat16),
                            ("float8_e4m3fn", jnp.float8_e4m3fn)):  # fmt: skip
        config = cfg.replace(kv_dtype=kv_dtype)
        assert config.cache_dtype == dtype
        assert {a.dtype for a in M.init_cache(config, 2, 8).k + M.init_cache(config, 2, 8).v} == {
            jnp.dtype(dtype)
        }
        assert {a.dtype for a in paged.init_pool(config, 4, 2, layout="split").kv} == {
            jnp.dtype(dtype)
        }


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logp_and_entropy(temperature):
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((2, 5, 7)).astype(np.float32) * 3
    tokens = rng.integers(0, 7, (2, 5))
    logp = np_log_softmax(logits.astype(np.float64) / temperature)
    ref = np.zeros((2, 5))
    ref_ent = np.zeros((2, 5))
    for b in range(2):
        for t in range(1, 5):
            ref[b, t] = logp[b, t - 1, tokens[b, t]]
            ref_ent[b, t] = -(np.exp(logp[b, t - 1]) * logp[b, t - 1]).sum()
    np.testing.assert_allclose(M.token_logp(logits, tokens, temperature), ref, atol=1e-5)
    np.testing.assert_allclose(M.token_entropy(logits, temperature), ref_ent, atol=1e-5)


def test_make_positions():
    valid = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]], bool)
    np.testing.assert_array_equal(M.make_positions(valid), [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]])


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"model_type": "gpt2"}, r"model_type.*'gpt2'.*llama, qwen2, qwen3"),
        ({"num_heads": 4, "num_kv_heads": 3}, r"num_heads \(4\).*num_kv_heads \(3\)"),
        ({"num_kv_heads": 0}, r"num_kv_heads"),
        ({"hidden_size": 0}, r"hidden_size: must be positive, got 0"),
        ({"vocab_size": -1}, r"vocab_size"),
        ({"dtype": "float8"}, r"dtype: unknown name 'float8'"),
        ({"param_dtype": "int4"}, r"dtype: unknown name 'int4'"),
        ({"head_dim": 7}, r"head_dim: must be positive and even"),
        ({"hidden_size": 30}, r"hidden_size \(30\).*num_heads \(4\)"),
        ({"rope_scaling": (("rope_type", "yarn"),)}, r"'yarn'.*default, llama3"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"needs \['low_freq_factor'"),
        ({"remat_policy": "dots"}, r"remat_policy: unknown name 'dots'.*nothing_saveable"),
        ({"attention": "flash"}, r"attention: unknown implementation 'flash'.*chunked"),
        ({"attention_block_size": 0}, r"attention_block_size: must be positive"),
        ({"kv_dtype": "fp8"}, r"kv_dtype: expected '' .*bfloat16, float8_e4m3fn, got 'fp8'"),
        ({"kv_dtype": "float32"}, r"kv_dtype: .* got 'float32'"),
    ],
)
def test_config_validation(changes, match):
    with pytest.raises(ValueError, match=match):
        model_config.ModelConfig(**{**TINY, "num_kv_heads": 2, **changes})


def test_default_head_dim_and_the_same_head_dim_written_out_share_one_compile():
    implicit = model_config.ModelConfig(**TINY)  # head_dim None -> 32 // 4
    explicit = model_config.ModelConfig(**TINY, head_dim=8)
    assert implicit == explicit and hash(implicit) == hash(explicit)
    assert implicit != model_config.ModelConfig(**TINY, head_dim=16)
    assert implicit != model_config.ModelConfig(**{**TINY, "num_layers": 3})
    traces = []
    g = jax.jit(lambda x, config: (traces.append(config), x + 1)[1], static_argnums=1)
    g(1.0, implicit)
    g(1.0, explicit)
    assert len(traces) == 1


def test_rope_scaling_dict_becomes_hashable_tuple():
    scaling = dict(CONFIGS["llama3_mqa_tied"].rope_scaling)
    config = model_config.ModelConfig(**TINY, num_kv_heads=1, rope_scaling=scaling)
    assert config.rope_scaling == CONFIGS["llama3_mqa_tied"].rope_scaling
    hash(config)
    # hidden_size need not divide by num_heads when head_dim is explicit (Qwen3).
    assert (
        model_config.ModelConfig(
            **{**TINY, "hidden_size": 30}, num_kv_heads=2, head_dim=8
        ).dim_per_head
        == 8
    )


@pytest.mark.parametrize("remat", [False, True])
def test_scanned_layers_equal_the_layer_loop(remat):
    """`scan_layers` runs the same layers as one lax.scan: same logits and gradients."""
    config = model_config.ModelConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        remat=remat,
    )
    scanned = config.replace(scan_layers=True)
    params = M.init_params(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 97)
    valid = jnp.ones((2, 9), bool).at[0, :3].set(False)

    def loss(p, cfg):
        return jnp.sum(M.token_logp(M.apply(p, cfg, tokens, valid_BxT=valid), tokens) * valid)

    apply = jax.jit(lambda p, cfg: M.apply(p, cfg, tokens, valid_BxT=valid), static_argnums=1)
    np.testing.assert_allclose(apply(params, scanned), apply(params, config), atol=1e-5)
    # Jitted: eager autodiff through the scan dispatches every op on its own (suite time).
    grads = jax.jit(jax.grad(loss), static_argnums=1)(params, scanned)
    ref = jax.jit(jax.grad(loss), static_argnums=1)(params, config)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-4)
    # One layer in the program instead of three: the scan is in the jaxpr.
    assert "scan" in str(jax.make_jaxpr(lambda p: loss(p, scanned))(params))
