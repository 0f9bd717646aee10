"""The Pallas kernels for one decode step over a paged KV cache: TPU and GPU.

    out_BxHxD = tpu_decode_attention(q_BxHxD, kv, kv_lens_B, page_indices_BxM, sm_scale=d**-0.5)
    out_BxHxD = gpu_decode_attention(q_BxHxD, k, v, kv_lens_B, page_indices_BxM, sm_scale=...)

GPU: jax's Triton paged attention kernel (`jax.experimental.pallas.ops.gpu.paged_attention`)
over the pool's split layout (keys and values [K, NP, PG, D] each, `paged.py`); power-of-two
head dims and page sizes, a pool in the queries' dtype (`gpu_decode_supported`: the kernel
casts q and the probabilities to the pool's dtype, which would round a float32 query to
bfloat16 or float8; its quantised route takes per-token scale arrays this wrapper does not
make, so a bfloat16 pool under float32 compute and a float8 pool take the XLA path). It
compiles for an H100 through jax's CUDA plugin with no GPU attached, and runs in Pallas'
interpreter on a CPU (the tests).
The rest of this doc is the TPU kernel's.

jax's ragged paged attention kernel (`jax.experimental.pallas.ops.tpu.
ragged_paged_attention`), called with one query token per sequence (`cu_q_lens` =
0, 1, .., B). Sequence b's query attends to its tokens at positions 0 .. kv_lens_B[b] - 1
(the query is the last of them): softmax(q k^T * sm_scale) v, query head h reading kv head
h // (H // K), as `paged.attend` does.

Layout. Per layer the pool is one array kv [NP, PG, 2K, D] (pages, tokens per page, kv
heads with keys at even and values at odd indices, head dim), in the cache dtype
(`ModelConfig.cache_dtype`). Sequence b's position p lies in page
page_indices_BxM[b, p // PG], row p % PG.

What the kernel takes (jax 0.10.2, libtpu 0.0.42; found by compiling for v5e):

- head_dim 128 exactly: 64 trips an assertion in the kernel (its softmax statistics are
  128 lanes wide), 256 and 512 are refused by Mosaic ("The last dim size is not 128 in
  original base memref").
- 2K combined heads that XLA tiles fully in the pool's dtype (the kernel's
  `get_min_heads_per_blk`): K in {1, 2, 4, 8} or a multiple of 8 in bfloat16; K in
  {1, 2, 4} or a multiple of 4 in float32; K in {2, 4, 8, 16} or a multiple of 16 in
  float8 (four to 32 bits).
- a pool of float32, bfloat16 or float8 e4m3fn, queries of float32 or bfloat16. A pool in
  the queries' dtype runs as is; another (a bfloat16 pool under float32 compute, a float8
  pool) takes the kernel's quantised-cache route with k_scale = v_scale = 1.0: each block
  of keys and values is converted to the queries' dtype in VMEM (through float32, times
  1.0: exact), so the kernel attends as `paged.attend` does to the stored values, and
  reads the pool's bytes from HBM. Compiled for v5e (`tests/models/paged_kernels_test.py`);
  v5e has no float8 arithmetic, and needs none on this route.
- a kv block within the chip's scoped VMEM (16 MiB by default on v5e: `decode_block_sizes`).

Any page size compiles (1, 3, 16, 256 tried), any pages per sequence, and the pages per
block need not divide it. `tuned_block_sizes` is not used: it asks `jax.devices()` for the
chip, which is wrong when a CPU host compiles for a TPU topology.

Neither Pallas interpreter runs this kernel on a CPU in jax 0.10.2 (the TPU interpreter
cannot read through the kernel's reshaped VMEM ref, the HLO interpreter cannot store
through its `.at[i]` views), so its numerics are checked only on a TPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from m2po_jax.common.mesh_axes import BATCH_AXES
from m2po_jax.models.attention_kernels import target_mesh

HEAD_DIM = 128  # the only head dim the kernel compiles
MAX_PAGES_PER_BLOCK = 16  # the largest block of jax's tuned tables (one DMA per page)
QUERIES_PER_BLOCK = 32  # the tuned tables' usual query block
# Half the smallest default scoped VMEM (16 MiB: v4, v5e, v5p): `_vmem_bytes` has
# underestimated what the v5e compiler needs by up to 1.44x (14 shapes), never by 2x.
VMEM_BUDGET_BYTES = 8 * 2**20
DTYPES = ("float32", "bfloat16", "float8_e4m3fn")  # the pool's
Q_DTYPES = ("float32", "bfloat16")  # the queries'


def _rpa():
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

    return kernel


def _kernel(*args, **kwargs):
    """jax's `ragged_paged_attention` (the tests put an XLA stand-in here on a CPU)."""
    return _rpa().ragged_paged_attention(*args, **kwargs)


def _heads_per_block(num_q_heads: int, num_kv_heads: int, dtype, q_dtype=None) -> tuple[int, int]:
    """(query heads, combined kv heads) of one kernel block for a pool of `dtype` and queries
    of `q_dtype` (default `dtype`); ValueError if 2K does not tile."""
    q_dtype = dtype if q_dtype is None else q_dtype
    return _rpa().get_min_heads_per_blk(num_q_heads, 2 * num_kv_heads, q_dtype, dtype)


def _vmem_bytes(
    page_size, pages_per_block, queries_per_block, q_heads, kv_heads, dtype, q_dtype=None
):
    """Scoped VMEM of one kernel block (an estimate: the compiler's own figure differs).

    kv pages (`dtype`) double-buffered, the q and output blocks (`q_dtype`, default
    `dtype`) double-buffered, the float32 accumulator and softmax statistics (128 lanes
    wide), one kv head's float32 scores, probabilities, masked keys and values."""
    q_dtype = dtype if q_dtype is None else q_dtype
    q_blk, combined = _heads_per_block(q_heads, kv_heads, dtype, q_dtype)
    group = q_heads // kv_heads
    tokens, rows, d = pages_per_block * page_size, queries_per_block * group, HEAD_DIM
    kv = 2 * tokens * combined * d * jnp.dtype(dtype).itemsize
    q_out = 4 * queries_per_block * q_blk * d * jnp.dtype(q_dtype).itemsize
    acc = queries_per_block * q_blk * d * 4
    stats = 2 * (combined // 2) * rows * 128 * 4
    temporaries = (2 * rows * tokens + 2 * tokens * d + rows * d) * 4
    return kv + q_out + acc + stats + temporaries


def _why_unsupported(
    page_size, num_q_heads, num_kv_heads, head_dim, dtype, q_dtype=None
) -> str | None:
    """Why the kernel cannot take these shapes and dtypes (the pool's `dtype`, the queries'
    `q_dtype`, default `dtype`), or None."""
    q_dtype = dtype if q_dtype is None else q_dtype
    if jnp.dtype(dtype).name not in DTYPES:
        return f"dtype {jnp.dtype(dtype).name}, expected one of {DTYPES}"
    if jnp.dtype(q_dtype).name not in Q_DTYPES:
        return f"query dtype {jnp.dtype(q_dtype).name}, expected one of {Q_DTYPES}"
    if head_dim != HEAD_DIM:
        return f"head_dim {head_dim}, expected {HEAD_DIM}"
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        return f"{num_q_heads} query heads, expected a multiple of the {num_kv_heads} kv heads"
    try:
        _heads_per_block(num_q_heads, num_kv_heads, dtype, q_dtype)
    except ValueError:
        return f"{num_kv_heads} kv heads do not tile in {jnp.dtype(dtype).name}"
    if _vmem_bytes(page_size, 1, 1, num_q_heads, num_kv_heads, dtype, q_dtype) > VMEM_BUDGET_BYTES:
        return (
            f"page_size {page_size}: one page per block is over {VMEM_BUDGET_BYTES} bytes of VMEM"
        )
    return None


def _local_heads(num_q_heads: int, num_kv_heads: int, tensor: int) -> tuple[int, int]:
    """Heads per device: split over `tensor` shards when they divide the kv heads."""
    if tensor > 1 and num_kv_heads % tensor == 0:
        return num_q_heads // tensor, num_kv_heads // tensor
    return num_q_heads, num_kv_heads


def tpu_decode_supported(
    page_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype,
    tensor: int = 1,
    q_dtype=None,
) -> bool:
    """Whether the kernel takes these shapes, a pool of `dtype` and queries of `q_dtype`
    (default `dtype`) (else use the XLA path, `paged.attend`).

    `tensor`: the size of the mesh's "tensor" axis `tpu_decode_attention_sharded` splits
    the heads over (it splits them when it divides the kv heads)."""
    heads = _local_heads(num_q_heads, num_kv_heads, tensor)
    return _why_unsupported(page_size, *heads, head_dim, dtype, q_dtype) is None


def decode_block_sizes(
    page_size: int,
    pages_per_seq: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype,
    q_dtype=None,
) -> tuple[int, int]:
    """(pages_per_block, queries_per_block) for a decode step, without asking for a device.

    queries_per_block: `QUERIES_PER_BLOCK`, halved while one page per block would be over
    `VMEM_BUDGET_BYTES`; pages_per_block: min(pages_per_seq, `MAX_PAGES_PER_BLOCK`), less
    one while the estimate (`_vmem_bytes`) is over the budget.

    Raises:
      ValueError: the kernel cannot take these shapes (`tpu_decode_supported`).
    """
    reason = _why_unsupported(page_size, num_q_heads, num_kv_heads, head_dim, dtype, q_dtype)
    if reason:
        raise ValueError(f"decode_block_sizes: {reason}")
    fits = functools.partial(_vmem_bytes, page_size, q_heads=num_q_heads,
                             kv_heads=num_kv_heads, dtype=dtype, q_dtype=q_dtype)  # fmt: skip
    queries = QUERIES_PER_BLOCK
    while queries > 1 and fits(1, queries) > VMEM_BUDGET_BYTES:
        queries //= 2
    pages = max(1, min(pages_per_seq, MAX_PAGES_PER_BLOCK))
    while pages > 1 and fits(pages, queries) > VMEM_BUDGET_BYTES:
        pages -= 1
    return pages, queries


def tpu_decode_attention(
    q_BxHxD: jax.Array,
    kv_NPxPGx2KxD: jax.Array,
    kv_lens_B: jax.Array,
    page_indices_BxM: jax.Array,
    *,
    sm_scale: float,
    pages_per_block: int | None = None,
    queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """One decode step of every sequence by the Pallas TPU ragged paged attention kernel.

    out[b, h] = sum_{p < kv_lens_B[b]} softmax_p(q[b, h] . k[b, p, h // G] * sm_scale)
    v[b, p, h // G], G = H // K, with k and v of position p read from page
    page_indices_BxM[b, p // PG], row p % PG.

    Empty slots: a sequence with kv_lens_B[b] <= 0 is run with length 1 (it reads row 0 of
    its first page) and its output is 0. The kernel must never see length 0: it skips
    such a sequence's blocks and so leaves unwaited the copy it started for it, and the
    next sequence reads those pages instead of its own.
    Lengths are clamped to M * PG and page ids to [0, NP): a sentinel id (NP, "no page",
    as `paged.py` uses) in a column beyond the length reads a real page harmlessly; one
    within the length is the caller's bug and reads page NP - 1.

    Args:
      q_BxHxD: each sequence's query, float32 or bfloat16; the output's dtype. A pool of
        another dtype is converted to it block by block in the kernel (module doc).
      kv_NPxPGx2KxD: the layer's pool (module doc), float32, bfloat16 or float8 e4m3fn.
      kv_lens_B: int tokens of each sequence in the pool, the query's own included.
      page_indices_BxM: int page ids of each sequence's positions.
      sm_scale: the scores' scale (D ** -0.5 for plain attention).
      pages_per_block, queries_per_block: the kernel's blocks; None: `decode_block_sizes`
        (queries per block at most B).
      vmem_limit_bytes: the kernel's scoped VMEM limit; None: the compiler's default.

    Returns:
      [B, H, D] in q's dtype.

    Raises:
      ValueError: shapes that do not match, or that the kernel cannot take
        (`tpu_decode_supported`); the message names them.
    """
    b, h, d = q_BxHxD.shape
    n_pages, page_size, combined, d_kv = kv_NPxPGx2KxD.shape
    m = page_indices_BxM.shape[-1]
    if combined % 2 or d_kv != d or kv_lens_B.shape != (b,) or page_indices_BxM.shape != (b, m):
        raise ValueError(
            f"tpu_decode_attention: q {q_BxHxD.shape}, kv {kv_NPxPGx2KxD.shape}, kv_lens "
            f"{kv_lens_B.shape}, page_indices {page_indices_BxM.shape}; expected "
            "[B, H, D], [NP, PG, 2K, D], [B], [B, M]"
        )
    dtype, q_dtype = kv_NPxPGx2KxD.dtype, q_BxHxD.dtype
    reason = _why_unsupported(page_size, h, combined // 2, d, dtype, q_dtype)
    if reason:
        raise ValueError(
            f"tpu_decode_attention: q {q_BxHxD.shape}, kv {kv_NPxPGx2KxD.shape} "
            f"{jnp.dtype(dtype).name}: {reason}"
        )
    auto_pages, auto_queries = decode_block_sizes(page_size, m, h, combined // 2, d, dtype, q_dtype)
    pages = pages_per_block or auto_pages
    queries = min(queries_per_block or auto_queries, b)
    if not 0 < pages <= m:
        raise ValueError(f"tpu_decode_attention: pages_per_block={pages}, expected 1 to {m}")
    length_B = jnp.clip(kv_lens_B.astype(jnp.int32), 1, m * page_size)
    pages_BxM = jnp.clip(page_indices_BxM.astype(jnp.int32), 0, n_pages - 1)
    # A pool in another dtype: the kernel's quantised route at scale 1.0 converts each
    # block of keys and values to q's dtype (exactly); without scales it would multiply
    # q with the pool's dtype as it is.
    scales = {} if dtype == q_dtype else dict(k_scale=1.0, v_scale=1.0)
    out = _kernel(
        q_BxHxD,
        kv_NPxPGx2KxD,
        length_B,
        pages_BxM,
        jnp.arange(b + 1, dtype=jnp.int32),  # cu_q_lens: one query per sequence
        jnp.array([b], jnp.int32),  # num_seqs
        sm_scale=float(sm_scale),
        **scales,
        num_kv_pages_per_block=pages,
        num_queries_per_block=queries,
        vmem_limit_bytes=vmem_limit_bytes,
    )
    return jnp.where((kv_lens_B > 0)[:, None, None], out, 0).astype(q_BxHxD.dtype)


def tpu_decode_attention_sharded(
    q_BxHxD: jax.Array,
    kv_NPxPGx2KxD: jax.Array,
    kv_lens_B: jax.Array,
    page_indices_BxM: jax.Array,
    *,
    sm_scale: float,
    mesh=None,
    pages_per_block: int | None = None,
    queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """`tpu_decode_attention` on every device's sequences and heads of a mesh.

    A Pallas kernel cannot be partitioned by XLA, so it runs inside `jax.shard_map` over
    the mesh's axes that are not manual already (`mesh`, default `target_mesh()`; with
    none, one device, or every axis manual, it runs on the arrays as they are):

    - sequences over the batch axes (`BATCH_AXES` of size > 1, s shards in all): shard i
      holds sequences i * B/s .. and its own pool, pages i * NP/s .. of kv, and its page
      ids are LOCAL to that pool (0 .. NP/s - 1). B and NP must divide by s.
    - heads over "tensor" (t shards) when t divides K: shard j holds query heads
      j * H/t .. and combined kv heads j * 2K/t .. (kv heads j * K/t .., each key with its
      value), which query head h // G reads. Otherwise every tensor shard holds all heads
      and computes them all.

    Inside an engine's `shard_map` manual over the batch axes (the paged engine's), the
    arrays are that shard's already and only "tensor" is split here.

    Raises:
      ValueError: B or NP does not divide over the batch shards, or a device's shapes are
        ones the kernel cannot take.
    """
    call = functools.partial(
        tpu_decode_attention,
        sm_scale=sm_scale,
        pages_per_block=pages_per_block,
        queries_per_block=queries_per_block,
        vmem_limit_bytes=vmem_limit_bytes,
    )

    def specs(rows, heads):  # q, kv, kv_lens, page_indices; the output is q's
        return P(rows, heads, None), P(rows, None, heads, None), P(rows), P(rows, None)

    return _on_free_axes(
        "tpu_decode_attention_sharded", call, specs, mesh, kv_NPxPGx2KxD.shape[0],
        kv_NPxPGx2KxD.shape[2] // 2, q_BxHxD, kv_NPxPGx2KxD, kv_lens_B, page_indices_BxM,
    )  # fmt: skip


def _on_free_axes(name, call, specs, mesh, n_pages, kv_heads, q_BxHxD, *args):
    """`call(q_BxHxD, *args)` in `jax.shard_map` over the mesh's axes not manual already:
    sequences (and the pool's pages) over the batch axes, heads over "tensor" when it
    divides the kv heads. `specs(rows, heads)` gives the in_specs (q's first, and it is
    the output's)."""
    mesh = target_mesh() if mesh is None else mesh
    if mesh is None or mesh.size == 1 or mesh.are_all_axes_manual:
        return call(q_BxHxD, *args)
    manual = set(mesh.manual_axes)
    free = [a for a in mesh.axis_names if a not in manual]
    size = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    rows = tuple(a for a in BATCH_AXES if a in free and size[a] > 1)
    shards = math.prod(size[a] for a in rows)
    b = q_BxHxD.shape[0]
    if b % shards or n_pages % shards:
        raise ValueError(
            f"{name}: {b} sequences and {n_pages} pages, expected "
            f"both to divide over the {shards} batch shards of {rows}"
        )
    tensor = size["tensor"] if "tensor" in free else 1
    heads = "tensor" if tensor > 1 and kv_heads % tensor == 0 else None
    in_specs = specs(rows or None, heads)
    return jax.shard_map(
        call, mesh=mesh, in_specs=in_specs, out_specs=in_specs[0], axis_names=set(free),
        check_vma=False,
    )(q_BxHxD, *args)  # fmt: skip


# ----------------------------------------------------------------------------- GPU

GPU_DTYPES = ("float32", "bfloat16", "float16")
GPU_BLOCK_TOKENS = 64  # keys per compute block (pages_per_compute_block x page size)
GPU_MAX_SPLITS = 16  # jax's default k_splits: partitions of a sequence's pages


def _gpu_kernel(*args, **kwargs):
    """jax's Triton `paged_attention` (`jax.experimental.pallas.ops.gpu`)."""
    from jax.experimental.pallas.ops.gpu import paged_attention

    return paged_attention.paged_attention(*args, **kwargs)


def _why_gpu_unsupported(
    page_size, num_q_heads, num_kv_heads, head_dim, dtype, q_dtype=None
) -> str | None:
    """Why the GPU kernel cannot take these shapes, or None (Triton blocks are powers of
    two: the head dim, and a compute block of whole pages of at least 16 keys; the pool in
    the queries' dtype `q_dtype`, default `dtype`)."""
    if jnp.dtype(dtype).name not in GPU_DTYPES:
        return f"dtype {jnp.dtype(dtype).name}, expected one of {GPU_DTYPES}"
    if q_dtype is not None and jnp.dtype(q_dtype) != jnp.dtype(dtype):
        return f"a {jnp.dtype(dtype).name} pool under {jnp.dtype(q_dtype).name} queries"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim}, expected a power of two >= 16"
    if page_size < 1 or page_size & (page_size - 1) or page_size > GPU_BLOCK_TOKENS:
        return f"page_size {page_size}, expected a power of two <= {GPU_BLOCK_TOKENS}"
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        return f"{num_q_heads} query heads, expected a multiple of the {num_kv_heads} kv heads"
    return None


def gpu_decode_supported(
    page_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype,
    tensor: int = 1,
    q_dtype=None,
) -> bool:
    """Whether the GPU kernel takes these shapes and dtypes (else use the XLA path,
    `paged.attend`); `tensor` and `q_dtype` as for `tpu_decode_supported`."""
    heads = _local_heads(num_q_heads, num_kv_heads, tensor)
    return _why_gpu_unsupported(page_size, *heads, head_dim, dtype, q_dtype) is None


def gpu_decode_block_sizes(page_size: int, pages_per_seq: int) -> tuple[int, int, int]:
    """(pages_per_compute_block, k_splits, padded pages per sequence): compute blocks of
    `GPU_BLOCK_TOKENS` keys (at least 16), as many partitions of a sequence as it has
    blocks (at most `GPU_MAX_SPLITS`), the page table padded to whole partitions."""
    block = max(GPU_BLOCK_TOKENS // page_size, 1)
    blocks = -(-pages_per_seq // block)
    splits = min(blocks, GPU_MAX_SPLITS)
    per_split = -(-blocks // splits) * block
    return block, splits, per_split * splits


def gpu_decode_attention(
    q_BxHxD: jax.Array,
    k_KxNPxPGxD: jax.Array,
    v_KxNPxPGxD: jax.Array,
    kv_lens_B: jax.Array,
    page_indices_BxM: jax.Array,
    *,
    sm_scale: float,
    interpret: bool = False,
) -> jax.Array:
    """One decode step of every sequence by jax's Triton paged attention kernel.

    The same attention as `tpu_decode_attention`, over keys and values in the pool's split
    layout ([K, NP, PG, D] each, `paged.py`). The kernel has no scale: q is scaled first.
    Page ids are clamped to [0, NP) and the table padded to the kernel's partitions
    (`gpu_decode_block_sizes`); columns beyond a sequence's length are masked by the
    kernel. A sequence of length 0 gives 0.

    `interpret`: run the kernel in Pallas' interpreter (on a CPU, for tests).

    Raises:
      ValueError: shapes that do not match or that the kernel cannot take; the message
        names them.
    """
    b, h, d = q_BxHxD.shape
    kh, n_pages, page_size, d_kv = k_KxNPxPGxD.shape
    m = page_indices_BxM.shape[-1]
    if (
        v_KxNPxPGxD.shape != k_KxNPxPGxD.shape or d_kv != d or kv_lens_B.shape != (b,)
        or page_indices_BxM.shape != (b, m)
    ):  # fmt: skip
        raise ValueError(
            f"gpu_decode_attention: q {q_BxHxD.shape}, k {k_KxNPxPGxD.shape}, v "
            f"{v_KxNPxPGxD.shape}, kv_lens {kv_lens_B.shape}, page_indices "
            f"{page_indices_BxM.shape}; expected [B, H, D], [K, NP, PG, D] twice, [B], [B, M]"
        )
    dtype = k_KxNPxPGxD.dtype
    reason = _why_gpu_unsupported(page_size, h, kh, d, dtype, q_BxHxD.dtype)
    if reason:
        raise ValueError(f"gpu_decode_attention: k {k_KxNPxPGxD.shape}: {reason}")
    block, splits, padded = gpu_decode_block_sizes(page_size, m)
    pages_BxM = jnp.clip(page_indices_BxM.astype(jnp.int32), 0, n_pages - 1)
    pages_BxM = jnp.pad(pages_BxM, ((0, 0), (0, padded - m)))
    lengths_B = jnp.clip(kv_lens_B.astype(jnp.int32), 0, m * page_size)
    out = _gpu_kernel(
        (q_BxHxD * sm_scale).astype(dtype), k_KxNPxPGxD, v_KxNPxPGxD, pages_BxM, lengths_B,
        block_h=16, pages_per_compute_block=block, k_splits=splits, interpret=interpret,
    )  # fmt: skip
    return jnp.where((kv_lens_B > 0)[:, None, None], out, 0).astype(q_BxHxD.dtype)


def gpu_decode_attention_sharded(
    q_BxHxD, k_KxNPxPGxD, v_KxNPxPGxD, kv_lens_B, page_indices_BxM, *, sm_scale, mesh=None
) -> jax.Array:
    """`gpu_decode_attention` on every device's sequences and heads of a mesh, split as
    `tpu_decode_attention_sharded` splits them (pages on axis 1, kv heads on axis 0)."""
    call = functools.partial(gpu_decode_attention, sm_scale=sm_scale)

    def specs(rows, heads):
        kv = P(heads, rows, None, None)
        return P(rows, heads, None), kv, kv, P(rows), P(rows, None)

    return _on_free_axes(
        "gpu_decode_attention_sharded", call, specs, mesh, k_KxNPxPGxD.shape[1],
        k_KxNPxPGxD.shape[0], q_BxHxD, k_KxNPxPGxD, v_KxNPxPGxD, kv_lens_B, page_indices_BxM,
    )  # fmt: skip
