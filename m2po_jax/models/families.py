"""Model families: what each Hugging Face `model_type` is, as one registry row.

A row says how a decoder layer is built and how its `config.json` reads: the attention's
q/k norms and biases, the default head width, the feed-forward block (`mlp`: "dense", a
SwiGLU `model.MLP`; "moe", a sparse mixture of experts `model.MoE`) and the keys a family
writes besides the common ones. `model.py` builds a layer's feed-forward block by `mlp`;
`hf_format.py` reads and writes configs and tensor names by the row (and by `mlp` for the
feed-forward keys and tensors). A new family whose blocks exist is one row here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

MLP_KINDS = ("dense", "moe")


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face `model_type`."""

    architecture: str  # config.json's "architectures" entry (the transformers class)
    mlp: str = "dense"  # each layer's feed-forward block: a name in MLP_KINDS
    qk_norm: bool = False  # RMSNorm on q and k per head
    # q/k/v biases: True for every checkpoint of the family (config.json's key is not read),
    # None when config.json's `attention_bias` says
    attention_bias: bool | None = None
    head_dim: int | None = None  # head_dim when config.json has none (None: hidden / heads)
    sliding_window_keys: bool = False  # config.json has use_sliding_window and friends
    hf_constants: tuple[tuple[str, Any], ...] = ()  # keys written as they are

    def __post_init__(self):
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"mlp: expected one of {MLP_KINDS}, got {self.mlp!r}")


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", hf_constants=(("mlp_bias", False), ("pretraining_tp", 1))),
    "qwen2": Family("Qwen2ForCausalLM", attention_bias=True, sliding_window_keys=True),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True, head_dim=128, sliding_window_keys=True),
    # Qwen3's attention; every layer a mixture of experts (decoder_sparse_step 1, no
    # mlp_only_layers). Qwen3MoeConfig has no head_dim default: hidden / heads.
    "qwen3_moe": Family("Qwen3MoeForCausalLM", mlp="moe", qk_norm=True, sliding_window_keys=True),
}


def family(model_type: str) -> Family:
    """The registry row of `model_type`; a one-line error naming the supported ones."""
    if model_type not in FAMILIES:
        raise ValueError(
            f"model_type: {model_type!r} is not supported; supported: {', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]
