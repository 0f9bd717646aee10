"""The paged decode kernel's wrapper against a numpy reference, and the kernel compiled.

No Pallas interpreter runs jax 0.10.2's ragged paged attention kernel on a CPU (the
module doc says why), so here the wrapper's arguments and empty-slot rule run through
jax's reference kernel (`ref_ragged_paged_attention`, the kernel's documented semantics)
and its `shard_map` contract through an XLA stand-in; the Mosaic kernel itself is
compiled for v5e by libtpu's deviceless compile and its numerics need a TPU.
"""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from m2po_jax.models import paged_kernels as pk
from m2po_jax.parallel import sharding

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed (the tpu extra: pip install -e '.[tpu]')",
)

B, H, K, D, PG, M = 6, 4, 2, 128, 4, 4
SCALE = D**-0.5


def numpy_decode(q_BxHxD, kv_NxPxCxD, lens_B, pages_BxM, sm_scale):
    """Each query over its sequence's first lens_B[b] positions, gathered page by page;
    query head h reads kv head h // (H // K); an empty sequence gives 0. float64."""
    b, h, d = q_BxHxD.shape
    group = h // (kv_NxPxCxD.shape[2] // 2)
    out = np.zeros((b, h, d))
    for row in range(b):
        pos = np.arange(lens_B[row])
        if not pos.size:
            continue
        tokens = kv_NxPxCxD[pages_BxM[row, pos // PG], pos % PG].astype(np.float64)
        for head in range(h):
            k, v = tokens[:, 2 * (head // group)], tokens[:, 2 * (head // group) + 1]
            scores = k @ q_BxHxD[row, head].astype(np.float64) * sm_scale
            p = np.exp(scores - scores.max())
            out[row, head] = (p / p.sum()) @ v
    return out


def xla_kernel(seen, q, kv, lens, pages, cu_q_lens, num_seqs, *, sm_scale, **blocks):
    """The kernel's decode semantics in XLA ops (a stand-in for the sharded tests); records
    the shapes and block sizes each device's call got."""
    seen.append((q.shape, kv.shape, lens.shape, pages.shape, blocks))
    b, h, d = q.shape
    k_heads = kv.shape[2] // 2
    tokens = kv[pages].reshape(b, -1, 2 * k_heads, d)  # [B, M * PG, 2K, D]
    k = jnp.repeat(tokens[:, :, 0::2], h // k_heads, axis=2)
    v = jnp.repeat(tokens[:, :, 1::2], h // k_heads, axis=2)
    scores = jnp.einsum("bhd,bshd->bhs", q, k) * sm_scale
    allowed = jnp.arange(tokens.shape[1])[None, None, :] < lens[:, None, None]
    probs = jax.nn.softmax(jnp.where(allowed, scores, -1e30), axis=-1)
    return jnp.einsum("bhs,bshd->bhd", probs, v)


def make_case(rng, b=B, n_pages=16, lens=(1, 3, 4, 9, 0, 16)):
    """Ragged lengths: 1, a partial page, a full page, 2 pages + 1, an empty slot, the
    whole table; columns beyond a length hold the engine's "no page" id (n_pages)."""
    lens = np.resize(np.asarray(lens, np.int32), b)
    q = rng.standard_normal((b, H, D)).astype(np.float32)
    kv = rng.standard_normal((n_pages, PG, 2 * K, D)).astype(np.float32)
    pages = np.full((b, M), n_pages, np.int32)
    for row in range(b):
        used = -(-lens[row] // PG)
        pages[row, :used] = rng.choice(n_pages, used, replace=False)
    return q, kv, lens, pages


def test_decode_matches_numpy_through_the_reference_kernel(monkeypatch):
    """The wrapper's arguments (one query per sequence, clamped lengths and page ids) run
    by jax's reference kernel equal the numpy reference; the empty slot gives exactly 0."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

    calls = []

    def reference(q, kv, lens, pages, cu_q_lens, num_seqs, *, sm_scale, **blocks):
        calls.append((np.asarray(cu_q_lens), np.asarray(num_seqs), np.asarray(lens), blocks))
        return rpa.ref_ragged_paged_attention(q, kv, lens, pages, cu_q_lens, num_seqs,
                                              sm_scale=sm_scale)  # fmt: skip

    monkeypatch.setattr(pk, "_kernel", reference)
    q, kv, lens, pages = make_case(np.random.default_rng(0))
    out = pk.tpu_decode_attention(q, kv, lens, pages, sm_scale=SCALE)
    np.testing.assert_allclose(out, numpy_decode(q, kv, lens, pages, SCALE), atol=1e-5, rtol=1e-5)
    assert not np.any(np.asarray(out)[4])  # the empty slot
    cu_q_lens, num_seqs, kernel_lens, blocks = calls[0]
    np.testing.assert_array_equal(cu_q_lens, np.arange(B + 1))
    np.testing.assert_array_equal(num_seqs, [B])
    np.testing.assert_array_equal(kernel_lens, [1, 3, 4, 9, 1, 16])  # never 0
    assert blocks == dict(num_kv_pages_per_block=M, num_queries_per_block=B, vmem_limit_bytes=None)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_a_pool_in_another_dtype_is_read_at_scale_one_under_the_queries_dtype(monkeypatch, dtype):
    """A bfloat16 or float8 pool under float32 queries: the query goes in as it is, with
    k_scale = v_scale = 1.0 (the kernel converts each block of keys and values to the
    query's dtype: exactly), so the reference kernel's output is the float32 attention
    over the pool's stored values."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

    calls = []

    def reference(q, kv, *args, sm_scale, **blocks):
        calls.append((q.dtype, kv.dtype, blocks))
        return rpa.ref_ragged_paged_attention(q, kv, *args, sm_scale=sm_scale,
                                              k_scale=blocks["k_scale"], v_scale=blocks["v_scale"])  # fmt: skip

    monkeypatch.setattr(pk, "_kernel", reference)
    q, kv, lens, pages = make_case(np.random.default_rng(8))
    stored = jnp.asarray(kv).astype(dtype)
    out = pk.tpu_decode_attention(q, stored, lens, pages, sm_scale=SCALE)
    assert out.dtype == jnp.float32
    want = numpy_decode(q, np.asarray(stored, np.float32), lens, pages, SCALE)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    q_dtype, kv_dtype, blocks = calls[0]
    assert (q_dtype, kv_dtype) == (jnp.float32, dtype)
    assert blocks["k_scale"] == blocks["v_scale"] == 1.0


def test_decode_kernel_takes_the_dtypes_each_kernel_reads(monkeypatch):
    """TPU: a pool in the queries' dtype, or a bfloat16 / float8 one under float32 or
    bfloat16 queries (float8 packs 4 to 32 bits: 2K = 2 does not tile, the XLA path);
    GPU: only a pool in the queries' dtype (its kernel would round a float32 query to the
    pool's dtype); everything else the XLA path (None)."""
    from m2po_jax.models import attention_kernels, paged

    def kernel(platform, q_dtype, kv_dtype, kv_heads=2):
        monkeypatch.setattr(attention_kernels, "target_platform", lambda: platform)
        q = jnp.zeros((4, 1, 4, D), q_dtype)
        if platform == "tpu":
            kv = jnp.zeros((8, PG, 2 * kv_heads, D), kv_dtype)
            return paged.decode_kernel(q, kv, paged.INTERLEAVED)
        kv = jnp.zeros((2, kv_heads, 8, PG, D), kv_dtype)
        return paged.decode_kernel(q, kv, paged.SPLIT)

    f32, bf16, fp8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn
    assert kernel("tpu", bf16, bf16) == kernel("tpu", f32, f32) == "tpu"
    assert kernel("tpu", f32, bf16) == kernel("tpu", f32, fp8) == kernel("tpu", bf16, fp8) == "tpu"
    assert kernel("tpu", f32, fp8, kv_heads=1) is None and kernel("tpu", f32, bf16, 1) == "tpu"
    assert kernel("tpu", jnp.float16, jnp.float16) is None
    assert kernel("gpu", bf16, bf16) == kernel("gpu", f32, f32) == "gpu"
    assert kernel("gpu", f32, bf16) is None and kernel("gpu", bf16, fp8) is None
    assert kernel("gpu", f32, fp8) is None


def _split_case(rng, shards, per_shard_pages=12):
    """Each shard's sequences with page ids local to its own pool; the pool of shard i is
    pages i * per_shard_pages .. of the whole."""
    parts = [make_case(rng, B, per_shard_pages) for _ in range(shards)]
    q, kv, lens, pages = (np.concatenate(x) for x in zip(*parts, strict=True))
    expected = np.concatenate([numpy_decode(*part, SCALE) for part in parts])
    return (q, kv, lens, pages), expected


def test_sharded_splits_sequences_pools_and_heads(monkeypatch):
    """data=2 x tensor=2: each device runs its 6 sequences over its own 12 pages with
    local page ids, and one kv head (its key and value) with its 2 query heads."""
    seen = []
    monkeypatch.setattr(pk, "_kernel", functools.partial(xla_kernel, seen))
    args, expected = _split_case(np.random.default_rng(1), shards=2)
    mesh = sharding.make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])
    with jax.set_mesh(mesh):
        out = jax.jit(functools.partial(pk.tpu_decode_attention_sharded, sm_scale=SCALE))(*args)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)
    assert seen[0][:4] == ((B, H // 2, D), (12, PG, 2, D), (B,), (B, M))


def test_sharded_inside_an_engines_shard_map_splits_only_the_heads(monkeypatch):
    """Called inside a shard_map already manual over "data" (as the paged engine runs
    each batch shard), it splits the heads over "tensor" and leaves the rows as they are."""
    seen = []
    monkeypatch.setattr(pk, "_kernel", functools.partial(xla_kernel, seen))
    args, expected = _split_case(np.random.default_rng(2), shards=2)
    mesh = sharding.make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])
    engine = jax.shard_map(
        functools.partial(pk.tpu_decode_attention_sharded, sm_scale=SCALE),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
        axis_names={"data"},
        check_vma=False,
    )
    with jax.set_mesh(mesh):
        out = jax.jit(engine)(*args)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)
    assert seen[0][:2] == ((B, H // 2, D), (12, PG, 2, D))


def test_shapes_the_kernel_cannot_take_raise_naming_them():
    q, kv, lens, pages = make_case(np.random.default_rng(3))
    with pytest.raises(ValueError, match=r"q \(6, 4, 64\).*head_dim 64, expected 128"):
        pk.tpu_decode_attention(q[..., :64], kv[..., :64], lens, pages, sm_scale=SCALE)
    three = np.zeros((16, PG, 6, D), jnp.bfloat16)
    with pytest.raises(ValueError, match="3 kv heads do not tile in bfloat16"):
        pk.tpu_decode_attention(np.zeros((B, 6, D), jnp.bfloat16), three, lens, pages,
                                sm_scale=SCALE)  # fmt: skip
    with pytest.raises(ValueError, match=r"kv \(16, 4, 3, 128\)"):
        pk.tpu_decode_attention(q, kv[:, :, :3], lens, pages, sm_scale=SCALE)
    mesh = sharding.make_mesh({"data": 4}, jax.devices()[:4])
    with pytest.raises(ValueError, match="6 sequences and 16 pages, expected both to divide"):
        pk.tpu_decode_attention_sharded(q, kv, lens, pages, sm_scale=SCALE, mesh=mesh)
    assert pk.tpu_decode_supported(16, 32, 8, 128, jnp.bfloat16)
    assert not pk.tpu_decode_supported(16, 32, 8, 64, jnp.bfloat16)
    assert not pk.tpu_decode_supported(16, 12, 6, 128, jnp.bfloat16)
    assert pk.tpu_decode_supported(16, 12, 6, 128, jnp.bfloat16, tensor=3)  # 2 per device
    assert not pk.tpu_decode_supported(16, 8, 8, 128, jnp.int8)
    assert not pk.tpu_decode_supported(2**16, 32, 8, 128, jnp.bfloat16)  # VMEM


def test_block_sizes_need_no_device(monkeypatch):
    """The rule is pure (jax's tuned table asks `jax.devices()` for the chip): up to 16
    pages and 32 queries, fewer pages where the kv block would be over the VMEM budget."""
    monkeypatch.setattr(jax, "devices", lambda *a: pytest.fail("asked for devices"))
    assert pk.decode_block_sizes(16, 64, 32, 8, 128, jnp.bfloat16) == (16, 32)
    assert pk.decode_block_sizes(16, 5, 4, 2, 128, jnp.float32) == (5, 32)
    pages, queries = pk.decode_block_sizes(256, 64, 32, 8, 128, jnp.bfloat16)
    assert 1 <= pages < 16 and queries == 32
    assert pk._vmem_bytes(256, pages, queries, 32, 8, jnp.bfloat16) <= pk.VMEM_BUDGET_BYTES
    assert pk._vmem_bytes(256, pages + 1, queries, 32, 8, jnp.bfloat16) > pk.VMEM_BUDGET_BYTES


# ----------------------------------------------------------------------------- TPU compile


@pytest.fixture(scope="module")
def v5e_2x2():
    from m2po_jax.trainer import compile_only

    return compile_only.target("v5e:2x2")


def _compile(mesh, spec_of, fn, b, h, k, page_size, m, n_pages, dtype=jnp.bfloat16, kv_dtype=None):
    """`fn(q, kv, lens, pages)` compiled for abstract arguments laid out by `spec_of(name)`
    (q in `dtype`, the pool in `kv_dtype`, default `dtype`)."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    shapes = dict(q=((b, h, D), dtype), kv=((n_pages, page_size, 2 * k, D), kv_dtype),
                  lens=((b,), jnp.int32), pages=((b, m), jnp.int32))  # fmt: skip
    args = [
        jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec_of(name)))
        for name, (shape, dt) in shapes.items()
    ]
    with jax.set_mesh(mesh):
        return jax.jit(fn).lower(*args).compile()


@needs_libtpu
def test_the_kernel_compiles_for_one_v5e_chip(v5e_2x2):
    """One chip, the default blocks, including a shape where VMEM sets them (32 query
    heads, 8 kv heads, 256-token pages): the Mosaic kernel, within the default limit."""
    mesh = sharding.make_mesh({}, list(v5e_2x2.devices[:1]))
    decode = functools.partial(pk.tpu_decode_attention, sm_scale=SCALE)
    for page_size, m in ((16, 8), (256, 64)):
        h, k = (4, 2) if page_size == 16 else (32, 8)
        compiled = _compile(mesh, lambda _: P(), decode, 8, h, k, page_size, m, n_pages=64)
        assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 1


@needs_libtpu
@pytest.mark.parametrize(
    "dtype, kv_dtype",
    [(jnp.float32, jnp.bfloat16), (jnp.float32, jnp.float8_e4m3fn),
     (jnp.bfloat16, jnp.float8_e4m3fn)],
)  # fmt: skip
def test_a_bfloat16_or_float8_pool_compiles_for_v5e(v5e_2x2, dtype, kv_dtype):
    """The kernel's scale-1.0 route (a pool in another dtype than the queries) compiles for
    v5e, which has no float8 arithmetic: the pool goes in as stored (bytes read from HBM
    at its itemsize), the queries and output in their own dtype."""
    mesh = sharding.make_mesh({}, list(v5e_2x2.devices[:1]))
    decode = functools.partial(pk.tpu_decode_attention, sm_scale=SCALE)
    text = _compile(mesh, lambda _: P(), decode, 8, 4, 2, 16, 8, 64, dtype, kv_dtype).as_text()
    kernel_call = next(line for line in text.splitlines() if "tpu_custom_call" in line)
    q_name, kv_name = ({jnp.float32: "f32", jnp.bfloat16: "bf16"}[dtype],
                       {jnp.bfloat16: "bf16", jnp.float8_e4m3fn: "f8e4m3fn"}[kv_dtype])  # fmt: skip
    assert f"{q_name}[8,4,128]" in kernel_call and f"{kv_name}[64,16,4,128]" in kernel_call


@needs_libtpu
def test_the_sharded_kernel_compiles_for_a_v5e_2x2_mesh(v5e_2x2):
    """data=2 x tensor=2: one kernel per device on its block, the pool and page ids
    already laid out as the contract says, so no collective moves them."""
    mesh = sharding.make_mesh({"data": 2, "tensor": 2}, list(v5e_2x2.devices))
    specs = dict(q=P("data", "tensor"), kv=P("data", None, "tensor"), lens=P("data"),
                 pages=P("data"))  # fmt: skip
    decode = functools.partial(pk.tpu_decode_attention_sharded, sm_scale=SCALE)
    compiled = _compile(mesh, specs.get, decode, 8, 4, 2, 16, 8, 64)
    text = compiled.as_text()
    assert text.count('custom_call_target="tpu_custom_call"') == 1
    assert not any(op in text for op in ("all-gather", "all-to-all", "collective-permute"))
    kernel_call = next(line for line in text.splitlines() if "tpu_custom_call" in line)
    assert "bf16[4,2,128]" in kernel_call and "bf16[32,16,2,128]" in kernel_call
    # Inside an engine's shard_map manual over "data": the heads split over "tensor".
    engine = jax.shard_map(
        decode,
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
        axis_names={"data"},
        check_vma=False,
    )
    text = _compile(mesh, specs.get, engine, 8, 4, 2, 16, 8, 64).as_text()
    kernel_call = next(line for line in text.splitlines() if "tpu_custom_call" in line)
    assert "bf16[4,2,128]" in kernel_call and "bf16[32,16,2,128]" in kernel_call


# ----------------------------------------------------------------------------- GPU
# jax's Triton paged attention kernel runs in Pallas' interpreter on a CPU: its numerics
# are checked here, in the pool's split layout ([K, NP, PG, D] keys and values).


def _split(kv_NxPxCxD):
    """The interleaved case as the split layout's keys and values, [K, NP, PG, D] each."""
    return kv_NxPxCxD[:, :, 0::2].transpose(2, 0, 1, 3), kv_NxPxCxD[:, :, 1::2].transpose(
        2, 0, 1, 3
    )


def _interpreted(monkeypatch, seen=None):
    from jax.experimental.pallas.ops.gpu import paged_attention

    def kernel(q, k, v, pages, lens, **kw):
        if seen is not None:
            seen.append(
                (
                    q.shape,
                    k.shape,
                    pages.shape,
                    {a: kw[a] for a in ("pages_per_compute_block", "k_splits")},
                )
            )
        return paged_attention.paged_attention(q, k, v, pages, lens, **{**kw, "interpret": True})

    monkeypatch.setattr(pk, "_gpu_kernel", kernel)


def test_gpu_kernel_matches_numpy_in_the_interpreter(monkeypatch):
    """Ragged lengths, "no page" ids beyond a length, an empty slot (exactly 0), and a
    page table padded to the kernel's partitions (16 pages of 4 tokens: 4-page compute
    blocks: M = 4 pages here, one block in one partition, the table padded to 16)."""
    seen = []
    _interpreted(monkeypatch, seen)
    q, kv, lens, pages = make_case(np.random.default_rng(3))
    k, v = _split(kv)
    out = pk.gpu_decode_attention(q, k, v, lens, pages, sm_scale=SCALE)
    np.testing.assert_allclose(out, numpy_decode(q, kv, lens, pages, SCALE), atol=1e-5, rtol=1e-5)
    assert not np.any(np.asarray(out)[4])
    assert seen[0][3] == dict(pages_per_compute_block=16, k_splits=1) and seen[0][2] == (B, 16)


def test_gpu_kernel_long_tables_split_into_partitions(monkeypatch):
    """37 pages of 4 tokens per sequence: 16-page compute blocks, 3 partitions, the
    table padded to 48 pages; lengths up to the whole table."""
    seen = []
    _interpreted(monkeypatch, seen)
    rng = np.random.default_rng(4)
    m, n_pages, b = 37, 120, 3
    q = rng.standard_normal((b, H, D)).astype(np.float32)
    kv = rng.standard_normal((n_pages, PG, 2 * K, D)).astype(np.float32)
    lens = np.asarray([m * PG, 65, 5], np.int32)
    pages = np.stack([rng.choice(n_pages, m, replace=False) for _ in range(b)]).astype(np.int32)
    k, v = _split(kv)
    out = pk.gpu_decode_attention(q, k, v, lens, pages, sm_scale=SCALE)
    want = numpy_decode(q, kv, lens, pages, SCALE)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    assert pk.gpu_decode_block_sizes(PG, m) == (16, 3, 48)
    assert seen[0][2] == (b, 48) and seen[0][3] == dict(pages_per_compute_block=16, k_splits=3)


def test_gpu_sharded_splits_sequences_pools_and_heads(monkeypatch):
    """data=2 x tensor=2 through the interpreter: each device its 6 sequences, its own 12
    pages (local ids) and one kv head with its 2 query heads."""
    seen = []
    _interpreted(monkeypatch, seen)
    (q, kv, lens, pages), expected = _split_case(np.random.default_rng(5), shards=2)
    k, v = _split(kv)
    mesh = sharding.make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])
    with jax.set_mesh(mesh):
        call = functools.partial(pk.gpu_decode_attention_sharded, sm_scale=SCALE)
        out = jax.jit(call)(q, k, v, lens, pages)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)
    assert seen[0][:2] == ((B, H // 2, D), (1, 12, PG, D))


def test_gpu_shapes_the_kernel_cannot_take_raise_naming_them():
    q, kv, lens, pages = make_case(np.random.default_rng(6))
    k, v = _split(kv)
    with pytest.raises(ValueError, match=r"head_dim 96, expected a power of two"):
        pk.gpu_decode_attention(q[..., :96], k[..., :96], v[..., :96], lens, pages, sm_scale=SCALE)
    with pytest.raises(ValueError, match=r"expected \[B, H, D\], \[K, NP, PG, D\] twice"):
        pk.gpu_decode_attention(q, k, v[:1], lens, pages, sm_scale=SCALE)
    with pytest.raises(ValueError, match="dtype int32"):
        pk.gpu_decode_attention(
            q, k.astype(np.int32), v.astype(np.int32), lens, pages, sm_scale=SCALE
        )
    assert pk.gpu_decode_supported(16, 32, 8, 128, jnp.bfloat16, tensor=4)
    assert not pk.gpu_decode_supported(12, 32, 8, 128, jnp.bfloat16)  # page size not 2^k
    assert not pk.gpu_decode_supported(16, 32, 8, 80, jnp.bfloat16)


def test_attend_on_a_gpu_runs_the_kernel_on_each_rows_page_list(monkeypatch):
    """A decode step traced for a GPU in the split layout goes through the Triton kernel
    (interpreted here) over `row_pages`, and gives the XLA path's output; multi-token
    calls and the interleaved layout stay on the XLA path."""
    from m2po_jax.models import attention_kernels, paged

    calls = []
    _interpreted(monkeypatch, calls)
    rng = np.random.default_rng(7)
    n_pages, pg, none = 40, 4, 40
    kv = jnp.asarray(rng.normal(size=(2, K, n_pages, pg, 16)), jnp.float32)
    view = paged.PagedView(
        own_table_BxM=jnp.asarray([[5, 6, none], [7, none, none], [none] * 3], jnp.int32),
        own_len_B=jnp.asarray([5, 1, 0], jnp.int32),
        inst_B=jnp.asarray([0, 1, 2], jnp.int32),
        prompt_table_IxM=jnp.asarray([[0, 1], [2, none]], jnp.int32),
        prompt_len_I=jnp.asarray([8, 4], jnp.int32),
        members_IxN=None, rank_B=None,
        own_pages=jnp.int32(2), prompt_pages=jnp.int32(2),
        own_widths=(1, 2, 3), prompt_widths=(1, 2),
    )  # fmt: skip
    q = jnp.asarray(rng.normal(size=(3, 1, H, 16)), jnp.float32)
    valid = jnp.asarray([[True], [True], [False]])
    want = paged.attend(q, kv, view, valid, layout="split")  # the XLA path on a CPU
    assert not calls
    monkeypatch.setattr(attention_kernels, "target_platform", lambda: "gpu")
    got = paged.attend(q, kv, view, valid, layout="split")
    assert len(calls) == 1 and calls[0][0] == (3, H, 16)
    np.testing.assert_allclose(np.asarray(got)[:2], np.asarray(want)[:2], atol=1e-5)
    assert not np.any(np.asarray(got)[2])  # the empty slot
    paged.attend(jnp.concatenate([q, q], 1), kv, view, valid.repeat(2, 1), layout="split")
    assert len(calls) == 1
