"""m2po_jax: stable off-policy RL for language models with M2PO, in JAX/Flax."""

__version__ = "0.1.0"
