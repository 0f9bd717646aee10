"""m2po_jax.algorithm."""
