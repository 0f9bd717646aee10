"""Calls on threads, each with its own deadline counted from when it starts.

    outcomes = call_all(score, pairs, workers=4, timeout_s=10.0, name="m2po-reward")
    # [("ok", value) | ("timeout", None), ...] in the order of `pairs`

A thread cannot be stopped. A pool whose threads are stuck in calls that timed out serves
nothing else: every later call waits in its queue and "times out" without having run.
Here a call that passes its deadline is abandoned (its daemon thread runs on to its end,
and the interpreter does not wait for it at exit) and its place goes to the next call, so
at most `workers` calls run that have not timed out, and every call gets its whole
`timeout_s` of running time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence


class _Call:
    def __init__(self, fn: Callable, item, done: threading.Condition):
        self.outcome = None
        self.started = time.monotonic()
        self._fn, self._item, self._done = fn, item, done
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            outcome = ("ok", self._fn(self._item))
        except BaseException as e:  # noqa: BLE001 (handed to the caller, raised there)
            outcome = ("raised", e)
        with self._done:
            self.outcome = outcome
            self._done.notify_all()


def call_all(
    fn: Callable, items: Sequence, *, workers: int, timeout_s: float, name: str = "m2po-call"
) -> list[tuple[str, object]]:
    """`fn(item)` of every item, at most `workers` at once: ("ok", value) per item, or
    ("timeout", None) for a call still running `timeout_s` after it started (abandoned).
    An exception of `fn` is raised here, after the calls before it are collected.
    `timeout_s` <= 0: no deadline."""
    done = threading.Condition()
    outcomes: list = [None] * len(items)
    running: dict[int, _Call] = {}
    next_item = 0
    with done:
        while next_item < len(items) or running:
            while next_item < len(items) and len(running) < max(int(workers), 1):
                call = _Call(fn, items[next_item], done)
                call.thread.name = f"{name}-{next_item}"
                running[next_item] = call
                call.thread.start()
                next_item += 1
            now = time.monotonic()
            for i, call in list(running.items()):
                if call.outcome is not None:
                    outcomes[i] = call.outcome
                    del running[i]
                elif timeout_s > 0 and now - call.started >= timeout_s:
                    outcomes[i] = ("timeout", None)  # abandoned: its place goes on
                    del running[i]
            if running and all(c.outcome is None for c in running.values()):
                wait = None
                if timeout_s > 0:
                    first = min(c.started for c in running.values())
                    wait = max(first + timeout_s - now, 0.0)
                done.wait(wait)
    for kind, value in outcomes:
        if kind == "raised":
            raise value
    return outcomes
