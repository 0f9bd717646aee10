"""One run per workdir: an exclusive `fcntl` lock on `workdir/.lock`, held for the whole run.

The kernel releases the lock when the process dies (even by SIGKILL), so a stale lock
file never blocks a rerun. The file records the holder's pid and host for the refusal.
A process may take the same workdir's lock again (nested holds); it is released when
the outermost hold ends.

An object-store workdir (`gs://...`) has no file locks: it is held without one, after a
one-line warning, so one trainer per workdir is then the user's to keep.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from m2po_jax.common.errors import WorkdirError
from m2po_jax.run import paths

LOCK_FILE = ".lock"

# realpath -> [open lock file, nesting depth] of the locks this process holds.
_held: dict[str, list] = {}


def _holder(file) -> str:
    file.seek(0)
    text = file.read().strip()
    pid, _, host = text.partition(" ")
    if not pid:
        return "another process (pid unknown)"
    return f"pid {pid} on host {host or '?'}"


def acquire(workdir: str | os.PathLike) -> str:
    """Takes the workdir's lock (or nests a hold this process has); returns its key."""
    if not paths.is_local(workdir):
        key = os.fspath(paths.workdir(workdir))
        if key not in _held:
            logging.warning("%s: object stores have no locks; run one trainer per workdir", key)
            _held[key] = [None, 0]
        _held[key][1] += 1
        return key
    directory = Path(workdir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WorkdirError(f"{directory}: cannot create the workdir ({e.strerror})") from e
    key = os.path.realpath(directory)
    if key in _held:
        _held[key][1] += 1
        return key
    path = directory / LOCK_FILE
    try:
        file = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (kept open while held)
    except OSError as e:
        raise WorkdirError(f"{path}: cannot open the lock file ({e.strerror})") from e
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(file)
        file.close()
        raise WorkdirError(
            f"{directory}: in use by another run ({holder}); "
            "wait for it to finish or choose another --workdir"
        ) from None
    file.seek(0)
    file.truncate()
    file.write(f"{os.getpid()} {socket.gethostname()}\n")
    file.flush()
    _held[key] = [file, 1]
    return key


def release(key: str) -> None:
    """Ends one hold taken by `acquire`; the lock goes when the last hold ends."""
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _held[key]
        # Closing the file releases the flock; the file itself stays (harmless when unlocked).
        if entry[0] is not None:
            entry[0].close()


@contextlib.contextmanager
def hold(workdir: str | os.PathLike, *, enabled: bool = True) -> Iterator[None]:
    """Holds the workdir's lock for the block (`enabled=False`: on processes other than 0)."""
    if not enabled:
        yield
        return
    key = acquire(workdir)
    try:
        yield
    finally:
        release(key)
