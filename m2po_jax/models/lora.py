"""LoRA adapters on the params tree: which leaves train, merging, and switching them off.

The model holds each adapter beside the matrix it adapts (`model.projection`): for a target
projection `q` of a layer, `q_kernel` [E, H, D] gets `q_lora_a` [E, r] and `q_lora_b`
[r, H, D] (float32), and the projection computes x W + (alpha / r) (x A) B. A mixture of
experts' gate, up and down adapt every expert (`model.MoE`): `gate_experts` [X, E, F] gets
`gate_experts_lora_a` [X, E, r] and `gate_experts_lora_b` [X, r, F]. With
`ModelConfig.lora_rank > 0` the adapters are the trainable params and everything else
(the base) is frozen: the train step differentiates the adapters only (`split` /
`merge`), so the base gets no gradient and no optimizer state, and stays bit-identical.

With `ModelConfig.lora_base` int8 or nf4 (QLoRA) the adapted kernels are held quantised
(`quant.py`): integer codes and a float32 `{name}_kernel_scale`, frozen like the rest of
the base; `merged` dequantises them.

These functions work on any params tree (nested dicts, as `model.init_params` and
`hf.load_pretrained` give): a tree without adapter leaves is all trainable, so the same
code runs full fine-tuning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from flax import traverse_util

from m2po_jax.models import quant
from m2po_jax.models.model_config import ModelConfig, as_dtype

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")


def adapter_stem(name: str) -> str | None:
    """What kernel leaf `name`'s adapters are named after: "q" for a projection's `q_kernel`
    (adapters `q_lora_a`, `q_lora_b`), "gate_experts" for a mixture of experts' stacked
    kernels `gate_experts` (`gate_experts_lora_a` [X, in, r], ...); None for other leaves."""
    if name.endswith("_kernel"):
        return name.removesuffix("_kernel")
    return name if name.endswith("_experts") else None


def is_adapter(path: tuple[str, ...]) -> bool:
    """Whether the leaf at `path` (a tuple of keys) is a LoRA adapter."""
    return str(path[-1]).endswith(ADAPTER_SUFFIXES)


def has_adapters(params) -> bool:
    return any(is_adapter(path) for path in traverse_util.flatten_dict(_plain(params)))


def _plain(params):
    return params.unfreeze() if hasattr(params, "unfreeze") else params


def split(params) -> tuple[Any, Any]:
    """(trainable, frozen): the adapters and the rest when `params` has adapters, else
    (params, None). `merge(trainable, frozen)` gives `params` back."""
    flat = traverse_util.flatten_dict(_plain(params))
    if not any(is_adapter(path) for path in flat):
        return params, None
    trainable = {path: x for path, x in flat.items() if is_adapter(path)}
    frozen = {path: x for path, x in flat.items() if not is_adapter(path)}
    return traverse_util.unflatten_dict(trainable), traverse_util.unflatten_dict(frozen)


def merge(trainable, frozen):
    """The whole params tree from `split`'s parts (`trainable` itself when `frozen` is None)."""
    if frozen is None:
        return trainable
    flat = traverse_util.flatten_dict(frozen)
    flat.update(traverse_util.flatten_dict(trainable))
    return traverse_util.unflatten_dict(flat)


def trainable(params):
    """The params an optimizer updates: the adapters, or every param without LoRA."""
    return split(params)[0]


def adapters_off(params):
    """`params` with every adapter's B at zero: the base model's function, with no second
    copy of the base (what the KL penalty's reference policy is under LoRA)."""
    flat = traverse_util.flatten_dict(_plain(params))
    return traverse_util.unflatten_dict(
        {
            path: jnp.zeros_like(x) if str(path[-1]).endswith("_lora_b") else x
            for path, x in flat.items()
        }
    )


def merged(params, config: ModelConfig):
    """(params, config) of the same function without adapters: each adapted kernel is
    W + (alpha / r) A B in the kernel's dtype (a mixture of experts' [X, in, out]: expert
    by expert), the adapter leaves dropped, and the config's LoRA off. What the sampler
    runs with one live adapter: one matmul per projection.

    Under a quantised base (`lora_base` int8 / nf4, `quant.py`) W is the dequantised
    kernel, and the merged kernel comes out float in `config.param_dtype` (its scale leaf
    dropped): a float model of `base_config(config)`'s layout."""
    if not config.lora_rank:
        return params, config
    if config.weight_quant:
        raise ValueError(
            f"lora.merged: weight_quant={config.weight_quant!r} params are a rollout copy; "
            "merge the trainer's params (weight_quant '')"
        )
    flat = traverse_util.flatten_dict(_plain(params))
    out = {}
    scale = config.lora_scale()
    param_dtype = as_dtype(config.param_dtype)
    for path, x in flat.items():
        name = str(path[-1])
        if is_adapter(path) or name.endswith(quant.SCALE_SUFFIX):
            continue
        target = adapter_stem(name)
        if target is not None:
            a_path = (*path[:-1], target + "_lora_a")
            if a_path in flat:
                a, b = flat[a_path], flat[(*path[:-1], target + "_lora_b")]
                if target.endswith("_experts"):  # [X, in, r] @ [X, r, out], expert by expert
                    delta = jnp.matmul(a, b)
                else:
                    delta = jnp.tensordot(a, b, axes=1)  # [in..., r] . [r, out...]
                dtype = x.dtype
                if jnp.issubdtype(x.dtype, jnp.integer):  # quantised codes
                    codes_scale = flat[(*path[:-1], target + quant.SCALE_SUFFIX)]
                    n_in = a.ndim - 1  # A is [in..., r]
                    x = quant.dequantize(config.lora_base, x, codes_scale, delta.shape, n_in)
                    dtype = param_dtype
                x = (x.astype(jnp.float32) + scale * delta).astype(dtype)
        out[path] = x
    return traverse_util.unflatten_dict(out), base_config(config)


def base_config(config: ModelConfig) -> ModelConfig:
    """`config` with LoRA off (the base model's architecture, its kernels float)."""
    default = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    return dataclasses.replace(
        config,
        lora_rank=0,
        lora_alpha=default["lora_alpha"],
        lora_targets=(),
        lora_base=default["lora_base"],
    )


def adapter_bytes(params) -> int:
    """Bytes of the adapter leaves (0 without LoRA)."""
    flat = traverse_util.flatten_dict(_plain(params))
    return sum(x.size * x.dtype.itemsize for path, x in flat.items() if is_adapter(path))
