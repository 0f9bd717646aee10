"""m2po_jax.learner."""
