"""TensorBoard scalar events, written synchronously on the calling thread.

tensorboardX's `SummaryWriter` writes from a background thread through a bounded
queue: when that thread dies (disk full), the next `add_scalar` blocks forever in
`queue.put`. Here a write error is raised where it happens, and every step's event
is flushed to the OS, so a killed run loses nothing it wrote; `sync()` also fsyncs.
A resumed run starts its file with a `SessionLog.START` at the resume step, which
tells TensorBoard to drop the older files' events at and after that step.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from collections.abc import Mapping

from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c

from m2po_jax.run import paths

_counter = itertools.count()


def _frame(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC-32C, the data, its masked CRC-32C."""
    header = struct.pack("<Q", len(data))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


class EventFile:
    """A new `events.out.tfevents.*` file in `logdir`; `purge_step` starts a resumed run."""

    def __init__(self, logdir: str | os.PathLike, *, purge_step: int | None = None):
        directory = paths.as_path(logdir)
        directory.mkdir(parents=True, exist_ok=True)
        # A nanosecond time sorts the files of successive runs by name (as TensorBoard reads
        # them); pid and a counter keep two writers from sharing (truncating) one file.
        name = (
            f"events.out.tfevents.{time.time_ns():020d}.{socket.gethostname()}."
            f"{os.getpid()}.{next(_counter)}"
        )
        self.path = os.fspath(directory / name)
        self._file = paths.AppendLog(self.path, binary=True, exclusive=True)
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:
            start = SessionLog(status=SessionLog.START)
            self._write(Event(wall_time=time.time(), step=purge_step, session_log=start))

    def _write(self, event: Event) -> None:
        self._file.write(_frame(event.SerializeToString()))

    def add_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """One event holding every scalar of `step`, flushed to the OS."""
        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()]
        self._write(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def sync(self) -> None:
        self._file.sync()

    def close(self) -> None:
        self._file.close()


def _records(path: str):
    data = paths.as_path(path).read_bytes()
    offset = 0
    while offset + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        end = offset + 12 + length + 4
        if end > len(data):
            return  # a record cut short by a kill
        yield data[offset + 12 : offset + 12 + length]
        offset = end


def read_scalars(logdir: str | os.PathLike) -> dict[str, dict[int, float]]:
    """tag -> {step: value} as TensorBoard shows it (files in name order, purges applied)."""
    scalars: dict[str, dict[int, float]] = {}
    directory = paths.as_path(logdir)
    names = sorted(p.name for p in directory.iterdir() if p.name.startswith("events.out"))
    for name in names:
        for raw in _records(directory / name):
            event = Event.FromString(raw)
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                for series in scalars.values():
                    for step in [s for s in series if s >= event.step]:
                        del series[step]
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars
