"""Shared vocabulary: errors, input checks, the batch records, the config sections, mesh axis names.

Imports nothing of m2po_jax.
"""
