"""Architectures of the public checkpoints users train, as the `config.json` fields that fix
their shapes.

They let the memory plan, the presets and the benchmarks reason about a real model without
its weights (nothing is downloaded):

    model_config = architectures.model_config("qwen2.5-7b", dtype="bfloat16")

Values are those of each checkpoint's published config.json (Instruct and base share them).
"""

from __future__ import annotations

from typing import Any

from m2po_jax.models import hf_format
from m2po_jax.models.model_config import ModelConfig

_QWEN25 = dict(model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1e6)
_QWEN3 = dict(
    model_type="qwen3", hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1e6, head_dim=128
)

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        _QWEN25,
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "qwen2.5-1.5b": dict(
        _QWEN25,
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "qwen2.5-7b": dict(
        _QWEN25,
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    ),
    "qwen3-0.6b": dict(
        _QWEN3,
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "qwen3-1.7b": dict(
        _QWEN3,
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "qwen3-4b": dict(
        _QWEN3,
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "qwen3-8b": dict(
        _QWEN3,
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
    # Qwen3-30B-A3B: transformers' Qwen3MoeConfig defaults (hidden, heads, experts, widths)
    # but for the checkpoint's 48 layers, norm_topk_prob and context length.
    "qwen3-30b-a3b": dict(
        _QWEN3,
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
}


def hf_config(name: str, **changes) -> dict[str, Any]:
    """The `config.json` dict of architecture `name`, with `changes` applied."""
    if name not in ARCHITECTURES:
        raise ValueError(f"architecture: unknown {name!r}; known: {', '.join(ARCHITECTURES)}")
    return {**ARCHITECTURES[name], **changes}


def model_config(name: str, dtype: str = "bfloat16", param_dtype: str = "float32", **changes):
    """`ModelConfig` of architecture `name`; `changes` apply to the ModelConfig."""
    config: ModelConfig = hf_format.config_from_hf(
        hf_config(name), dtype=dtype, param_dtype=param_dtype
    )
    return config.replace(**changes)
