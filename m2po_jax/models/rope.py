"""Rotary position embeddings (RoPE), half-split like Hugging Face, with Llama 3 scaling."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from m2po_jax.models.model_config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> jax.Array:
    """Inverse frequencies, with Llama 3 scaling when configured (float32)."""
    d = config.dim_per_head
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if config.rope_scaling is None:
        return inv_freq
    scaling = dict(config.rope_scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not supported (llama3 only)")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(medium, smoothed, scaled)


def rope_cos_sin(
    positions_BxT: jax.Array, inv_freq: jax.Array, dtype: Any = jnp.float32
) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B, T, 1, D] of the rotary angles, half-split like Hugging Face."""
    freqs = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([freqs, freqs], -1)[:, :, None, :]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def rotate(x_BxTxHxD: jax.Array, cos_BxTx1xD: jax.Array, sin_BxTx1xD: jax.Array) -> jax.Array:
    """x rotated by the angles whose cos and sin are given (`rope_cos_sin`), half-split."""
    x1, x2 = jnp.split(x_BxTxHxD, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x_BxTxHxD * cos_BxTx1xD + rotated * sin_BxTx1xD
