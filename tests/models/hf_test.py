"""Checkpoint I/O and logit parity against transformers (torch, eager attention, float32).

Tiny random models are built with transformers itself, so the reference is independent
of `model.py` and `hf.py`. Weights are re-drawn with a larger scale than transformers'
init so that attention patterns, biases and norms all move the logits.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from m2po_jax.models import families, hf, hf_format
from m2po_jax.models.model import apply, init_params
from m2po_jax.models.model_config import ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
)
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
TOL = 1e-4


def _hf_configs():
    return {
        "llama_gqa": transformers.LlamaConfig(
            **COMMON, num_key_value_heads=2, tie_word_embeddings=False
        ),
        "llama_mqa_tied_llama3": transformers.LlamaConfig(
            **COMMON,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_parameters={**LLAMA3_SCALING, "rope_theta": 500000.0},
        ),
        "qwen2_tied": transformers.Qwen2Config(
            **COMMON, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6
        ),
        "qwen3_untied": transformers.Qwen3Config(
            **COMMON, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False
        ),
    }


NAMES = ("llama_gqa", "llama_mqa_tied_llama3", "qwen2_tied", "qwen3_untied")


def _randomize(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, transformers model in eval mode)."""
    torch.set_num_threads(1)
    out = {}
    for seed, (name, cfg) in enumerate(_hf_configs().items()):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        _randomize(model, seed)
        model.eval()
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, safe_serialization=True)
        out[name] = (path, model)
    return out


@pytest.fixture(scope="module")
def loaded(checkpoints):
    return {name: hf.load_pretrained(path) for name, (path, _) in checkpoints.items()}


def _torch_logits(model, ids, mask=None, positions=None):
    kwargs = {}
    if mask is not None:
        kwargs["attention_mask"] = torch.tensor(np.asarray(mask, np.int64))
    if positions is not None:
        kwargs["position_ids"] = torch.tensor(np.asarray(positions, np.int64))
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids, np.int64)), **kwargs).logits.float().numpy()


def _random_params(config, seed):
    """Params of `config` without running (slow, eager) Flax init."""
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (0.2 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)


def _ids(seed, shape=(2, 12)):
    return np.random.default_rng(seed).integers(0, VOCAB, shape)


# ----------------------------------------------------------------------------- config


def test_config_from_checkpoints(loaded):
    c = loaded["llama_gqa"].config
    assert (c.model_type, c.num_kv_heads, c.dim_per_head, c.tie_word_embeddings) == (
        "llama",
        2,
        16,
        False,
    )
    assert not c.attention_bias and not c.qk_norm and c.rope_scaling is None
    assert c.rms_norm_eps == 1e-5 and c.rope_theta == 10000.0

    c = loaded["llama_mqa_tied_llama3"].config
    assert c.num_kv_heads == 1 and c.tie_word_embeddings and c.rope_theta == 500000.0
    assert c.rope_scaling == tuple(sorted(LLAMA3_SCALING.items()))

    c = loaded["qwen2_tied"].config
    assert c.attention_bias and c.tie_word_embeddings and not c.qk_norm and c.rope_theta == 1e6
    assert "lm_head" not in loaded["qwen2_tied"].params

    c = loaded["qwen3_untied"].config
    assert c.qk_norm and c.head_dim == 32 and c.dim_per_head == 32 and not c.attention_bias
    assert loaded["qwen3_untied"].params["layers_0"]["attn"]["q_kernel"].shape == (64, 4, 32)


def test_every_family_names_its_transformers_class():
    """A registry row's architecture is the transformers class of its model_type, and its
    default head_dim is that config class's (Qwen3: 128, the others hidden / heads)."""
    for model_type, fam in families.FAMILIES.items():
        cls = getattr(transformers, fam.architecture)
        assert cls.config_class.model_type == model_type
        cfg = cls.config_class(hidden_size=64, num_attention_heads=4)
        assert (getattr(cfg, "head_dim", None) or 16) == (fam.head_dim or 16), model_type


def test_legacy_and_v5_rope_layouts_agree():
    base = {**COMMON, "model_type": "llama", "num_key_value_heads": 2, "head_dim": 16}
    legacy = {**base, "rope_theta": 5e5, "rope_scaling": dict(LLAMA3_SCALING)}
    v5 = {**base, "rope_parameters": {**LLAMA3_SCALING, "rope_theta": 5e5}}
    assert hf_format.config_from_hf(legacy) == hf_format.config_from_hf(v5)
    # transformers falls back to max_position_embeddings for the original length.
    no_orig = {k: v for k, v in LLAMA3_SCALING.items() if k != "original_max_position_embeddings"}
    cfg = hf_format.config_from_hf({**base, "rope_scaling": no_orig})
    assert dict(cfg.rope_scaling)["original_max_position_embeddings"] == 4096
    # Qwen3 without head_dim uses transformers' default 128, not hidden / heads.
    assert (
        hf_format.config_from_hf({**base, "model_type": "qwen3", "head_dim": None}).head_dim == 128
    )


def test_config_dtypes():
    base = {**COMMON, "model_type": "qwen2"}
    cfg = hf_format.config_from_hf(base, dtype=jnp.bfloat16)
    assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "bfloat16")
    cfg = hf_format.config_from_hf(base, dtype="bfloat16", param_dtype=jnp.float32)
    assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "float32")


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"model_type": "gpt2"}, r"'gpt2'.*supported: llama, qwen2, qwen3"),
        ({"model_type": None}, r"None.*supported: llama, qwen2, qwen3"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"'yarn'.*default, llama3"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"'linear'"),
        ({"hidden_act": "gelu"}, r"hidden_act.*'gelu'"),
        ({"mlp_bias": True}, r"mlp_bias"),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor"),
        (
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 8,
                "max_window_layers": 1,
            },
            r"sliding.*\[1\]",
        ),
        ({"vocab_size": None}, r"missing \['vocab_size'\]"),
    ],
)
def test_config_from_hf_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        hf_format.config_from_hf({**COMMON, "model_type": "llama", **changes})


def test_unused_sliding_window_is_accepted():
    cfg = {**COMMON, "model_type": "qwen2", "use_sliding_window": False, "sliding_window": 8}
    assert hf_format.config_from_hf(cfg).model_type == "qwen2"


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(checkpoints, loaded, name):
    _, torch_model = checkpoints[name]
    ids = _ids(1)
    ref = _torch_logits(torch_model, ids)
    ours = np.asarray(loaded[name](ids))
    assert ours.dtype == np.float32 and ours.shape == (2, 12, VOCAB)
    assert np.abs(ref).max() > 1.0  # the weights are not trivially small
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


def test_out_of_vocabulary_ids_are_refused(loaded):
    model = loaded[NAMES[0]]
    ids = _ids(1)
    ids[0, 3] = VOCAB
    with pytest.raises(ValueError, match=rf"input_ids_BxT: token id {VOCAB} is outside"):
        model(ids)


@pytest.mark.parametrize("name", NAMES)
def test_left_padded_batch_matches_transformers(checkpoints, loaded, name):
    _, torch_model = checkpoints[name]
    ids = _ids(2, (3, 10))
    pad = np.array([0, 3, 6])
    valid = np.arange(10)[None, :] >= pad[:, None]
    # transformers' generate() derives position ids the same way from the mask.
    positions = np.maximum(np.cumsum(valid, -1) - 1, 0)
    ref = _torch_logits(torch_model, ids, valid, positions)
    ours = np.asarray(loaded[name](ids, valid_BxT=valid))
    np.testing.assert_allclose(ours[valid], ref[valid], atol=TOL, rtol=0)
    assert np.isfinite(ours).all()  # pad rows attend to nothing and must stay finite
    # A row's real-token logits do not depend on how much padding precedes it.
    alone = np.asarray(loaded[name](ids[2:, 6:]))
    np.testing.assert_allclose(ours[2, 6:], alone[0], atol=TOL, rtol=0)


def test_llama3_rope_far_positions(checkpoints, loaded):
    """Positions past original_max_position_embeddings reach the scaled low frequencies."""
    name = "llama_mqa_tied_llama3"
    _, torch_model = checkpoints[name]
    ids = _ids(3, (1, 8))
    positions = 3000 + 37 * np.arange(8)[None, :]
    model = loaded[name]
    ref = _torch_logits(torch_model, ids, positions=positions)
    forward = jax.jit(apply, static_argnums=1)
    ours = np.asarray(forward(model.params, model.config, ids, positions))
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)
    unscaled = forward(model.params, model.config.replace(rope_scaling=None), ids, positions)
    assert np.abs(np.asarray(unscaled) - ref).max() > 100 * TOL  # the test can tell


# ----------------------------------------------------------------------------- save


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_through_transformers(loaded, tmp_path, name):
    model = loaded[name]
    hf.save_pretrained(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == model.config.model_type
    assert hf_format.config_from_hf(written) == model.config
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    )
    ids = _ids(4)
    np.testing.assert_allclose(_torch_logits(back, ids), np.asarray(model(ids)), atol=TOL, rtol=0)
    again = hf.load_pretrained(tmp_path)
    jax.tree.map(np.testing.assert_array_equal, again.params, model.params)


def test_save_bare_params_bf16_sharded(tmp_path):
    config = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        model_type="qwen3",
        qk_norm=True,
    )
    params = _random_params(config, 0)
    with pytest.raises(TypeError, match="config"):
        hf.save_pretrained(params, tmp_path)
    hf.save_pretrained(
        params,
        tmp_path,
        config=config,
        dtype=jnp.bfloat16,
        max_shard_size="8KB",
        hf_config={"eos_token_id": 5, "bos_token_id": 1},
    )
    index = json.loads((tmp_path / hf.INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / hf.SINGLE_FILE).exists()
    stored = load_file(tmp_path / shards[0])
    assert all(a.dtype == jnp.bfloat16 for a in stored.values())
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["eos_token_id"] == 5 and written["torch_dtype"] == "bfloat16"

    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    )
    ours = hf.load_pretrained(tmp_path)  # bf16 on disk, float32 in memory
    assert ours.params["embedding"].dtype == jnp.float32
    rounded = jax.tree.map(lambda p: p.astype(jnp.bfloat16).astype(jnp.float32), params)
    jax.tree.map(np.testing.assert_array_equal, ours.params, rounded)
    ids = _ids(5)
    np.testing.assert_allclose(_torch_logits(back, ids), np.asarray(ours(ids)), atol=TOL, rtol=0)
    # Saving again unsharded replaces the shards instead of leaving them beside the file.
    hf.save_pretrained(params, tmp_path, config=config)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors*")) == [hf.SINGLE_FILE]


def test_sharded_transformers_checkpoint_loads(checkpoints, loaded, tmp_path):
    _, torch_model = checkpoints["qwen2_tied"]
    torch_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / hf.INDEX_FILE).exists() and not (tmp_path / hf.SINGLE_FILE).exists()
    model = hf.load_pretrained(tmp_path)
    jax.tree.map(np.testing.assert_array_equal, model.params, loaded["qwen2_tied"].params)


def test_iter_hf_params_layout(checkpoints):
    path, _ = checkpoints["qwen3_untied"]
    config = hf_format.config_from_hf(hf.read_hf_config(path))
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    expected = {
        tuple(k.key for k in kp): v.shape for kp, v in jax.tree_util.tree_leaves_with_path(shapes)
    }
    got = {p: a for p, a in hf.iter_hf_params(path, config, dtype=jnp.bfloat16)}
    assert {p: a.shape for p, a in got.items()} == expected
    assert all(isinstance(a, np.ndarray) and a.dtype == jnp.bfloat16 for a in got.values())


def test_layout_transposes_against_torch_modules(checkpoints, loaded):
    """The mapping itself, checked on one layer against the torch module's own weights."""
    _, tm = checkpoints["qwen3_untied"]
    attn = tm.model.layers[1].self_attn
    p = loaded["qwen3_untied"].params["layers_1"]
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    with torch.no_grad():
        q_ref = attn.q_proj(torch.tensor(x)).numpy().reshape(3, 4, 32)
        o_in = np.random.default_rng(1).standard_normal((3, 4 * 32)).astype(np.float32)
        o_ref = attn.o_proj(torch.tensor(o_in)).numpy()
    np.testing.assert_allclose(np.einsum("te,ehd->thd", x, p["attn"]["q_kernel"]), q_ref, atol=1e-5)
    o_ours = np.einsum("thd,hde->te", o_in.reshape(3, 4, 32), p["attn"]["o_kernel"])
    np.testing.assert_allclose(o_ours, o_ref, atol=1e-5)


# ----------------------------------------------------------------------------- load errors


def _copy_with(src, dst, edit):
    """Copy a single-file checkpoint, passing its tensors through `edit(dict) -> dict`."""
    shutil.copytree(src, dst)
    tensors = edit(load_file(os.path.join(src, hf.SINGLE_FILE)))
    save_file(tensors, os.path.join(dst, hf.SINGLE_FILE), metadata={"format": "pt"})
    return dst


def test_missing_tensor(checkpoints, tmp_path):
    src, _ = checkpoints["llama_gqa"]
    name = "model.layers.1.mlp.up_proj.weight"
    path = _copy_with(src, tmp_path / "ckpt", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        hf.load_pretrained(path)


def test_wrong_shape(checkpoints, tmp_path):
    src, _ = checkpoints["llama_gqa"]
    name = "model.layers.0.self_attn.k_proj.weight"
    path = _copy_with(src, tmp_path / "ckpt", lambda t: {**t, name: t[name][:16]})
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\(16, 64\).*\(32, 64\)"):
        hf.load_pretrained(path)


def test_extra_tensors(checkpoints, tmp_path):
    src, _ = checkpoints["llama_gqa"]
    extra = np.zeros(3, np.float32)
    path = _copy_with(
        src, tmp_path / "a", lambda t: {**t, "model.layers.2.mlp.up_proj.weight": extra}
    )
    with pytest.raises(ValueError, match=r"unexpected tensor.*model\.layers\.2\.mlp\.up_proj"):
        hf.load_pretrained(path)
    benign = "model.layers.0.self_attn.rotary_emb.inv_freq"
    path = _copy_with(src, tmp_path / "b", lambda t: {**t, benign: extra})
    with pytest.warns(UserWarning, match="inv_freq"):
        hf.load_pretrained(path)


def test_missing_files(checkpoints, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        hf.load_pretrained(tmp_path)
    src, _ = checkpoints["llama_gqa"]
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors or model\.safetensors\.index"):
        hf.load_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf.load_pretrained(tmp_path / "nowhere")


def test_save_rejects_unrepresentable_config(tmp_path):
    config = ModelConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        model_type="qwen2",
    )
    params = _random_params(config, 0)
    with pytest.raises(ValueError, match="qwen2.*bias"):
        hf.save_pretrained(params, tmp_path, config=config)
    good = config.replace(attention_bias=True)
    with pytest.raises(ValueError, match="param tree does not match"):
        hf.save_pretrained(params, tmp_path, config=good)


# ----------------------------------------------------------------------------- tokenizer


def test_model_tokenizer_is_lazy_and_copied_on_save(checkpoints, tokenizer_dir, tmp_path):
    src, _ = checkpoints["llama_gqa"]
    assert hf.load_pretrained(src).tokenizer is None
    shutil.copytree(src, tmp_path / "with_tok")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / "with_tok" / name)
    model = hf.load_pretrained(tmp_path / "with_tok")
    assert model._tokenizer is False
    # config.json's eos_token_id (2, from LlamaConfig) joins the list after the others.
    assert model.tokenizer.eos_ids == (3, 4, 2)
    hf.save_pretrained(model, tmp_path / "saved")
    assert (tmp_path / "saved" / "tokenizer.json").exists()
    assert hf.load_pretrained(tmp_path / "saved").tokenizer.eos_id == 3


def test_a_truncated_config_json_is_named(tmp_path):
    from m2po_jax.common import checks

    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 6')
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}: not valid JSON"):
        checks.read_json(tmp_path / "config.json")
