"""Device meshes, logical-axis rules and shardings, one run's placement, multi-host start-up.

Imports `common` and `models`.
"""
