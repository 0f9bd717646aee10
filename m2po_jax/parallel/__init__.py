"""m2po_jax.parallel."""
