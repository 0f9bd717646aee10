"""The asynchronous rollout worker: a thread that generates while the learner trains.

The worker loops: wait until `staleness.Admission` admits the next batch under the
learner's current version, take the newest weights the learner has published
(`WeightSlot`), generate and score the batch (`make_batch`, on the rollout devices and
the host), put it in the `RolloutBuffer`. JAX releases the GIL while a program runs, so
the learner's train step and the worker's sampler run at once on their own devices.

New weights are taken between batches: a batch in flight finishes under the weights it
started with (the fixed-shape sampler decodes a batch as one program; interrupting it
would waste the batch). Every row carries the version that generated it.

Failures reach the learner: an exception in the worker is raised by the learner's next
`RolloutBuffer.get` as `RolloutWorkerError` with the worker's traceback, and a worker
that produces nothing for `timeout_s` is named with what it was doing.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from m2po_jax.common.errors import M2poError
from m2po_jax.common.types import RolloutBatch
from m2po_jax.models import lora
from m2po_jax.rollout.staleness import Admission


class RolloutWorkerError(RuntimeError):
    """The rollout worker failed or stopped producing batches (not a user error: the
    message carries the worker's traceback or what it was stuck in)."""


class Timeline:
    """Intervals (lane, start, end) of who was busy when, for the run's timeline plot."""

    def __init__(self):
        self._lock = threading.Lock()
        self.origin = time.perf_counter()
        self._spans: list[tuple[str, float, float]] = []

    def add(self, lane: str, start: float, end: float) -> None:
        with self._lock:
            self._spans.append((lane, start - self.origin, end - self.origin))

    def spans(self) -> list[tuple[str, float, float]]:
        with self._lock:
            return list(self._spans)

    def busy(self, lane_prefix: str, start: float, end: float) -> float:
        """Seconds of [start, end] (perf_counter times) covered by spans of the lanes."""
        a, b = start - self.origin, end - self.origin
        covered = 0.0
        for lane, s, e in self.spans():
            if lane.startswith(lane_prefix):
                covered += max(0.0, min(e, b) - max(s, a))
        return covered


class WeightSlot:
    """The newest weights the learner published to the rollout devices, with their version.

    Under LoRA (`base` given) the learner sends the frozen base once and then only each
    version's adapters (a few MB instead of the model): `params` are then the adapters,
    and `latest()` gives the whole tree the model expects, `lora.merge(adapters, base)`
    (made once per publish, without copying an array). A later `publish(..., base=)`
    replaces the base, should it ever change (the train step leaves it bit-identical).
    Like the whole weights, only the newest version is kept: a batch holds on to the
    weights it started with, and every token records its version.
    """

    def __init__(self, version: int, params: Any, base: Any = None):
        self._cond = threading.Condition()
        self._base = base
        self._version, self._adapters = version, params
        self._params = self._whole(params)

    def _whole(self, params: Any) -> Any:
        return params if self._base is None else lora.merge(params, self._base)

    @property
    def has_base(self) -> bool:
        """Whether the slot holds a base and takes adapters (a LoRA run)."""
        return self._base is not None

    def publish(self, version: int, params: Any, base: Any = None) -> None:
        """Makes `params` (of policy `version`) the newest: the whole weights, or with a
        base held the adapters (and `base`, when given, the new base)."""
        if base is not None and self._base is None:
            raise ValueError("publish: a base for a slot that holds whole weights")
        with self._cond:
            if version < self._version:
                raise ValueError(f"publish: version {version} is older than {self._version}")
            if base is not None:
                self._base = base
            self._version, self._adapters = version, params
            self._params = self._whole(params)
            self._cond.notify_all()

    def parts(self) -> tuple[int, Any, Any]:
        """(version, adapters, base) as published (a slot without a base: (version,
        whole weights, None))."""
        with self._cond:
            return self._version, self._adapters, self._base

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    def latest(self) -> tuple[int, Any]:
        with self._cond:
            return self._version, self._params

    def wait_newer(self, version: int, timeout: float) -> None:
        """Returns when a version newer than `version` is published, or after `timeout`."""
        with self._cond:
            self._cond.wait_for(lambda: self._version > version, timeout)


class RolloutBuffer:
    """Finished rollout batches in the order they were made; the learner takes the oldest."""

    def __init__(self, batches=()):
        self._cond = threading.Condition()
        self._batches: collections.deque[RolloutBatch] = collections.deque(batches)
        self._error: str | None = None
        self._user_error: BaseException | None = None

    def __len__(self) -> int:
        with self._cond:
            return len(self._batches)

    def put(self, batch: RolloutBatch) -> None:
        if not isinstance(batch, RolloutBatch):
            raise TypeError(f"the rollout buffer holds RolloutBatch records, got {type(batch)}")
        with self._cond:
            self._batches.append(batch)
            self._cond.notify_all()

    def fail(self, message: str, user_error: BaseException | None = None) -> None:
        """Makes every later `get` raise `RolloutWorkerError(message)`, or `user_error` (a
        user's error the worker met, such as a reward function's `RewardError`) as itself."""
        with self._cond:
            self._error = message
            self._user_error = user_error
            self._cond.notify_all()

    def get(self, timeout: float, describe: Callable[[], str] = lambda: "") -> RolloutBatch:
        """The oldest batch; waits up to `timeout` seconds for one."""
        with self._cond:
            ready = self._cond.wait_for(lambda: self._batches or self._error, timeout)
            if self._batches:
                return self._batches.popleft()
            if self._error:
                if self._user_error is not None:
                    raise self._user_error
                raise RolloutWorkerError(self._error)
            assert not ready
            raise RolloutWorkerError(
                f"rollout.worker_timeout_s: no rollout batch in {timeout:g} s; {describe()}"
            )

    def state(self) -> list[RolloutBatch]:
        """The buffered batches, oldest first (what a checkpoint stores)."""
        with self._cond:
            return list(self._batches)


class RolloutWorker(threading.Thread):
    """Generates batches `first_index`, `first_index + 1`, ... up to `end_index` (exclusive).

    Two stages run at once: this thread generates batch i + 1 on the rollout devices
    while a scoring thread computes batch i's rewards on the host (a verifier, a
    sandbox), the same calls a sync run makes, in the same order.

    Args:
      generate: `(index, version, params) -> pending`: batch `index`'s prompts sampled
        with `params` (of policy `version`), not scored yet.
      score: `pending -> RolloutBatch`, the batch with its rewards.
      admission: the staleness counters; the worker starts a batch only when they admit it
        (it counts as running until it is scored and buffered).
      weights: where the learner publishes new weights.
      buffer: where finished batches go.
      batch_size: prompts per batch (what `admission` counts).
      timeline: records busy intervals (lanes "rollout/generate" and "host/score").
      generate_many: `(first, count, version, params) -> iterator of pending`, batches
        first .. first + count - 1 made together and yielded in order as each is done
        (a streaming engine); with `batches_per_call` > 1 the worker admits up to that
        many batches at once (each by the admission rule) and calls it instead.
    """

    def __init__(
        self,
        generate: Callable[[int, int, Any], Any],
        score: Callable[[Any], RolloutBatch],
        admission: Admission,
        weights: WeightSlot,
        buffer: RolloutBuffer,
        *,
        batch_size: int,
        first_index: int,
        end_index: int,
        timeline: Timeline | None = None,
        poll_s: float = 0.05,
        generate_many: Callable[[int, int, int, Any], Any] | None = None,
        batches_per_call: int = 1,
    ):
        super().__init__(name="m2po-rollout-worker", daemon=True)
        self.generate, self.score = generate, score
        if batches_per_call < 1 or (batches_per_call > 1 and generate_many is None):
            raise ValueError(
                f"batches_per_call={batches_per_call}: must be >= 1, and > 1 needs generate_many"
            )
        self.generate_many, self.batches_per_call = generate_many, batches_per_call
        self.admission, self.weights, self.buffer = admission, weights, buffer
        self.batch_size = batch_size
        self._next, self._failed_at = first_index, None
        self.end_index = end_index
        self.timeline = timeline or Timeline()
        self.poll_s = poll_s
        self._stop_event = threading.Event()
        self._pause = threading.Event()
        self._idle = threading.Event()
        self._lock = threading.Lock()
        self._activity = ("starting", first_index, weights.version, time.perf_counter())
        self._scoring: tuple[int, float] | None = None  # (batch, since) being scored
        self._to_score: queue.Queue = queue.Queue(maxsize=1)
        self._scorer = threading.Thread(target=self._score_loop, name="m2po-scorer", daemon=True)
        self.error: BaseException | None = None

    # ---- the learner's side -------------------------------------------------------------

    @property
    def next_index(self) -> int:
        """The first batch not in the buffer yet and not being made (after a failure: the
        batch that failed, which a resumed run makes again)."""
        with self._lock:
            return self._next if self._failed_at is None else self._failed_at

    def describe(self) -> str:
        """What the worker is doing now (for timeout errors)."""
        with self._lock:
            what, index, version, since = self._activity
            scoring = self._scoring
        now = time.perf_counter()
        state = "alive" if self.is_alive() else "not running"
        text = (
            f"the rollout worker ({state}) is {what} batch {index} (policy version {version}) "
            f"for {now - since:.1f} s"
        )
        if scoring is not None:
            text += f"; its scorer is scoring batch {scoring[0]} for {now - scoring[1]:.1f} s"
        return text

    def pause(self, timeout: float) -> None:
        """Lets the batches in flight finish (into the buffer), then holds the worker."""
        self._pause.set()
        if not self._idle.wait(timeout) and self.is_alive():
            raise RolloutWorkerError(
                f"rollout.worker_timeout_s: the worker did not pause in {timeout:g} s; "
                f"{self.describe()}"
            )

    def resume(self) -> None:
        self._idle.clear()
        self._pause.clear()

    def stop(self, timeout: float) -> None:
        """Ends the worker after the batches in flight (which are kept in the buffer)."""
        self._stop_event.set()
        self._pause.clear()
        self.join(timeout)
        if self.is_alive():
            raise RolloutWorkerError(
                f"rollout.worker_timeout_s: the worker did not stop in {timeout:g} s; "
                f"{self.describe()}"
            )

    # ---- the worker's side --------------------------------------------------------------

    def _set(self, what: str, index: int, version: int) -> None:
        with self._lock:
            self._activity = (what, index, version, time.perf_counter())

    def _fail(self, error: BaseException, index: int, trace: str) -> None:
        with self._lock:
            first = self._failed_at is None
            self._failed_at = index if first else min(self._failed_at, index)
        if first:
            self.error = error
            self.buffer.fail(
                f"rollout worker: {type(error).__name__}: {error} (batch {index}); its "
                f"traceback:\n{trace}",
                error if isinstance(error, M2poError) else None,
            )

    def run(self) -> None:
        self._scorer.start()
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 (everything reaches the learner)
            # Reported once the batches made before it are scored and buffered, in order.
            self._to_score.put(("failed", self._next, e, traceback.format_exc()))
        finally:
            self._to_score.put(None)
            self._scorer.join()
            self._idle.set()

    def _drained(self) -> bool:
        """Waits for the batch being scored (if any); False if scoring failed."""
        self._to_score.join()
        return self.error is None

    def _loop(self) -> None:
        while not self._stop_event.is_set() and self.next_index < self.end_index:
            if self.error is not None:
                return
            if self._pause.is_set():
                if self._drained():
                    self._idle.set()
                time.sleep(self.poll_s)
                continue
            version = self.weights.version
            index = self.next_index
            if not self.admission.try_start(version, self.batch_size):
                self._set("waiting for admission of", index, version)
                self.weights.wait_newer(version, self.poll_s)
                continue
            count = 1  # and as many more as the rule admits now, up to batches_per_call
            while (
                count < self.batches_per_call
                and index + count < self.end_index
                and self.admission.try_start(version, self.batch_size)
            ):
                count += 1
            version, params = self.weights.latest()  # the newest, at least the admitted one
            self._set("generating", index, version)
            done, t0 = 0, time.perf_counter()
            try:
                if self.batches_per_call == 1:
                    made = iter([self.generate(index, version, params)])
                else:
                    made = self.generate_many(index, count, version, params)
                for pending in made:
                    self.timeline.add("rollout/generate", t0, time.perf_counter())
                    self._set("waiting to score", index + done, version)
                    self._to_score.put(("batch", index + done, version, pending))
                    done += 1
                    with self._lock:
                        self._next = index + done
                    self._set("generating", index + done, version)
                    t0 = time.perf_counter()
                if done != count:
                    raise RuntimeError(f"generate made {done} of the {count} batches asked")
            except BaseException:
                self.admission.discard((count - done) * self.batch_size, "worker error")
                raise
        self._drained()

    def _score_loop(self) -> None:
        while True:
            item = self._to_score.get()
            try:
                if item is None:
                    return
                kind, index, *rest = item
                if kind == "failed":
                    self._fail(rest[0], index, rest[1])
                    continue
                version, pending = rest
                if self.error is not None:  # a later batch than the one that failed
                    self.admission.discard(self.batch_size, "worker error")
                    continue
                t0 = time.perf_counter()
                with self._lock:
                    self._scoring = (index, t0)
                try:
                    batch = self.score(pending)
                except BaseException as e:  # noqa: BLE001
                    self.admission.discard(self.batch_size, "worker error")
                    self._fail(e, index, traceback.format_exc())
                    continue
                finally:
                    with self._lock:
                        self._scoring = None
                self.timeline.add("host/score", t0, time.perf_counter())
                self.admission.accept(self.batch_size)
                self.buffer.put(batch)
            finally:
                self._to_score.task_done()
