"""`RunStop.signals`: what a run installs for SIGTERM / SIGINT goes when it ends.

The stop itself: one process in tests/trainer/trainer_test.py (a signal during a step and
during the warm-up), two in tests/parallel/ (with and without the runtime's notifier)."""

import os
import signal

from m2po_jax.trainer import stopping


def test_signals_restores_the_handlers_and_the_wakeup_fd_it_found():
    """A host program's own SIGTERM handler, SIGINT's (KeyboardInterrupt, in a notebook)
    and its wakeup fd (asyncio's) are back once the run's signals end, and its handler runs
    for a SIGTERM after the run, not the run's stop."""
    seen = []

    def host_handler(signum, frame):
        seen.append(signum)

    r, w = os.pipe()
    os.set_blocking(w, False)
    int_before = signal.getsignal(signal.SIGINT)
    term_before = signal.signal(signal.SIGTERM, host_handler)
    wakeup_before = signal.set_wakeup_fd(w)
    try:
        stop = stopping.RunStop()
        with stop.signals():
            assert signal.getsignal(signal.SIGTERM) is not host_handler
        assert signal.getsignal(signal.SIGTERM) is host_handler
        assert signal.getsignal(signal.SIGINT) is int_before
        assert signal.set_wakeup_fd(w) == w
        signal.raise_signal(signal.SIGTERM)
        assert seen == [signal.SIGTERM] and stop.requested is None
    finally:
        signal.set_wakeup_fd(wakeup_before)
        signal.signal(signal.SIGTERM, term_before)
        os.close(r)
        os.close(w)
