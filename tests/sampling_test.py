"""Tests for m2po_jax.sampling: log-probs, HF greedy parity, KV cache, stops, layout."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax import model as model_lib
from m2po_jax import sampling

CONFIG = model_lib.ModelConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
)
PROMPTS = [[5, 17, 3, 44, 9], [8, 2], [61, 30, 12], [7]]


@pytest.fixture(scope="module")
def params():
    # Larger weights than the default init so that the next-token distributions are peaked
    # and greedy argmaxes are well separated.
    p = model_lib.init_params(CONFIG, jax.random.key(0))
    return jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, p)


def _generate(params, sampling_config, prompts=PROMPTS, seed=1, n_samples=1):
    tokens, valid = sampling.pad_prompts(prompts, sampling_config.pad_id)
    return sampling.generate(
        params, CONFIG, tokens, valid, jax.random.key(seed), sampling_config, n_samples
    )


def _teacher_forced_logp(params, out, temperature):
    logits = model_lib.apply(params, CONFIG, out.tokens_BxT, valid_BxT=out.valid_BxT)
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


# ---------------------------------------------------------------- log-probs and layout


def test_behav_logp_matches_teacher_forced_forward(params):
    temperature = 0.7
    config = sampling.SamplingConfig(max_new_tokens=10, temperature=temperature)
    out = _generate(params, config)
    expected = _teacher_forced_logp(params, out, temperature)
    completion = np.asarray(out.completion_mask_BxT)
    assert completion.sum() == len(PROMPTS) * 10
    np.testing.assert_allclose(
        np.asarray(out.behav_logp_BxT)[completion], expected[completion], atol=1e-4
    )
    np.testing.assert_array_equal(np.asarray(out.behav_logp_BxT)[~completion], 0.0)


def test_layout_and_lengths(params):
    config = sampling.SamplingConfig(max_new_tokens=6, pad_id=1)
    out = _generate(params, config)
    width = max(len(p) for p in PROMPTS)
    prompt_tokens, prompt_valid = sampling.pad_prompts(PROMPTS, 1)
    assert out.tokens_BxT.shape == (len(PROMPTS), width + 6)
    assert out.tokens_BxT.dtype == jnp.int32 and out.behav_logp_BxT.dtype == jnp.float32
    np.testing.assert_array_equal(out.tokens_BxT[:, :width], prompt_tokens)
    np.testing.assert_array_equal(out.valid_BxT[:, :width], prompt_valid)
    np.testing.assert_array_equal(out.prompt_len_B, [len(p) for p in PROMPTS])
    np.testing.assert_array_equal(out.completion_len_B, [6] * len(PROMPTS))
    np.testing.assert_array_equal(out.completion_mask_BxT[:, width:], True)
    np.testing.assert_array_equal(out.completion_mask_BxT[:, :width], False)
    assert not np.asarray(out.stopped_B).any()
    assert int(out.num_steps) == 6


def test_n_samples_layout(params):
    config = sampling.SamplingConfig(max_new_tokens=5)
    n = 3
    out = _generate(params, config, n_samples=n)
    prompt_tokens, _ = sampling.pad_prompts(PROMPTS, 0)
    width = prompt_tokens.shape[1]
    assert out.tokens_BxT.shape[0] == len(PROMPTS) * n
    np.testing.assert_array_equal(out.tokens_BxT[:, :width], np.repeat(prompt_tokens, n, axis=0))
    np.testing.assert_array_equal(out.prompt_len_B, np.repeat([len(p) for p in PROMPTS], n))
    # Samples of one prompt differ from each other (distinct noise per row).
    completions = np.asarray(out.tokens_BxT[:, width:]).reshape(len(PROMPTS), n, -1)
    assert all(len({tuple(c) for c in group}) > 1 for group in completions)
    # And still score correctly under a teacher-forced forward.
    expected = _teacher_forced_logp(params, out, 1.0)
    mask = np.asarray(out.completion_mask_BxT)
    np.testing.assert_allclose(np.asarray(out.behav_logp_BxT)[mask], expected[mask], atol=1e-4)


def test_same_rng_same_tokens_and_different_rng_differs(params):
    config = sampling.SamplingConfig(max_new_tokens=8)
    a, b = _generate(params, config, seed=3), _generate(params, config, seed=3)
    c = _generate(params, config, seed=4)
    np.testing.assert_array_equal(a.tokens_BxT, b.tokens_BxT)
    np.testing.assert_array_equal(a.behav_logp_BxT, b.behav_logp_BxT)
    assert not np.array_equal(a.tokens_BxT, c.tokens_BxT)


# ---------------------------------------------------------------- stops and early exit


def test_stop_tokens_end_rows_and_exit_early(params):
    max_new = 12
    free = _generate(params, sampling.SamplingConfig(max_new_tokens=max_new, temperature=1.3))
    width = max(len(p) for p in PROMPTS)
    completions = np.asarray(free.tokens_BxT[:, width:])
    # One stop id per row, taken from early columns of the unstopped run, so every row stops.
    stop_ids = tuple(sorted({int(completions[row, 1 + row % 3]) for row in range(len(PROMPTS))}))
    pad = 96
    assert pad not in stop_ids
    config = sampling.SamplingConfig(
        max_new_tokens=max_new, temperature=1.3, stop_token_ids=stop_ids, pad_id=pad
    )
    out = _generate(params, config)

    # Reference: the unstopped completion cut after its first stop token (same rng and
    # per-step keys, so tokens before the stop are identical).
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
    assert int(out.num_steps) == max(lengths) < max_new
    # Log-probs of the kept tokens are still those of a teacher-forced forward.
    expected = _teacher_forced_logp(params, out, 1.3)
    mask = np.asarray(out.completion_mask_BxT)
    np.testing.assert_allclose(np.asarray(out.behav_logp_BxT)[mask], expected[mask], atol=1e-4)


def test_stop_on_first_token_runs_no_decode_step(params):
    greedy = sampling.SamplingConfig(max_new_tokens=5, greedy=True)
    first = np.asarray(_generate(params, greedy).tokens_BxT)[:, max(len(p) for p in PROMPTS)]
    config = dataclasses.replace(greedy, stop_token_ids=tuple({int(t) for t in first}))
    out = _generate(params, config)
    np.testing.assert_array_equal(out.completion_len_B, 1)
    np.testing.assert_array_equal(out.stopped_B, True)
    assert int(out.num_steps) == 1


# ---------------------------------------------------------------- greedy, top-k, top-p


def test_top_k_one_and_tiny_top_p_equal_greedy(params):
    greedy = _generate(params, sampling.SamplingConfig(max_new_tokens=8, greedy=True))
    top_k = _generate(params, sampling.SamplingConfig(max_new_tokens=8, top_k=1), seed=5)
    top_p = _generate(params, sampling.SamplingConfig(max_new_tokens=8, top_p=1e-6), seed=6)
    np.testing.assert_array_equal(top_k.tokens_BxT, greedy.tokens_BxT)
    np.testing.assert_array_equal(top_p.tokens_BxT, greedy.tokens_BxT)
    # Recorded log-probs are those of the untruncated temperature-1 distribution.
    np.testing.assert_allclose(top_k.behav_logp_BxT, greedy.behav_logp_BxT, atol=1e-6)
    assert float(jnp.max(greedy.behav_logp_BxT)) <= 0.0


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


def test_top_k_samples_stay_in_top_k(params):
    config = sampling.SamplingConfig(max_new_tokens=6, top_k=3, temperature=2.0)
    out = _generate(params, config)
    logits = np.asarray(model_lib.apply(params, CONFIG, out.tokens_BxT, valid_BxT=out.valid_BxT))
    width = max(len(p) for p in PROMPTS)
    for col in range(width, width + 6):
        top3 = np.argsort(-logits[:, col - 1], axis=-1)[:, :3]
        assert all(t in row for t, row in zip(np.asarray(out.tokens_BxT[:, col]), top3))


# ---------------------------------------------------------------- KV cache


def test_kv_cache_decode_equals_full_recompute(params):
    tokens_BxP, valid_BxP = sampling.pad_prompts(PROMPTS, 0)
    batch, width = tokens_BxP.shape
    extra = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (batch, 4), np.int32)
    cache = model_lib.init_cache(CONFIG, batch, width + 4)
    _, cache = model_lib.apply(params, CONFIG, tokens_BxP, None, valid_BxP, cache, 0)
    prompt_len = valid_BxP.sum(-1)
    for i in range(4):
        step_logits, cache = model_lib.apply(
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
    full_logits = model_lib.apply(params, CONFIG, full_tokens, valid_BxT=full_valid)
    np.testing.assert_allclose(step_logits[:, 0], full_logits[:, -1], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- compilation


def test_no_recompilation_for_same_shapes(params):
    config = sampling.SamplingConfig(max_new_tokens=3, temperature=0.9)
    tokens, valid = sampling.pad_prompts([[1, 2], [3, 4]], 0)
    before = sampling._generate._cache_size()
    sampling.generate(params, CONFIG, tokens, valid, jax.random.key(0), config)
    after_first = sampling._generate._cache_size()
    # Different prompt contents and lengths, rng, and an equal-but-new config object.
    tokens2, valid2 = sampling.pad_prompts([[5], [6, 7]], 0)
    for seed in range(3):
        sampling.generate(
            params,
            CONFIG,
            tokens2,
            valid2,
            jax.random.key(seed),
            sampling.SamplingConfig(max_new_tokens=3, temperature=0.9),
        )
    assert after_first == before + 1
    assert sampling._generate._cache_size() == after_first


# ---------------------------------------------------------------- Hugging Face parity


def _hf_llama():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=CONFIG.vocab_size,
        hidden_size=CONFIG.hidden_size,
        intermediate_size=CONFIG.intermediate_size,
        num_hidden_layers=CONFIG.num_layers,
        num_attention_heads=CONFIG.num_heads,
        num_key_value_heads=CONFIG.num_kv_heads,
        rms_norm_eps=CONFIG.rms_norm_eps,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    hf_model = transformers.LlamaForCausalLM(hf_config).to(torch.float32).eval()
    hf_model.config._attn_implementation = "eager"
    return torch, hf_model


def _params_from_hf(hf_model):
    """Independent HF -> our param mapping (torch Linear weights are [out, in])."""
    sd = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    e, d = CONFIG.hidden_size, CONFIG.dim_per_head
    params = {
        "embedding": sd["model.embed_tokens.weight"],
        "final_norm": {"scale": sd["model.norm.weight"]},
        "lm_head": sd["lm_head.weight"].T,
    }
    for i in range(CONFIG.num_layers):
        pre = f"model.layers.{i}."
        heads = {"q": CONFIG.num_heads, "k": CONFIG.num_kv_heads, "v": CONFIG.num_kv_heads}
        attn = {
            f"{n}_kernel": sd[pre + f"self_attn.{n}_proj.weight"].T.reshape(e, h, d)
            for n, h in heads.items()
        }
        attn["o_kernel"] = sd[pre + "self_attn.o_proj.weight"].T.reshape(CONFIG.num_heads, d, e)
        params[f"layers_{i}"] = {
            "attn": attn,
            "mlp": {
                f"{n}_kernel": sd[pre + f"mlp.{n}_proj.weight"].T for n in ("gate", "up", "down")
            },
            "input_norm": {"scale": sd[pre + "input_layernorm.weight"]},
            "post_attn_norm": {"scale": sd[pre + "post_attention_layernorm.weight"]},
        }
    expected = jax.tree.structure(model_lib.init_params(CONFIG, jax.random.key(0)))
    assert jax.tree.structure(params) == expected
    return jax.tree.map(jnp.asarray, params)


def test_greedy_matches_transformers_generate():
    torch, hf_model = _hf_llama()
    params = _params_from_hf(hf_model)
    max_new = 10
    # Same-length prompts, then left-padded prompts of different lengths.
    for prompts in ([[5, 17, 3, 44], [8, 2, 90, 1], [61, 30, 12, 7]], PROMPTS):
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
        config = sampling.SamplingConfig(max_new_tokens=max_new, greedy=True)
        out = sampling.generate(params, CONFIG, tokens, valid, jax.random.key(0), config)
        np.testing.assert_array_equal(np.asarray(out.tokens_BxT), hf_out.numpy())
