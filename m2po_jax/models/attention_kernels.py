"""The vendor attention kernels behind `attention.attend`'s "cudnn" and "splash" paths.

Both take the cache layout (k, v [B, K, S, D]) and T = S (no cache); see `attention.py`
for the masking contract they implement.

The devices a program is compiled for decide what runs, not the host's default backend:
`target_platform()` is the platform of the mesh in context (`jax.set_mesh(mesh)`, or
`jax.sharding.use_abstract_mesh` while tracing, which the trainer's program builders
enter), so a CPU host compiling for a TPU mesh (a deviceless topology) builds the real
Mosaic kernel, and a program for CPU devices on a TPU host runs Pallas' interpreter.
A Pallas kernel cannot be partitioned by XLA: `splash_attention_sharded` runs it inside
`jax.shard_map` over the mesh's batch and tensor axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from m2po_jax.common.mesh_axes import BATCH_AXES


def target_mesh():
    """The abstract mesh in context while tracing, or None when there is none."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def target_platform() -> str:
    """The platform ("tpu", "gpu", "cpu") of the devices the program is compiled for: the
    mesh in context, else `jax.default_backend()`."""
    mesh = target_mesh()
    device = None if mesh is None else getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None)
    if platform in ("cuda", "rocm"):
        platform = "gpu"
    return platform or jax.default_backend()


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
      interpret: Pallas interpret mode; None: off when compiling for TPU devices
        (`target_platform()`), on elsewhere (slow; for tests).

    Returns:
      [B, T, H, D] in q's dtype.
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, t, h, d = q_BxTxHxD.shape
    k = k_BxKxSxD.shape[1]
    if interpret is None:
        interpret = target_platform() != "tpu"
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


def auto_axes(mesh, rows: int) -> tuple[dict, list]:
    """A mesh's automatic axes (inside a `shard_map` manual over some axes, e.g. the paged
    engine's batch shards, the arrays are those axes' shards already: split over the
    others only) by size, and the batch axes (`BATCH_AXES`, in order) whose product
    divides `rows`: what a kernel run under `jax.shard_map` splits its rows over."""
    manual = set(getattr(mesh, "manual_axes", ()))
    shape = {a: s for a, s in zip(mesh.axis_names, mesh.axis_sizes, strict=True)
             if a not in manual}  # fmt: skip
    split, used = [], 1
    for axis in BATCH_AXES:
        size = shape.get(axis, 1)
        if size > 1 and rows % (used * size) == 0:
            split.append(axis)
            used *= size
    return shape, split


def splash_attention_sharded(
    q_BxTxHxD: jax.Array,
    k_BxKxSxD: jax.Array,
    v_BxKxSxD: jax.Array,
    segment_BxT: jax.Array,
    block_size: int = 512,
    mesh=None,
) -> jax.Array:
    """`splash_attention` on every device's block of rows and heads of a mesh.

    `mesh` (default `target_mesh()`): with none, one device, or inside a `shard_map`
    whose axes are all manual already, the kernel runs on the arrays as they are.
    Otherwise it runs inside `jax.shard_map`: rows split over the batch axes
    (`BATCH_AXES`, those whose product divides B), heads over "tensor". Query head h uses
    kv head h // G, so contiguous blocks of H / t query heads match blocks of K / t kv
    heads when t divides K; when t divides H but not K (fewer kv heads than tensor
    shards), k and v are repeated to H heads first (G = 1 inside); else heads stay whole
    on every tensor shard.
    """
    mesh = target_mesh() if mesh is None else mesh
    if mesh is None or mesh.size == 1 or mesh.are_all_axes_manual:
        return splash_attention(q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, segment_BxT, block_size)
    b, _, h, _ = q_BxTxHxD.shape
    k = k_BxKxSxD.shape[1]
    shape, rows = auto_axes(mesh, b)
    rows_axes = tuple(rows) or None
    tensor = shape.get("tensor", 1)
    heads = "tensor" if tensor > 1 and h % tensor == 0 else None
    if heads and k % tensor:
        k_BxKxSxD = jnp.repeat(k_BxKxSxD, h // k, axis=1)
        v_BxKxSxD = jnp.repeat(v_BxKxSxD, h // k, axis=1)
    q_spec, kv_spec = P(rows_axes, None, heads, None), P(rows_axes, heads, None, None)

    def local(q, k_, v, segment):
        return splash_attention(q, k_, v, segment, block_size)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, P(rows_axes, None)),
        out_specs=q_spec,
        axis_names=set(shape),
        check_vma=False,
    )(q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, segment_BxT)
