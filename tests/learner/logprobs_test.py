"""Chunked log-probs and entropies equal the full-logits computation, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax.learner import batching, logprobs
from m2po_jax.models import model as model_lib
from m2po_jax.models import model_config

CONFIG = model_config.ModelConfig(
    vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2
)


def _inputs(rows=3, cols=11, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CONFIG.vocab_size, (rows, cols)).astype(np.int32)
    valid = np.ones((rows, cols), bool)
    valid[0, :3] = False  # a left-padded prompt
    valid[1, -2:] = False  # right padding after a completion
    return jnp.asarray(tokens), jnp.asarray(valid)


def _full(params, config, tokens, valid, temperature):
    logits = model_lib.apply(params, config, tokens, valid_BxT=valid)
    return (
        model_lib.token_logp(logits, tokens, temperature),
        model_lib.token_entropy(logits, temperature),
    )


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk", [1, 7, 12, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_equal_full_logits(tied, chunk, temperature):
    config = CONFIG.replace(tie_word_embeddings=tied)
    params = model_lib.init_params(config, jax.random.key(1))
    tokens, valid = _inputs()
    logp, ent = jax.jit(
        lambda p: logprobs.sequence_logp(p, config, tokens, valid, temperature, chunk)
    )(params)
    ref_logp, ref_ent = jax.jit(lambda p: _full(p, config, tokens, valid, temperature))(params)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5, rtol=1e-5)
    assert logp.shape == tokens.shape and float(jnp.abs(logp[:, 0]).max()) == 0.0


@pytest.mark.parametrize("tied", [True, False])
def test_gradients_equal_full_logits(tied):
    config = CONFIG.replace(tie_word_embeddings=tied)
    params = model_lib.init_params(config, jax.random.key(2))
    tokens, valid = _inputs(seed=3)
    weights = jnp.asarray(np.random.default_rng(4).normal(size=tokens.shape), jnp.float32)

    def objective(fn):
        def f(p):
            logp, ent = fn(p)
            # Both outputs carry gradient, with different weights per token.
            return jnp.sum(logp * weights) + 0.3 * jnp.sum(ent * valid)

        return jax.grad(f)(params)

    grads = objective(lambda p: logprobs.sequence_logp(p, config, tokens, valid, 0.8, chunk=3))
    ref = objective(lambda p: _full(p, config, tokens, valid, 0.8))
    flat, flat_ref = jax.tree.leaves(grads), jax.tree.leaves(ref)
    for g, r in zip(flat, flat_ref, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-4)
    assert max(float(jnp.abs(g).max()) for g in flat) > 1e-3


def test_micro_batched_logp_equals_one_pass_and_keeps_row_order():
    params = model_lib.init_params(CONFIG, jax.random.key(5))
    tokens, valid = _inputs(rows=6, seed=6)
    one = logprobs.micro_batched_logp(params, CONFIG, tokens, valid, 1.0, 4, n_micro=1)
    three = logprobs.micro_batched_logp(params, CONFIG, tokens, valid, 1.0, 4, n_micro=3)
    for a, b in zip(one, three, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    x = jnp.arange(12).reshape(6, 2)
    parts = batching.split_rows(x, 3)
    np.testing.assert_array_equal(parts[1], x[1::3])
    np.testing.assert_array_equal(batching.merge_rows(parts), x)
    with pytest.raises(ValueError, match="do not split into 4"):
        batching.split_rows(x, 4)


def test_head_memory_scales_with_chunk_not_sequence():
    """The compiled gradient's temporaries stay near chunk x V, not rows x T x V."""
    e, v, rows, cols = 64, 8192, 2, 512
    hidden = jnp.zeros((rows, cols, e), jnp.float32)
    head = jnp.zeros((e, v), jnp.float32)
    tokens = jnp.zeros((rows, cols), jnp.int32)

    def temp_bytes(fn):
        grad = jax.jit(jax.grad(lambda h, w: jnp.sum(fn(h, w)[0]), argnums=(0, 1)))
        return grad.lower(hidden, head).compile().memory_analysis().temp_size_in_bytes

    def full(h, w):
        return model_lib.token_logp(model_lib.dense(h, w), tokens), None

    chunked = temp_bytes(lambda h, w: logprobs.head_logp_entropy(h, w, tokens, 1.0, 64))
    whole = temp_bytes(full)
    full_logits = rows * cols * v * 4
    assert whole >= full_logits
    assert chunked < full_logits / 4, (chunked, whole)


def _grouped(groups=3, group_size=4, prompt=6, new=5, seed=3):
    """Rows whose prompt columns repeat per group, with left-padded prompts and completions
    that stop early (right padding)."""
    rng = np.random.default_rng(seed)
    prompt_GxP = rng.integers(1, CONFIG.vocab_size, (groups, prompt))
    prompt_valid = np.ones((groups, prompt), bool)
    prompt_valid[0, :2] = False
    prompt_valid[2, :1] = False
    completion = rng.integers(1, CONFIG.vocab_size, (groups * group_size, new))
    completion_valid = np.ones((groups * group_size, new), bool)
    completion_valid[1, 3:] = False
    completion_valid[5, 1:] = False
    tokens = np.concatenate([np.repeat(prompt_GxP, group_size, 0), completion], 1)
    valid = np.concatenate([np.repeat(prompt_valid, group_size, 0), completion_valid], 1)
    scored = valid.copy()
    scored[:, :prompt] = False
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(valid), jnp.asarray(scored)


# Layers as a Python loop, or one rematerialised `lax.scan` (the real-size presets'
# setting, where each layer takes its prompt keys and values as scan inputs).
VARIANTS = {
    "tied": dict(tie_word_embeddings=True),
    "untied": dict(tie_word_embeddings=False),
    "scan-remat": dict(tie_word_embeddings=False, scan_layers=True, remat=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("chunk", [5, 1024])
def test_shared_prompt_logp_equals_whole_sequences(variant, chunk):
    config = CONFIG.replace(**VARIANTS[variant])
    params = model_lib.init_params(config, jax.random.key(4))
    tokens, valid, scored = _grouped()
    ref_logp, ref_ent = jax.jit(lambda p: _full(p, config, tokens, valid, 0.8))(params)
    # Jitted: one compile instead of thousands of eagerly dispatched ops (suite time).
    share = jax.jit(
        lambda p: logprobs.shared_prompt_logp(p, config, tokens, valid, 6, 4, 0.8, chunk)
    )
    logp, ent = share(params)
    np.testing.assert_allclose(
        jnp.where(scored, logp, 0), jnp.where(scored, ref_logp, 0), atol=1e-5
    )
    np.testing.assert_allclose(jnp.where(scored, ent, 0), jnp.where(scored, ref_ent, 0), atol=1e-5)
    assert float(jnp.abs(logp[:, :6]).max()) == 0.0  # prompt columns carry nothing

    # Gradients flow through the shared prompt keys/values as through each row's own.
    weights = jnp.where(scored, jnp.arange(1.0, tokens.shape[1] + 1), 0.0)
    loss = lambda fn: lambda p: jnp.sum(fn(p)[0] * weights)  # noqa: E731
    grads = jax.jit(
        jax.grad(loss(lambda p: logprobs.sequence_logp(p, config, tokens, valid, 0.8)))
    )(params)
    shared = jax.jit(jax.grad(loss(share)))(params)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(shared), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("blocks,scan", [(1, False), (4, False), (4, True)])
def test_length_blocks_run_each_block_over_the_fewest_columns(blocks, scan):
    """Rows of very different lengths: the sorted blocks of four rows take the N/4, N/2
    and N branches (longest 3, 6 and 12), values and gradients still equal whole rows."""
    config = CONFIG.replace(scan_layers=scan, remat=scan)
    params = model_lib.init_params(config, jax.random.key(5))
    tokens, valid, scored = _grouped(groups=4, group_size=4, new=12, seed=7)
    lengths = np.array([1, 2, 3, 1, 5, 6, 4, 12, 2, 3, 1, 2, 6, 5, 4, 3])
    cols = np.arange(12)[None, :] < lengths[:, None]
    valid = valid.at[:, 6:].set(jnp.asarray(cols))
    scored = valid.at[:, :6].set(False)
    tokens = jnp.where(valid, tokens, 0)
    ref_logp, ref_ent = jax.jit(lambda p: _full(p, config, tokens, valid, 1.0))(params)

    @jax.jit
    def shared(p):
        return logprobs.shared_prompt_logp(p, config, tokens, valid, 6, 4, length_blocks=blocks)

    logp, ent = shared(params)
    np.testing.assert_allclose(
        jnp.where(scored, logp, 0), jnp.where(scored, ref_logp, 0), atol=1e-5
    )
    np.testing.assert_allclose(jnp.where(scored, ent, 0), jnp.where(scored, ref_ent, 0), atol=1e-5)
    weights = jnp.where(scored, jnp.arange(1.0, tokens.shape[1] + 1), 0.0)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(_full(p, config, tokens, valid, 1.0)[0] * weights)))(
        params
    )
    mine = jax.jit(jax.grad(lambda p: jnp.sum(shared(p)[0] * weights)))(params)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(mine), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


def test_shared_prompt_logp_refuses_bad_groups():
    params = model_lib.init_params(CONFIG, jax.random.key(0))
    tokens, valid, _ = _grouped()
    with pytest.raises(ValueError, match="group_size=5 must divide the 12 rows"):
        logprobs.shared_prompt_logp(params, CONFIG, tokens, valid, 6, 5)
    with pytest.raises(ValueError, match="prompt_len=11"):
        logprobs.shared_prompt_logp(params, CONFIG, tokens, valid, 11, 4)
