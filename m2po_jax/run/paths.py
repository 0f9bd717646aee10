"""One path layer for everything a run writes: local directories and object stores alike.

Every workdir path goes through `workdir()`, which returns an `etils.epath.Path` (the path
type orbax uses): a local path, or `gs://`, `s3://`, `az://` where its filesystem backend
is installed (`gcsfs` / `s3fs` / `adlfs` through fsspec, or TensorFlow's `tf.io.gfile`).
A URL with another scheme, or one whose backend is missing, is refused at start-up in one
line, before anything is written, instead of becoming a local folder named `gs:`.

An object store has no append, no rename and no lock. So a file written whole
(`write_atomic`) is one object write there (atomic by itself) and a temporary file plus
`os.replace` locally; an appended log (`AppendLog`: metrics.jsonl, TensorBoard events) is
rewritten whole at each `sync()` there and appended to the OS file locally.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import IO

from etils import epath

from m2po_jax.common.errors import WorkdirError

# scheme -> the pip packages a run there needs: fsspec's filesystem (TensorFlow's gfile also
# serves), and for gs:// the client orbax asks about the bucket's layout.
SCHEMES = {"gs": "gcsfs google-cloud-storage", "s3": "s3fs", "az": "adlfs"}
_MODULES = {"gs": ("google.cloud.storage",)}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme(path: str | os.PathLike) -> str | None:
    """ "gs" for "gs://bucket/run", None for a local path."""
    match = _URL.match(os.fspath(path))
    return match.group(1).lower() if match else None


def is_local(path: str | os.PathLike) -> bool:
    return scheme(path) is None


def workdir(raw: str | os.PathLike) -> epath.Path:
    """The workdir as a path every writer accepts; refuses what cannot be written, in one line.

    A local path is made absolute. A remote one is checked by asking its backend whether it
    exists, so a missing backend (or unreachable store) fails here, not at the first save.
    """
    text = os.fspath(raw)
    kind = scheme(text)
    if kind is None:
        return epath.Path(text).expanduser().absolute()
    if kind not in SCHEMES:
        supported = ", ".join(f"{s}://" for s in SCHEMES)
        raise WorkdirError(
            f"{text}: a workdir on {kind}:// is not supported (a local path, or {supported})"
        )
    path = epath.Path(text)
    try:
        for module in _MODULES.get(kind, ()):
            importlib.import_module(module)
        path.exists()
    except ImportError as e:
        raise WorkdirError(
            f"{text}: no filesystem backend for {kind}:// is installed "
            f"(pip install {SCHEMES[kind]}; the m2po-jax[{kind}] extra)"
        ) from e
    except Exception as e:  # auth, network, a bad bucket name: the backend's own words
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise WorkdirError(f"{text}: cannot reach the workdir ({type(e).__name__}: {first})") from e
    return path


def as_path(path: str | os.PathLike) -> epath.Path:
    return path if isinstance(path, epath.Path) else epath.Path(os.fspath(path))


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Writes the whole file so that a reader sees the old content or the new, never half."""
    path = as_path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if not is_local(path):
        path.write_bytes(raw)  # one object write: atomic in the store
        return
    tmp = os.fspath(path.parent / f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.fspath(path))


class AppendLog:
    """A file that grows by appends: the OS file locally, a rewritten object remotely.

    `write` appends (flushed to the OS at once locally, so a killed process keeps it);
    `sync` makes everything durable (fsync locally, one whole-object write remotely).
    `exclusive=True` refuses an existing file (a new TensorBoard event file).
    """

    def __init__(self, path: str | os.PathLike, *, binary: bool = False, exclusive: bool = False):
        self.path = as_path(path)
        self._binary = binary
        self._file: IO | None = None
        self._remote: bytearray | None = None
        self.closed = False
        if is_local(self.path):
            mode = ("x" if exclusive else "a") + ("b" if binary else "")
            encoding = None if binary else "utf-8"
            self._file = open(os.fspath(self.path), mode, encoding=encoding)  # noqa: SIM115
        else:
            if exclusive and self.path.exists():
                raise FileExistsError(f"{self.path}: already exists")
            self._remote = bytearray(self.path.read_bytes() if self.path.exists() else b"")

    def write(self, data: str | bytes) -> None:
        if self._file is not None:
            self._file.write(data)
            self._file.flush()
        else:
            self._remote += data.encode("utf-8") if isinstance(data, str) else data

    def sync(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
        elif self._remote is not None:
            self.path.write_bytes(bytes(self._remote))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sync()
        finally:
            if self._file is not None:
                self._file.close()
