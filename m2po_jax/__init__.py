"""m2po_jax: stable off-policy RL for language models with M2PO, in JAX/Flax."""

from m2po_jax.advantages import grpo_token_advantages
from m2po_jax.losses import RejectionSampling, policy_loss
from m2po_jax.masking import m2po_clip_bound, m2po_mask, m2po_mask_with_stats

__version__ = "0.1.0"

__all__ = [
    "RejectionSampling",
    "grpo_token_advantages",
    "m2po_clip_bound",
    "m2po_mask",
    "m2po_mask_with_stats",
    "policy_loss",
]
