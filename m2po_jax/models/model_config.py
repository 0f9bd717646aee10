"""`ModelConfig`: the architecture of a causal LM, and the names its fields accept.

A frozen, hashable dataclass (a static jit argument); `model.py` re-exports everything here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from m2po_jax.models import attention, families
from m2po_jax.models import moe as moe_lib

# `ModelConfig.remat_policy` -> what a rematerialised layer keeps for the backward pass
# (`jax.checkpoint_policies`); the save_* policies keep the values `Attention` names.
REMAT_POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names("qkv_proj"),
    "save_attention_out": jax.checkpoint_policies.save_only_these_names("attention_out"),
}

# The projections LoRA can adapt (`lora_targets`): attention's q, k, v, o and the MLP's.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# How the frozen base kernels of the adapted projections are held (`lora_base`, `quant.py`):
# float (param_dtype), int8 (per output channel) or nf4 (QLoRA's 4-bit NormalFloat).
LORA_BASES = ("float", "int8", "nf4")
# How every projection's kernel (LORA_TARGETS' matrices; not embeddings, head or norms) is
# stored (`weight_quant`, `quant.py`): "" as param_dtype, or int8 / float8_e4m3fn codes with
# a float32 scale per output channel, dequantised per projection (cheaper rollout weights).
WEIGHT_QUANTS = ("", "int8", "float8_e4m3fn")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# What the rollout engines' KV caches may hold keys and values in (`kv_dtype`; "" = the
# compute dtype): bfloat16, or float8 e4m3 without scales (vLLM's kv_cache_dtype="fp8" at
# its default scale 1.0), saturated at +-448 (`model.kv_store`).
KV_DTYPES = {"bfloat16": jnp.bfloat16, "float8_e4m3fn": jnp.float8_e4m3fn}


def as_dtype(dtype: Any) -> jnp.dtype:
    """A jnp dtype from a name or dtype."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype: unknown name {dtype!r}; expected one of {sorted(DTYPES)}")
        return jnp.dtype(DTYPES[dtype])
    return jnp.dtype(dtype)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (names follow Hugging Face configs)."""

    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    model_type: str = "llama"  # a name in `families.FAMILIES`: llama | qwen2 | qwen3 | qwen3_moe
    rope_theta: float = 10000.0
    # Llama 3 rope scaling as a sorted tuple of (key, value) pairs, or None.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    max_position_embeddings: int = 4096
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    remat: bool = False  # rematerialise each layer in the backward pass
    remat_policy: str = "nothing_saveable"  # with remat: a name in REMAT_POLICIES
    attention: str = "auto"  # a name in attention.IMPLEMENTATIONS
    attention_block_size: int = 512  # key block of "chunked", block of "splash"
    scan_layers: bool = False  # run the layers as one lax.scan (training passes, no cache)
    # LoRA (`lora.py`): rank 0 = off; the adapters' targets by projection name (LORA_TARGETS)
    lora_rank: int = 0
    lora_alpha: float = 16.0  # adapter output scaled by lora_alpha / lora_rank
    lora_targets: tuple[str, ...] = ()
    # QLoRA: the adapted projections' base kernels held as LORA_BASES says (not float:
    # quantised codes and scales, dequantised per projection; lora_rank > 0 only)
    lora_base: str = "float"
    # Keys and values as a KV cache stores them: "" (the compute dtype) or a name in
    # KV_DTYPES. Caches and pools are allocated in it, and every forward, with a cache or
    # without, rounds each layer's keys and values to it after RoPE (`model.kv_store`), so a
    # teacher-forced pass of the rollouts' config gives the engines' log-probs.
    kv_dtype: str = ""
    # every projection kernel held as WEIGHT_QUANTS says ("": float; the rollout engine's
    # copy under `rollout.weight_dtype` int8 / float8_e4m3fn, `quant.quantize_weights`)
    weight_quant: str = ""
    # A mixture of experts (a family whose `mlp` is "moe", `moe.py`; 0 for dense families):
    # experts per layer, experts per token, an expert's SwiGLU hidden width
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1
    router_aux_loss_coef: float = 0.001  # weight of `moe.load_balancing_loss` in training
    # The mesh axis the experts are split over (`moe_lib.EXPERT_AXES`: "" = none, every device
    # holds every expert; "fsdp" / "data": tokens exchanged over it, `moe.moe_experts`)
    expert_axis: str = ""
    # The experts' grouped matmul (`moe_lib.MOE_KERNELS`; "auto": megablox on TPU, else ragged_dot)
    moe_kernel: str = "auto"

    def __post_init__(self):
        self._check_shape()
        self._check_rope()
        self._check_layout()
        self._check_lora()
        self._check_storage()
        self._check_experts(families.family(self.model_type).mlp == "moe")

    def _check_shape(self) -> None:
        """Sizes: positive, heads a multiple of the KV heads, an even head width."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a positive multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is not None and (self.head_dim <= 0 or self.head_dim % 2):
            raise ValueError(f"head_dim: must be positive and even (RoPE), got {self.head_dim}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                f"({self.num_heads}) unless head_dim is given"
            )

    def _check_rope(self) -> None:
        """rope_scaling as a hashable tuple (the config is a static jit argument), of a
        supported type with its keys."""
        if isinstance(self.rope_scaling, dict):
            # A dict would make the config unhashable (it is a static jit argument).
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in ("default", "llama3"):
                raise ValueError(
                    f"rope_scaling: rope_type {rope_type!r} is not supported; "
                    "supported: default, llama3"
                )
            needed = (
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            )
            missing = [k for k in needed if k not in scaling]
            if rope_type == "llama3" and missing:
                raise ValueError(f"rope_scaling: llama3 scaling needs {missing}; got {scaling}")

    def _check_layout(self) -> None:
        """Dtypes, the remat policy and the attention implementation by name."""
        as_dtype(self.dtype)
        as_dtype(self.param_dtype)
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"remat_policy: unknown name {self.remat_policy!r}; "
                f"expected one of {', '.join(REMAT_POLICIES)}"
            )
        if self.attention not in attention.IMPLEMENTATIONS:
            raise ValueError(
                f"attention: unknown implementation {self.attention!r}; "
                f"expected one of {', '.join(attention.IMPLEMENTATIONS)}"
            )

    def _check_lora(self) -> None:
        """lora_targets as a tuple of known names, rank, alpha and the base's storage."""
        if isinstance(self.lora_targets, list | str):
            targets = self.lora_targets
            targets = targets.split(",") if isinstance(targets, str) else targets
            object.__setattr__(self, "lora_targets", tuple(t.strip() for t in targets if t.strip()))
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank: must be >= 0 (0 = off), got {self.lora_rank}")
        if self.lora_rank:
            unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
            if unknown or not self.lora_targets:
                raise ValueError(
                    f"lora_targets: expected names among {', '.join(LORA_TARGETS)}, got "
                    f"{','.join(self.lora_targets) or 'none'}"
                )
            if not self.lora_alpha > 0:
                raise ValueError(f"lora_alpha: must be > 0, got {self.lora_alpha}")
        if self.lora_base not in LORA_BASES:
            raise ValueError(
                f"lora_base: expected one of {', '.join(LORA_BASES)}, got {self.lora_base!r}"
            )
        if self.lora_base != "float" and not self.lora_rank:
            raise ValueError(
                f"lora_base: a quantised base ({self.lora_base!r}) needs lora_rank > 0"
            )

    def _check_storage(self) -> None:
        """The KV cache's dtype and the quantised projection kernels."""
        if self.kv_dtype and self.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_dtype: expected '' (the compute dtype) or one of {', '.join(KV_DTYPES)}, "
                f"got {self.kv_dtype!r}"
            )
        if self.weight_quant not in WEIGHT_QUANTS:
            raise ValueError(
                f"weight_quant: expected one of {WEIGHT_QUANTS}, got {self.weight_quant!r}"
            )
        if self.weight_quant and self.lora_base != "float":
            raise ValueError(
                f"weight_quant={self.weight_quant!r} with lora_base={self.lora_base!r}: the "
                "adapted kernels are quantised already; one of them only"
            )
        if self.attention_block_size <= 0:
            raise ValueError(
                f"attention_block_size: must be positive, got {self.attention_block_size}"
            )

    def _check_experts(self, moe: bool) -> None:
        """The mixture-of-experts fields: set for a "moe" family, zero for a dense one."""
        mt = self.model_type
        if not moe:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                if getattr(self, name):
                    raise ValueError(f"{name}: {mt} is dense (0), got {getattr(self, name)}")
            return
        if self.num_experts < 1 or self.moe_intermediate_size < 1:
            raise ValueError(
                f"num_experts ({self.num_experts}) and moe_intermediate_size "
                f"({self.moe_intermediate_size}): {mt} needs both positive"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: expected 1..num_experts ({self.num_experts}), got "
                f"{self.num_experts_per_tok}"
            )
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"router_aux_loss_coef: must be >= 0, got {self.router_aux_loss_coef}")
        experts = sorted(set(self.lora_targets) & {"gate", "up", "down"})
        if self.lora_rank and experts and self.lora_base != "float":
            raise ValueError(
                f"lora_base: {mt}'s expert kernels ({','.join(experts)}) are not quantised "
                f"yet; got {self.lora_base!r} (use float, or adapt q, k, v, o only)"
            )
        if self.expert_axis not in moe_lib.EXPERT_AXES:
            raise ValueError(
                f"expert_axis: expected one of {moe_lib.EXPERT_AXES}, got {self.expert_axis!r}"
            )
        if self.moe_kernel not in moe_lib.MOE_KERNELS:
            raise ValueError(
                f"moe_kernel: expected one of {', '.join(moe_lib.MOE_KERNELS)}, got {self.moe_kernel!r}"
            )
        if self.weight_quant:
            raise ValueError(
                f"weight_quant: {mt}'s expert kernels are not quantised yet; got "
                f"{self.weight_quant!r} (use '')"
            )

    @property
    def is_moe(self) -> bool:
        """Every layer's feed-forward block is a mixture of experts (`model.MoE`)."""
        return self.num_experts > 0

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def cache_dtype(self) -> jnp.dtype:
        """The dtype KV caches hold keys and values in: `kv_dtype`, else the compute dtype."""
        return jnp.dtype(KV_DTYPES[self.kv_dtype]) if self.kv_dtype else as_dtype(self.dtype)

    def _key(self) -> tuple:
        # head_dim=None and the same head_dim written out describe one architecture: they
        # compare and hash equal, so jit (where the config is static) compiles once.
        return tuple(
            self.dim_per_head if f.name == "head_dim" else getattr(self, f.name)
            for f in dataclasses.fields(self)
        )

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def lora_scale(self) -> float:
        """What the adapters' product is multiplied by: lora_alpha / lora_rank."""
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def lora_params(self) -> int:
        """Adapter parameter count (0 without LoRA): rank x (in + out) per adapted matrix
        (of a mixture of experts, gate, up and down: per expert)."""
        if not self.lora_rank:
            return 0
        e, d = self.hidden_size, self.dim_per_head
        f = self.moe_intermediate_size if self.is_moe else self.intermediate_size
        h, k = self.num_heads, self.num_kv_heads
        sizes = {"q": (e, h * d), "k": (e, k * d), "v": (e, k * d), "o": (h * d, e)}
        sizes.update({"gate": (e, f), "up": (e, f), "down": (f, e)})
        experts = self.num_experts if self.is_moe else 1  # copies of gate, up and down
        copies = {t: experts if t in ("gate", "up", "down") else 1 for t in sizes}
        per_layer = sum(copies[t] * sum(sizes[t]) for t in self.lora_targets)
        return self.num_layers * self.lora_rank * per_layer

    def num_params(self, active: bool = False) -> int:
        """Parameter count (embeddings included; LoRA adapters not: `lora_params`).

        `active`: what one token runs through: of a mixture of experts, the router and
        `num_experts_per_tok` experts per layer (the same as the total for a dense model).
        """
        e, f, d = self.hidden_size, self.intermediate_size, self.dim_per_head
        h, k = self.num_heads, self.num_kv_heads
        attn = e * d * (h + 2 * k) + h * d * e
        if self.attention_bias:
            attn += d * (h + 2 * k)
        if self.qk_norm:
            attn += 2 * d
        mlp = 3 * e * f
        if self.is_moe:
            experts = self.num_experts_per_tok if active else self.num_experts
            mlp = e * self.num_experts + experts * 3 * e * self.moe_intermediate_size
        layer = attn + mlp + 2 * e
        head = 0 if self.tie_word_embeddings else e * self.vocab_size
        return self.num_layers * layer + self.vocab_size * e + e + head
