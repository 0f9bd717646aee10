"""JAX's persistent compilation cache: a restarted or resumed run skips compiling.

`m2po-train` turns it on by default (`--compile_cache=DIR`, `--compile_cache=off`); library
users call `enable()` once before the first `jit`. Compiled programs are keyed by the
program, the JAX version and the device kind, so one directory serves every run of a user.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from absl import logging

ENV = "M2PO_COMPILE_CACHE"
OFF = ("", "off", "none", "false", "0")
# Programs that compile faster than this are not worth a file (XLA:CPU's tiny helpers).
MIN_COMPILE_SECONDS = 0.2


def default_dir() -> str:
    """$M2PO_COMPILE_CACHE, else $XDG_CACHE_HOME/m2po_jax/xla, else ~/.cache/m2po_jax/xla."""
    if ENV in os.environ:
        return os.environ[ENV]
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "m2po_jax" / "xla")


def enable(directory: str | None = None) -> str | None:
    """Points JAX's persistent compilation cache at `directory` (default `default_dir()`).

    "off" (or "", "none") leaves it off. A directory that cannot be created is reported
    and skipped: the cache only saves time, so it never stops a run. Returns the directory
    in use, or None.
    """
    directory = default_dir() if directory is None else directory
    if directory.strip().lower() in OFF:
        return None
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        logging.warning("compilation cache off: cannot create %s (%s)", path, e.strerror or e)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return str(path)
