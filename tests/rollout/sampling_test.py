"""Tests for m2po_jax.rollout.sampling: log-probs, HF greedy parity, KV cache, stops, layout."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax.models import hf, hf_format, model_config
from m2po_jax.models import model as model_lib
from m2po_jax.rollout import sampling

CONFIG = model_config.ModelConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,  # explicit, as hf.load_pretrained reads it, so both configs compile once
)
PROMPTS = [[5, 17, 3, 44, 9], [8, 2], [61, 30, 12], [7]]
# Jitted once here: op-by-op Flax forwards are slow on a shared CPU.
_apply = jax.jit(model_lib.apply, static_argnums=1)


def _random_params(config, seed, std):
    """Normal(0, std) weights and unit norm scales, without compiling the model's init."""
    shapes = jax.eval_shape(lambda: model_lib.init_params(config, jax.random.key(0)))
    leaves, treedef = jax.tree.flatten(shapes)
    rng = np.random.default_rng(seed)
    arrays = [
        rng.normal(0.0, std, leaf.shape).astype(np.float32)
        if len(leaf.shape) > 1
        else np.ones(leaf.shape, np.float32)
        for leaf in leaves
    ]
    return jax.tree.unflatten(treedef, [jnp.asarray(a) for a in arrays])


@pytest.fixture(scope="module")
def params():
    # Larger weights than a default init so that next-token distributions are peaked and
    # greedy argmaxes are well separated.
    return _random_params(CONFIG, seed=0, std=0.1)


# Shared by several tests so that the file compiles `generate` only a few times.
SAMPLED = sampling.SamplingConfig(max_new_tokens=10, temperature=0.7)
N_SAMPLES = 2
GREEDY = sampling.SamplingConfig(max_new_tokens=10, greedy=True)


@pytest.fixture(scope="module")
def sampled(params):
    return _generate(params, SAMPLED, n_samples=N_SAMPLES)


def _generate(params, sampling_config, prompts=PROMPTS, seed=1, n_samples=1):
    tokens, valid = sampling.pad_prompts(prompts, sampling_config.pad_id)
    return sampling.generate(
        params, CONFIG, tokens, valid, jax.random.key(seed), sampling_config, n_samples
    )


def _teacher_forced_logp(params, out, temperature):
    logits = _apply(params, CONFIG, out.tokens_BxT, valid_BxT=out.valid_BxT)
    return np.asarray(model_lib.token_logp(logits, out.tokens_BxT, temperature))


# ---------------------------------------------------------------- host helpers


def test_pad_prompts_left_pads():
    tokens, valid = sampling.pad_prompts([[1, 2, 3], [4]], pad_id=9, width=4)
    np.testing.assert_array_equal(tokens, [[9, 1, 2, 3], [9, 9, 9, 4]])
    np.testing.assert_array_equal(valid, [[0, 1, 1, 1], [0, 0, 0, 1]])
    assert tokens.dtype == np.int32 and valid.dtype == bool


@pytest.mark.parametrize(
    "prompts, width, match",
    [([], None, "at least one"), ([[1], []], None, "empty"), ([[1, 2, 3]], 2, "width")],
)
def test_pad_prompts_rejects_bad_input(prompts, width, match):
    with pytest.raises(ValueError, match=match):
        sampling.pad_prompts(prompts, 0, width)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_sampling_config_validates(changes, match):
    with pytest.raises(ValueError, match=match):
        sampling.SamplingConfig(**{"max_new_tokens": 4, **changes})


def test_sampling_config_is_hashable_with_list_stop_ids():
    config = sampling.SamplingConfig(max_new_tokens=4, stop_token_ids=[3, 5])
    assert config.stop_token_ids == (3, 5)
    hash(config)


def test_generate_rejects_bad_input(params):
    config = sampling.SamplingConfig(max_new_tokens=2)
    tokens, valid = sampling.pad_prompts(PROMPTS, 0)
    rng = jax.random.key(0)
    with pytest.raises(ValueError, match="prompt_valid_BxP: shape"):
        sampling.generate(params, CONFIG, tokens, valid[:, 1:], rng, config)
    with pytest.raises(ValueError, match="left-padded"):
        sampling.generate(params, CONFIG, tokens, valid[:, ::-1], rng, config)
    with pytest.raises(TypeError, match="prompt_tokens_BxP"):
        sampling.generate(params, CONFIG, tokens.astype(np.float32), valid, rng, config)
    with pytest.raises(ValueError, match="n_samples"):
        sampling.generate(params, CONFIG, tokens, valid, rng, config, n_samples=0)
    with pytest.raises(ValueError, match="vocabulary"):
        bad = dataclasses.replace(config, stop_token_ids=(CONFIG.vocab_size,))
        sampling.generate(params, CONFIG, tokens, valid, rng, bad)
    too_large = tokens.copy()
    too_large[1, -1] = CONFIG.vocab_size + 7
    match = rf"prompt_tokens_BxP: token id {CONFIG.vocab_size + 7} is outside .*\[0, {CONFIG.vocab_size}\)"
    with pytest.raises(ValueError, match=match):
        sampling.generate(params, CONFIG, too_large, valid, rng, config)
    with pytest.raises(ValueError, match="token id -1"):
        sampling.generate(params, CONFIG, np.where(valid, tokens, -1), valid, rng, config)


# ---------------------------------------------------------------- log-probs and layout


def test_behav_logp_matches_teacher_forced_forward(params, sampled):
    expected = _teacher_forced_logp(params, sampled, SAMPLED.temperature)
    completion = np.asarray(sampled.completion_mask_BxT)
    assert completion.sum() == len(PROMPTS) * N_SAMPLES * SAMPLED.max_new_tokens
    np.testing.assert_allclose(
        np.asarray(sampled.behav_logp_BxT)[completion], expected[completion], atol=1e-4
    )
    np.testing.assert_array_equal(np.asarray(sampled.behav_logp_BxT)[~completion], 0.0)


def test_layout_lengths_and_n_samples(sampled):
    out, n, max_new = sampled, N_SAMPLES, SAMPLED.max_new_tokens
    prompt_tokens, prompt_valid = sampling.pad_prompts(PROMPTS, 0)
    width = prompt_tokens.shape[1]
    assert out.tokens_BxT.shape == (len(PROMPTS) * n, width + max_new)
    assert out.tokens_BxT.dtype == jnp.int32 and out.behav_logp_BxT.dtype == jnp.float32
    # Rows b * n .. b * n + n - 1 answer prompt b.
    np.testing.assert_array_equal(out.tokens_BxT[:, :width], np.repeat(prompt_tokens, n, axis=0))
    np.testing.assert_array_equal(out.valid_BxT[:, :width], np.repeat(prompt_valid, n, axis=0))
    np.testing.assert_array_equal(out.prompt_len_B, np.repeat([len(p) for p in PROMPTS], n))
    np.testing.assert_array_equal(out.completion_len_B, max_new)
    np.testing.assert_array_equal(out.valid_BxT[:, width:], True)
    np.testing.assert_array_equal(out.completion_mask_BxT[:, width:], True)
    np.testing.assert_array_equal(out.completion_mask_BxT[:, :width], False)
    assert not np.asarray(out.stopped_B).any()
    assert int(out.num_steps) == max_new
    # Samples of one prompt differ (distinct noise per row).
    completions = np.asarray(out.tokens_BxT[:, width:]).reshape(len(PROMPTS), n, -1)
    assert all(len({tuple(c) for c in group}) == n for group in completions)


def test_same_rng_same_tokens_and_different_rng_differs(params, sampled):
    again = _generate(params, SAMPLED, n_samples=N_SAMPLES)
    other = _generate(params, SAMPLED, n_samples=N_SAMPLES, seed=2)
    np.testing.assert_array_equal(again.tokens_BxT, sampled.tokens_BxT)
    np.testing.assert_array_equal(again.behav_logp_BxT, sampled.behav_logp_BxT)
    assert not np.array_equal(other.tokens_BxT, sampled.tokens_BxT)


# ---------------------------------------------------------------- stops and early exit


def test_stop_tokens_end_rows_and_exit_early(params, sampled):
    width = max(len(p) for p in PROMPTS)
    completions = np.asarray(sampled.tokens_BxT[:, width:])
    # One stop id per row, taken from early columns of the unstopped run, so every row stops.
    stop_ids = tuple(sorted({int(row[1 + i % 3]) for i, row in enumerate(completions)}))
    pad = 96
    assert pad not in stop_ids
    config = dataclasses.replace(SAMPLED, stop_token_ids=stop_ids, pad_id=pad)
    out = _generate(params, config, n_samples=N_SAMPLES)

    # Reference: the unstopped completion cut after its first stop token (same rng and
    # per-step keys, so tokens up to the stop are identical).
    lengths = [int(np.flatnonzero(np.isin(row, stop_ids))[0]) + 1 for row in completions]
    got = np.asarray(out.tokens_BxT[:, width:])
    for row, length in enumerate(lengths):
        np.testing.assert_array_equal(got[row, :length], completions[row, :length])
        np.testing.assert_array_equal(got[row, length:], pad)
        np.testing.assert_array_equal(out.completion_mask_BxT[row, width : width + length], True)
        np.testing.assert_array_equal(out.completion_mask_BxT[row, width + length :], False)
        np.testing.assert_array_equal(out.valid_BxT[row, width + length :], False)
        np.testing.assert_array_equal(out.behav_logp_BxT[row, width + length :], 0.0)
    np.testing.assert_array_equal(out.completion_len_B, lengths)
    np.testing.assert_array_equal(out.stopped_B, True)
    assert int(out.num_steps) == max(lengths) < SAMPLED.max_new_tokens
    # Log-probs of the kept tokens are still those of a teacher-forced forward.
    expected = _teacher_forced_logp(params, out, SAMPLED.temperature)
    mask = np.asarray(out.completion_mask_BxT)
    np.testing.assert_allclose(np.asarray(out.behav_logp_BxT)[mask], expected[mask], atol=1e-4)


def test_stop_on_first_token_runs_no_decode_step(params):
    first = np.asarray(_generate(params, GREEDY).tokens_BxT)[:, max(len(p) for p in PROMPTS)]
    config = dataclasses.replace(GREEDY, stop_token_ids=tuple({int(t) for t in first}))
    out = _generate(params, config)
    np.testing.assert_array_equal(out.completion_len_B, 1)
    np.testing.assert_array_equal(out.stopped_B, True)
    assert int(out.num_steps) == 1


# ---------------------------------------------------------------- greedy, top-k, top-p


def test_top_k_one_and_tiny_top_p_equal_greedy(params):
    greedy = _generate(params, GREEDY)
    top_k = _generate(params, dataclasses.replace(SAMPLED, top_k=1), seed=5)
    top_p = _generate(params, dataclasses.replace(SAMPLED, top_p=1e-6), seed=6)
    np.testing.assert_array_equal(top_k.tokens_BxT, greedy.tokens_BxT)
    np.testing.assert_array_equal(top_p.tokens_BxT, greedy.tokens_BxT)
    # Recorded log-probs: the untruncated distribution at the configured temperature.
    expected = _teacher_forced_logp(params, top_k, SAMPLED.temperature)
    mask = np.asarray(top_k.completion_mask_BxT)
    np.testing.assert_allclose(np.asarray(top_k.behav_logp_BxT)[mask], expected[mask], atol=1e-4)
    assert np.all(expected[mask] < 0.0)


def test_truncate_keeps_expected_sets():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    keep = lambda **kw: np.isfinite(
        np.asarray(sampling._truncate(logits, sampling.SamplingConfig(max_new_tokens=1, **kw)))
    )[0]
    np.testing.assert_array_equal(keep(top_k=2), [1, 1, 0, 0, 0])
    # Nucleus: smallest prefix with mass >= top_p (0.5 + 0.2 = 0.7 >= 0.6).
    np.testing.assert_array_equal(keep(top_p=0.6), [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(keep(top_p=0.86), [1, 1, 1, 1, 0])
    np.testing.assert_array_equal(keep(top_p=0.4), [1, 0, 0, 0, 0])
    # top-k first, then top-p on the renormalised top-k distribution: [0.5, 0.2, 0.15] / 0.85.
    np.testing.assert_array_equal(keep(top_k=3, top_p=0.8), [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(keep(top_k=3, top_p=0.9), [1, 1, 1, 0, 0])


@pytest.mark.parametrize(
    "changes, probs",
    [
        # Unscrambled order, a tiny probability and, at temperature 0.5, squared weights.
        (dict(), [0.05, 0.5, 0.001, 0.2, 0.249]),
        (dict(temperature=0.5), [0.1, 0.3, 0.2, 0.4, 0.0]),
        # top-k 2 keeps 0.4 and 0.3 renormalised; the rest must never be drawn.
        (dict(top_k=2), [0.1, 0.3, 0.2, 0.4, 0.0]),
    ],
)
def test_sample_token_draws_the_softmax_distribution(changes, probs):
    """Empirical frequencies over 40k rows against hand-computed probabilities."""
    n = 40_000
    logits = np.log(np.maximum(np.array(probs), 1e-30))
    config = sampling.SamplingConfig(max_new_tokens=1, **changes)
    token_B, _ = jax.jit(sampling.sample_token, static_argnums=2)(
        jnp.asarray(np.tile(logits, (n, 1)), jnp.float32), jax.random.key(3), config
    )
    want = np.array(probs) ** (1.0 / config.temperature)
    if config.top_k:
        want[np.argsort(want)[: -config.top_k]] = 0.0
    want = want / want.sum()
    freq = np.bincount(np.asarray(token_B), minlength=len(probs)) / n
    # 5 binomial standard deviations (plus a floor for the tiny probabilities).
    tol = 5 * np.sqrt(want * (1 - want) / n) + 1e-4
    np.testing.assert_array_less(np.abs(freq - want), tol)
    assert np.all(freq[want == 0.0] == 0.0)


# ---------------------------------------------------------------- KV cache


def test_kv_cache_decode_equals_full_recompute(params):
    tokens_BxP, valid_BxP = sampling.pad_prompts(PROMPTS, 0)
    batch, width = tokens_BxP.shape
    extra = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (batch, 4), np.int32)
    cache = model_lib.init_cache(CONFIG, batch, width + 4)
    _, cache = _apply(params, CONFIG, tokens_BxP, None, valid_BxP, cache, 0)
    prompt_len = valid_BxP.sum(-1)
    for i in range(4):
        step_logits, cache = _apply(
            params,
            CONFIG,
            extra[:, i : i + 1],
            (prompt_len + i)[:, None],
            np.ones((batch, 1), bool),
            cache,
            width + i,
        )
    full_tokens = np.concatenate([tokens_BxP, extra], axis=1)
    full_valid = np.concatenate([valid_BxP, np.ones_like(extra, bool)], axis=1)
    full_logits = _apply(params, CONFIG, full_tokens, valid_BxT=full_valid)
    np.testing.assert_allclose(step_logits[:, 0], full_logits[:, -1], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- compilation


def test_no_recompilation_for_same_shapes(params, sampled):
    compiled = sampling._generate._cache_size()
    # Other prompt contents and lengths (same padded shape), rng and an equal new config.
    other_prompts = [[1, 2, 3, 4, 5], [6], [7, 8], [9, 10, 11, 12]]
    for seed in range(3):
        _generate(
            params,
            dataclasses.replace(SAMPLED),
            prompts=other_prompts,
            seed=seed,
            n_samples=N_SAMPLES,
        )
    assert sampling._generate._cache_size() == compiled
    # The counter does move for a new static config.
    _generate(params, dataclasses.replace(SAMPLED, max_new_tokens=2), n_samples=N_SAMPLES)
    assert sampling._generate._cache_size() == compiled + 1


# ---------------------------------------------------------------- Hugging Face parity


def test_greedy_matches_transformers_generate(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # initializer_range 0.1: peaked logits, so greedy margins >> float error.
    base = {"initializer_range": 0.1, "pad_token_id": 0}
    hf_config = transformers.LlamaConfig(**hf_format.config_to_hf(CONFIG, base=base))
    hf_model = transformers.LlamaForCausalLM(hf_config).to(torch.float32).eval()
    hf_model.config._attn_implementation = "eager"
    hf_model.save_pretrained(tmp_path)
    loaded = hf.load_pretrained(tmp_path)

    max_new = GREEDY.max_new_tokens
    # Same-length prompts, then left-padded prompts of different lengths.
    same_length = [[5, 17, 3, 44, 9], [8, 2, 90, 1, 3], [61, 30, 12, 7, 7], [1, 2, 3, 4, 5]]
    for prompts in (same_length, PROMPTS):
        tokens, valid = sampling.pad_prompts(prompts, 0)
        with torch.no_grad():
            hf_out = hf_model.generate(
                input_ids=torch.from_numpy(tokens.astype(np.int64)),
                attention_mask=torch.from_numpy(valid.astype(np.int64)),
                do_sample=False,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=0,
            )
        out = sampling.generate(
            loaded.params, loaded.config, tokens, valid, jax.random.key(0), GREEDY
        )
        np.testing.assert_array_equal(np.asarray(out.tokens_BxT), hf_out.numpy())
