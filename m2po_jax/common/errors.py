"""The project's error types: problems a user can cause, reported by `m2po-train` in one line.

`m2po-train` prints `m2po-train: <what>: <message>` and exits 2 for any `M2poError`;
messages start with the file, field or key at fault (`<file or field>: <problem>`).
"""

from __future__ import annotations


class M2poError(Exception):
    """Base of the errors a user can cause and fix (config, data, workdir, disk)."""

    what = "error"


class ConfigError(M2poError, ValueError):
    """A config key or value is invalid."""

    what = "config error"


class DataError(M2poError, ValueError):
    """A data file cannot be read (missing, not UTF-8, not JSON, ...)."""

    what = "data error"


class ModelError(M2poError, ValueError):
    """A model checkpoint (config.json, safetensors) cannot be read."""

    what = "model error"


class RewardError(M2poError):
    """A reward function raised, or returned something that is not a finite number."""

    what = "reward error"


class WorkdirError(M2poError):
    """The workdir cannot be used (another run holds it, or it is not writable)."""

    what = "workdir error"


class CheckpointError(M2poError):
    """A checkpoint is damaged, incomplete or does not match the run."""

    what = "checkpoint error"


class WriterError(M2poError, OSError):
    """Writing an output (metrics, TensorBoard, plots, checkpoint) failed: disk full, I/O."""

    what = "I/O error"


def describe_os_error(error: OSError, path: object = None) -> str:
    """`<path>: <strerror>` for an OSError (errno name included: ENOSPC, EIO, ...)."""
    import errno

    where = path if path is not None else (error.filename or "?")
    name = errno.errorcode.get(error.errno or 0)
    reason = error.strerror or str(error)
    return f"{where}: {reason}" + (f" ({name})" if name else "")
