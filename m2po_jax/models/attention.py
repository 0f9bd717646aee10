"""Grouped-query causal attention, with implementations selected by `ModelConfig.attention`.

Every implementation computes, per query head h (kv head h // G, G = H / K),

  out[b, t, h] = softmax_s(q[b, t, h] . k[b, h // G, s] / sqrt(D) + mask) @ v[b, h // G]

where query t (cache column q_start + t) may attend key column s iff s <= q_start + t and
s holds a real token. Prompts are left-padded and completions right-padded, so a row's
real tokens are one contiguous span; the "cudnn" path relies on that.

A padding query's output is unspecified but finite, and the model never reads it (its
cotangent is zero), so no gradient flows from it into real tokens.

Implementations (`IMPLEMENTATIONS`):
- "xla": scores materialised as [B, H, T, S] with a hand-written VJP (`grouped_attention`).
  The fastest on CPU; also the path of every cached (sampling) call except "dot_product"
  and "chunked".
- "dot_product": `jax.nn.dot_product_attention(implementation="xla")` with a boolean mask.
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN flash attention
  (GPU, bfloat16/float16). Each row is rotated so its real tokens start at column 0; then
  causal + `query_seq_lengths`/`key_value_seq_lengths` is exactly the mask, a form cuDNN
  takes without a materialised bias.
- "splash": Pallas TPU splash attention: a causal mask plus segment ids (real tokens 1,
  padding 0), one multi-query kernel per kv head.
- "chunked": pure JAX flash-style attention, blockwise over keys with an online softmax
  and a custom VJP; memory O(T * block) per head on any backend.
- "auto": resolved at trace time from the platform of the devices the program is compiled
  for (`attention_kernels.target_platform()`: the mesh in context, else
  `jax.default_backend()`): "cudnn" on GPU for bfloat16/float16 with head_dim <= 128 and
  a multiple of 8 (CUDA assumed: "gpu" is also ROCm's name), "splash" on TPU, else "xla".
The "cudnn" and "splash" wrappers live in `attention_kernels.py`; splash runs inside
`shard_map` over the mesh in context (a Pallas kernel cannot be partitioned by XLA), and
for devices other than TPUs in Pallas interpret mode (slow; what the tests run).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from m2po_jax.models import attention_kernels as kernels

IMPLEMENTATIONS = ("auto", "xla", "dot_product", "cudnn", "splash", "chunked")

# Added to the scores of masked keys. Finite, so a query with no real key (a padding
# query) gets a uniform softmax instead of NaN, like jax.nn.dot_product_attention.
_MASKED = -1e30


def resolve(
    implementation: str,
    dtype: Any,
    head_dim: int,
    cached: bool = False,
    platform: str | None = None,
) -> str:
    """The concrete implementation for `implementation` on the target platform.

    Args:
      implementation: one of `IMPLEMENTATIONS`.
      dtype: compute dtype of q, k, v.
      head_dim: D.
      cached: attention against a KV cache (sampling); "cudnn" and "splash" assume
        queries and keys are the same columns, so these calls use "xla".

    Returns:
      One of `IMPLEMENTATIONS` other than "auto".
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention: unknown implementation {implementation!r}; "
            f"expected one of {', '.join(IMPLEMENTATIONS)}"
        )
    if implementation == "auto":
        backend = platform or kernels.target_platform()
        backend = "gpu" if backend in ("cuda", "rocm") else backend
        half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        if backend == "gpu" and half and head_dim <= 128 and head_dim % 8 == 0:
            implementation = "cudnn"
        elif backend == "tpu":
            implementation = "splash"
        else:
            implementation = "xla"
    if cached and implementation in ("cudnn", "splash"):
        return "xla"
    return implementation


class Mask(NamedTuple):
    """What one implementation needs to mask, built once per forward and shared by layers.

    Only the fields of the implementation it was made for are set (the others are None).
    """

    bias_Bx1x1xTxS: jax.Array | None = None  # xla: 0 or _MASKED
    allowed_Bx1xTxS: jax.Array | None = None  # dot_product
    key_valid_BxS: jax.Array | None = None  # chunked
    q_start: jax.Array | None = None  # chunked: cache column of query 0
    start_B: jax.Array | None = None  # cudnn: column of each row's first real token
    length_B: jax.Array | None = None  # cudnn: real tokens per row (at least 1)
    segment_BxT: jax.Array | None = None  # splash: 1 for real tokens, 0 for padding
    width_index: jax.Array | None = None  # xla, decode: which of the layer's widths to read


def attention_bias(mask_BxTxS: jax.Array) -> jax.Array:
    """Additive float32 bias [B, 1, 1, T, S]: 0 where attending is allowed, -1e30 elsewhere."""
    return jnp.where(mask_BxTxS, 0.0, _MASKED).astype(jnp.float32)[:, None, None]


def make_mask(
    implementation: str,
    valid_BxT: jax.Array,
    key_valid_BxS: jax.Array,
    q_start: jax.Array | int = 0,
) -> Mask:
    """The mask of `implementation` (resolved) for queries at columns q_start .. q_start+T-1.

    Args:
      implementation: a resolved implementation (see `resolve`).
      valid_BxT: which queries are real tokens.
      key_valid_BxS: which key columns hold real tokens (S = T without a cache).
      q_start: cache column of the first query (`cache_index`).

    Returns:
      A `Mask` for `attend`.
    """
    t = valid_BxT.shape[1]
    if implementation == "chunked":
        return Mask(key_valid_BxS=key_valid_BxS, q_start=jnp.asarray(q_start, jnp.int32))
    if implementation == "cudnn":
        valid = valid_BxT.astype(jnp.int32)
        # A row of padding only gets length 1 (its first token attends itself): finite.
        length_B = jnp.maximum(valid.sum(1), 1).astype(jnp.int32)
        return Mask(start_B=jnp.argmax(valid, axis=1).astype(jnp.int32), length_B=length_B)
    if implementation == "splash":
        return Mask(segment_BxT=valid_BxT.astype(jnp.int32))
    q_col = q_start + jnp.arange(t)
    k_col = jnp.arange(key_valid_BxS.shape[1])
    allowed_BxTxS = (k_col[None, None, :] <= q_col[None, :, None]) & key_valid_BxS[:, None, :]
    if implementation == "dot_product":
        return Mask(allowed_Bx1xTxS=allowed_BxTxS[:, None])
    return Mask(bias_Bx1x1xTxS=attention_bias(allowed_BxTxS))


def attend_bucketed(
    q_BxTxHxD: jax.Array,
    k_BxKxSxD: jax.Array,
    v_BxKxSxD: jax.Array,
    mask: Mask,
    widths: tuple[int, ...],
) -> jax.Array:
    """ "xla" attention over the keys' first `widths[mask.width_index]` columns only.

    For decode steps against a wide cache of which only the first columns are written:
    one branch per width under a `lax.switch`, each reading a static slice of the keys,
    values and bias; the cache is an operand the branches only read (the caller has
    written it), so no branch copies it. The caller guarantees that no query may attend
    to a column past the chosen width.
    """

    def one(width, operands):
        q, k, v, bias = operands
        return grouped_attention(q, k[:, :, :width], v[:, :, :width], bias[..., :width])

    operands = (q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, mask.bias_Bx1x1xTxS)
    if len(widths) == 1:
        return one(widths[0], operands)
    return jax.lax.switch(mask.width_index, [functools.partial(one, w) for w in widths], operands)


def attend(
    implementation: str,
    q_BxTxHxD: jax.Array,
    k_BxKxSxD: jax.Array,
    v_BxKxSxD: jax.Array,
    mask: Mask,
    block_size: int = 512,
) -> jax.Array:
    """Causal GQA softmax(q k^T / sqrt(D) + mask) v by `implementation` (resolved).

    Args:
      implementation: a resolved implementation; `mask` must come from `make_mask` for it.
      q_BxTxHxD: queries (before scaling).
      k_BxKxSxD, v_BxKxSxD: keys and values in the cache layout.
      mask: from `make_mask`.
      block_size: key block of "chunked", query/key block of "splash".

    Returns:
      [B, T, H, D] in q's dtype.
    """
    if implementation == "xla":
        return grouped_attention(q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, mask.bias_Bx1x1xTxS)
    if implementation == "chunked":
        return chunked_attention(
            q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, mask.key_valid_BxS, mask.q_start, block_size
        )
    if implementation == "dot_product":
        return jax.nn.dot_product_attention(
            q_BxTxHxD,
            k_BxKxSxD.transpose(0, 2, 1, 3),
            v_BxKxSxD.transpose(0, 2, 1, 3),
            mask=mask.allowed_Bx1xTxS,
            implementation="xla",
        )
    if implementation == "cudnn":
        return kernels.span_attention(
            q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, mask.start_B, mask.length_B, "cudnn"
        )
    if implementation == "splash":
        return kernels.splash_attention_sharded(
            q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, mask.segment_BxT, block_size
        )
    raise ValueError(f"attention: unresolved or unknown implementation {implementation!r}")


# ----------------------------------------------------------------------------- xla


def grouped_attention(
    q_BxTxHxD: jax.Array, k_BxKxSxD: jax.Array, v_BxKxSxD: jax.Array, bias_Bx1x1xTxS: jax.Array
) -> jax.Array:
    """softmax(q k^T / sqrt(D) + bias) v with H = K * G query heads sharing K kv heads.

    Query head h uses kv head h // G (the Hugging Face GQA grouping). Softmax runs in
    float32; the products run in the inputs' dtype. The backward pass is written out
    (`_attention_bwd`, the flash-attention form dS = P * (dP - rowsum(dO * O))): it needs
    the probabilities and output only, and on XLA:CPU it is faster than the autodiff of
    the forward pass.

    Returns:
      [B, T, H, D] in q's dtype.
    """
    return _attention(q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, bias_Bx1x1xTxS)


def _to_groups(x_BxTxHxD: jax.Array, k: int) -> jax.Array:
    """[B, T, H, D] -> [B, K, G*T, D]: both products are then batched matmuls over (B, K)
    on the cache layout, with no transpose of keys or values."""
    b, t, h, d = x_BxTxHxD.shape
    return x_BxTxHxD.reshape(b, t, k, h // k, d).transpose(0, 2, 3, 1, 4).reshape(b, k, -1, d)


def _from_groups(x_BxKxGTxD: jax.Array, t: int) -> jax.Array:
    b, k, gt, d = x_BxKxGTxD.shape
    g = gt // t
    return x_BxKxGTxD.reshape(b, k, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, k * g, d)


def _attention_fwd(q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, bias_Bx1x1xTxS):
    b, t, h, d = q_BxTxHxD.shape
    k, s = k_BxKxSxD.shape[1], k_BxKxSxD.shape[2]
    q = _to_groups(q_BxTxHxD * jnp.asarray(d**-0.5, q_BxTxHxD.dtype), k)
    scores = jnp.einsum("bkqd,bksd->bkqs", q, k_BxKxSxD).reshape(b, k, h // k, t, s)
    probs = jax.nn.softmax(scores.astype(jnp.float32) + bias_Bx1x1xTxS, axis=-1)
    probs_BxKxGTxS = probs.astype(v_BxKxSxD.dtype).reshape(b, k, -1, s)
    out_BxKxGTxD = jnp.einsum("bkqs,bksd->bkqd", probs_BxKxGTxS, v_BxKxSxD)
    residuals = (q, k_BxKxSxD, v_BxKxSxD, bias_Bx1x1xTxS, probs_BxKxGTxS, out_BxKxGTxD)
    return _from_groups(out_BxKxGTxD, t), residuals


def _attention_bwd(residuals, dout_BxTxHxD):
    q, k_BxKxSxD, v_BxKxSxD, bias_Bx1x1xTxS, probs, out = residuals
    b, k, gt, d = q.shape
    dout = _to_groups(dout_BxTxHxD, k_BxKxSxD.shape[1])
    dv = jnp.einsum("bksq,bkqd->bksd", jnp.swapaxes(probs, -1, -2), dout)
    dprobs = jnp.einsum("bkqd,bksd->bkqs", dout, v_BxKxSxD).astype(jnp.float32)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    dscores = probs.astype(jnp.float32) * (dprobs - delta)
    # Masked keys (bias _MASKED) get no gradient. This matters only for a query with no real
    # key: its softmax is uniform whatever the scores are, so q and k get none either.
    allowed_Bx1x1xTxS = bias_Bx1x1xTxS > _MASKED / 2
    t, s = allowed_Bx1x1xTxS.shape[3:]
    dscores = (dscores.reshape(b, k, gt // t, t, s) * allowed_Bx1x1xTxS).reshape(b, k, gt, s)
    dscores = dscores.astype(q.dtype)
    dq = jnp.einsum("bkqs,bksd->bkqd", dscores, k_BxKxSxD) * jnp.asarray(d**-0.5, q.dtype)
    dk = jnp.einsum("bksq,bkqd->bksd", jnp.swapaxes(dscores, -1, -2), q)
    # The bias is built from the token mask: no gradient flows into it.
    return _from_groups(dq, dout_BxTxHxD.shape[1]), dk, dv, None


@jax.custom_vjp
def _attention(q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, bias_Bx1x1xTxS):
    return _attention_fwd(q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, bias_Bx1x1xTxS)[0]


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------- chunked


def chunked_attention(
    q_BxTxHxD: jax.Array,
    k_BxKxSxD: jax.Array,
    v_BxKxSxD: jax.Array,
    key_valid_BxS: jax.Array,
    q_start: jax.Array | int = 0,
    block_size: int = 512,
) -> jax.Array:
    """Causal GQA attention in key blocks with an online softmax: no [B, H, T, S] array.

    For each key block j (S padded up to a multiple of `block_size`):
      m' = max(m, rowmax(S_j)),  l' = l e^(m - m') + rowsum(e^(S_j - m')),
      acc' = acc e^(m - m') + e^(S_j - m') V_j,  out = acc / l.
    The custom VJP recomputes each block's probabilities e^(S_j - m) / l and accumulates
    dQ, dK_j, dV_j with dS = P * (dP - rowsum(dO * O)). Masked keys get the same finite
    score as in `grouped_attention`, so the two agree even on padding queries.

    Args:
      q_BxTxHxD: queries; query t sits at cache column q_start + t.
      k_BxKxSxD, v_BxKxSxD: keys and values.
      key_valid_BxS: which key columns hold real tokens.
      q_start: cache column of query 0.
      block_size: keys per block; memory is O(T * block_size) per head.

    Returns:
      [B, T, H, D] in q's dtype.
    """
    q_start = jnp.asarray(q_start, jnp.int32)
    return _chunked(q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, key_valid_BxS, q_start, block_size)


def _pad_keys(x, block: int, axis: int):
    """x padded along `axis` to a whole number of blocks."""
    pad = -x.shape[axis] % block
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _block_scores(q_BxKxGTxD, k_pad, valid_pad, q_start, j, block: int, t: int, s: int):
    """Masked float32 scores [B, K, G*T, block] of key block j, and its allowed mask."""
    kb = jax.lax.dynamic_slice_in_dim(k_pad, j * block, block, axis=2)
    valid_BxN = jax.lax.dynamic_slice_in_dim(valid_pad, j * block, block, axis=1)
    col = j * block + jnp.arange(block)
    q_col = q_start + jnp.arange(t)
    allowed = ((col[None, None, :] <= q_col[None, :, None]) & valid_BxN[:, None, :])[:, None, None]
    scores = jnp.einsum("bkqd,bksd->bkqs", q_BxKxGTxD, kb, preferred_element_type=jnp.float32)
    b, k, gt, _ = scores.shape
    scores = jnp.where(allowed, scores.reshape(b, k, gt // t, t, block), _MASKED)
    # Block padding weighs nothing, even for a padding query whose real keys are all masked.
    scores = jnp.where(col < s, scores, -jnp.inf).reshape(b, k, gt, block)
    return scores, allowed


def _chunked_fwd(q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, key_valid_BxS, q_start, block):
    b, t, h, d = q_BxTxHxD.shape
    k, s = k_BxKxSxD.shape[1], k_BxKxSxD.shape[2]
    block = min(block, s)
    q = _to_groups(q_BxTxHxD * jnp.asarray(d**-0.5, q_BxTxHxD.dtype), k)
    k_pad, v_pad = _pad_keys(k_BxKxSxD, block, 2), _pad_keys(v_BxKxSxD, block, 2)
    valid_pad = _pad_keys(key_valid_BxS, block, 1)

    def body(j, carry):
        m, denom, acc = carry
        scores, _ = _block_scores(q, k_pad, valid_pad, q_start, j, block, t, s)
        vb = jax.lax.dynamic_slice_in_dim(v_pad, j * block, block, axis=2)
        m_new = jnp.maximum(m, scores.max(-1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(scores - m_new[..., None])
        pv = jnp.einsum(
            "bkqs,bksd->bkqd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32
        )
        return m_new, denom * correction + p.sum(-1), acc * correction[..., None] + pv

    gt = q.shape[2]
    init = (
        jnp.full((b, k, gt), -jnp.inf, jnp.float32),
        jnp.zeros((b, k, gt), jnp.float32),
        jnp.zeros((b, k, gt, d), jnp.float32),
    )
    m, denom, acc = jax.lax.fori_loop(0, k_pad.shape[2] // block, body, init)
    out = (acc / denom[..., None]).astype(q.dtype)
    residuals = (q, k_BxKxSxD, v_BxKxSxD, key_valid_BxS, q_start, out, m, denom)
    return _from_groups(out, t), residuals


def _chunked_bwd(block, residuals, dout_BxTxHxD):
    q, k_BxKxSxD, v_BxKxSxD, key_valid_BxS, q_start, out, m, denom = residuals
    b, k, gt, d = q.shape
    t, s = dout_BxTxHxD.shape[1], k_BxKxSxD.shape[2]
    block = min(block, s)
    dout = _to_groups(dout_BxTxHxD, k)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    k_pad, v_pad = _pad_keys(k_BxKxSxD, block, 2), _pad_keys(v_BxKxSxD, block, 2)
    valid_pad = _pad_keys(key_valid_BxS, block, 1)

    def body(j, carry):
        dq, dk, dv = carry
        scores, allowed = _block_scores(q, k_pad, valid_pad, q_start, j, block, t, s)
        kb = jax.lax.dynamic_slice_in_dim(k_pad, j * block, block, axis=2)
        vb = jax.lax.dynamic_slice_in_dim(v_pad, j * block, block, axis=2)
        p = jnp.exp(scores - m[..., None]) / denom[..., None]
        dv_j = jnp.einsum(
            "bkqs,bkqd->bksd", p.astype(dout.dtype), dout, preferred_element_type=jnp.float32
        )
        dp = jnp.einsum("bkqd,bksd->bkqs", dout, vb, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[..., None])
        # As in `_attention_bwd`: masked keys (and so padding queries) get no q/k gradient.
        ds = (ds.reshape(b, k, gt // t, t, block) * allowed).reshape(b, k, gt, block)
        ds = ds.astype(q.dtype)
        dq = dq + jnp.einsum("bkqs,bksd->bkqd", ds, kb, preferred_element_type=jnp.float32)
        dk_j = jnp.einsum("bkqs,bkqd->bksd", ds, q, preferred_element_type=jnp.float32)
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dk_j, j * block, axis=2)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dv_j, j * block, axis=2)
        return dq, dk, dv

    init = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.zeros(k_pad.shape, jnp.float32),
        jnp.zeros(v_pad.shape, jnp.float32),
    )
    dq, dk, dv = jax.lax.fori_loop(0, k_pad.shape[2] // block, body, init)
    dq = _from_groups((dq * d**-0.5).astype(q.dtype), t)
    dk = dk[:, :, :s].astype(k_BxKxSxD.dtype)
    return dq, dk, dv[:, :, :s].astype(v_BxKxSxD.dtype), None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _chunked(q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, key_valid_BxS, q_start, block):
    return _chunked_fwd(q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, key_valid_BxS, q_start, block)[0]


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
