"""Test session setup: eight fake CPU devices for the sharding tests.

Set before jax is imported anywhere, so every test process (xdist workers
included) sees the same device count; single-device code runs on device 0.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
