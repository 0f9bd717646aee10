"""A sparse mixture of experts' math (Qwen3-MoE's feed-forward block), on explicit arrays.

N tokens of width E, X experts of hidden width F, each token routed to its K most probable
experts. `model.MoE` declares the params and calls these:

- `route`: softmax of the float32 router logits, the top K, renormalised to sum to 1 when
  `norm_topk_prob` (transformers' `Qwen3MoeTopKRouter`); with `recorded_NxK` (routing
  replay, R3) the recorded experts instead where a token has them;
- `moe_experts`: the experts' SwiGLU on the routed tokens, dropless (no capacity: every
  token reaches its K experts), as grouped matmuls (`jax.lax.ragged_dot`) over the N * K
  assignments sorted by expert, then unsorted and summed with the routing weights; with
  per-expert LoRA adapters on gate, up and down when given. The one function a kernel
  (megablox on TPU) or an expert-parallel dispatch would replace;
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

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import megablox
from jax.sharding import PartitionSpec as P

from m2po_jax.common.mesh_axes import BATCH_AXES
from m2po_jax.models import attention_kernels

# The experts' grouped matmul (`moe_experts`' kernel): "auto" = "megablox" when compiling
# for TPU, "ragged_dot" elsewhere.
MOE_KERNELS = ("auto", "ragged_dot", "megablox")
# The mesh axes `expert_axis` may split the experts over ("" = none): the batch axes, so
# the devices that hold one expert's shard exchange tokens they already split.
EXPERT_AXES = ("",) + BATCH_AXES
# `gmm`'s tile: rows, contraction and output width.
_GMM_TILE = 128


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
    expert_axis: str = "",
    kernel: str = "auto",
    gate_lora: ExpertAdapters | None = None,
    up_lora: ExpertAdapters | None = None,
    down_lora: ExpertAdapters | None = None,
    lora_scale: float = 1.0,
) -> jax.Array:
    """y[n] = sum_k weights[n, k] * down_e(silu(gate_e(x[n])) * up_e(x[n])), e = experts[n, k].

    The dispatch point of the experts' work over the mesh in context (`target_mesh`):
    with none (or one device, or inside a `shard_map` manual over every axis), or for
    ragged_dot without `expert_axis` (XLA partitions it), the arrays are computed as they
    are (`local_experts`). Otherwise inside `jax.shard_map` (a Pallas kernel cannot be
    partitioned by XLA): tokens
    split over the batch axes, the experts' hidden width F over "tensor", and with
    `expert_axis` (a batch axis, `EXPERT_AXES`) the experts themselves split over that
    axis: each device all-gathers the tokens (with their routes) of its `expert_axis`
    group, runs its X / s local experts on the assignments routed to them, and a
    reduce-scatter over the axis sums every token's K contributions back onto the device
    that holds the token. Without `expert_axis` every device runs every expert on its own
    tokens (the experts' weights gathered, as for a dense MLP).

    Args:
      expert_axis: the mesh axis the X experts are split over ("" = none); X must divide
        by its size.
      kernel: the grouped matmul (`MOE_KERNELS`): "ragged_dot" (`jax.lax.ragged_dot`),
        "megablox" (Pallas' TPU kernel `gmm`, its interpreter off TPU), "auto" =
        megablox when compiling for TPU, ragged_dot elsewhere.
      gate_lora, up_lora, down_lora: a projection's LoRA adapters on every expert (A and
        B in x's dtype): proj_e(h) = h W_e + lora_scale * (h A_e) B_e, the adapter product
        two more grouped matmuls over the same sorted groups (the merged kernel
        W_e + lora_scale * A_e B_e without forming it).
      lora_scale: alpha / rank.
    """
    if kernel not in MOE_KERNELS:
        raise ValueError(f"moe_kernel: expected one of {', '.join(MOE_KERNELS)}, got {kernel!r}")
    if kernel == "auto":
        kernel = "megablox" if attention_kernels.target_platform() == "tpu" else "ragged_dot"
    interpret = attention_kernels.target_platform() != "tpu"
    num_experts = gate_XxExF.shape[0]
    loras = (gate_lora, up_lora, down_lora)
    mesh = attention_kernels.target_mesh()
    whole = not expert_axis and kernel == "ragged_dot"  # XLA partitions ragged_dot itself
    if whole or mesh is None or mesh.size == 1 or mesh.are_all_axes_manual:
        return local_experts(x_NxE, experts_NxK, weights_NxK, gate_XxExF, up_XxExF,
                             down_XxFxE, 0, num_experts, kernel, interpret,
                             loras=loras, lora_scale=lora_scale)  # fmt: skip
    shape, rows, split, hidden = _layout(mesh, x_NxE.shape[0], expert_axis, gate_XxExF.shape)
    rows_axes = tuple(rows) or None
    token_spec = P(rows_axes, None)
    expert = split or None

    def local(x, experts, weights, gate, up, down, local_loras):
        first = 0
        if split:
            first = jax.lax.axis_index(split) * gate.shape[0]
            if split in rows:  # each device's tokens, gathered over the expert axis
                x, experts, weights = (
                    jax.lax.all_gather(a, split, axis=0, tiled=True) for a in (x, experts, weights)
                )
        local_loras = tuple(lo or None for lo in local_loras)
        y = local_experts(x, experts, weights, gate, up, down, first, num_experts, kernel,
                          interpret, out_dtype=jnp.float32, loras=local_loras,
                          lora_scale=lora_scale)  # fmt: skip
        if hidden:
            y = jax.lax.psum(y, "tensor")
        if split in rows:
            y = jax.lax.psum_scatter(y, split, scatter_dimension=0, tiled=True)
        elif split:
            y = jax.lax.psum(y, split)
        return y.astype(x_NxE.dtype)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(
            token_spec,
            token_spec,
            token_spec,
            P(expert, None, hidden),
            P(expert, None, hidden),
            P(expert, hidden, None),
            # A [X, in, r] and B [X, r, out], the experts' width F split as its kernel's
            (
                (P(expert, None, None), P(expert, None, hidden)) if gate_lora else (),
                (P(expert, None, None), P(expert, None, hidden)) if up_lora else (),
                (P(expert, hidden, None), P(expert, None, None)) if down_lora else (),
            ),
        ),  # fmt: skip
        out_specs=token_spec,
        axis_names=set(shape),
        # Pallas' output shapes carry no varying-axes type; the gradients through the
        # collectives are tested equal to one device's (tests/models/moe_test.py).
        check_vma=False,
    )(x_NxE, experts_NxK, weights_NxK, gate_XxExF, up_XxExF, down_XxFxE,
      tuple(lo or () for lo in loras))  # fmt: skip


def _layout(mesh, n: int, expert_axis: str, gate_shape) -> tuple[dict, list, str, str | None]:
    """How `moe_experts` splits its work over the mesh's automatic axes: (their sizes, the
    batch axes the N tokens split over (those that divide N), the axis the experts split
    over ("" = none), "tensor" when it splits the experts' width F, else None)."""
    shape, rows = attention_kernels.auto_axes(mesh, n)
    split = expert_axis if shape.get(expert_axis, 1) > 1 else ""
    num_experts, _, width = gate_shape
    if split and num_experts % shape[split]:
        raise ValueError(
            f"num_experts ({num_experts}) must divide by the size of mesh axis {split!r} "
            f"({shape[split]}) that expert_axis splits the experts over"
        )
    tensor = shape.get("tensor", 1)
    hidden = "tensor" if tensor > 1 and width % tensor == 0 else None
    return shape, rows, split, hidden


def local_experts(
    x_NxE: jax.Array,
    experts_NxK: jax.Array,
    weights_NxK: jax.Array,
    gate_LxExF: jax.Array,
    up_LxExF: jax.Array,
    down_LxFxE: jax.Array,
    first_expert: jax.Array | int,
    num_experts: int,
    kernel: str = "ragged_dot",
    interpret: bool = True,
    out_dtype=None,
    *,
    loras: tuple[ExpertAdapters | None, ...] = (None, None, None),
    lora_scale: float = 1.0,
) -> jax.Array:
    """`moe_experts`' sum over the L local experts first_expert ... first_expert + L - 1 of
    X (the others' assignments add nothing), on one device's arrays.

    The N * K assignments are sorted (stably: token order within an expert) by expert
    index relative to `first_expert` mod X, so the local experts' rows come first, one
    contiguous group each; the grouped matmul multiplies each group by its expert's
    kernel (rows past the local groups come out zero), and the rows go back to their
    (token, k) places. Matmuls in x's dtype; the weighted sum in float32, cast to
    `out_dtype` (default x's dtype). `loras`: gate's, up's and down's adapters on the L
    local experts, or None (`moe_experts`); their grouped matmuls are ragged_dot's (a rank
    below megablox's tiles).
    """
    n, k = experts_NxK.shape
    flat_M = experts_NxK.reshape(-1)  # M = N * K assignments, token-major
    if gate_LxExF.shape[0] < num_experts:
        flat_M = (flat_M - first_expert) % num_experts  # the local experts first
    order_M = jnp.argsort(flat_M, stable=True)  # assignment of each sorted row
    sizes_X = jnp.bincount(flat_M, length=num_experts).astype(jnp.int32)

    def grouped(rows_MxI, kernel_LxIxO, lora):
        out_MxO = matmul(rows_MxI, kernel_LxIxO)
        if lora is None:
            return out_MxO
        a_LxIxR, b_LxRxO = lora
        low_MxR = _ragged_dot(rows_MxI, a_LxIxR, sizes_X, interpret)
        scale = jnp.asarray(lora_scale, out_MxO.dtype)
        return out_MxO + scale * _ragged_dot(low_MxR, b_LxRxO, sizes_X, interpret)

    x_MxE = jnp.take(x_NxE, order_M // k, axis=0)
    matmul = functools.partial(
        _megablox if kernel == "megablox" else _ragged_dot,
        sizes_X=sizes_X,
        interpret=interpret,
    )
    gate_lora, up_lora, down_lora = loras
    hidden_MxF = jax.nn.silu(grouped(x_MxE, gate_LxExF, gate_lora))
    hidden_MxF = hidden_MxF * grouped(x_MxE, up_LxExF, up_lora)
    y_MxE = grouped(hidden_MxF, down_LxFxE, down_lora)
    # Back to token-major rows: row order_M[i] of the output is sorted row i.
    inverse_M = jnp.zeros_like(order_M).at[order_M].set(jnp.arange(n * k, dtype=order_M.dtype))
    y_NxKxE = jnp.take(y_MxE, inverse_M, axis=0).reshape(n, k, -1)
    y_NxE = jnp.einsum("nke,nk->ne", y_NxKxE.astype(jnp.float32), weights_NxK)
    return y_NxE.astype(out_dtype or x_NxE.dtype)


def _ragged_dot(lhs_MxA, rhs_LxAxB, sizes_X, interpret):
    """`jax.lax.ragged_dot` over the first L groups of the rows (the rest come out zero)."""
    del interpret
    return jax.lax.ragged_dot(lhs_MxA, rhs_LxAxB, sizes_X[: rhs_LxAxB.shape[0]])


def _megablox(lhs_MxA, rhs_LxAxB, sizes_X, interpret):
    """Pallas' grouped matmul `gmm` (TPU; its interpreter elsewhere) over the first L groups
    of the rows, the others zero.

    `gmm` needs the rows in whole tiles of `tm` rows (zero rows appended, cut off after)
    and leaves rows outside the kernel's groups unwritten unless its group sizes name more
    groups than its kernel has: the L local sizes plus one group of every other row, so
    the rows past the local groups come out zero, forward and backward (`gmm`'s VJP).
    Contraction and output widths are tiled by 128 (or the whole width when narrower).
    """
    m, a = lhs_MxA.shape
    num_local, _, b = rhs_LxAxB.shape
    tm = min(_GMM_TILE, -(-m // 16) * 16)
    padded = -(-m // tm) * tm
    local_L = sizes_X[:num_local]
    sizes = jnp.concatenate([local_L, (padded - jnp.sum(local_L))[None]]).astype(jnp.int32)
    lhs = jnp.pad(lhs_MxA, ((0, padded - m), (0, 0)))
    out = megablox.gmm(
        lhs,
        rhs_LxAxB,
        sizes,
        lhs_MxA.dtype,
        (tm, min(_GMM_TILE, a), min(_GMM_TILE, b)),
        interpret=interpret,
    )
    return out[:m]


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
