"""m2po_jax.models."""
