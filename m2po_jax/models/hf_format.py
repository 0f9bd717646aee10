"""What a Hugging Face checkpoint's files mean for `model.py`, without reading any file.

`config_from_hf` / `config_to_hf` translate `config.json` (transformers 4 and 5 layouts,
RoPE scaling) to and from a `ModelConfig`; `tensor_layout` names every checkpoint tensor,
its shape and where it goes in the param tree. Reading and writing the files is `hf.py`'s
job.

| Hugging Face tensor [shape]                      | param path [shape]                 |
|--------------------------------------------------|------------------------------------|
| model.embed_tokens.weight [V, E]                 | embedding [V, E]                   |
| model.layers.i.self_attn.q_proj.weight [H*D, E]  | layers_i/attn/q_kernel [E, H, D]   |
| model.layers.i.self_attn.{k,v}_proj.weight       | layers_i/attn/{k,v}_kernel [E,K,D] |
| model.layers.i.self_attn.{q,k,v}_proj.bias       | layers_i/attn/{q,k,v}_bias [., D]  |
| model.layers.i.self_attn.o_proj.weight [E, H*D]  | layers_i/attn/o_kernel [H, D, E]   |
| model.layers.i.self_attn.{q,k}_norm.weight [D]   | layers_i/attn/{q,k}_norm/scale     |
| model.layers.i.input_layernorm.weight [E]        | layers_i/input_norm/scale          |
| model.layers.i.post_attention_layernorm.weight   | layers_i/post_attn_norm/scale      |
| model.layers.i.mlp.{gate,up}_proj.weight [F, E]  | layers_i/mlp/{gate,up}_kernel [E,F]|
| model.layers.i.mlp.down_proj.weight [E, F]       | layers_i/mlp/down_kernel [F, E]    |
| model.layers.i.mlp.gate.weight [X, E] (MoE)      | layers_i/mlp/router_kernel [E, X]  |
| ....mlp.experts.j.{gate,up}_proj.weight [F, E]   | layers_i/mlp/{gate,up}_experts[j]  |
| ....mlp.experts.j.down_proj.weight [E, F]        | layers_i/mlp/down_experts[j]       |
| model.norm.weight [E]                            | final_norm/scale                   |
| lm_head.weight [V, E] (absent when tied)         | lm_head [E, V]                     |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from m2po_jax.models import families
from m2po_jax.models.model_config import ModelConfig, as_dtype

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _dtype_name(dtype: Any) -> str:
    return as_dtype(dtype).name


def _rope_settings(hf: Mapping[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, rope_scaling) from either the transformers 4 or the 5 layout.

    transformers 4 writes `rope_theta` and `rope_scaling` at the top level; 5 writes one
    `rope_parameters` dict holding `rope_theta` and `rope_type` (or one dict per layer
    type). A non-empty legacy `rope_scaling` wins, as it does in transformers.
    """
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise ValueError(f"rope_parameters: expected a dict, got {rope!r}")
    if rope and all(isinstance(v, Mapping) or v is None for v in rope.values()):
        # Nested per layer type: every layer here is full attention.
        per_type = {k: v for k, v in rope.items() if v is not None}
        if set(per_type) != {"full_attention"}:
            raise ValueError(
                f"rope_parameters: per-layer-type RoPE {sorted(per_type)} is not supported; "
                "expected only 'full_attention'"
            )
        rope = per_type["full_attention"]
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor: {partial} is not supported (only 1.0)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(
            f"rope_scaling: rope_type {rope_type!r} is not supported; supported: default, llama3"
        )
    scaling = {"rope_type": "llama3"}
    for key in _LLAMA3_KEYS:
        if key in rope:
            scaling[key] = rope[key]
        elif key == "original_max_position_embeddings" and "max_position_embeddings" in hf:
            scaling[key] = hf["max_position_embeddings"]  # transformers' own fallback
        else:
            raise ValueError(f"rope_scaling: llama3 scaling needs {key!r}; got {dict(rope)}")
    return theta, tuple(sorted(scaling.items()))


def _check_sliding_window(hf: Mapping[str, Any], model_type: str, num_layers: int) -> None:
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first = hf.get("max_window_layers", num_layers)
        layer_types = [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
    sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if sliding:
        raise ValueError(
            f"{model_type}: sliding-window attention (use_sliding_window=true, "
            f"sliding_window={hf['sliding_window']}) on layers {sliding} is not supported"
        )


def config_from_hf(
    hf_config: Mapping[str, Any], *, dtype: Any = "float32", param_dtype: Any = None
) -> ModelConfig:
    """A `ModelConfig` from a Hugging Face `config.json` dict (a family in `families`).

    Args:
      hf_config: the parsed `config.json`.
      dtype: compute dtype (name or jnp dtype).
      param_dtype: parameter dtype; None means the same as `dtype`.

    Returns:
      The config; raises ValueError for a model type or feature the model can't run.
    """
    model_type = hf_config.get("model_type")
    fam = families.family(model_type)
    required = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    )
    missing = [k for k in required if hf_config.get(k) is None]
    if missing:
        raise ValueError(f"config.json: missing {missing} for model_type {model_type!r}")
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: {act!r} is not supported (only 'silu')")
    if hf_config.get("mlp_bias"):
        raise ValueError("mlp_bias: true is not supported (MLP projections have no bias)")
    num_layers = int(hf_config["num_hidden_layers"])
    _check_sliding_window(hf_config, model_type, num_layers)
    heads = int(hf_config["num_attention_heads"])
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim")
    if head_dim is None:  # as transformers' config class defaults it (Qwen3: 128)
        head_dim = fam.head_dim or int(hf_config["hidden_size"]) // heads
    attention_bias = fam.attention_bias or bool(hf_config.get("attention_bias", False))
    rope_theta, rope_scaling = _rope_settings(hf_config)
    dtype = _dtype_name(dtype)
    feed_forward = _FEED_FORWARD[fam.mlp].fields(hf_config, model_type, num_layers)
    return ModelConfig(
        vocab_size=int(hf_config["vocab_size"]),
        hidden_size=int(hf_config["hidden_size"]),
        intermediate_size=int(hf_config["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        model_type=model_type,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=fam.qk_norm,
        max_position_embeddings=int(hf_config.get("max_position_embeddings", 4096)),
        dtype=dtype,
        param_dtype=dtype if param_dtype is None else _dtype_name(param_dtype),
        **feed_forward,
    )


def config_to_hf(config: ModelConfig, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A full `config.json` dict for `config`, keeping non-architecture keys of `base`.

    Written for transformers 4 and 5 alike: both `rope_theta`/`rope_scaling` and
    `rope_parameters`.
    """
    mt = config.model_type
    fam = families.family(mt)
    if fam.attention_bias and not config.attention_bias:
        raise ValueError(f"attention_bias: {mt} checkpoints always have q/k/v biases; got False")
    if fam.qk_norm and not config.qk_norm:
        raise ValueError(f"qk_norm: {mt} checkpoints always have q/k norms; got False")
    if not fam.qk_norm and config.qk_norm:
        raise ValueError(f"qk_norm: {mt} checkpoints have no q/k norms; got True")
    scaling = None if config.rope_scaling is None else dict(config.rope_scaling)
    if scaling is not None and scaling.get("rope_type", "default") == "default":
        scaling = None
    rope_parameters = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if scaling is not None:
        rope_parameters = {**scaling, "rope_theta": config.rope_theta}
    base = dict(base or {})
    stale = ("rope_parameters", "rope_scaling", "rope_theta", "torch_dtype", "dtype")
    for key in (*stale, *_FEED_FORWARD[fam.mlp].stale_keys):
        base.pop(key, None)
    hf = {
        **base,
        "architectures": [fam.architecture],
        "model_type": mt,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.dim_per_head,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": base.get("initializer_range", 0.02),
        "use_cache": True,
        "torch_dtype": config.param_dtype,
        "bos_token_id": base.get("bos_token_id"),
        "eos_token_id": base.get("eos_token_id"),
        "pad_token_id": base.get("pad_token_id"),
    }
    if fam.attention_bias is None:  # read from config.json, so written
        hf["attention_bias"] = config.attention_bias
    hf.update(fam.hf_constants)
    hf.update(_FEED_FORWARD[fam.mlp].hf_keys(config))
    if fam.sliding_window_keys:
        hf.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=config.num_layers,
            layer_types=["full_attention"] * config.num_layers,
        )
    return hf


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One checkpoint tensor and where it lives in the param tree."""

    param_path: tuple[str, ...]
    hf_name: str
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]  # the param's
    transpose: bool  # torch Linear weights are [out, in]; ours are [in, ...out]
    # The tensor is slice [expert] of a param stacked over experts (one checkpoint tensor
    # per expert); None: the whole param.
    expert: int | None = None

    def to_param(self, x: np.ndarray) -> np.ndarray:
        """The checkpoint tensor as the param (or its expert's slice of it)."""
        if self.transpose:
            x = x.T
        shape = self.shape if self.expert is None else self.shape[1:]
        return np.ascontiguousarray(x.reshape(shape))

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """The checkpoint tensor of param `x` (the whole param, also of an expert's tensor)."""
        if self.expert is not None:
            x = x[self.expert]
        if self.transpose:
            return np.ascontiguousarray(x.reshape(self.hf_shape[::-1]).T)
        return np.ascontiguousarray(x.reshape(self.hf_shape))


def tensor_layout(config: ModelConfig) -> list[HFTensor]:
    """Every checkpoint tensor of `config`, in param-tree order."""
    e, v = config.hidden_size, config.vocab_size
    h, k, d = config.num_heads, config.num_kv_heads, config.dim_per_head
    mlp = families.family(config.model_type).mlp
    out = [HFTensor(("embedding",), "model.embed_tokens.weight", (v, e), (v, e), False)]
    for i in range(config.num_layers):
        hf, p = f"model.layers.{i}.", f"layers_{i}"

        def add(path, name, hf_shape, shape, transpose, hf=hf, p=p):
            out.append(HFTensor((p, *path), hf + name, hf_shape, shape, transpose))

        for proj, heads in (("q", h), ("k", k), ("v", k)):
            add(
                ("attn", f"{proj}_kernel"),
                f"self_attn.{proj}_proj.weight",
                (heads * d, e),
                (e, heads, d),
                True,
            )
            if config.attention_bias:
                add(
                    ("attn", f"{proj}_bias"),
                    f"self_attn.{proj}_proj.bias",
                    (heads * d,),
                    (heads, d),
                    False,
                )
        add(("attn", "o_kernel"), "self_attn.o_proj.weight", (e, h * d), (h, d, e), True)
        if config.qk_norm:
            add(("attn", "q_norm", "scale"), "self_attn.q_norm.weight", (d,), (d,), False)
            add(("attn", "k_norm", "scale"), "self_attn.k_norm.weight", (d,), (d,), False)
        add(("input_norm", "scale"), "input_layernorm.weight", (e,), (e,), False)
        add(("post_attn_norm", "scale"), "post_attention_layernorm.weight", (e,), (e,), False)
        out.extend(_FEED_FORWARD[mlp].tensors(config, hf, p))
    out.append(HFTensor(("final_norm", "scale"), "model.norm.weight", (e,), (e,), False))
    if not config.tie_word_embeddings:
        out.append(HFTensor(("lm_head",), "lm_head.weight", (v, e), (e, v), True))
    return out


def _dense_mlp_tensors(config: ModelConfig, hf: str, p: str) -> list[HFTensor]:
    """A SwiGLU MLP's tensors in layer `p` (`hf`: the layer's checkpoint name prefix)."""
    e, f = config.hidden_size, config.intermediate_size
    return [
        HFTensor((p, "mlp", f"{proj}_kernel"), f"{hf}mlp.{proj}_proj.weight", hf_shape, shape, True)
        for proj, hf_shape, shape in (
            ("gate", (f, e), (e, f)),
            ("up", (f, e), (e, f)),
            ("down", (e, f), (f, e)),
        )
    ]


def _moe_tensors(config: ModelConfig, hf: str, p: str) -> list[HFTensor]:
    """A mixture of experts' tensors in layer `p`: the router `mlp.gate` [X, E] and one
    tensor per expert and projection (`mlp.experts.j.gate_proj`, ...), each expert's slice
    of a param stacked over the experts (the layout of Qwen3-MoE checkpoints on the Hub
    and of transformers' `save_pretrained`; in memory transformers 5 fuses them)."""
    e, f, n = config.hidden_size, config.moe_intermediate_size, config.num_experts
    out = [HFTensor((p, "mlp", "router_kernel"), f"{hf}mlp.gate.weight", (n, e), (e, n), True)]
    for proj, hf_shape, shape in (
        ("gate", (f, e), (n, e, f)),
        ("up", (f, e), (n, e, f)),
        ("down", (e, f), (n, f, e)),
    ):
        path = (p, "mlp", f"{proj}_experts")
        out.extend(
            HFTensor(path, f"{hf}mlp.experts.{j}.{proj}_proj.weight", hf_shape, shape, True, j)
            for j in range(n)
        )
    return out


def _no_fields(hf: Mapping[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    return {}


def _moe_fields(hf: Mapping[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The `ModelConfig` mixture-of-experts fields of a config.json (every layer sparse)."""
    step = hf.get("decoder_sparse_step", 1)
    if step != 1:
        raise ValueError(
            f"decoder_sparse_step: {step} leaves some {model_type} layers dense; only 1 "
            "(every layer a mixture of experts) is supported"
        )
    if hf.get("mlp_only_layers"):
        raise ValueError(
            f"mlp_only_layers: {hf['mlp_only_layers']} (dense layers among {model_type}'s "
            "experts) is not supported; only []"
        )
    # transformers 5 writes num_experts as num_local_experts (its attribute_map)
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    missing = [
        name
        for name, value in (
            ("num_experts", experts),
            ("num_experts_per_tok", hf.get("num_experts_per_tok")),
            ("moe_intermediate_size", hf.get("moe_intermediate_size")),
        )
        if value is None
    ]
    if missing:
        raise ValueError(f"config.json: missing {missing} for model_type {model_type!r}")
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def _moe_keys(config: ModelConfig) -> dict[str, Any]:
    return {
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": config.norm_topk_prob,
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
    }


@dataclasses.dataclass(frozen=True)
class _FeedForwardFormat:
    """How a feed-forward kind (`families.Family.mlp`) reads and writes: its `ModelConfig`
    fields from config.json, its config.json keys, the base keys it replaces and its
    tensors in a layer."""

    # (config.json, model_type, num_layers) -> ModelConfig fields
    fields: Callable[[Mapping[str, Any], str, int], dict[str, Any]]
    hf_keys: Callable[[ModelConfig], dict[str, Any]]  # config.json keys
    stale_keys: tuple[str, ...]  # a base config.json's keys that would contradict them
    # (config, the layer's checkpoint name prefix, its param name) -> its tensors
    tensors: Callable[[ModelConfig, str, str], list[HFTensor]]


_FEED_FORWARD = {
    "dense": _FeedForwardFormat(_no_fields, lambda config: {}, (), _dense_mlp_tensors),
    "moe": _FeedForwardFormat(_moe_fields, _moe_keys, ("num_local_experts",), _moe_tensors),
}
