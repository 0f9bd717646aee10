"""A paged KV cache: keys and values in a pool of fixed-size pages, read through page tables.

    pool = init_pool(config, pages=512, page_size=16)
    view = PagedView(...)                       # which pages each row reads and writes
    logits, pool = model.apply(params, config, tokens, positions, valid, paged=(pool, view))

Layout. Each layer keeps one array `kv`, in one of two layouts (`PagedPool.layout`):

- "interleaved", [NP, PG, 2K, D] (pages, tokens per page, kv heads with keys at even and
  values at odd indices, head dim): the layout of jax's ragged paged attention kernel
  (`paged_kernels`), the one a program traced for a TPU keeps;
- "split", [2, K, NP, PG, D] (keys, then values; kv head-major, the layout of jax's GPU
  paged attention kernel): elsewhere, where the XLA path gathers a head's pages as
  contiguous blocks already in the order its batched matmuls take (no split of
  interleaved heads, no transpose of the gathered keys).

Page id NP (one past the end) is "no page": writes to it are dropped, reads of it are
masked. A row's context is two parts, attended
separately and merged with their log-sum-exp (the softmax over the union):

- its *prompt*: the full pages of the prompt instance it continues (`inst_B`), whose
  tokens sit in that instance's pages from position 0 (`prompt_table_IxM`; `prompt_len_I`
  tokens read, a multiple of PG). A GRPO group's rows all continue one instance: its full
  pages are stored once and referenced by all of them, never copied.
- its *own* tokens: the prompt's partly filled last page copied (vLLM's layout: the one
  copy a sample makes; the caller copies it), then its completion and appended turns:
  `own_table_BxM`, `own_len_B` of them in the cache before this call; the call's T tokens
  are written at own positions own_len_B .. own_len_B + T - 1 (pages the caller has
  allocated) and attend to their own earlier tokens causally.

So row b's tokens, position p, lie in page p // PG of [its prompt's full pages, its own
pages]: one contiguous page list per sequence, what the kernel reads (`row_pages`).

Decode steps (T = 1) attend to the prompt *by instance*: the queries of an instance's
rows (`members_IxN`, at most N per instance) are gathered, and each instance's prompt
keys are read once and multiplied with all of its rows' queries in one batched matmul;
the sequences' own pages are read per row. Multi-token calls (a preempted sequence's
recompute, a multi-turn append) read the prompt per row.

Reads are bucketed: each part reads the first `widths[i]` pages of its table, the
smallest bucket holding every live row's pages (one `lax.switch` branch per width), so a
step reads the live pages, not the table's width.
"""

from __future__ import annotations

import functools
import math

import flax
import jax
import jax.numpy as jnp

_MASKED = -1e30


# Tokens a preempted sequence's recompute runs per model pass (the paged engine's resume):
# a power of two; the memory plan counts a chunk's activations and scores.
RESUME_CHUNK = 256
INTERLEAVED, SPLIT = "interleaved", "split"
_PAGES_AXIS = {INTERLEAVED: 0, SPLIT: 2}


def pool_layout() -> str:
    """The layout a pool created now takes: interleaved for a program traced for a TPU
    (the kernel's), split elsewhere (`attention_kernels.target_platform()`)."""
    from m2po_jax.models import attention_kernels

    return INTERLEAVED if attention_kernels.target_platform() == "tpu" else SPLIT


def layout_for(mesh=None) -> str:
    """The layout of a pool for programs run on `mesh`'s devices (None: the default
    backend's): interleaved on TPUs, split elsewhere."""
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    return INTERLEAVED if platform == "tpu" else SPLIT


@flax.struct.dataclass
class PagedPool:
    """Per layer keys and values in pages: [NP, PG, 2K, D] (keys at even kv heads, values
    at odd) or [2, K, NP, PG, D] (`layout`, see the module doc)."""

    kv: tuple[jax.Array, ...]
    layout: str = flax.struct.field(pytree_node=False, default=INTERLEAVED)

    @property
    def pages(self) -> int:
        return self.kv[0].shape[_PAGES_AXIS[self.layout]]

    @property
    def page_size(self) -> int:
        return self.kv[0].shape[_PAGES_AXIS[self.layout] + 1]

    @property
    def pages_axis(self) -> int:
        """The axis of each layer's array that holds pages (split over the batch shards)."""
        return _PAGES_AXIS[self.layout]

    @property
    def heads_axis(self) -> int:
        """The axis of each layer's array that holds kv heads (split over "tensor")."""
        return 2 if self.layout == INTERLEAVED else 1


@flax.struct.dataclass
class PagedLayer:
    """One layer's pages and the call's view, as a decoder layer takes its cache."""

    kv: jax.Array
    view: PagedView
    valid_BxT: jax.Array
    layout: str = flax.struct.field(pytree_node=False, default=INTERLEAVED)

    def write(self, k_BxTxKxD, v_BxTxKxD) -> jax.Array:
        """The layer's pages with the call's keys and values written (`write`)."""
        view = self.view
        if self.layout == SPLIT:  # [2, K, B, T, D]
            new = jnp.stack([k_BxTxKxD, v_BxTxKxD.astype(k_BxTxKxD.dtype)])
            new = new.transpose(0, 3, 1, 2, 4)
            return write(self.kv, new, view.own_table_BxM, view.own_len_B, self.valid_BxT,
                         split=True)  # fmt: skip
        new = interleave(k_BxTxKxD, v_BxTxKxD)
        return write(self.kv, new, view.own_table_BxM, view.own_len_B, self.valid_BxT)

    def write_and_attend(self, q_BxTxHxD, k_BxTxKxD, v_BxTxKxD):
        """(attention output [B, T, H, D], the layer's new pages)."""
        kv = self.write(k_BxTxKxD, v_BxTxKxD)
        return attend(q_BxTxHxD, kv, self.view, self.valid_BxT, self.layout), kv


@flax.struct.dataclass
class PagedView:
    """What the rows of one call read and write (see the module doc).

    own_table_BxM: int32 page ids of each row's own tokens (NP: none).
    own_len_B: int32 own tokens already in the cache (the call's go after them).
    inst_B: int32 prompt instance of each row (I: none, e.g. a padding row).
    prompt_table_IxM: int32 page ids of each instance's prompt.
    prompt_len_I: int32 tokens of each instance's prompt.
    members_IxN: int32 rows continuing each instance (B: none); decode steps only
      (`grouped`), with `rank_B` each row's index in its instance's members.
    own_pages / prompt_pages: traced, how many table columns the live rows use.
    own_widths / prompt_widths: static buckets of table columns read (ascending; the last
      is the table's width).
    instances / instance_widths: decode steps whose instances are listed live ones first:
      traced, how many are live, and static buckets of how many are read (ascending; the
      last is I). Empty: every instance is read.
    """

    own_table_BxM: jax.Array
    own_len_B: jax.Array
    inst_B: jax.Array
    prompt_table_IxM: jax.Array
    prompt_len_I: jax.Array
    members_IxN: jax.Array | None
    rank_B: jax.Array | None
    own_pages: jax.Array
    prompt_pages: jax.Array
    own_widths: tuple[int, ...] = flax.struct.field(pytree_node=False)
    prompt_widths: tuple[int, ...] = flax.struct.field(pytree_node=False)
    instances: jax.Array | None = None
    instance_widths: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    # A prefill: each row's context is this call's tokens alone (no prompt part, no own
    # tokens before); the model attends to them with its own attention (splash on a TPU)
    # and only writes them into the pages.
    fresh: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def grouped(self) -> bool:
        return self.members_IxN is not None


def init_pool(config, pages: int, page_size: int, dtype=None, layout=None) -> PagedPool:
    """An empty pool of `pages` pages of `page_size` tokens per layer, in `layout` (default:
    the one the program being traced takes, `pool_layout`) and `dtype` (default: the
    config's `cache_dtype`)."""
    from m2po_jax.models.model_config import as_dtype

    dtype = config.cache_dtype if dtype is None else as_dtype(dtype)
    layout = pool_layout() if layout is None else layout
    k, d = config.num_kv_heads, config.dim_per_head
    if layout == INTERLEAVED:
        shape = (pages, page_size, 2 * k, d)
    elif layout == SPLIT:
        shape = (2, k, pages, page_size, d)
    else:
        raise ValueError(f"paged pool layout {layout!r}: expected {INTERLEAVED!r} or {SPLIT!r}")
    kv = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return PagedPool(kv=kv, layout=layout)


def interleave(k_BxTxKxD: jax.Array, v_BxTxKxD: jax.Array) -> jax.Array:
    """[B, T, 2K, D]: kv head i's keys at 2i, its values at 2i + 1 (the pool's layout)."""
    b, t, kh, d = k_BxTxKxD.shape
    return jnp.stack([k_BxTxKxD, v_BxTxKxD.astype(k_BxTxKxD.dtype)], axis=3).reshape(
        b, t, 2 * kh, d
    )


def copy_pages(pool: PagedPool, from_X: jax.Array, to_X: jax.Array) -> PagedPool:
    """Every layer's page `to_X[x]` set to page `from_X[x]` (`to` NP: none)."""
    n = pool.pages
    # Token rows (page, position), as `write` indexes them: whole-page indexing makes the
    # TPU compiler change the pool's layout for it, a copy of every layer's pool.
    src_XxP = jnp.minimum(from_X, n - 1)[:, None]
    to_XxP, pos_XxP = to_X[:, None], jnp.arange(pool.page_size)[None]
    if pool.layout == SPLIT:
        kv = tuple(kv.at[:, :, to_XxP, pos_XxP].set(kv[:, :, src_XxP, pos_XxP], mode="drop")
                   for kv in pool.kv)  # fmt: skip
    else:
        kv = tuple(kv.at[to_XxP, pos_XxP].set(kv[src_XxP, pos_XxP], mode="drop")
                   for kv in pool.kv)  # fmt: skip
    return pool.replace(kv=kv)


def pool_bytes(config, pages: int, page_size: int, dtype=None) -> int:
    """Bytes of a pool (keys and values of every layer; default dtype `cache_dtype`)."""
    from m2po_jax.models.model_config import as_dtype

    itemsize = (config.cache_dtype if dtype is None else as_dtype(dtype)).itemsize
    per_page = page_size * config.num_kv_heads * config.dim_per_head * itemsize
    return 2 * config.num_layers * pages * per_page


def buckets(pages: int, smallest: int = 1) -> tuple[int, ...]:
    """Table columns read per step: `smallest`, twice that, ... then the table's width."""
    out, w = [], max(min(smallest, pages), 1)
    while w < pages:
        out.append(w)
        w *= 2
    return (*out, pages)


def pick(widths: tuple[int, ...], needed) -> jax.Array:
    """Index of the smallest width >= `needed` (the last one at most)."""
    index = jnp.searchsorted(jnp.asarray(widths), jnp.maximum(needed, 1))
    return jnp.minimum(index, len(widths) - 1)


def members(inst_B: jax.Array, instances: int, n: int) -> tuple[jax.Array, jax.Array]:
    """(members_IxN, rank_B): the rows of each instance in ascending order (B: none), at
    most `n` per instance, and each row's index among its instance's rows."""
    rows = inst_B.shape[0]
    onehot_IxB = inst_B[None, :] == jnp.arange(instances)[:, None]
    members_IxN = jax.vmap(lambda r: jnp.nonzero(r, size=n, fill_value=rows)[0])(onehot_IxB)
    rank_IxB = jnp.cumsum(onehot_IxB, axis=1, dtype=jnp.int32) - 1
    inst = jnp.minimum(inst_B, instances - 1)
    return members_IxN.astype(jnp.int32), rank_IxB[inst, jnp.arange(rows)]


def write(pages_NxPxKxD, new_BxTxKxD, table_BxM, start_B, valid_BxT, split: bool = False):
    """The pages with token t of row b written at own position start_B[b] + t (rows'
    padding tokens, and positions whose page is NP, are dropped). `split`: pages
    [2, K, N, P, D] and new [2, K, B, T, D] (keys, values)."""
    if split:
        n, pg = pages_NxPxKxD.shape[2:4]
        b, t = new_BxTxKxD.shape[2:4]
    else:
        n, pg = pages_NxPxKxD.shape[:2]
        b, t = new_BxTxKxD.shape[:2]
    pos_BxT = start_B[:, None] + jnp.arange(t)[None, :]
    col = jnp.minimum(pos_BxT // pg, table_BxM.shape[1] - 1)
    page_BxT = jnp.take_along_axis(table_BxM, col, axis=1)
    page_BxT = jnp.where(valid_BxT & (pos_BxT // pg < table_BxM.shape[1]), page_BxT, n)
    if split:
        return pages_NxPxKxD.at[:, :, page_BxT, pos_BxT % pg].set(
            new_BxTxKxD.astype(pages_NxPxKxD.dtype), mode="drop"
        )
    return pages_NxPxKxD.at[page_BxT, pos_BxT % pg].set(
        new_BxTxKxD.astype(pages_NxPxKxD.dtype), mode="drop"
    )


def _gather(kv_pages: jax.Array, table_XxW: jax.Array, dtype, layout: str = INTERLEAVED):
    """Keys and values [K, X, W * PG, D] in `dtype`: the listed pages, concatenated (page NP
    reads another page, for the reader to mask), kv head-major (the batched matmuls' order)."""
    x, w = table_XxW.shape
    # Page NP ("none") reads page NP - 1 instead: the reader masks what it did not write
    # (a gather with no bounds check and no fill is about a third faster on a CPU).
    page_XxW = jnp.minimum(table_XxW, kv_pages.shape[_PAGES_AXIS[layout]] - 1)
    if layout == SPLIT:  # [2, K, NP, PG, D]: a head's pages are whole blocks

        def pages(kv_KxNxPxD):
            got = kv_KxNxPxD.at[:, page_XxW].get(mode="promise_in_bounds")
            k, _, pg, d = kv_KxNxPxD.shape
            return got.reshape(k, x, w * pg, d).astype(dtype)

        return pages(kv_pages[0]), pages(kv_pages[1])
    got = kv_pages.at[page_XxW].get(mode="promise_in_bounds")
    got = got.reshape(x, w * kv_pages.shape[1], *kv_pages.shape[2:]).astype(dtype)
    return got[:, :, 0::2].transpose(2, 0, 1, 3), got[:, :, 1::2].transpose(2, 0, 1, 3)


def _partial(q_KxXxGxTxD, k_KxXxSxD, v_KxXxSxD, allowed_XxTxS):
    """Softmax partials over one part of the keys: (max [K,X,G,T], sum [K,X,G,T], weighted
    values [K,X,G,T,D]) in float32; rows with nothing allowed give sum 0."""
    d = q_KxXxGxTxD.shape[-1]
    scores = jnp.einsum(
        "kxgtd,kxsd->kxgts", q_KxXxGxTxD, k_KxXxSxD, preferred_element_type=jnp.float32
    ) / math.sqrt(d)
    allowed = allowed_XxTxS[None, :, None]
    scores = jnp.where(allowed, scores, _MASKED)
    m = jnp.max(scores, axis=-1)
    p = jnp.where(allowed, jnp.exp(scores - m[..., None]), 0.0)
    o = jnp.einsum("kxgts,kxsd->kxgtd", p.astype(v_KxXxSxD.dtype), v_KxXxSxD,
                   preferred_element_type=jnp.float32)  # fmt: skip
    return m, jnp.sum(p, axis=-1), o


def _switch(widths, index, fn, operands):
    if len(widths) == 1:
        return fn(widths[0], operands)
    return jax.lax.switch(index, [functools.partial(fn, w) for w in widths], operands)


def _own_part(q, kv_pages, view: PagedView, t: int, layout: str):
    """The rows' own tokens (causal): partials [K, B, G, T, ...]."""
    pg = kv_pages.shape[_PAGES_AXIS[layout] + 1]

    def one(width, operands):
        q, kv_pages, table, own_len = operands
        k, v = _gather(kv_pages, table[:, :width], q.dtype, layout)
        s = jnp.arange(width * pg)
        allowed = s[None, None, :] <= (own_len[:, None] + jnp.arange(t)[None, :])[..., None]
        return _partial(q, k, v, allowed)

    operands = (q, kv_pages, view.own_table_BxM, view.own_len_B)
    return _switch(view.own_widths, pick(view.own_widths, view.own_pages), one, operands)


def _prompt_part(q, kv_pages, view: PagedView, layout: str):
    """The rows' prompts (q: [K, B, G, T, D]): by instance for decode steps, per row
    otherwise; partials [K, B, G, T, ...]."""
    pg = kv_pages.shape[_PAGES_AXIS[layout] + 1]
    none = kv_pages.shape[_PAGES_AXIS[layout]]
    instances = view.prompt_table_IxM.shape[0]

    def one(width, operands, count=instances):
        q, kv_pages, table_IxM, len_I, inst_B = operands
        if view.grouped:  # the first `count` instances (the live ones, when bucketed)
            # [K, C, N, G, 1, D] -> [K, C, G, N, D]: an instance's rows as its queries.
            members_CxN = view.members_IxN[:count]
            qg = jnp.take(q, members_CxN, axis=1, mode="fill", fill_value=0)
            qg = qg[:, :, :, :, 0].transpose(0, 1, 3, 2, 4)
            k, v = _gather(kv_pages, table_IxM[:count, :width], q.dtype, layout)
            s = jnp.arange(width * pg)
            n = qg.shape[3]
            allowed = jnp.broadcast_to(
                s[None, None, :] < len_I[:count, None, None], (count, n, s.size)
            )
            m, total, o = _partial(qg, k, v, allowed)  # [K, C, G, N, ...]
            inst = jnp.minimum(inst_B, count - 1)
            real = (inst_B < count)[None, :, None, None]

            def at(x):  # [K, B, G, 1, ...]: row b's entry, x[:, inst[b], :, rank[b]]
                return jnp.expand_dims(jnp.moveaxis(x[:, inst, :, view.rank_B], 0, 1), 3)

            return (
                jnp.where(real, at(m), _MASKED),
                jnp.where(real, at(total), 0.0),
                jnp.where(real[..., None], at(o), 0.0),
            )
        inst = jnp.minimum(inst_B, instances - 1)
        table = jnp.where((inst_B < instances)[:, None], table_IxM[inst], none)
        k, v = _gather(kv_pages, table[:, :width], q.dtype, layout)
        s = jnp.arange(width * pg)
        length = jnp.where(inst_B < instances, len_I[inst], 0)
        allowed = jnp.broadcast_to(
            s[None, None, :] < length[:, None, None], (q.shape[1], q.shape[3], s.size)
        )
        return _partial(q, k, v, allowed)

    operands = (q, kv_pages, view.prompt_table_IxM, view.prompt_len_I, view.inst_B)
    index = pick(view.prompt_widths, view.prompt_pages)
    if not (view.grouped and view.instance_widths):
        return _switch(view.prompt_widths, index, one, operands)
    # (columns, instances) read: a branch per pair, the smallest holding the live ones.
    pairs = [(w, c) for c in view.instance_widths for w in view.prompt_widths]
    index = pick(view.instance_widths, view.instances) * len(view.prompt_widths) + index
    branches = [lambda ops, w=w, c=c: one(w, ops, c) for w, c in pairs]
    return jax.lax.switch(index, branches, operands)


def row_pages(view: PagedView, page_size: int, t: int) -> tuple[jax.Array, jax.Array]:
    """Each row's tokens as one page list, the kernel's layout: ([B, Mp + Mo] its prompt's
    full pages, then its own; [B] its tokens once this call's `t` are written). Needs
    `prompt_len_I` in whole pages (the engine's layout: the partly filled last page is the
    row's first own page)."""
    instances, mp = view.prompt_table_IxM.shape
    b, mo = view.own_table_BxM.shape
    real_B = view.inst_B < instances
    inst_B = jnp.minimum(view.inst_B, instances - 1)
    prompt_B = jnp.where(real_B, view.prompt_len_I[inst_B], 0)
    full_B = prompt_B // page_size
    j = jnp.arange(mp + mo)[None]
    from_prompt = jnp.take_along_axis(
        view.prompt_table_IxM[inst_B], jnp.broadcast_to(jnp.minimum(j, mp - 1), (b, mp + mo)),
        axis=1,
    )  # fmt: skip
    from_own = jnp.take_along_axis(view.own_table_BxM, jnp.clip(j - full_B[:, None], 0, mo - 1),
                                   axis=1)  # fmt: skip
    pages_BxM = jnp.where(j < full_B[:, None], from_prompt, from_own)
    return pages_BxM, prompt_B + view.own_len_B + t


def decode_kernel(q_BxTxHxD, kv_pages, layout: str) -> str | None:
    """Which Pallas kernel a decode step runs (`paged_kernels`), or None for the XLA path:
    "tpu" (ragged paged attention, the interleaved layout) or "gpu" (Triton paged
    attention, the split layout) for a program traced for those devices, one token per
    row, shapes and dtypes the kernel takes (the GPU kernel: pages in q's dtype only, so
    a bfloat16 pool under float32 compute and a float8 pool take the XLA path there)."""
    from m2po_jax.models import attention_kernels, paged_kernels

    b, t, h, d = q_BxTxHxD.shape
    platform = attention_kernels.target_platform()
    if t != 1 or platform not in ("tpu", "gpu"):
        return None
    mesh = attention_kernels.target_mesh()
    tensor = 1
    if mesh is not None and "tensor" in mesh.axis_names and "tensor" not in mesh.manual_axes:
        tensor = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))["tensor"]
    if platform == "tpu" and layout == INTERLEAVED:
        pg, kh = kv_pages.shape[1], kv_pages.shape[2] // 2
        supported = paged_kernels.tpu_decode_supported
    elif platform == "gpu" and layout == SPLIT:
        kh, pg = kv_pages.shape[1], kv_pages.shape[3]
        supported = paged_kernels.gpu_decode_supported
    else:
        return None
    return platform if supported(pg, h, kh, d, kv_pages.dtype, tensor, q_BxTxHxD.dtype) else None


def attend(q_BxTxHxD, kv_pages, view: PagedView, valid_BxT=None, layout=INTERLEAVED):
    """softmax over [the row's prompt, its own tokens so far (causal)] of q k^T / sqrt(D),
    times v; H = K * G query heads share K kv heads (head h uses kv head h // G).
    The call's keys and values must already be written (`write`); `kv_pages` is one
    layer's array in `layout`. Returns [B, T, H, D] in q's dtype."""
    b, t, h, d = q_BxTxHxD.shape
    kernel = decode_kernel(q_BxTxHxD, kv_pages, layout)
    if kernel is not None:  # a TPU / GPU decode step: each row's page list
        from m2po_jax.models import paged_kernels

        pages_BxM, lengths_B = row_pages(view, kv_pages.shape[_PAGES_AXIS[layout] + 1], t)
        if valid_BxT is not None:
            lengths_B = jnp.where(valid_BxT[:, 0], lengths_B, 0)  # empty slots: output 0
        if kernel == "tpu":
            out = paged_kernels.tpu_decode_attention_sharded(
                q_BxTxHxD[:, 0], kv_pages, lengths_B, pages_BxM, sm_scale=d**-0.5
            )
        else:
            out = paged_kernels.gpu_decode_attention_sharded(
                q_BxTxHxD[:, 0], kv_pages[0], kv_pages[1], lengths_B, pages_BxM, sm_scale=d**-0.5
            )
        return out[:, None].astype(q_BxTxHxD.dtype)
    kh = kv_pages.shape[1] if layout == SPLIT else kv_pages.shape[2] // 2
    q = q_BxTxHxD.reshape(b, t, kh, h // kh, d).transpose(2, 0, 3, 1, 4)  # [K, B, G, T, D]
    m1, l1, o1 = _prompt_part(q, kv_pages, view, layout)
    m2, l2, o2 = _own_part(q, kv_pages, view, t, layout)
    m = jnp.maximum(m1, m2)
    a1, a2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    total = l1 * a1 + l2 * a2
    out = (o1 * a1[..., None] + o2 * a2[..., None]) / jnp.maximum(total, 1e-30)[..., None]
    return out.transpose(1, 3, 0, 2, 4).reshape(b, t, h, d).astype(q_BxTxHxD.dtype)
