"""Flax causal LM of the Llama 3.x, Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE families.

The model is a pure function of (params, tokens): `CausalLM(config).apply({"params": p}, ...)`.
Every parameter carries logical axis names (`nn.with_logical_partitioning`) that
`sharding.py` maps onto a device mesh.

Layout conventions (shared with `sampling.py` and `rollout.py`):
- Prompts are left-padded; `valid_BxT` marks real tokens, `positions_BxT` are RoPE
  positions (`make_positions(valid_BxT)` by default).
- With a `KVCache`, the T new tokens are written at columns
  `cache_index .. cache_index + T - 1` of the cache; a query at column c attends to
  cache columns <= c that hold real tokens. A decode step of one token per row may give
  each row its own column (`cache_index` of shape [B], as the continuous-batching engine
  does); its query then attends to every real column of its row.
- The cache stores keys and values as [B, K, S, D] (kv heads before columns): attention
  reads it in that layout, so a decode step never transposes the whole cache.
- `ModelConfig.kv_dtype` (bfloat16, float8_e4m3fn; "" = the compute dtype) is what caches
  hold keys and values in. Every forward rounds them to it after RoPE (`kv_store`) and
  attends to them in the compute dtype, so a pass without a cache rounds as a cached one.
- `ModelConfig.attention` selects the attention implementation (`attention.py`); calls
  with a cache (the sampler's prefill and decode steps) run "xla" unless it is
  "dot_product" or "chunked". `ModelConfig.remat_policy` (with `remat=True`) selects what
  each rematerialised layer keeps for the backward pass (`REMAT_POLICIES`).
- A layer's feed-forward block is its family's (`families.py`): a SwiGLU `MLP`, or a sparse
  mixture of experts `MoE` (`moe.py`) that sows its router logits for the load-balancing
  loss (`router_logits`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.ad_checkpoint import checkpoint_name

from m2po_jax.models import attention, families, lora, moe, quant
from m2po_jax.models import paged as paged_lib
from m2po_jax.models.model_config import (
    REMAT_POLICIES,
    ModelConfig,
    as_dtype,
)
from m2po_jax.models.rope import rope_cos_sin, rope_inv_freq, rotate


@flax.struct.dataclass
class KVCache:
    """Per-layer key/value buffers [B, K, S, D] and which of the S columns hold real tokens."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    valid_BxS: jax.Array


@flax.struct.dataclass
class Prefix:
    """Keys and values of G prefixes (prompts) that the R rows of a call continue.

    `k`, `v`: [L, G, K, P, D], layer by layer, as `apply(..., return_kv=True)` returns
    them for the prefix tokens; `valid_GxP` marks their real tokens. Row r continues
    prefix `argmax(pick_RxG[r])`, or, with `pick_RxG` None, prefix r // (R / G): the
    rows come in G consecutive groups. The rows' queries sit at columns P, P + 1, ...
    after the prefix; each layer expands its prefix to the rows inside the (scanned,
    rematerialised) layer, so the rows' copies never outlive one layer.
    """

    k: jax.Array
    v: jax.Array
    valid_GxP: jax.Array
    pick_RxG: jax.Array | None = None

    def expand(self, x_GxN: jax.Array, rows: int) -> jax.Array:
        """[G, ...] -> [R, ...]: each row's prefix."""
        if self.pick_RxG is None:
            return jnp.repeat(x_GxN, rows // x_GxN.shape[0], axis=0)
        if x_GxN.dtype == jnp.bool_:  # masks carry no gradient
            return x_GxN[jnp.argmax(self.pick_RxG, axis=1)]
        # A one-hot matmul, not a gather: its gradient is a matmul too, where a gather's is
        # a scatter-add (slow on XLA:CPU).
        return jnp.einsum("rg,g...->r...", self.pick_RxG.astype(x_GxN.dtype), x_GxN)

    def layer_cache(self, k_GxKxPxD, v_GxKxPxD, rows: int, width: int):
        """One layer's [R, K, P + width, D] buffers: the prefix, then room for the rows."""

        def one(x):
            x = self.expand(x, rows)
            return jnp.pad(x, ((0, 0), (0, 0), (0, width), (0, 0)))

        return one(k_GxKxPxD), one(v_GxKxPxD)


@flax.struct.dataclass
class Columns:
    """How much of a wide cache a decode step's attention reads: the smallest of `widths`
    (static, ascending, the last one the cache's width) that holds the first `needed`
    columns (traced: the columns written so far, as far as any query of the step may
    read). One attention branch per width (`attention.attend_bucketed`)."""

    needed: jax.Array
    widths: tuple[int, ...] = flax.struct.field(pytree_node=False)


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> KVCache:
    """An empty cache of `max_len` columns, in `config.cache_dtype` unless `dtype` is given."""
    dtype = config.cache_dtype if dtype is None else as_dtype(dtype)
    shape = (batch, config.num_kv_heads, max_len, config.dim_per_head)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return KVCache(k=zeros, v=zeros, valid_BxS=jnp.zeros((batch, max_len), bool))


def kv_store(x: jax.Array, config: ModelConfig) -> jax.Array:
    """Keys or values as a cache of `config` stores them: cast to `config.cache_dtype`.

    float8 e4m3fn is clipped to its largest finite value (+-448) first: it has no infinity,
    and a plain cast makes NaN of anything past 464 (where rounding would leave the range),
    which would poison every later score of its row. No scale: as vLLM's fp8 KV cache at
    its default scale 1.0, so keys and values past 448 saturate.
    """
    dtype = config.cache_dtype
    if dtype == x.dtype:
        return x
    if dtype == jnp.float8_e4m3fn:
        big = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -big, big)
    return x.astype(dtype)


def _cache_write(cache_BxKxSxD: jax.Array, new_BxKxTxD: jax.Array, cache_index) -> jax.Array:
    """Writes the new keys (or values) at `cache_index`: a column shared by every row, or
    one column per row ([B] int32; one new token per row, as a continuous-batching decode
    step writes each slot at its own column)."""
    new_BxKxTxD = new_BxKxTxD.astype(cache_BxKxSxD.dtype)
    if jnp.ndim(cache_index) == 0:
        return jax.lax.dynamic_update_slice_in_dim(cache_BxKxSxD, new_BxKxTxD, cache_index, 2)
    rows = jnp.arange(cache_BxKxSxD.shape[0])
    return cache_BxKxSxD.at[rows, :, cache_index].set(new_BxKxTxD[:, :, 0], mode="drop")


def make_positions(valid_BxT: jax.Array) -> jax.Array:
    """RoPE positions that skip left padding: 0 at the first real token."""
    return jnp.maximum(jnp.cumsum(valid_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def dense(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """x [..., *w.shape[:n_in]] @ w, contracting the last `n_in` dims of x with w's first.

    Done as one 2-D matmul on flattened views: XLA:CPU lays out the backward pass of a
    2-D matmul far better than that of a batched einsum (measured: docs/benchmarks.md).
    """
    lead, w_in, w_out = x.shape[: x.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
    y = x.reshape(math.prod(lead), math.prod(w_in)) @ w.reshape(math.prod(w_in), -1)
    return y.reshape(*lead, *w_out)


def _param(module: nn.Module, name: str, shape, axes, init, dtype):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def lora_a_init(key, shape, dtype, experts: bool = False):
    """PEFT's default for A (Kaiming-uniform, a = sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
    fan_in the input dims of A [in..., r]; of experts' A [X, in, r] (`experts`), one expert's."""
    bound = 1.0 / math.sqrt(math.prod(shape[1 if experts else 0 : -1]))
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def _kernel(module, name: str, shape, in_axes, out_axes, config: ModelConfig, base: str):
    """Declares projection `name`'s kernel `{name}_kernel` (logical axes in_axes + out_axes,
    normal(0.02) init, param dtype) and returns it as float32 or param dtype. With a
    quantised `base` (int8 / nf4: an adapted projection under `lora_base`) it declares the
    stored codes `{name}_kernel` and scales `{name}_kernel_scale` (`_stored`; zeros here:
    `init_params` quantises a float init) and returns their dequantised float32 kernel of
    `shape`."""
    axes = (*in_axes, *out_axes)
    if base == "float":
        init = nn.initializers.normal(0.02)
        return _param(module, f"{name}_kernel", shape, axes, init, as_dtype(config.param_dtype))
    stored = _stored(module, name, shape, in_axes, out_axes, base)
    return quant.dequantize(base, stored["kernel"], stored["kernel_scale"], shape, len(in_axes))


def _stored(module, name: str, shape, in_axes, out_axes, base: str) -> dict:
    """Declares a quantised kernel's codes `{name}_kernel` and scales `{name}_kernel_scale`
    in `quant.leaf_layout`'s shapes, dtypes and axes; returns them by suffix."""
    layout = quant.leaf_layout(base, shape, len(in_axes), (*in_axes, *out_axes))
    return {
        suffix: _param(module, f"{name}_{suffix}", s, a, nn.initializers.zeros, dtype)
        for suffix, (s, dtype, a) in layout.items()
    }


def projection(module, name: str, x, shape, in_axes, out_axes, config: ModelConfig):
    """x @ W for projection `name`, whose kernel `{name}_kernel` of `shape` ([in..., out...],
    logical axes in_axes + out_axes) this declares (`_kernel`), contracting len(in_axes)
    dims (`dense`); plus the LoRA adapter when the config adapts `name`:
    scale * (x @ A) @ B, A [in..., r] and B [r, out...] float32 params `{name}_lora_a` /
    `{name}_lora_b` beside the kernel, sharded as the kernel's input and output axes (the
    rank axis replicated). B starts at zero, so a new adapter leaves the model as it is.

    Under a quantised base (`lora_base` int8 / nf4) an adapted projection's kernel is
    stored as codes and scales (`quant.py`) and dequantised here, just before its matmul:
    one projection's float kernel at a time, never the whole model's. Under `weight_quant`
    (int8 / float8_e4m3fn: a rollout engine's weights) every projection's is, and its
    per-output-channel scale multiplies the matmul's output instead (x @ (q s) = (x @ q) s),
    so the codes are the matmul's operand."""
    n_in = len(in_axes)
    dt = as_dtype(config.dtype)
    adapted = bool(config.lora_rank) and name in config.lora_targets
    if config.weight_quant:
        # Per output channel, x @ (q s) = (x @ q) s: the codes go to the matmul cast (exact:
        # int8 and e4m3 fit bfloat16), where the compiler fuses the cast into the matmul's
        # read, and the scale multiplies the output, so no float kernel is written out.
        stored = _stored(module, name, shape, in_axes, out_axes, config.weight_quant)
        y = dense(x, stored["kernel"].astype(dt), n_in)
        y = (y * stored["kernel_scale"]).astype(dt)
    else:
        base = config.lora_base if adapted else "float"
        w = _kernel(module, name, shape, in_axes, out_axes, config, base)
        y = dense(x, w.astype(dt), n_in)
    if not adapted:
        return y
    r = config.lora_rank
    a = _param(
        module, f"{name}_lora_a", (*shape[:n_in], r), (*in_axes, None), lora_a_init, jnp.float32
    )
    b = _param(
        module,
        f"{name}_lora_b",
        (r, *shape[n_in:]),
        (None, *out_axes),
        nn.initializers.zeros,
        jnp.float32,
    )
    low = dense(dense(x, a.astype(dt), n_in), b.astype(dt))
    return y + jnp.asarray(config.lora_scale(), dt) * low


class RMSNorm(nn.Module):
    eps: float
    axis_name: str
    param_dtype: Any
    dtype: Any

    @nn.compact
    def __call__(self, x):
        scale = _param(
            self, "scale", (x.shape[-1],), (self.axis_name,), nn.initializers.ones, self.param_dtype
        )
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * normed.astype(self.dtype)


class Attention(nn.Module):
    config: ModelConfig
    implementation: str  # resolved (`attention.resolve`)
    widths: tuple[int, ...] | None = None  # with a cache: `Columns.widths`

    @nn.compact
    def __call__(self, x_BxTxE, cos_sin, mask, cache_kv, cache_index):
        c = self.config
        dt, pdt = as_dtype(c.dtype), as_dtype(c.param_dtype)
        e, h, k, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.dim_per_head

        def proj(name, heads, axis):
            y = projection(self, name, x_BxTxE, (e, heads, d), ("embed",), (axis, "head_dim"), c)
            if c.attention_bias:
                bias = _param(
                    self, f"{name}_bias", (heads, d), (axis, "head_dim"), nn.initializers.zeros, pdt
                )
                y = y + bias.astype(dt)
            return y

        q = proj("q", h, "q_heads")
        key = proj("k", k, "kv_heads")
        value = proj("v", k, "kv_heads")
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, "head_dim", pdt, dt, name="q_norm")(q)
            key = RMSNorm(c.rms_norm_eps, "head_dim", pdt, dt, name="k_norm")(key)
        # Named for the save_* remat policies.
        q = checkpoint_name(rotate(q, *cos_sin), "qkv_proj")
        # [B, K, T, D]: the cache layout, so decode reads the cache without transposing it.
        key = checkpoint_name(rotate(key, *cos_sin).transpose(0, 2, 1, 3), "qkv_proj")
        value = checkpoint_name(value.transpose(0, 2, 1, 3), "qkv_proj")
        if c.kv_dtype:  # as a cache holds them, with a cache or without (attended in dt)
            key, value = kv_store(key, c), kv_store(value, c)
        new_kv = (key, value)  # without a cache: this call's own (`return_kv`)
        pages = cache_kv if isinstance(cache_kv, paged_lib.PagedLayer) else None
        if pages is not None and not pages.view.fresh:  # pages: written, then attended
            out, new_kv = pages.write_and_attend(
                q, key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)
            )
            o_axes = (("q_heads", "head_dim"), ("embed",))
            return projection(self, "o", out, (h, d, e), *o_axes, c), new_kv
        if pages is not None:  # a paged prefill: written, attended as without a cache
            new_kv = pages.write(key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3))
        elif cache_kv is not None:
            key = _cache_write(cache_kv[0], key, cache_index)
            value = _cache_write(cache_kv[1], value, cache_index)
            new_kv = (key, value)
        if self.widths is not None and mask.width_index is not None:
            out = attention.attend_bucketed(q, key.astype(dt), value.astype(dt), mask, self.widths)
        else:
            out = attention.attend(
                self.implementation,
                q,
                key.astype(dt),
                value.astype(dt),
                mask,
                c.attention_block_size,
            )
        out = checkpoint_name(out, "attention_out")
        o_axes = (("q_heads", "head_dim"), ("embed",))
        return projection(self, "o", out, (h, d, e), *o_axes, c), new_kv


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxE):
        c = self.config
        e, f = c.hidden_size, c.intermediate_size
        x = x_BxTxE
        # Each projection declares its kernel (gate, up, down: the init's order).
        hidden = jax.nn.silu(projection(self, "gate", x, (e, f), ("embed",), ("mlp",), c))
        hidden = hidden * projection(self, "up", x, (e, f), ("embed",), ("mlp",), c)
        return projection(self, "down", hidden, (f, e), ("mlp",), ("embed",), c)


class MoE(nn.Module):
    """A sparse mixture of experts (Qwen3-MoE's block, `moe.py`): a router [E, X] whose
    float32 logits pick each token's `num_experts_per_tok` experts, and X SwiGLU experts
    stacked [X, E, F] / [X, F, E] (logical axis "expert" first), run dropless as grouped
    matmuls (`moe.moe_experts`). The router logits [B, T, X] are sown as "intermediates" /
    "router_logits" for the load-balancing loss (`router_logits`), the experts each token
    ran [B, T, K] as "routed_experts" (`routed_experts`: what a rollout records).
    `routed_experts_BxTxK`: recorded experts to replay (-1: route freshly; `moe.route`).

    LoRA on gate, up or down (`lora_targets`) adapts every expert: `{name}_experts_lora_a`
    [X, in, r] and `{name}_experts_lora_b` [X, r, out] (float32, B zero at init), applied in
    the grouped matmuls. The router is never adapted: it stays the base model's, so LoRA
    changes what the experts compute, not which experts a token reaches."""

    config: ModelConfig

    def _experts(self, name: str, shape, axes):
        """Declares expert kernel `{name}_experts` [X, in, out] and, when LoRA adapts
        `name`, its adapters; returns (kernel, adapters or None) in the compute dtype."""
        c = self.config
        dt = as_dtype(c.dtype)
        init = nn.initializers.normal(0.02)
        kernel = _param(self, f"{name}_experts", shape, axes, init, as_dtype(c.param_dtype))
        if not (c.lora_rank and name in c.lora_targets):
            return kernel.astype(dt), None
        (experts, d_in, d_out), r = shape, c.lora_rank
        a_shape, b_shape = (experts, d_in, r), (experts, r, d_out)
        a_axes, b_axes = (*axes[:2], None), (axes[0], None, axes[2])  # the rank replicated
        a_init = functools.partial(lora_a_init, experts=True)
        a = _param(self, f"{name}_experts_lora_a", a_shape, a_axes, a_init, jnp.float32)
        zeros = nn.initializers.zeros
        b = _param(self, f"{name}_experts_lora_b", b_shape, b_axes, zeros, jnp.float32)
        return kernel.astype(dt), (a.astype(dt), b.astype(dt))

    @nn.compact
    def __call__(self, x_BxTxE, routed_experts_BxTxK=None):
        c = self.config
        pdt = as_dtype(c.param_dtype)
        e, f, n = c.hidden_size, c.moe_intermediate_size, c.num_experts
        init = nn.initializers.normal(0.02)
        router = _param(self, "router_kernel", (e, n), ("embed", "expert"), init, pdt)
        gate, gate_lora = self._experts("gate", (n, e, f), ("expert", "embed", "mlp"))
        up, up_lora = self._experts("up", (n, e, f), ("expert", "embed", "mlp"))
        down, down_lora = self._experts("down", (n, f, e), ("expert", "mlp", "embed"))
        b, t = x_BxTxE.shape[:2]
        x_NxE = x_BxTxE.reshape(b * t, e)
        # float32 logits at full precision whatever the compute dtype: the router is small,
        # and the expert choice is a discontinuous function of them.
        logits_NxX = jnp.matmul(
            x_NxE.astype(jnp.float32),
            router.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        self.sow("intermediates", "router_logits", logits_NxX.reshape(b, t, n))
        k = c.num_experts_per_tok
        recorded_NxK = None
        if routed_experts_BxTxK is not None:
            recorded_NxK = routed_experts_BxTxK.reshape(b * t, k)
        weights_NxK, experts_NxK = moe.route(
            logits_NxX, k, c.norm_topk_prob, recorded_NxK=recorded_NxK
        )
        self.sow("intermediates", "routed_experts", experts_NxK.reshape(b, t, k))
        y_NxE = moe.moe_experts(
            x_NxE,
            experts_NxK,
            weights_NxK,
            gate,
            up,
            down,
            gate_lora=gate_lora,
            up_lora=up_lora,
            down_lora=down_lora,
            lora_scale=c.lora_scale(),
            expert_axis=c.expert_axis,
            kernel=c.moe_kernel,
        )
        return y_NxE.reshape(b, t, e)


# Each feed-forward kind's block (`families.Family.mlp`).
_MLP_BLOCKS = {"dense": MLP, "moe": MoE}


class DecoderLayer(nn.Module):
    config: ModelConfig
    implementation: str
    widths: tuple[int, ...] | None = None

    @nn.compact
    def __call__(self, x_BxTxE, cos_sin, mask, cache_kv, cache_index, routed_experts_BxTxK=None):
        c = self.config
        dt, pdt = as_dtype(c.dtype), as_dtype(c.param_dtype)
        normed = RMSNorm(c.rms_norm_eps, "embed", pdt, dt, name="input_norm")(x_BxTxE)
        attn, new_kv = Attention(c, self.implementation, self.widths, name="attn")(
            normed, cos_sin, mask, cache_kv, cache_index
        )
        x_BxTxE = x_BxTxE + attn
        normed = RMSNorm(c.rms_norm_eps, "embed", pdt, dt, name="post_attn_norm")(x_BxTxE)
        mlp = _MLP_BLOCKS[families.family(c.model_type).mlp](c, name="mlp")
        if routed_experts_BxTxK is not None:  # replayed routing (a mixture of experts only)
            return x_BxTxE + mlp(normed, routed_experts_BxTxK), new_kv
        return x_BxTxE + mlp(normed), new_kv


def _scan_layers(
    c: ModelConfig,
    impl: str,
    params,
    x_BxTxE,
    cos_sin,
    mask,
    prefix: Prefix | None = None,
    return_kv: bool = False,
    sown: bool = False,
    routed_experts_BxTxLxK=None,
):
    """The decoder layers as one `lax.scan` over their stacked params.

    Same values as the layer loop. Each iteration gathers one layer's (fsdp-sharded)
    weights and, in the backward pass, reduces that layer's weight gradients before the
    next one starts, so no scheduler can keep every layer's gathered weights or full-size
    gradients alive at once; the program also compiles one layer instead of all of them.
    With a `prefix` each iteration also takes that layer's prefix keys and values; with
    `return_kv` it returns this call's keys and values, stacked [L, B, K, T, D]; with
    `sown` the layers' "intermediates" (a mixture of experts' router logits), stacked;
    `routed_experts_BxTxLxK` (replay) gives each iteration its layer's recorded experts.
    """
    stacked = jax.tree.map(
        lambda *ws: jnp.stack(ws), *[params[f"layers_{i}"] for i in range(c.num_layers)]
    )
    layer = DecoderLayer(c, impl)
    rows, width = x_BxTxE.shape[:2]

    def one(layer_params, x, prefix_kv, routed_BxTxK):
        cache_kv, index = None, 0
        if prefix is not None:
            cache_kv, index = prefix.layer_cache(*prefix_kv, rows, width), prefix.k.shape[3]
        variables = {"params": layer_params}
        args = (x, cos_sin, mask, cache_kv, index, routed_BxTxK)
        intermediates = None
        if sown:
            (y, kv), state = layer.apply(variables, *args, mutable=["intermediates"])
            intermediates = state.get("intermediates", {})
        else:
            y, kv = layer.apply(variables, *args)
        if prefix is not None:  # the rows' own columns of the buffers
            kv = tuple(z[:, :, index:] for z in kv)
        return y, (kv if return_kv else None, intermediates)

    if c.remat:
        one = jax.checkpoint(one, policy=REMAT_POLICIES[c.remat_policy])

    def body(x, xs):
        layer_params, prefix_kv, routed_BxTxK = xs
        return one(layer_params, x, prefix_kv, routed_BxTxK)

    prefix_kv = None if prefix is None else (prefix.k, prefix.v)
    routed_LxBxTxK = None
    if routed_experts_BxTxLxK is not None:
        routed_LxBxTxK = jnp.moveaxis(routed_experts_BxTxLxK, 2, 0)
    return jax.lax.scan(body, x_BxTxE, (stacked, prefix_kv, routed_LxBxTxK))


class CausalLM(nn.Module):
    """Decoder-only LM. Returns float32 logits, and the updated cache when one is given.

    Logits are [B, T, V], or [B, 1, V] for the last column only with `last_only=True`
    (what a sampler needs after a prefill or decode step). With `hidden_only=True` it
    returns the final-normed hidden states [B, T, E] in the compute dtype instead (with
    the cache when one is given): `head_weight` then gives the output head, so that log-probs can be taken
    without materialising [B, T, V] logits (`logprobs.py`).

    With a cache, `columns` (`Columns`) bounds the columns attention reads: the caller
    guarantees that no query needs a column past `columns.needed`. The cache keeps its
    width; with the "xla" implementation each layer reads only the bucketed width.

    `routed_experts_BxTxLxK` (a mixture of experts): each token's recorded experts per layer
    to replay (routing replay; -1 where a token routes freshly; `moe.route`).
    """

    config: ModelConfig

    # Long on purpose: the forward's modes (no cache, a cache written at one column or at one
    # column per row, a shared prompt prefix; layers scanned or unrolled; logits, hidden
    # states or keys and values out) share one embedding, mask, rope and head, declared once
    # here under `nn.compact` (a split would pass the mask, rope and cache between methods
    # and declare the params elsewhere).
    @nn.compact
    def __call__(
        self,
        tokens_BxT: jax.Array,
        positions_BxT: jax.Array | None = None,
        valid_BxT: jax.Array | None = None,
        cache: KVCache | None = None,
        cache_index: jax.Array | int = 0,
        last_only: bool = False,
        hidden_only: bool = False,
        prefix: Prefix | None = None,
        return_kv: bool = False,
        columns: Columns | None = None,
        paged: tuple[paged_lib.PagedPool, paged_lib.PagedView] | None = None,
        routed_experts_BxTxLxK: jax.Array | None = None,
    ):
        c = self.config
        dt, pdt = as_dtype(c.dtype), as_dtype(c.param_dtype)
        b, t = tokens_BxT.shape
        if valid_BxT is None:
            valid_BxT = jnp.ones((b, t), bool)
        if positions_BxT is None:
            positions_BxT = make_positions(valid_BxT)
        embedding = _param(
            self,
            "embedding",
            (c.vocab_size, c.hidden_size),
            ("vocab", "embed"),
            nn.initializers.normal(0.02),
            pdt,
        )
        x = jnp.take(embedding, tokens_BxT, axis=0).astype(dt)

        if sum(x is not None for x in (cache, prefix, paged)) > 1:
            raise ValueError("CausalLM: give at most one of a cache, a prefix and pages")

        if prefix is not None:
            cache_index = prefix.k.shape[3]
            key_valid_BxS = jnp.concatenate([prefix.expand(prefix.valid_GxP, b), valid_BxT], 1)
        elif cache is None:
            key_valid_BxS = valid_BxT
        elif jnp.ndim(cache_index) == 0:
            key_valid_BxS = jax.lax.dynamic_update_slice_in_dim(
                cache.valid_BxS, valid_BxT, cache_index, 1
            )
        else:  # one column per row: a decode step of rows at different lengths
            if t != 1 or jnp.shape(cache_index) != (b,):
                raise ValueError(
                    f"CausalLM: a per-row cache_index (shape {jnp.shape(cache_index)}) needs "
                    f"one new token per row, got tokens of shape {(b, t)}"
                )
            key_valid_BxS = cache.valid_BxS.at[jnp.arange(b), cache_index].set(
                valid_BxT[:, 0], mode="drop"
            )
        fresh = paged is not None and paged[1].fresh  # a paged prefill: no cache to read
        cached = cache is not None or prefix is not None or (paged is not None and not fresh)
        impl = attention.resolve(c.attention, dt, c.dim_per_head, cached=cached)
        if paged is not None:  # the pages' view is the mask (`paged.attend`)
            key_valid_BxS = valid_BxT
        # Computed once here and shared by every layer. With a column per row, the cache
        # holds nothing after it (the caller clears a row's columns when it reuses the
        # row), so the key columns' validity is the whole mask.
        q_start = cache_index if jnp.ndim(cache_index) == 0 else cache.valid_BxS.shape[1] - 1
        mask = attention.make_mask(impl, valid_BxT, key_valid_BxS, q_start)
        widths = None
        if columns is not None and cache is not None and impl == "xla":
            if columns.widths[-1] != key_valid_BxS.shape[1]:
                raise ValueError(
                    f"CausalLM: columns.widths {columns.widths} must end at the cache's "
                    f"width {key_valid_BxS.shape[1]}"
                )
            widths = columns.widths
            index = jnp.searchsorted(jnp.asarray(widths), columns.needed)
            mask = mask._replace(width_index=jnp.minimum(index, len(widths) - 1))
        cos_sin = rope_cos_sin(positions_BxT, rope_inv_freq(c), dt)

        layer_cls = DecoderLayer
        if c.remat:
            layer_cls = nn.remat(
                DecoderLayer, policy=REMAT_POLICIES[c.remat_policy], static_argnums=()
            )
        new_k, new_v = [], []
        if c.scan_layers and cache is None and paged is None and not self.is_initializing():
            sown = self.is_mutable_collection("intermediates")
            x, (kv, intermediates) = _scan_layers(
                c,
                impl,
                self.variables["params"],
                x,
                cos_sin,
                mask,
                prefix,
                return_kv,
                sown,
                routed_experts_BxTxLxK,
            )
            if return_kv:
                new_k, new_v = kv
            if sown:  # as the unrolled layers sow them, each leaf stacked [L, ...]
                self.sow("intermediates", "scanned_layers", intermediates)
        else:
            for i in range(c.num_layers):
                cache_kv = None if cache is None else (cache.k[i], cache.v[i])
                if paged is not None:
                    pool, view = paged
                    cache_kv = paged_lib.PagedLayer(pool.kv[i], view, valid_BxT, pool.layout)
                if prefix is not None:
                    cache_kv = prefix.layer_cache(prefix.k[i], prefix.v[i], b, t)
                layer = layer_cls(c, impl, widths, name=f"layers_{i}")
                routed_BxTxK = None
                if routed_experts_BxTxLxK is not None:
                    routed_BxTxK = routed_experts_BxTxLxK[:, :, i]
                x, kv = layer(x, cos_sin, mask, cache_kv, cache_index, routed_BxTxK)
                if prefix is not None:
                    kv = tuple(z[:, :, cache_index:] for z in kv)
                if paged is not None:  # the layer's new pages (keys and values in one)
                    kv = (kv, None)
                new_k.append(kv[0])
                new_v.append(kv[1])
            if return_kv:
                new_k, new_v = jnp.stack(new_k), jnp.stack(new_v)
        if last_only:
            x = x[:, -1:]
        x = RMSNorm(c.rms_norm_eps, "embed", pdt, dt, name="final_norm")(x)
        new_cache = None
        if cache is not None:
            new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), valid_BxS=key_valid_BxS)
        if paged is not None:
            new_cache = paged[0].replace(kv=tuple(new_k))
        if return_kv:  # [L, B, K, T, D] each: a `Prefix` for rows that continue these
            return x, (new_k, new_v)
        if hidden_only:  # the caller applies the head (`logprobs.py`, in chunks)
            return x if new_cache is None else (x, new_cache)
        if c.tie_word_embeddings:
            logits = dense(x, embedding.astype(dt).T)
        else:
            head = _param(
                self,
                "lm_head",
                (c.hidden_size, c.vocab_size),
                ("embed", "vocab"),
                nn.initializers.normal(0.02),
                pdt,
            )
            logits = dense(x, head.astype(dt))
        logits = logits.astype(jnp.float32)
        return logits if new_cache is None else (logits, new_cache)


def host_value(x: Any) -> np.ndarray | None:
    """x as a numpy array, or None when it cannot be checked on the host: a tracer, or an
    array spread over several processes. Input checks use it to skip such values."""
    if isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    return np.asarray(x)


def check_token_ids(tokens: Any, vocab_size: int, name: str) -> None:
    """Raises if a concrete token array holds an id outside [0, vocab_size).

    An out-of-range id would embed as NaN (`jnp.take` fills) and poison every logit after
    it. Traced or not fully addressable arrays are not checked.
    """
    ids = host_value(tokens)
    if ids is None or ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"{name}: token id {bad} is outside the model's vocabulary [0, {vocab_size})"
        )


def init_params(config: ModelConfig, rng: jax.Array, boxed: bool = False):
    """Random params (unboxed arrays unless `boxed`, which keeps the logical-axis metadata).

    Under LoRA the base is the same as without it (`lora.base_config`'s init from the same
    key) and the adapters are new (`add_adapters`, B = 0). Under a quantised base
    (`lora_base` int8 / nf4) that float base is quantised (`quant.quantize_base`) before
    the adapters are added; under `weight_quant` (int8 / float8_e4m3fn) the float model's
    projection kernels are quantised (`quant.quantize_weights`). (`boxed` runs the
    module's own init, whose quantised leaves are zeros: it is for shapes and logical
    axes, `logical_axes`.)
    """
    if config.lora_rank and not boxed:
        base = init_params(lora.base_config(config), rng)
        base = quant.quantize_base(base, config)
        return add_adapters(base, config, jax.random.fold_in(rng, 1))
    if config.weight_quant and not boxed:
        params = init_params(config.replace(weight_quant=""), rng)
        return _quantize_weights(params, config.weight_quant)
    tokens = jnp.zeros((1, 2), jnp.int32)
    params = CausalLM(config).init(rng, tokens)["params"]
    return params if boxed else nn.meta.unbox(params)


_quantize_weights = jax.jit(quant.quantize_weights, static_argnums=1)


def add_adapters(params, config: ModelConfig, rng: jax.Array):
    """`params` (a base model's, e.g. loaded from a checkpoint) with new adapters for
    `config`: A as the model initialises it, B zero (so the function is unchanged). Under
    a quantised base (`config.lora_base`) `params` must hold it quantised already
    (`quant.quantize_base`)."""
    if not config.lora_rank:
        return params
    boxed = jax.eval_shape(lambda: init_params(config, jax.random.key(0), boxed=True))
    shapes = traverse_util.flatten_dict(nn.meta.unbox(boxed))
    flat = dict(traverse_util.flatten_dict(flax.core.unfreeze(params)))
    missing = [p for p in shapes if not lora.is_adapter(p) and p not in flat]
    if missing:
        hint = ""
        if str(missing[0][-1]).endswith(quant.SCALE_SUFFIX):
            hint = f" (lora_base={config.lora_base!r}: quantise it first, quant.quantize_base)"
        raise ValueError(f"params: the base lacks {'/'.join(missing[0])} of the LoRA config{hint}")
    adapters = sorted(p for p in shapes if lora.is_adapter(p))
    for i, path in enumerate(adapters):
        shape = shapes[path]
        if str(path[-1]).endswith("_lora_b"):
            flat[path] = jnp.zeros(shape.shape, shape.dtype)
        else:
            key = jax.random.fold_in(rng, i)
            experts = str(path[-1]).endswith("_experts_lora_a")  # A [X, in, r]
            flat[path] = lora_a_init(key, shape.shape, shape.dtype, experts=experts)
    return traverse_util.unflatten_dict(flat)


def logical_axes(config: ModelConfig):
    """Pytree of logical-axis PartitionSpecs matching `init_params(config, ...)`."""
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0), boxed=True))
    return nn.get_partition_spec(shapes)


def apply(
    params,
    config: ModelConfig,
    tokens_BxT,
    positions_BxT=None,
    valid_BxT=None,
    cache=None,
    cache_index=0,
    last_only: bool = False,
    hidden_only: bool = False,
    prefix: Prefix | None = None,
    return_kv: bool = False,
    columns: Columns | None = None,
    paged: tuple[paged_lib.PagedPool, paged_lib.PagedView] | None = None,
    *,
    routed_experts_BxTxLxK: jax.Array | None = None,
    return_routing: bool = False,
):
    """`CausalLM(config).apply` on bare params.

    `prefix`: the rows continue prefixes whose keys and values are given (`Prefix`; no
    cache then). `paged`: (pool, view) of a paged cache (`paged.py`): returns the new
    pool where a cache call returns the new cache. `return_kv` (with `hidden_only`, no cache): also this call's keys and
    values, ([L, B, K, T, D], [L, B, K, T, D]), i.e. (hidden, (k, v)).

    A mixture of experts: `routed_experts_BxTxLxK` replays recorded experts (`CausalLM`);
    `return_routing` returns (what it returns otherwise, (router logits [L, B, T, X],
    experts each token ran [B, T, L, K] int32)) (`router_logits`, `routed_experts`).
    """
    if return_kv and (not hidden_only or cache is not None):
        raise ValueError("apply: return_kv needs hidden_only=True and no cache")
    if (routed_experts_BxTxLxK is not None or return_routing) and not config.is_moe:
        raise ValueError(f"apply: {config.model_type} has no router (routing replay or record)")
    out = CausalLM(config).apply(
        {"params": params},
        tokens_BxT,
        positions_BxT,
        valid_BxT,
        cache,
        cache_index,
        last_only=last_only,
        hidden_only=hidden_only,
        prefix=prefix,
        return_kv=return_kv,
        columns=columns,
        paged=paged,
        routed_experts_BxTxLxK=routed_experts_BxTxLxK,
        mutable=["intermediates"] if return_routing else False,
    )
    if not return_routing:
        return out
    out, state = out
    sown = state["intermediates"]
    return out, (router_logits(sown, config), routed_experts(sown, config))


def router_logits(intermediates, config: ModelConfig) -> jax.Array:
    """Every layer's router logits [L, B, T, X] (float32) from the "intermediates" of a
    mixture of experts' forward (`CausalLM(config).apply(..., mutable=["intermediates"])`),
    layers unrolled or scanned; `moe.load_balancing_loss` takes them."""
    if not config.is_moe:
        raise ValueError(f"router_logits: {config.model_type} has no router (num_experts 0)")
    if "scanned_layers" in intermediates:
        return intermediates["scanned_layers"][0]["mlp"]["router_logits"][0]
    layers = [
        intermediates[f"layers_{i}"]["mlp"]["router_logits"][0] for i in range(config.num_layers)
    ]
    return jnp.stack(layers)


def routed_experts(intermediates, config: ModelConfig) -> jax.Array:
    """The experts each token ran in every layer, [B, T, L, K] int32 (what a rollout
    records for routing replay), from the "intermediates" as `router_logits` reads them."""
    if not config.is_moe:
        raise ValueError(f"routed_experts: {config.model_type} has no router (num_experts 0)")
    if "scanned_layers" in intermediates:
        return jnp.moveaxis(intermediates["scanned_layers"][0]["mlp"]["routed_experts"][0], 0, 2)
    layers = [
        intermediates[f"layers_{i}"]["mlp"]["routed_experts"][0] for i in range(config.num_layers)
    ]
    return jnp.stack(layers, axis=2)


def head_weight(params, config: ModelConfig) -> jax.Array:
    """The output head [E, V] in the compute dtype (the embedding's transpose when tied)."""
    w = params["embedding"].T if config.tie_word_embeddings else params["lm_head"]
    return w.astype(as_dtype(config.dtype))


def token_logp(logits_BxTxV: jax.Array, tokens_BxT: jax.Array, temperature: float = 1.0):
    """log p(tokens[:, t] | tokens[:, :t]) aligned with tokens; column 0 is 0.

    logits at column t-1 predict the token at column t; `temperature` divides the
    logits first, as the sampler does when it records behaviour log-probs.
    """
    logits = logits_BxTxV[:, :-1].astype(jnp.float32) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, tokens_BxT[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(picked, ((0, 0), (1, 0)))


def token_entropy(logits_BxTxV: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Entropy of the next-token distribution, aligned like `token_logp`."""
    logits = logits_BxTxV[:, :-1].astype(jnp.float32) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return jnp.pad(ent, ((0, 0), (1, 0)))
