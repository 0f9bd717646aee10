"""Scoring completions with a per-completion timeout, in worker processes where it can stop.

    scorer = RewardScorer(task, workers=4, timeout_s=10.0)
    rewards = scorer(examples, texts)   # one float per completion; timeouts score 0
    scorer.take_timeouts()              # completions that timed out since the last call

A verifier that can take unbounded time on adversarial input (math-verify's sympy, marked
`may_hang`) runs in `workers` spawned processes: a completion is stopped after `timeout_s`
by an alarm in its worker, and a worker stuck where an alarm cannot reach it (C code) is
replaced. Any other reward (a user's `task.reward_fn`, a task's own `verify`) runs in this
process on `workers` threads; one that passes `timeout_s` (counted from its own start)
scores 0 and is counted, and its thread is left to finish on its own (a thread cannot be
stopped) while the next completion takes its place (`common.workers`). A reward that raises or
returns anything but a finite number stops the run with `RewardError` naming the function,
the problem and the completion.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import signal
import threading
from collections.abc import Sequence

from absl import logging

from m2po_jax.common import workers as workers_lib
from m2po_jax.tasks.base import RewardFailure, Task, call_reward, reward_error

_GRACE_S = 5.0  # past its alarm, how long a worker may take before it is replaced
_START_S = 300.0  # how long spawned workers may take to import and warm up


class _Timeout(BaseException):  # not an Exception: call_reward must not catch it
    pass


_FN = None
_TIMEOUT_S = 0.0


def _init_worker(fn, timeout_s: float, ready) -> None:
    global _FN, _TIMEOUT_S
    _FN, _TIMEOUT_S = fn, timeout_s
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle

    def expire(signum, frame):
        raise _Timeout

    signal.signal(signal.SIGALRM, expire)
    # The first call imports the verifier's libraries (sympy, ANTLR: seconds on a busy
    # host); that must not count against a completion's timeout.
    try:
        fn("\\boxed{1}", "1")
    except BaseException:  # noqa: BLE001 (a warm-up; real calls report their own errors)
        pass
    ready.put(True)


def _score_in_worker(completion: str, answer: str):
    """("ok", reward) | ("timeout", None) | ("error", reason), in a worker process."""
    signal.setitimer(signal.ITIMER_REAL, _TIMEOUT_S)
    try:
        return "ok", call_reward(_FN, completion, answer)
    except _Timeout:
        return "timeout", None
    except RewardFailure as failure:
        return "error", failure.reason
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


class RewardScorer:
    """Scores `(example, completion)` pairs with `task`'s reward (`Task.scorer`).

    Args:
      task: the task (its `scorer`, `reward_name`).
      workers: processes (a `may_hang` verifier) or threads (anything else) at once.
      timeout_s: per completion; 0 = none (then everything runs in this process).
    """

    def __init__(self, task: Task, *, workers: int = 1, timeout_s: float = 0.0):
        self.fn = task.scorer
        self.name = task.reward_name
        self.workers = max(int(workers), 1)
        self.timeout_s = float(timeout_s)
        self.in_processes = bool(
            self.timeout_s > 0 and getattr(self.fn, "may_hang", False) and _picklable(self.fn)
        )
        self._pool = None
        self._timeouts = 0
        self._lock = threading.Lock()

    def __call__(self, examples: Sequence, texts: Sequence[str]) -> list[float]:
        """One reward per completion; `examples[i]` is the example `texts[i]` answers."""
        pairs = list(zip(examples, texts, strict=True))
        if self.in_processes:
            outcomes = self._in_processes(pairs)
        else:
            outcomes = self._here(pairs)
        rewards, timeouts = [], 0
        for (example, text), (kind, value) in zip(pairs, outcomes, strict=True):
            if kind == "error":
                raise reward_error(self.name, value, example, text)
            timeouts += kind == "timeout"
            rewards.append(value if kind == "ok" else 0.0)
        if timeouts:
            with self._lock:
                self._timeouts += timeouts
        return rewards

    def take_timeouts(self) -> int:
        """Completions that timed out (scored 0) since the last call."""
        with self._lock:
            n, self._timeouts = self._timeouts, 0
        return n

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None

    # ---- in this process ----------------------------------------------------------------

    def _one(self, pair):
        example, text = pair
        try:
            return "ok", call_reward(self.fn, text, example.answer)
        except RewardFailure as failure:
            return "error", failure.reason

    def _here(self, pairs):
        if self.workers == 1 and self.timeout_s <= 0:
            return [self._one(p) for p in pairs]
        # Each completion's deadline counts from its own start, and one past it gives its
        # place to the next: a hung reward never makes the completions queued behind it
        # "time out" unscored.
        outcomes = workers_lib.call_all(
            self._one, pairs, workers=self.workers, timeout_s=self.timeout_s, name="m2po-reward"
        )
        return [value if kind == "ok" else (kind, None) for kind, value in outcomes]

    # ---- in worker processes ------------------------------------------------------------

    def _start(self):
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            ready = context.Queue()
            self._pool = context.Pool(
                self.workers, initializer=_init_worker, initargs=(self.fn, self.timeout_s, ready)
            )
            # Deadlines count from a warm worker: start-up (spawn, imports) is not scoring.
            try:
                for _ in range(self.workers):
                    ready.get(timeout=_START_S)
            except queue.Empty:
                self.close()
                raise RuntimeError(
                    f"{self.name}: reward worker processes did not start within {_START_S:.0f} s"
                ) from None
        return self._pool

    def _in_processes(self, pairs):
        out: list = [None] * len(pairs)
        todo = list(range(len(pairs)))
        while todo:
            pool = self._start()
            jobs = {
                i: pool.apply_async(_score_in_worker, (pairs[i][1], pairs[i][0].answer))
                for i in todo
            }
            stuck = None
            for i, job in jobs.items():
                try:
                    out[i] = job.get(timeout=self.timeout_s + _GRACE_S)
                except multiprocessing.TimeoutError:
                    stuck = i
                    break
            if stuck is None:
                break
            # A worker its alarm could not stop: it scores 0, the pool is replaced, and the
            # completions not scored yet go to the new one.
            logging.warning(
                "%s: a completion of problem %s ran past %.0f s and its alarm; its worker is "
                "replaced",
                self.name,
                pairs[stuck][0].uid,
                self.timeout_s + _GRACE_S,
            )
            out[stuck] = ("timeout", None)
            self.close()
            todo = [i for i in todo if out[i] is None]
        return out


def _picklable(fn) -> bool:
    try:
        pickle.dumps(fn)
    except Exception:  # noqa: BLE001 (anything pickle refuses)
        return False
    return True
