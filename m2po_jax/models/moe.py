"""A sparse mixture of experts' math (Qwen3-MoE's feed-forward block), on explicit arrays.

N tokens of width E, X experts of hidden width F, each token routed to its K most probable
experts. `model.MoE` declares the params and calls these:

- `route`: softmax of the float32 router logits, the top K, renormalised to sum to 1 when
  `norm_topk_prob` (transformers' `Qwen3MoeTopKRouter`);
- `moe_experts`: the experts' SwiGLU on the routed tokens, dropless (no capacity: every
  token reaches its K experts), as grouped matmuls (`jax.lax.ragged_dot`) over the N * K
  assignments sorted by expert, then unsorted and summed with the routing weights; with
  per-expert LoRA adapters on gate, up and down when given. The one function a kernel
  (megablox on TPU) or an expert-parallel dispatch would replace;
- `load_balancing_loss`: transformers' `load_balancing_loss_func` (Switch Transformer's
  auxiliary loss) over every layer's router logits.

How `ragged_dot` runs depends on the platform: TPU lowers it to its grouped-matmul
custom call (`ragged-dot-none`, forward and backward: tests/parallel/tpu_compile_test.py);
CPU (and jax's default lowering) to a masked dense product, every expert on every
assignment (X times the FLOPs and a [X, N * K, ...] temporary: fine for tests, not for
speed); GPU to `chlo.ragged_dot` as XLA compiles it (not measured here).

Ties: `jax.lax.top_k` takes the lowest expert index among equal probabilities. torch.topk
on CPU breaks ties otherwise (8 equal probabilities, k = 3: experts 6, 5, 4), so the two
route differently only where a token's K-th and (K+1)-th probabilities are exactly equal
(equal router rows, or a zero hidden state).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(
    router_logits_NxX: jax.typing.ArrayLike, top_k: int, norm_topk_prob: bool
) -> tuple[jax.Array, jax.Array]:
    """Each token's K experts and their weights.

    p = softmax(logits) in float32; experts = the K largest p (descending, ties to the
    lower index); weights = their p, divided by their sum when `norm_topk_prob`.

    Returns:
      (weights_NxK float32, experts_NxK int32).
    """
    probs_NxX = jax.nn.softmax(jnp.asarray(router_logits_NxX, jnp.float32), axis=-1)
    weights_NxK, experts_NxK = jax.lax.top_k(probs_NxX, top_k)
    if norm_topk_prob:
        weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
    return weights_NxK, experts_NxK.astype(jnp.int32)


# One projection's LoRA adapters on every expert: (A [X, in, r], B [X, r, out]).
ExpertAdapters = tuple[jax.Array, jax.Array]


def moe_experts(
    x_NxE: jax.Array,
    experts_NxK: jax.Array,
    weights_NxK: jax.Array,
    gate_XxExF: jax.Array,
    up_XxExF: jax.Array,
    down_XxFxE: jax.Array,
    *,
    gate_lora: ExpertAdapters | None = None,
    up_lora: ExpertAdapters | None = None,
    down_lora: ExpertAdapters | None = None,
    lora_scale: float = 1.0,
) -> jax.Array:
    """y[n] = sum_k weights[n, k] * down_e(silu(gate_e(x[n])) * up_e(x[n])), e = experts[n, k].

    The N * K assignments are sorted by expert (stably: token order within an expert), so
    each expert's tokens are one contiguous group of rows; `jax.lax.ragged_dot` multiplies
    each group by its expert's kernel, and the rows go back to their (token, k) places.
    Matmuls in x's dtype; the weighted sum in float32, cast back to x's dtype.

    LoRA: a projection given its adapters (`gate_lora`, `up_lora`, `down_lora`: A and B in
    x's dtype) is proj_e(h) = h W_e + lora_scale * (h A_e) B_e, the adapter product two
    more grouped matmuls over the same sorted groups: the merged kernel
    W_e + lora_scale * A_e B_e without forming it.
    """
    n, k = experts_NxK.shape
    num_experts = gate_XxExF.shape[0]
    flat_M = experts_NxK.reshape(-1)  # M = N * K assignments, token-major
    order_M = jnp.argsort(flat_M, stable=True)  # assignment of each sorted row
    sizes_X = jnp.bincount(flat_M, length=num_experts).astype(jnp.int32)

    def grouped(rows_MxI, kernel_XxIxO, lora):
        out_MxO = jax.lax.ragged_dot(rows_MxI, kernel_XxIxO, sizes_X)
        if lora is None:
            return out_MxO
        a_XxIxR, b_XxRxO = lora
        low_MxR = jax.lax.ragged_dot(rows_MxI, a_XxIxR, sizes_X)
        scale = jnp.asarray(lora_scale, out_MxO.dtype)
        return out_MxO + scale * jax.lax.ragged_dot(low_MxR, b_XxRxO, sizes_X)

    x_MxE = jnp.take(x_NxE, order_M // k, axis=0)
    hidden_MxF = jax.nn.silu(grouped(x_MxE, gate_XxExF, gate_lora))
    hidden_MxF = hidden_MxF * grouped(x_MxE, up_XxExF, up_lora)
    y_MxE = grouped(hidden_MxF, down_XxFxE, down_lora)
    # Back to token-major rows: row order_M[i] of the output is sorted row i.
    inverse_M = jnp.zeros_like(order_M).at[order_M].set(jnp.arange(n * k, dtype=order_M.dtype))
    y_NxKxE = jnp.take(y_MxE, inverse_M, axis=0).reshape(n, k, -1)
    y_NxE = jnp.einsum("nke,nk->ne", y_NxKxE.astype(jnp.float32), weights_NxK)
    return y_NxE.astype(x_NxE.dtype)


def load_balancing_loss(
    router_logits_LxBxTxX: jax.typing.ArrayLike,
    top_k: int,
    valid_BxT: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    """Switch Transformer's load-balancing loss over L layers' routers, as transformers'
    `load_balancing_loss_func` computes it (a float32 scalar).

    loss = X * sum_e f_e * P_e, over the n valid tokens of every layer together:
    f_e = (top-K assignments to expert e) / n and P_e = (sum of softmax p_e) / n, n = L x
    (valid tokens). 1 x K when routing is uniform; a model adds `router_aux_loss_coef` x
    loss to its training loss.

    Args:
      router_logits_LxBxTxX: each layer's router logits (`model.router_logits`).
      top_k: experts per token (`num_experts_per_tok`).
      valid_BxT: real tokens (padding left out); None counts every token.
    """
    logits = jnp.asarray(router_logits_LxBxTxX, jnp.float32)
    num_experts = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    _, experts = jax.lax.top_k(probs, top_k)
    assigned = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=-2)
    valid = jnp.ones(logits.shape[1:3]) if valid_BxT is None else jnp.asarray(valid_BxT)
    weight_1xBxTx1 = valid.astype(jnp.float32)[None, :, :, None]
    tokens = logits.shape[0] * jnp.sum(weight_1xBxTx1)
    f_X = jnp.sum(assigned * weight_1xBxTx1, axis=(0, 1, 2)) / tokens
    p_X = jnp.sum(probs * weight_1xBxTx1, axis=(0, 1, 2)) / tokens
    return num_experts * jnp.sum(f_X * p_X)
