"""The paged KV cache against the model without a cache: prompts written into shared
pages, rows continuing them with their own pages (multi-token and decode steps, rows of
an instance not adjacent, a padding row), logits equal to the whole sequence's forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_test import CONFIGS, random_params

from m2po_jax.models import model as M
from m2po_jax.models import paged

PG = 4  # tokens per page


def _view(own_table, own_len, inst, prompt_table, prompt_len, grouped=False, n=3):
    own_table, prompt_table = (
        jnp.asarray(own_table, jnp.int32),
        jnp.asarray(prompt_table, jnp.int32),
    )
    inst = jnp.asarray(inst, jnp.int32)
    members_IxN = rank_B = None
    if grouped:
        members_IxN, rank_B = paged.members(inst, prompt_table.shape[0], n)
    used = lambda table, pool: jnp.max(jnp.sum(table < pool, axis=1))
    return paged.PagedView(
        own_table_BxM=own_table,
        own_len_B=jnp.asarray(own_len, jnp.int32),
        inst_B=inst,
        prompt_table_IxM=prompt_table,
        prompt_len_I=jnp.asarray(prompt_len, jnp.int32),
        members_IxN=members_IxN,
        rank_B=rank_B,
        own_pages=used(own_table, 64),
        prompt_pages=used(prompt_table, 64),
        own_widths=paged.buckets(own_table.shape[1]),
        prompt_widths=paged.buckets(prompt_table.shape[1]),
    )


def _right_padded(seqs, width):
    tokens = np.zeros((len(seqs), width), np.int32)
    valid = np.zeros((len(seqs), width), bool)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
        valid[i, : len(s)] = True
    return tokens, valid


@pytest.mark.parametrize(
    "name, layout",
    [("llama_gqa", "split"), ("qwen3_qk_norm", "split"), ("llama_gqa", "interleaved")],
)
def test_paged_rows_see_their_shared_prompt_and_their_own_tokens(name, layout):
    config = CONFIGS[name]
    params = random_params(config, seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 61, 5).tolist(), rng.integers(1, 61, 7).tolist()]
    apply = jax.jit(M.apply, static_argnums=(1,), static_argnames=("last_only",))
    dense = lambda seq: np.asarray(apply(params, config, jnp.asarray([seq]))[0])
    pool = paged.init_pool(config, pages=64, page_size=PG, layout=layout)
    assert pool.layout == layout
    none = pool.pages

    # The prompts: rows without a prompt whose own pages are the instances' prompt pages.
    prompt_table = [[0, 1, none], [2, 3, none]]
    tokens, valid = _right_padded(prompts, 8)
    positions = np.broadcast_to(np.arange(8), tokens.shape)
    view = _view(prompt_table, [0, 0], [2, 2], [[none] * 3] * 2, [0, 0])
    logits, pool = apply(params, config, tokens, positions, valid, paged=(pool, view))
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(np.asarray(logits)[i, : len(p)], dense(p), atol=2e-5)

    # Six rows, three per prompt, not adjacent; each with its own tokens (1..6 of them).
    inst = [1, 0, 1, 0, 0, 1]
    lengths = [3, 6, 1, 4, 2, 5]
    own = [rng.integers(1, 61, n).tolist() for n in lengths]
    next_page = iter(range(4, 64))
    own_table = [[next(next_page) for _ in range(-(-n // PG))] for n in lengths]
    own_table = [t + [none] * (3 - len(t)) for t in own_table]
    tokens, valid = _right_padded(own, 6)
    plen = np.asarray([len(prompts[i]) for i in inst])
    positions = plen[:, None] + np.arange(6)[None]
    view = _view(own_table, [0] * 6, inst, prompt_table, [5, 7])
    logits, pool = apply(params, config, tokens, positions, valid, paged=(pool, view))
    for r in range(6):
        want = dense(prompts[inst[r]] + own[r])[len(prompts[inst[r]]) :]
        np.testing.assert_allclose(np.asarray(logits)[r, : lengths[r]], want, atol=2e-5)

    # A decode step: a token per row, the prompt read per instance for all its rows; the
    # row of 4 own tokens starts a new page; a padding row (instance 2 = none) rides along.
    for r, n in enumerate(lengths):
        if n % PG == 0:
            own_table[r][n // PG] = next(next_page)
    step = rng.integers(1, 61, 6)
    tokens = np.concatenate([step, [0]])[:, None]
    positions = np.concatenate([plen + np.asarray(lengths), [0]])[:, None]
    valid = np.asarray([True] * 6 + [False])[:, None]
    view = _view(own_table + [[none] * 3], lengths + [0], inst + [2], prompt_table, [5, 7], True)
    logits, pool = jax.jit(M.apply, static_argnums=(1,), static_argnames=("last_only",))(
        params, config, tokens, positions, valid, last_only=True, paged=(pool, view)
    )
    assert np.isfinite(np.asarray(logits)).all()
    for r in range(6):
        want = dense(prompts[inst[r]] + own[r] + [int(step[r])])[-1]
        np.testing.assert_allclose(np.asarray(logits)[r, 0], want, atol=2e-5)


def test_members_list_each_instances_rows_in_order():
    members_IxN, rank_B = paged.members(jnp.asarray([1, 0, 1, 3, 0, 1]), 3, 3)
    np.testing.assert_array_equal(members_IxN, [[1, 4, 6], [0, 2, 5], [6, 6, 6]])
    np.testing.assert_array_equal(np.asarray(rank_B)[[0, 1, 2, 4, 5]], [0, 0, 1, 1, 2])


def test_buckets_and_pick():
    assert paged.buckets(5) == (1, 2, 4, 5) and paged.buckets(1) == (1,)
    assert [int(paged.pick((1, 2, 4, 5), n)) for n in (0, 1, 2, 3, 5, 9)] == [0, 0, 1, 2, 3, 3]


def test_a_rows_page_list_is_its_context_as_the_kernel_reads_it():
    """The engine's layout (each prompt's full pages shared, its partly filled last page
    copied into each row's first own page): `row_pages` gives each row one page list and
    length, and jax's reference for the TPU kernel over them equals `attend`'s two parts
    merged (GQA: head h reads kv head h // G; keys at even, values at odd kv indices)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

    rng = np.random.default_rng(5)
    h, kh, d, n_pages = 4, 2, 8, 40
    kv = jnp.asarray(rng.normal(size=(n_pages, PG, 2 * kh, d)), jnp.float32)
    none = n_pages
    prompt_table = [[0, 1, 2], [3, 4, none]]  # instance 0: 9 tokens, 1: 5 tokens
    full = [8, 4]  # the prompt part: whole pages only
    tails = [1, 1]  # copied into each row's own page 0
    inst = [0, 1, 1, 0, 2]  # row 4: a padding row (no instance)
    completion = [3, 0, 6, 2, 0]
    own_len = [t + c for t, c in zip([*tails, tails[1], tails[0], 0], completion, strict=True)]
    pages = iter(range(5, n_pages))
    own_table = [[next(pages) for _ in range(-(-(n + 1) // PG))] for n in own_len]
    own_table = [t + [none] * (3 - len(t)) for t in own_table]
    view = _view(own_table, own_len, inst, prompt_table, full, grouped=True, n=2)
    q = jnp.asarray(rng.normal(size=(5, 1, h, d)), jnp.float32)
    want = np.asarray(paged.attend(q, kv, view))[:4, 0]
    # The split layout ([2, K, NP, PG, D]: keys, then values) attends the same.
    split = jnp.stack([kv[:, :, 0::2], kv[:, :, 1::2]]).transpose(0, 3, 1, 2, 4)
    got_split = np.asarray(paged.attend(q, split, view, layout="split"))[:4, 0]
    np.testing.assert_allclose(got_split, want, atol=1e-6)
    page_list, lengths = paged.row_pages(view, PG, 1)
    np.testing.assert_array_equal(
        np.asarray(lengths)[:4], np.add(full, 0)[[0, 1, 1, 0]] + np.asarray(own_len[:4]) + 1
    )
    np.testing.assert_array_equal(np.asarray(page_list)[0, :5], [0, 1, *own_table[0][:3]])
    np.testing.assert_array_equal(np.asarray(page_list)[1, :4], [3, *own_table[1][:3]])
    got = rpa.ref_ragged_paged_attention(
        q[:4, 0], kv, lengths[:4], page_list[:4], jnp.arange(5, dtype=jnp.int32),
        jnp.asarray([4], jnp.int32), sm_scale=d**-0.5,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
