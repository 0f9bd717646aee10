"""m2po_jax: stable off-policy RL for language models with M2PO, in JAX/Flax."""

from m2po_jax.masking import m2po_mask, m2po_mask_with_stats

__version__ = "0.1.0"

__all__ = ["m2po_mask", "m2po_mask_with_stats"]
