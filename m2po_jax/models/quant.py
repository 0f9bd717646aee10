"""Quantised kernels: QLoRA's frozen bases (int8, NF4) and the rollout engine's weights
(int8, float8 e4m3), dequantised per projection.

With `ModelConfig.lora_base` "int8" or "nf4" (LoRA on), the base kernel of every adapted
projection (`lora_targets`) is held quantised in the params tree, under the kernel's own
name, beside a float32 scale leaf; `model.projection` dequantises it just before its
matmul, one projection at a time, so a whole dequantised model never exists. The
adapters stay float32 and are the only params that train (`lora.split`), so the integer
leaves get no gradient. Projections without an adapter keep their float kernel.

Layouts, for a kernel `w` of shape `shape` whose first `n_in` dims are its inputs:

- int8 (per output channel absmax): `{name}_kernel` int8 of `shape` and
  `{name}_kernel_scale` float32 of `shape[n_in:]` (the input dims reduced), with
  scale = absmax / 127 and q = round(w / scale) in [-127, 127]; w ~ q * scale, off by at
  most scale / 2 per element. Both leaves are sharded as the kernel's dims.
- nf4 (the QLoRA paper's NormalFloat4, laid out as bitsandbytes lays out the Hugging
  Face weight): the kernel is stored transposed, its output dims first,
  `t = w.transpose(out dims + in dims)`, so that `t` flattened row-major is the torch
  Linear weight [out, in] flattened row-major (`hf_format`'s flattening of the head
  axes), which bitsandbytes' `quantize_4bit(weight, blocksize=64, quant_type="nf4")`
  cuts into blocks of `NF4_BLOCK` = 64 values; each block's absmax is its float32
  scale, and each value is the index (0..15) of the `NF4_CODE` entry nearest to
  value / absmax. Two indices share a byte: element 2i of the flattened weight in the
  HIGH nibble, element 2i+1 in the LOW nibble (bitsandbytes' order). t ~
  NF4_CODE[index] * block absmax, so the codes and scales are bitsandbytes' own for the
  same weight (a `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")` base
  dequantises to our kernel). With `ts` = (*shape[n_in:], *shape[:n_in]) the transposed
  shape and its axes permuted alike: `{name}_kernel` is uint8 of shape
  (*ts[:-1], ts[-1] // 2) (the same bytes as the flattened packing, sharded as `t`'s
  dims) when ts[-1] is even, else flat (ceil(n / 2),) unsharded; `{name}_kernel_scale`
  is float32 of shape (*ts[:k], prod(ts[k:]) // 64) for the largest k whose trailing
  dims hold whole blocks (sharded as `t`'s leading k dims, the block dim replicated),
  else flat (ceil(n / 64),) unsharded, the last block zero-padded.

- float8_e4m3fn (per output channel absmax): int8's layout with float8_e4m3fn codes,
  scale = absmax / 448 (the format's largest finite value) and q = w / scale rounded to
  the nearest e4m3 value (3 mantissa bits: within 2^-4 of |w / scale| relative, or 2^-10
  absolute below the normal range, 2^-6), so |w - q scale| <= max(2^-4 |w|, 2^-10 scale).

With `ModelConfig.weight_quant` int8 or float8_e4m3fn every projection's kernel (`N_IN`:
q, k, v, o, gate, up, down; not the embedding, the head or the norms) is held so; that
is the rollout engine's copy under `rollout.weight_dtype` (`convert_weights`), made from
the trainer's float params at each publish. Adapters stay float and are added as ever.

Bytes per weight: int8 and float8 1 (+ 4 per output channel), nf4 0.5 (+ 4 per 64 weights).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from m2po_jax.models.model_config import LORA_BASES, WEIGHT_QUANTS, ModelConfig

__all__ = [
    "FP8_MAX",
    "LORA_BASES",
    "N_IN",
    "NF4_BLOCK",
    "NF4_CODE",
    "SCALE_SUFFIX",
    "WEIGHT_DTYPES",
    "convert_weights",
    "dequantize",
    "dequantize_fp8",
    "dequantize_int8",
    "dequantize_nf4",
    "is_quantized_leaf",
    "leaf_layout",
    "quantize",
    "quantize_base",
    "quantize_fp8",
    "quantize_int8",
    "quantize_nf4",
    "quantize_weights",
]

# The 16 NF4 values (QLoRA paper, appendix E; bitsandbytes' `get_4bit_type("nf4")`),
# ascending: index 7 is 0.0, indices 0 and 15 are -1.0 and 1.0.
NF4_CODE = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    np.float32,
)
# Midpoints between neighbouring code values: a value's nearest code is the number of
# midpoints below it (a value on a midpoint takes the lower code).
_NF4_MIDPOINTS = (NF4_CODE[1:] + NF4_CODE[:-1]) / 2
NF4_BLOCK = 64  # values per absmax scale (bitsandbytes' QLoRA block size)
INT8_MAX = 127
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value (it has no infinities)
# The stored weights a rollout engine may run (`rollout.weight_dtype`, `convert_weights`):
# as trained, float leaves cast to bfloat16, or every projection kernel quantised.
WEIGHT_DTYPES = ("", "bfloat16", *WEIGHT_QUANTS[1:])
# Per-output-channel layouts (`leaf_layout`): their codes' dtypes.
_CHANNEL_CODES = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn}

# Input dims of each adaptable projection's kernel (`model.projection`): o is
# [heads, head_dim, embed], the others [in, out...].
N_IN = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}

SCALE_SUFFIX = "_kernel_scale"  # `{name}_kernel_scale`: a quantised kernel's scales
_KERNEL, _SCALE = "_kernel", SCALE_SUFFIX


# ----------------------------------------------------------------------------- layouts


def _nf4_perm(ndim: int, n_in: int) -> tuple[int, ...]:
    """The transposition of a kernel [in..., out...] (`n_in` input dims) that NF4 stores:
    [out..., in...], the torch Linear weight's order (bitsandbytes' blocks)."""
    return (*range(n_in, ndim), *range(n_in))


def _nf4_scale_split(shape: Sequence[int]) -> int | None:
    """The largest k whose trailing dims shape[k:] hold whole NF4 blocks, else None."""
    for k in range(len(shape) - 1, -1, -1):
        if math.prod(shape[k:]) % NF4_BLOCK == 0:
            return k
    return None


def leaf_layout(base: str, shape: Sequence[int], n_in: int, axes: Sequence[str | None]):
    """{"kernel": (shape, dtype, logical axes), "kernel_scale": (...)}: how a float kernel
    of `shape` (logical `axes`, the first `n_in` dims its inputs) is stored under the
    quantised `base` ("int8", "float8_e4m3fn" or "nf4"); see the module docstring."""
    shape, axes = tuple(shape), tuple(axes)
    if base in _CHANNEL_CODES:
        return {
            "kernel": (shape, _CHANNEL_CODES[base], axes),
            "kernel_scale": (shape[n_in:], jnp.float32, axes[n_in:]),
        }
    if base != "nf4":
        raise ValueError(f"lora_base: no quantised layout for {base!r}")
    perm = _nf4_perm(len(shape), n_in)
    shape, axes = tuple(shape[i] for i in perm), tuple(axes[i] for i in perm)
    n = math.prod(shape)
    if shape[-1] % 2 == 0:
        packed = ((*shape[:-1], shape[-1] // 2), jnp.uint8, axes)
    else:
        packed = ((-(-n // 2),), jnp.uint8, (None,))
    k = _nf4_scale_split(shape)
    if k is None:
        scale = ((-(-n // NF4_BLOCK),), jnp.float32, (None,))
    else:
        scale = ((*shape[:k], math.prod(shape[k:]) // NF4_BLOCK), jnp.float32, (*axes[:k], None))
    return {"kernel": packed, "kernel_scale": scale}


def is_quantized_leaf(path: Sequence, dtype) -> bool:
    """Whether the leaf at `path` (keys) of `dtype` is part of a quantised kernel: integer
    or float8 codes, or a kernel's scale (stored at its own itemsize, not the param
    dtype's; never cast)."""
    return _is_codes(dtype) or str(path[-1]).endswith(_SCALE)


def _is_codes(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer) or jnp.dtype(dtype) == jnp.float8_e4m3fn


# ----------------------------------------------------------------------------- int8


def quantize_int8(w: jax.Array, n_in: int) -> tuple[jax.Array, jax.Array]:
    """(q int8 [shape], scale float32 [shape[n_in:]]): per output channel absmax / 127; a
    zero channel gets scale 0 and codes 0."""
    w = jnp.asarray(w, jnp.float32)
    absmax = jnp.max(jnp.abs(w), axis=tuple(range(n_in)))
    scale = absmax / INT8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(w / safe), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def dequantize_int8(q: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 q * scale, the scale broadcast over the input dims."""
    return q.astype(jnp.float32) * scale


# ----------------------------------------------------------------------------- float8


def quantize_fp8(w: jax.Array, n_in: int) -> tuple[jax.Array, jax.Array]:
    """(q float8_e4m3fn [shape], scale float32 [shape[n_in:]]): per output channel
    absmax / 448, q = w / scale rounded to the nearest e4m3 value (clipped to +-448 first:
    a quotient an ulp past 448 must not become NaN); a zero channel gets scale 0, codes 0."""
    w = jnp.asarray(w, jnp.float32)
    absmax = jnp.max(jnp.abs(w), axis=tuple(range(n_in)))
    scale = absmax / FP8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(w / safe, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 q * scale, the scale broadcast over the input dims."""
    return q.astype(jnp.float32) * scale


# ----------------------------------------------------------------------------- nf4


def quantize_nf4(w: jax.Array, n_in: int) -> tuple[jax.Array, jax.Array]:
    """(packed uint8, block absmax float32) in `leaf_layout("nf4", w.shape, n_in, ...)`'s
    shapes: `w` [in..., out...] (`n_in` input dims) transposed to [out..., in...] and
    flattened (the torch weight's order, bitsandbytes' blocks), each value the index of
    the NF4 code nearest to value / its block's absmax, two indices per byte, the even
    element in the high nibble."""
    shape = tuple(w.shape)
    layout = leaf_layout("nf4", shape, n_in, (None,) * len(shape))
    n = math.prod(shape)
    blocks = -(-n // NF4_BLOCK)
    t = jnp.transpose(jnp.asarray(w, jnp.float32), _nf4_perm(len(shape), n_in))
    flat = jnp.pad(jnp.ravel(t), (0, blocks * NF4_BLOCK - n))
    flat = flat.reshape(blocks, NF4_BLOCK)
    absmax = jnp.max(jnp.abs(flat), axis=1)
    safe = jnp.where(absmax > 0, absmax, 1.0)[:, None]
    codes = jnp.searchsorted(jnp.asarray(_NF4_MIDPOINTS), flat / safe, side="left")
    codes = codes.astype(jnp.uint8).reshape(-1)[: n + n % 2].reshape(-1, 2)
    packed = (codes[:, 0] << 4) | codes[:, 1]
    return packed.reshape(layout["kernel"][0]), absmax.reshape(layout["kernel_scale"][0])


def dequantize_nf4(
    packed: jax.Array, scale: jax.Array, shape: Sequence[int], n_in: int
) -> jax.Array:
    """The float32 kernel of `shape` ([in..., out...], `n_in` input dims) from
    `quantize_nf4`'s (packed, scale): unpack, look up, times the block scale, transposed
    back from the stored [out..., in...]. Kept in the stored layout where `leaf_layout`
    is (no flattening of sharded dims)."""
    shape = tuple(shape)
    perm = _nf4_perm(len(shape), n_in)
    ts = tuple(shape[i] for i in perm)
    n = math.prod(shape)
    codes = jnp.stack([packed >> 4, packed & 0xF], axis=-1)  # [..., bytes, 2]
    values = jnp.asarray(NF4_CODE)[codes.astype(jnp.int32)]
    k = _nf4_scale_split(ts)
    if packed.shape == (*ts[:-1], ts[-1] // 2) and k is not None:
        values = values.reshape(*ts[:k], -1, NF4_BLOCK)
        t = (values * scale[..., None]).reshape(ts)
    else:
        values = values.reshape(-1)[:n]
        blocks = -(-n // NF4_BLOCK)
        values = jnp.pad(values, (0, blocks * NF4_BLOCK - n)).reshape(blocks, NF4_BLOCK)
        t = (values * scale.reshape(blocks, 1)).reshape(-1)[:n].reshape(ts)
    return jnp.transpose(t, tuple(int(i) for i in np.argsort(perm)))


# ----------------------------------------------------------------------------- both


def quantize(base: str, w: jax.Array, n_in: int) -> tuple[jax.Array, jax.Array]:
    """(codes, scale) of float kernel `w` under `base` ("int8", "float8_e4m3fn" or "nf4")."""
    if base == "int8":
        return quantize_int8(w, n_in)
    if base == "float8_e4m3fn":
        return quantize_fp8(w, n_in)
    if base == "nf4":
        return quantize_nf4(w, n_in)
    raise ValueError(f"lora_base: cannot quantise to {base!r}")


def dequantize(
    base: str, codes: jax.Array, scale: jax.Array, shape: Sequence[int], n_in: int
) -> jax.Array:
    """The float32 kernel of `shape` (its first `n_in` dims the inputs) from its stored
    (codes, scale) under `base`."""
    if base == "int8":
        return dequantize_int8(codes, scale)
    if base == "float8_e4m3fn":
        return dequantize_fp8(codes, scale)
    if base == "nf4":
        return dequantize_nf4(codes, scale, shape, n_in)
    raise ValueError(f"lora_base: cannot dequantise {base!r}")


@functools.partial(jax.jit, static_argnums=(0, 2))
def _quantize_jit(base: str, w: jax.Array, n_in: int):
    return quantize(base, w, n_in)


def quantize_base(params, config: ModelConfig):
    """`params` (a float base: `model.init_params` of `lora.base_config(config)`,
    `hf.load_pretrained`, `sharding.load_pretrained_sharded`; adapters may be there or
    not) with the kernel of every projection in `config.lora_targets` quantised to
    `config.lora_base`: `{name}_kernel` replaced by its codes and `{name}_kernel_scale`
    added. Unchanged for lora_base "float"; kernels already quantised (integer) are kept.
    Each kernel is quantised on its own (one jitted call per shape), so the extra memory
    is one kernel's temporaries."""
    if config.lora_base == "float" or not config.lora_rank:
        return params
    return _quantize_kernels(params, config.lora_base, config.lora_targets, _quantize_jit)


def quantize_weights(params, weight_quant: str):
    """`params` (float kernels) with every projection's kernel (`N_IN`: q, k, v, o, gate,
    up, down) quantised to `weight_quant` (int8 / float8_e4m3fn, `ModelConfig.weight_quant`),
    its float32 `{name}_kernel_scale` added; the embedding, the head, the norms, biases and
    LoRA adapters are kept as they are. Traceable (the rollout copy is made in one jitted
    call, `convert_weights`)."""
    if weight_quant not in WEIGHT_QUANTS[1:]:
        raise ValueError(f"weight_quant: expected one of {WEIGHT_QUANTS[1:]}, got {weight_quant!r}")
    return _quantize_kernels(params, weight_quant, tuple(N_IN), quantize)


def _quantize_kernels(params, base: str, targets, quantize_fn):
    """`params` with the float `{t}_kernel` of every t in `targets` quantised to `base` by
    `quantize_fn(base, kernel, n_in)`; codes already there are kept."""
    plain = params.unfreeze() if hasattr(params, "unfreeze") else params
    flat = traverse_util.flatten_dict(plain)
    names = {f"{t}{_KERNEL}": t for t in targets}
    out = {}
    for path, x in flat.items():
        target = names.get(str(path[-1]))
        if target is None or _is_codes(x.dtype):
            out[path] = x
            continue
        codes, scale = quantize_fn(base, x, N_IN[target])
        out[path] = codes
        out[(*path[:-1], f"{target}{_SCALE}")] = scale
    return traverse_util.unflatten_dict(out)


def convert_weights(params, weight_dtype: str):
    """The rollout engine's copy of the trainer's `params` under `rollout.weight_dtype`
    (`WEIGHT_DTYPES`, or a float param dtype name): "" as they are; a float dtype
    ("bfloat16") every float leaf cast, a quantised kernel's codes and float32 scales kept
    (the sampler dequantises the learner's kernels exactly); int8 / float8_e4m3fn
    `quantize_weights` (the other leaves as trained). Traceable; the engine runs it under
    `setup.rollout_model_config`."""
    if not weight_dtype:
        return params
    if weight_dtype in WEIGHT_QUANTS:
        return quantize_weights(params, weight_dtype)
    dtype = jnp.dtype(weight_dtype)

    def cast(path, x):
        keys = tuple(getattr(k, "key", k) for k in path)
        if is_quantized_leaf(keys, x.dtype) or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)
