"""The vendor attention kernels behind `attention.attend`'s "cudnn" and "splash" paths.

Both take the cache layout (k, v [B, K, S, D]) and T = S (no cache); see `attention.py`
for the masking contract they implement.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _pad(x, multiple: int, axis: int):
    """x padded with zeros along `axis` to a multiple of `multiple`."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, -x.shape[axis] % multiple)
    return jnp.pad(x, widths)


# ----------------------------------------------------------------------------- cudnn


def span_attention(
    q_BxTxHxD: jax.Array,
    k_BxKxSxD: jax.Array,
    v_BxKxSxD: jax.Array,
    start_B: jax.Array,
    length_B: jax.Array,
    implementation: str = "cudnn",
) -> jax.Array:
    """Causal attention over each row's span of real tokens via `jax.nn.dot_product_attention`.

    Row b is rotated left by start_B[b], so its real tokens fill columns [0, length_B[b]);
    there causal & (query, key < length) equals causal & key-valid on the real queries,
    and cuDNN applies it as `is_causal` plus sequence lengths, skipping masked blocks.
    The output is rotated back. Needs T = S (no cache) and one contiguous span per row.

    Args:
      q_BxTxHxD, k_BxKxSxD, v_BxKxSxD: as in `attention.attend`; T = S (no cache).
      start_B: column of each row's first real token.
      length_B: real tokens per row, at least 1.
      implementation: passed to `jax.nn.dot_product_attention`: "cudnn", or "xla" to run
        the same arguments on any backend (tests).

    Returns:
      [B, T, H, D] in q's dtype.
    """
    roll = jax.vmap(lambda x, shift: jnp.roll(x, shift, axis=0))
    q = roll(q_BxTxHxD, -start_B)
    k = roll(k_BxKxSxD.transpose(0, 2, 1, 3), -start_B)
    v = roll(v_BxKxSxD.transpose(0, 2, 1, 3), -start_B)
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        is_causal=True,
        query_seq_lengths=length_B,
        key_value_seq_lengths=length_B,
        implementation=implementation,
    )
    return roll(out, start_B)


# ----------------------------------------------------------------------------- splash


def splash_attention(
    q_BxTxHxD: jax.Array,
    k_BxKxSxD: jax.Array,
    v_BxKxSxD: jax.Array,
    segment_BxT: jax.Array,
    block_size: int = 512,
    interpret: bool | None = None,
) -> jax.Array:
    """Causal attention by the Pallas TPU splash kernel, padding kept apart by segment ids.

    Real tokens are segment 1 and padding segment 0, so a real query sees exactly the real
    keys at or before it, and every query sees at least itself (no empty softmax row).
    GQA: one multi-query kernel per kv head over its G query heads [G, T, D], vmapped over
    (B, K). T is padded to a multiple of the block (a multiple of 128) with segment 0.

    Args:
      q_BxTxHxD, k_BxKxSxD, v_BxKxSxD: as in `attention.attend`; T = S (no cache).
      segment_BxT: 1 for real tokens, 0 for padding.
      block_size: query and key block of the kernel (rounded up to a multiple of 128).
      interpret: Pallas interpret mode; None: off on TPU, on elsewhere (slow; for tests).

    Returns:
      [B, T, H, D] in q's dtype.
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, t, h, d = q_BxTxHxD.shape
    k = k_BxKxSxD.shape[1]
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    block = min(-(-block_size // 128), -(-t // 128)) * 128
    tp = -(-t // block) * block
    scaled = q_BxTxHxD * jnp.asarray(d**-0.5, q_BxTxHxD.dtype)
    q = _pad(scaled.transpose(0, 2, 1, 3).reshape(b, k, h // k, t, d), tp, 3)
    kv = [_pad(x, tp, 2) for x in (k_BxKxSxD, v_BxKxSxD)]
    segment = _pad(segment_BxT.astype(jnp.int32), tp, 1)
    sizes = sa.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    causal = sa.MultiHeadMask([sa.CausalMask((tp, tp))] * (h // k))
    kernel = sa.make_splash_mqa_single_device(causal, block_sizes=sizes, interpret=interpret)

    def one(q_GxTxD, k_TxD, v_TxD, segment_T):
        return kernel(q_GxTxD, k_TxD, v_TxD, segment_ids=sa.SegmentIds(segment_T, segment_T))

    out = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)))(q, *kv, segment)
    return out[:, :, :, :t].reshape(b, h, t, d).transpose(0, 2, 1, 3)
