"""A sparse mixture of experts' math (Qwen3-MoE's feed-forward block), on explicit arrays.

N tokens of width E, X experts of hidden width F, each token routed to its K most probable
experts. `model.MoE` declares the params and calls these:

- `route`: softmax of the float32 router logits, the top K, renormalised to sum to 1 when
  `norm_topk_prob` (transformers' `Qwen3MoeTopKRouter`); with `recorded_NxK` (routing
  replay, R3) the recorded experts instead where a token has them;
- `moe_experts`: the experts' SwiGLU on the routed tokens, dropless (no capacity: every
  token reaches its K experts), as grouped matmuls (`jax.lax.ragged_dot`) over the N * K
  assignments sorted by expert, then unsorted and summed with the routing weights. The one
  function a kernel (megablox on TPU) or an expert-parallel dispatch would replace;
- `load_balancing_loss`: transformers' `load_balancing_loss_func` (Switch Transformer's
  auxiliary loss) over every layer's router logits; `routing_sums` its per-layer sums,
  which add up over parts of a batch (and give the expert load and replay agreement).

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

from typing import NamedTuple

import jax
import jax.numpy as jnp


def route(
    router_logits_NxX: jax.typing.ArrayLike,
    top_k: int,
    norm_topk_prob: bool,
    *,
    recorded_NxK: jax.typing.ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Each token's K experts and their weights.

    p = softmax(logits) in float32; experts = the K largest p (descending, ties to the
    lower index); weights = their p, divided by their sum when `norm_topk_prob`.

    Routing replay (R3, arXiv 2510.11370): where a token's `recorded_NxK` row is recorded
    (its first entry >= 0; -1 = not recorded), its experts are the recorded ones and its
    weights the current router's p gathered there (renormalised likewise), so the
    gradient still reaches the router; other rows route as without it.

    Returns:
      (weights_NxK float32, experts_NxK int32).
    """
    probs_NxX = jax.nn.softmax(jnp.asarray(router_logits_NxX, jnp.float32), axis=-1)
    weights_NxK, experts_NxK = jax.lax.top_k(probs_NxX, top_k)
    if recorded_NxK is not None:
        recorded_NxK = jnp.asarray(recorded_NxK, jnp.int32)
        replayed_Nx1 = recorded_NxK[:, :1] >= 0
        experts_NxK = jnp.where(replayed_Nx1, recorded_NxK, experts_NxK)
        weights_NxK = jnp.take_along_axis(probs_NxX, experts_NxK, axis=-1)
    if norm_topk_prob:
        weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
    return weights_NxK, experts_NxK.astype(jnp.int32)


def moe_experts(
    x_NxE: jax.Array,
    experts_NxK: jax.Array,
    weights_NxK: jax.Array,
    gate_XxExF: jax.Array,
    up_XxExF: jax.Array,
    down_XxFxE: jax.Array,
) -> jax.Array:
    """y[n] = sum_k weights[n, k] * down_e(silu(gate_e(x[n])) * up_e(x[n])), e = experts[n, k].

    The N * K assignments are sorted by expert (stably: token order within an expert), so
    each expert's tokens are one contiguous group of rows; `jax.lax.ragged_dot` multiplies
    each group by its expert's kernel, and the rows go back to their (token, k) places.
    Matmuls in x's dtype; the weighted sum in float32, cast back to x's dtype.
    """
    n, k = experts_NxK.shape
    num_experts = gate_XxExF.shape[0]
    flat_M = experts_NxK.reshape(-1)  # M = N * K assignments, token-major
    order_M = jnp.argsort(flat_M, stable=True)  # assignment of each sorted row
    sizes_X = jnp.bincount(flat_M, length=num_experts).astype(jnp.int32)
    x_MxE = jnp.take(x_NxE, order_M // k, axis=0)
    hidden_MxF = jax.nn.silu(jax.lax.ragged_dot(x_MxE, gate_XxExF, sizes_X))
    hidden_MxF = hidden_MxF * jax.lax.ragged_dot(x_MxE, up_XxExF, sizes_X)
    y_MxE = jax.lax.ragged_dot(hidden_MxF, down_XxFxE, sizes_X)
    # Back to token-major rows: row order_M[i] of the output is sorted row i.
    inverse_M = jnp.zeros_like(order_M).at[order_M].set(jnp.arange(n * k, dtype=order_M.dtype))
    y_NxKxE = jnp.take(y_MxE, inverse_M, axis=0).reshape(n, k, -1)
    y_NxE = jnp.einsum("nke,nk->ne", y_NxKxE.astype(jnp.float32), weights_NxK)
    return y_NxE.astype(x_NxE.dtype)


class RoutingSums(NamedTuple):
    """Sums over the valid tokens of a forward's routing, per layer: parts of a batch (micro-
    batches, a shared prompt and its completions) add up to the whole batch's.

    Attributes:
      assigned_LxX: top-K assignments of the router's own choice (its logits' top K).
      probs_LxX: softmax probabilities.
      used_LxX: assignments to the experts the forward ran (the recorded ones where
        replayed).
      tokens: valid tokens (one count for every layer).
      replayed: token-layer pairs routed by recorded experts.
      agreed: of those, the pairs whose own top-K set equals the recorded set.
    """

    assigned_LxX: jax.Array
    probs_LxX: jax.Array
    used_LxX: jax.Array
    tokens: jax.Array
    replayed: jax.Array
    agreed: jax.Array

    def scaled(self, factor) -> RoutingSums:
        """Every sum times `factor` (a part that stands for `factor` identical copies)."""
        return RoutingSums(*(x * factor for x in self))


def routing_sums(
    router_logits_LxBxTxX: jax.typing.ArrayLike,
    top_k: int,
    valid_BxT: jax.typing.ArrayLike | None = None,
    *,
    recorded_BxTxLxK: jax.typing.ArrayLike | None = None,
) -> RoutingSums:
    """The `RoutingSums` of L layers' router logits over the valid tokens (None: all).

    `recorded_BxTxLxK`: the experts a replayed forward ran (-1: routed freshly, as
    `route` reads them); None: every token routed freshly.
    """
    logits = jnp.asarray(router_logits_LxBxTxX, jnp.float32)
    num_experts = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    _, experts_LxBxTxK = jax.lax.top_k(probs, top_k)
    valid = jnp.ones(logits.shape[1:3]) if valid_BxT is None else jnp.asarray(valid_BxT)
    weight_BxT = valid.astype(jnp.float32)

    def per_expert(experts):  # [L, X] assignments of valid tokens
        one_hot = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32)
        return jnp.einsum("lbtkx,bt->lx", one_hot, weight_BxT)

    assigned_LxX = per_expert(experts_LxBxTxK)
    zero = jnp.zeros((), jnp.float32)
    used_LxX, replayed, agreed = assigned_LxX, zero, zero
    if recorded_BxTxLxK is not None:
        recorded = jnp.moveaxis(jnp.asarray(recorded_BxTxLxK, jnp.int32), 2, 0)
        replayed_LxBxT = (recorded[..., 0] >= 0) & (weight_BxT > 0)[None]
        used_LxX = per_expert(jnp.where(replayed_LxBxT[..., None], recorded, experts_LxBxTxK))
        same_set = jnp.all(jnp.sort(recorded, -1) == jnp.sort(experts_LxBxTxK, -1), axis=-1)
        replayed = jnp.sum(replayed_LxBxT, dtype=jnp.float32)
        agreed = jnp.sum(replayed_LxBxT & same_set, dtype=jnp.float32)
    return RoutingSums(
        assigned_LxX=assigned_LxX,
        probs_LxX=jnp.einsum("lbtx,bt->lx", probs, weight_BxT),
        used_LxX=used_LxX,
        tokens=jnp.sum(weight_BxT),
        replayed=replayed,
        agreed=agreed,
    )


def balancing_loss(sums: RoutingSums) -> jax.Array:
    """`load_balancing_loss` from its sums: X * sum_e f_e * P_e, f and P over all layers."""
    layers, num_experts = sums.probs_LxX.shape
    tokens = layers * sums.tokens
    f_X = jnp.sum(sums.assigned_LxX, axis=0) / tokens
    p_X = jnp.sum(sums.probs_LxX, axis=0) / tokens
    return num_experts * jnp.sum(f_X * p_X)


def expert_load(sums: RoutingSums, top_k: int) -> jax.Array:
    """Each layer's experts' share of the tokens they ran, over the even share K / X: [L, X],
    1 everywhere when perfectly even."""
    num_experts = sums.used_LxX.shape[1]
    return sums.used_LxX / jnp.maximum(sums.tokens, 1.0) / (top_k / num_experts)


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
    return balancing_loss(routing_sums(router_logits_LxBxTxX, top_k, valid_BxT))
