"""`call_all`: calls on a WorkerPool, a deadline each from its own start; a hung call
gives up its place instead of holding it (WorkerPool itself: tests/tasks/environments_test.py)."""

import threading
import time

import pytest

from m2po_jax.common.workers import WorkerPool, call_all


def test_each_call_has_its_whole_timeout_from_its_own_start():
    # One thread, three calls of 0.2 s under a 0.35 s timeout: 0.6 s in all, each in time.
    t0 = time.monotonic()
    out = call_all(lambda s: time.sleep(s) or s, [0.2, 0.2, 0.2], workers=1, timeout_s=0.35)
    assert out == [("ok", 0.2)] * 3 and time.monotonic() - t0 >= 0.6


def test_a_hung_call_times_out_and_its_place_goes_to_the_next():
    release = threading.Event()
    started = []

    def fn(x):
        started.append(x)
        if x == "hang":
            release.wait(10)
        return x

    t0 = time.monotonic()
    out = call_all(fn, ["hang", "a", "b"], workers=1, timeout_s=0.2)
    took = time.monotonic() - t0
    release.set()
    assert out == [("timeout", None), ("ok", "a"), ("ok", "b")]
    assert started == ["hang", "a", "b"] and took < 1.0


def test_workers_bound_the_calls_running_at_once():
    lock, now, most = threading.Lock(), [0], [0]

    def fn(x):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.05)
        with lock:
            now[0] -= 1
        return x * 2

    assert call_all(fn, list(range(8)), workers=3, timeout_s=0) == [("ok", 2 * i) for i in range(8)]
    assert most[0] == 3


def test_an_exception_of_a_call_is_raised_to_the_caller():
    def fn(x):
        if x == 2:
            raise KeyError("boom")
        return x

    with pytest.raises(KeyError, match="boom"):
        call_all(fn, [1, 2, 3], workers=2, timeout_s=1.0)


def _threads(prefix):
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def _ended(prefix, within=2.0):
    end = time.monotonic() + within
    while _threads(prefix) and time.monotonic() < end:
        time.sleep(0.01)
    return not _threads(prefix)


def test_a_pool_holds_threads_only_between_its_first_call_and_its_shutdown_then_serves_again():
    """No thread before the first call; `shutdown` ends them all (the owner's runs leave
    none behind); a call after it starts fresh ones; a call abandoned before a shutdown
    gets no replacement after it (the pool would otherwise keep one thread too many)."""
    pool = WorkerPool(3, "m2po-test-life")
    assert _threads("m2po-test-life") == []
    assert pool.wait(pool.submit(lambda: 7), 1.0) == 7
    assert len(_threads("m2po-test-life")) == 3
    pool.shutdown()
    assert _ended("m2po-test-life")
    assert pool.wait(pool.submit(lambda: 8), 1.0) == 8  # served again, by fresh threads
    assert len(_threads("m2po-test-life")) == 3
    release = threading.Event()
    hung = pool.submit(release.wait, 5.0)
    hung.started.wait(1.0)
    pool.shutdown()
    assert pool.abandon(hung) and pool.stuck == 1
    release.set()
    assert _ended("m2po-test-life")  # the idle ones at the shutdown, the hung one after it


def test_a_timed_out_call_leaves_the_pool_with_its_thread_when_it_returns():
    """A call past its timeout gets a fresh thread in its place; when the call returns at
    last, its thread ends instead of serving again (the pool keeps `workers` threads, and
    a shutdown ends them all)."""
    pool = WorkerPool(1, "m2po-test-leave")
    release = threading.Event()
    hung = pool.submit(release.wait, 5.0)
    with pytest.raises(TimeoutError, match="ran past"):
        pool.wait(hung, 0.05)
    assert pool.wait(pool.submit(lambda: 3), 1.0) == 3  # the replacement serves
    assert len(_threads("m2po-test-leave")) == 2 and pool.stuck == 1
    release.set()
    end = time.monotonic() + 2.0
    while pool.stuck and time.monotonic() < end:
        time.sleep(0.01)
    assert pool.stuck == 0 and len(_threads("m2po-test-leave")) == 1
    pool.shutdown()
    assert _ended("m2po-test-leave")
