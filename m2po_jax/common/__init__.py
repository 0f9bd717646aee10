"""m2po_jax.common."""
