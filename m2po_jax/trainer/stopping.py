"""One stop for every process of a run: SIGTERM, Ctrl-C or `Trainer.request_stop` on any
process stops all of them after the same step.

A stop requested on one process of a multi-process run is handed to the distributed
runtime's preemption service (the sync point that `multihost_utils.
reached_preemption_sync_point` and orbax's `CheckpointManager.reached_preemption` read): the
runtime tells every process, they agree on the next step all of them can still reach, and
`RunStop.agreed(...)` turns True there on each, a local check with no host round trip.
The signal's number goes into the runtime's key-value store first, so that every process
exits with 128 + that signal.

Signals are read by a watchdog thread from Python's wakeup fd, so a second signal ends the
process at once even while its main thread waits in a collective (where no Python signal
handler can run), with one line saying so.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import signal
import sys
import threading
from collections.abc import Callable

import jax
import numpy as np
from absl import logging

_SIGNAL_KEY = "m2po/stop_signal"
_HANDLED = (signal.SIGTERM, signal.SIGINT)
# struct sigaction is under 200 bytes on Linux and macOS; its handler is the first field.
_SIGACTION_BYTES = 256


def _distributed():
    from jax._src import distributed

    return distributed.global_state


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.sigaction  # noqa: B018 (present?)
        return libc
    except (OSError, AttributeError):
        return None


def _read_sigaction(signum: int):
    """The raw `struct sigaction` now installed for `signum`, or None where unreadable."""
    libc = _libc()
    if libc is None:
        return None
    raw = ctypes.create_string_buffer(_SIGACTION_BYTES)
    if libc.sigaction(signum, None, raw) != 0:
        return None
    return raw


def _write_sigaction(signum: int, raw) -> None:
    libc = _libc()
    if libc is not None and raw is not None:
        libc.sigaction(signum, raw, None)


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _foreign_handler(signum: int, raw) -> Callable[[int], None] | None:
    """The C handler of `signum` that jaxlib installed (the distributed runtime's preemption
    notifier, for SIGTERM: it only records the notice), as a callable; else None."""
    if raw is None or callable(signal.getsignal(signum)):
        return None
    pointer = ctypes.c_void_p.from_buffer(raw).value or 0
    if pointer in (0, 1):  # SIG_DFL, SIG_IGN
        return None
    libc, info = _libc(), _DlInfo()
    try:
        found = libc.dladdr(ctypes.c_void_p(pointer), ctypes.byref(info))
    except AttributeError:
        return None
    if not found or b"jaxlib" not in (info.dli_fname or b""):
        return None  # another library's handler: not called
    return ctypes.CFUNCTYPE(None, ctypes.c_int)(pointer)


class RunStop:
    """A run's stop: requested on one process, agreed on by all.

    `request(signum)` is the local request (a signal, `Trainer.request_stop`); `agreed()`,
    called once per step by every process in the same order, is True at the step where
    every process stops; `signal` is then the signal all of them exit with.
    """

    def __init__(self):
        self.requested: int | None = None  # this process's request (a signal number)
        self._lock = threading.RLock()
        self._calls = 0
        self._agreed = False  # once agreed, every later check is True too
        self._preemption_notifier: Callable[[int], None] | None = None
        self._wakeup_r: int | None = None
        self._signals_seen = 0
        self._on_exit_now: Callable[[], str] = lambda: ""

    # ---- requests ---------------------------------------------------------------------

    def request(self, signum: int = signal.SIGTERM, *, announce: bool = False) -> None:
        """Asks every process to stop after the step it is on (idempotent)."""
        with self._lock:
            if self.requested is not None:
                return
            self.requested = int(signum)
        if jax.process_count() > 1:
            state = _distributed()
            if state.client is not None:
                try:  # the first request wins: every process reads the same number
                    state.client.key_value_set(_SIGNAL_KEY, str(int(signum)))
                except Exception:  # noqa: BLE001 (set by another process already)
                    pass
            notify = self._preemption_notifier or _foreign_handler(
                signal.SIGTERM, _read_sigaction(signal.SIGTERM)
            )
            if notify is not None and state.preemption_sync_manager is not None:
                notify(signal.SIGTERM)  # the runtime's notifier: all processes are told
        if announce:
            where = (
                "every process stops after the same step"
                if jax.process_count() > 1
                else "stopping after this step"
            )
            logging.warning(
                "signal %d: %s, with a checkpoint (send it again to stop now)", signum, where
            )

    # ---- the agreement ----------------------------------------------------------------

    def agreed(self) -> bool:
        """True if every process stops after this step. Call once per step, on every
        process, in the same order (the warm-up's steps, then the RL steps)."""
        self._drain()
        if self._agreed:
            return True
        self._agreed = self._agree()
        return self._agreed

    def _agree(self) -> bool:
        self._calls += 1
        count = jax.process_count()
        manager = _distributed().preemption_sync_manager
        if count == 1:
            if self.requested is not None:
                return True
            # A SIGTERM the runtime's own handler caught (before ours was installed).
            return manager is not None and manager.reached_sync_point(self._calls)
        if manager is not None and self._preemption_notifier is not None:
            return manager.reached_sync_point(self._calls)
        # No preemption service: one small collective per step says whether anyone asked.
        from jax.experimental import multihost_utils

        wanted = multihost_utils.process_allgather(np.int32(self.requested is not None))
        return bool(np.any(wanted))

    @property
    def signal(self) -> int:
        """The signal every process exits with: the first request's, else SIGTERM."""
        if jax.process_count() > 1:
            client = _distributed().client
            try:
                return int(client.key_value_try_get(_SIGNAL_KEY))
            except Exception:  # noqa: BLE001 (no request recorded: a runtime notice)
                pass
        return self.requested or signal.SIGTERM

    # ---- signals ----------------------------------------------------------------------

    @contextlib.contextmanager
    def signals(self, on_exit_now: Callable[[], str] = lambda: ""):
        """SIGTERM / SIGINT request the stop; a second one ends the process at once.

        `on_exit_now()` gives the end of the line printed then (where the last checkpoint
        is). Outside the main thread this does nothing (Python delivers signals there)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._on_exit_now = on_exit_now
        saved = {sig: (signal.getsignal(sig), _read_sigaction(sig)) for sig in _HANDLED}
        self._preemption_notifier = _foreign_handler(signal.SIGTERM, saved[signal.SIGTERM][1])
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._wakeup_r, self._signals_seen = r, 0
        for sig in _HANDLED:
            # Python's C handler writes the signal's number to the wakeup fd; the work is
            # done by `_drain` (the main thread each step, or the watchdog when it waits).
            signal.signal(sig, self._on_python_signal)
        done = threading.Event()
        watchdog = threading.Thread(
            target=self._watch, args=(r, done), name="m2po-signal-watchdog", daemon=True
        )
        watchdog.start()
        try:
            yield
        finally:
            done.set()
            signal.set_wakeup_fd(old_wakeup)
            for sig, (python_handler, raw) in saved.items():
                signal.signal(sig, python_handler if python_handler is not None else signal.SIG_DFL)
                if python_handler is None or not callable(python_handler):
                    _write_sigaction(sig, raw)  # a library's C handler, as it was
            os.close(w)
            watchdog.join(timeout=2)
            with self._lock:
                self._wakeup_r = None
            os.close(r)
            self._preemption_notifier = None

    def _on_python_signal(self, signum, frame) -> None:
        self._drain()

    def _watch(self, r: int, done: threading.Event) -> None:
        while not done.is_set():
            try:
                ready, _, _ = select.select([r], [], [], 0.2)
            except (OSError, ValueError):
                return
            if ready:
                self._drain()

    def _drain(self) -> None:
        """Acts on the signals that arrived (each read once, under the lock)."""
        with self._lock:
            if self._wakeup_r is None:
                return
            try:
                data = os.read(self._wakeup_r, 64)
            except (BlockingIOError, OSError):
                return
            for signum in data:
                self._signals_seen += 1
                if self._signals_seen == 1 and self.requested is None:
                    self.request(signum, announce=True)
                else:
                    self._exit_now(signum)

    def _exit_now(self, signum: int) -> None:
        """A second signal: one line, then the process ends with 128 + the signal."""
        where = self._on_exit_now()
        sys.stdout.flush()
        print(
            f"m2po-train: signal {signum} again: exiting now (exit {128 + signum}) without "
            f"a checkpoint of this step{'; ' + where if where else ''}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signum)
