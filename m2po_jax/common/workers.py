"""Calls on daemon threads that a hung call cannot use up, each with its own deadline.

    pool = WorkerPool(4, "m2po-tool")
    job = pool.submit(fn, *args)
    value = pool.wait(job, timeout_s=10.0)   # TimeoutError past 10 s of running

    outcomes = call_all(score, items, workers=4, timeout_s=10.0, name="m2po-reward")
    # [("ok", value) | ("timeout", None), ...] in the order of `items`

A thread cannot be stopped. A pool whose threads are stuck in calls that timed out serves
nothing else: every later call waits in its queue and "times out" without having run. Here
a call its waiter gives up on leaves the pool with its thread (a fresh thread takes its
place), and a call's time counts from its own start, not from when it was queued. Used by
ToolEnv's tools, the episode driver's environment steps and the reward threads.
"""

from __future__ import annotations

import itertools
import numbers
import queue
import threading
import time
from collections.abc import Callable, Sequence


class Job:
    """A call submitted to a `WorkerPool`: `started` / `done` events, then `result()`."""

    def __init__(self, fn: Callable, args: tuple):
        self.fn, self.args = fn, args
        self.started, self.done = threading.Event(), threading.Event()
        self.started_at: float | None = None
        self.thread: threading.Thread | None = None
        self.queue: queue.SimpleQueue | None = None  # of the threads it was queued for
        self.abandoned = False
        self._value = self._error = None

    def result(self):
        if self._error is not None:
            raise self._error
        return self._value

    def _run(self):
        try:
            self._value = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 (handed to the waiter)
            self._error = e
        self.done.set()


class WorkerPool:
    """`workers` daemon threads that a hung call cannot use up: a call its waiter gives up on
    (`abandon`) keeps its thread, which leaves the pool, and a fresh thread takes its place,
    so later calls still run (ToolEnv's tools, the episode driver's environment steps).
    `abandoned` counts the threads left to their calls; `stuck` those still running. Daemon
    threads: a call that never returns does not keep the interpreter from exiting. The
    threads start with the first call and end at `shutdown`; a pool shut down serves
    again (fresh threads) when called again, so an owner that ends its runs with
    `shutdown` leaves no idle thread between them."""

    def __init__(self, workers: int, name: str = "m2po-tool"):
        if isinstance(workers, bool) or not isinstance(workers, numbers.Integral) or workers < 1:
            raise ValueError(f"WorkerPool.workers: expected an int >= 1, got {workers!r}")
        self.workers, self.name = int(workers), name
        self.abandoned = 0
        self._queue: queue.SimpleQueue | None = None  # the running threads' (None: none)
        self._lock = threading.Lock()
        self._serial = itertools.count()
        self._left: list[threading.Thread] = []

    @property
    def stuck(self) -> int:
        """Abandoned threads still running their call."""
        return sum(t.is_alive() for t in self._left)

    def _spawn(self, jobs: queue.SimpleQueue):
        name = f"{self.name}_{next(self._serial)}"
        threading.Thread(target=self._serve, args=(jobs,), name=name, daemon=True).start()

    def _serve(self, jobs: queue.SimpleQueue):
        while True:
            job = jobs.get()
            if job is None:
                return
            with self._lock:
                job.thread, job.started_at = threading.current_thread(), time.perf_counter()
                job.started.set()
            job._run()
            with self._lock:
                if job.abandoned:  # replaced already: this thread leaves the pool
                    return

    def submit(self, fn: Callable, *args) -> Job:
        """Queues `fn(*args)`; the first call after creation or `shutdown` starts the
        threads."""
        job = Job(fn, args)
        with self._lock:
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                for _ in range(self.workers):
                    self._spawn(self._queue)
            job.queue = self._queue
            self._queue.put(job)
        return job

    def wait(self, job: Job, timeout_s: float | None, deadline: float | None = None):
        """`job`'s result once it ends; waiting in the queue does not count. TimeoutError
        (the job abandoned) when it runs `timeout_s` past its start, or past `deadline`
        (a `time.perf_counter` time) when that is later."""
        job.started.wait()
        if timeout_s is not None:
            end = job.started_at + timeout_s
            end = end if deadline is None else max(end, deadline)
            if not job.done.wait(max(end - time.perf_counter(), 0.0)):
                if self.abandon(job):
                    raise TimeoutError(f"ran past {timeout_s:g}s")
        job.done.wait()
        return job.result()

    def abandon(self, job: Job) -> bool:
        """Gives up on a running `job`: a fresh thread replaces its thread. False when the
        job had already ended (its result stands)."""
        with self._lock:
            if job.done.is_set() or job.abandoned:
                return not job.done.is_set()
            job.abandoned = True
            self.abandoned += 1
            self._left = [t for t in self._left if t.is_alive()] + [job.thread]
            if job.queue is self._queue:  # not after a shutdown of the job's threads
                self._spawn(self._queue)
        return True

    def shutdown(self) -> None:
        """The threads end after the calls queued before this (an abandoned call's thread
        when its call returns); a later `submit` starts fresh ones."""
        with self._lock:
            if self._queue is not None:
                for _ in range(self.workers):
                    self._queue.put(None)
                self._queue = None


def call_all(
    fn: Callable, items: Sequence, *, workers: int, timeout_s: float, name: str = "m2po-call"
) -> list[tuple[str, object]]:
    """`fn(item)` of every item on a `WorkerPool` of `workers`: ("ok", value) per item, or
    ("timeout", None) for a call still running `timeout_s` after its own start (left to
    its thread). An exception of `fn` is raised here. `timeout_s` <= 0: no deadline."""
    pool = WorkerPool(workers, name)
    try:
        jobs = [pool.submit(fn, item) for item in items]
        out: list[tuple[str, object]] = []
        for job in jobs:
            try:
                out.append(("ok", pool.wait(job, timeout_s if timeout_s > 0 else None)))
            except TimeoutError:
                if not job.abandoned:
                    raise  # fn's own TimeoutError
                out.append(("timeout", None))
        return out
    finally:
        pool.shutdown()
