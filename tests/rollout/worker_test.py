"""The rollout worker thread, with a stand-in batch maker (no model): admission, failures
surfaced with their traceback, a stuck worker named, pause for checkpoints."""

import threading
import time

import numpy as np
import pytest

from m2po_jax.common.types import RolloutBatch
from m2po_jax.rollout import staleness
from m2po_jax.rollout import worker as worker_lib

B = 4


def fake_batch(index, version, params):
    rows = B * 2
    z = np.zeros((rows, 3))
    return RolloutBatch(
        tokens_BxT=z.astype(np.int32),
        valid_BxT=z.astype(bool),
        behav_logp_BxT=z.astype(np.float32),
        loss_mask_BxT=z.astype(bool),
        prompt_len_B=np.zeros(rows, np.int32),
        completion_len_B=np.zeros(rows, np.int32),
        stopped_B=np.zeros(rows, bool),
        version_B=np.full(rows, version, np.int32),
        group_id_B=np.repeat(np.arange(B, dtype=np.int32) + index * B, 2),
        rewards_B=np.full(rows, float(params), np.float32),
        version_BxT=np.full((rows, 3), version, np.int32),
    )


def make_worker(
    k, make_batch=fake_batch, end=100, first=0, buffered=(), score=lambda b: b, **streaming
):
    admission = staleness.Admission.restored(k, B, first - len(buffered), len(buffered) * B)
    weights = worker_lib.WeightSlot(max(first - len(buffered), 0), 0.0)
    buffer = worker_lib.RolloutBuffer(buffered)
    worker = worker_lib.RolloutWorker(
        make_batch,
        score,
        admission,
        weights,
        buffer,
        batch_size=B,
        first_index=first,
        end_index=end,
        poll_s=0.005,
        **streaming,
    )
    return worker, weights, buffer, admission


@pytest.mark.parametrize("k", [0, 2])
def test_a_learner_never_trains_a_batch_staler_than_k(k):
    worker, weights, buffer, _ = make_worker(k, end=12)
    worker.start()
    seen = []
    for step in range(12):
        batch = buffer.get(timeout=10)
        seen.append((step, int(batch.version_B[0]), int(batch.group_id_B[0]) // B))
        time.sleep(0.002 * (step % 3))  # a learner of uneven speed
        weights.publish(step + 1, float(step + 1))
    worker.stop(timeout=10)
    assert [i for _, _, i in seen] == list(range(12))  # every batch, in order, once
    assert all(0 <= step - v <= k for step, v, _ in seen), seen
    # The worker used the newest weights it had: each batch's reward is its version.
    assert worker.error is None and not worker.is_alive()


def test_a_worker_exception_reaches_the_learner_with_its_traceback():
    def broken(index, version, params):
        if index == 2:
            raise ZeroDivisionError("the verifier divided by zero")
        return fake_batch(index, version, params)

    def slow_score_of_batch_1(batch):
        if int(batch.group_id_B[0]) == B:
            time.sleep(0.3)  # batch 2 fails while batch 1 is still being scored
        return batch

    worker, weights, buffer, admission = make_worker(1, broken, score=slow_score_of_batch_1)
    worker.start()
    buffer.get(timeout=10)
    weights.publish(1, 1.0)
    weights.publish(2, 2.0)
    # Batch 1 (made before the failure) still reaches the learner, then the error.
    assert int(buffer.get(timeout=10).group_id_B[0]) == B
    with pytest.raises(worker_lib.RolloutWorkerError) as info:
        buffer.get(timeout=10)
    message = str(info.value)
    assert "ZeroDivisionError: the verifier divided by zero (batch 2)" in message
    assert "Traceback" in message and "in broken" in message
    assert admission.counts().discarded == {"worker error": B}
    assert worker.next_index == 2  # a resumed run makes batch 2 again


def test_a_stuck_worker_is_named_after_the_timeout():
    release = threading.Event()

    def stuck(index, version, params):
        if index == 1:
            release.wait(30)
        return fake_batch(index, version, params)

    worker, weights, buffer, _ = make_worker(3, stuck)
    worker.start()
    buffer.get(timeout=10)
    with pytest.raises(worker_lib.RolloutWorkerError) as info:
        buffer.get(timeout=0.3, describe=worker.describe)
    message = str(info.value)
    assert "rollout.worker_timeout_s: no rollout batch in 0.3 s" in message
    assert "is generating batch 1 (policy version 0)" in message
    release.set()
    worker.stop(timeout=10)


def test_pause_lets_the_batch_in_flight_finish_and_holds_the_worker():
    """A pause waits for the batch being generated and then for its scoring: what a
    checkpoint stores then holds every batch before the worker's next index."""
    started = threading.Event()
    release = threading.Event()

    def slow(index, version, params):
        if index == 1:
            started.set()
            release.wait(30)
        return fake_batch(index, version, params)

    def slow_score_of_batch_1(batch):
        if int(batch.group_id_B[0]) == B:
            time.sleep(0.2)  # still being scored when the worker could first hold
        return batch

    worker, weights, buffer, _ = make_worker(5, slow, end=4, score=slow_score_of_batch_1)
    worker.start()
    assert started.wait(10)
    pausing = threading.Thread(target=worker.pause, args=(10,))
    pausing.start()
    time.sleep(0.05)
    assert pausing.is_alive()  # waits for batch 1
    release.set()
    pausing.join(10)
    held = len(buffer)
    assert held == 2 and worker.next_index == 2
    time.sleep(0.05)
    assert len(buffer) == held  # nothing new while paused
    worker.resume()
    worker.join(10)
    assert len(buffer) == 4 and not worker.is_alive()


def test_a_worker_that_does_not_pause_in_time_is_named():
    release = threading.Event()
    worker, _, _, _ = make_worker(
        2, lambda i, v, p: (release.wait(30), fake_batch(i, v, p))[1], end=3
    )
    worker.start()
    time.sleep(0.05)
    with pytest.raises(worker_lib.RolloutWorkerError, match="did not pause in 0.1 s"):
        worker.pause(0.1)
    release.set()
    worker.stop(10)


def test_the_weight_slot_never_goes_back():
    slot = worker_lib.WeightSlot(3, "w3")
    slot.publish(4, "w4")
    assert slot.latest() == (4, "w4")
    with pytest.raises(ValueError, match="version 2 is older than 4"):
        slot.publish(2, "w2")


def test_scoring_overlaps_the_next_generation_and_its_failures_reach_the_learner():
    def slow_generate(index, version, params):
        time.sleep(0.05)
        return fake_batch(index, version, params)

    def score(batch):
        time.sleep(0.05)
        if int(batch.group_id_B[0]) == 3 * B:
            raise ValueError("reward model returned nan")
        return batch

    admission = staleness.Admission(3, B)
    weights = worker_lib.WeightSlot(0, 0.0)
    buffer = worker_lib.RolloutBuffer()
    worker = worker_lib.RolloutWorker(
        slow_generate, score, admission, weights, buffer,
        batch_size=B, first_index=0, end_index=10, poll_s=0.005,
    )  # fmt: skip
    worker.start()
    got = [buffer.get(timeout=10) for _ in range(3)]
    assert [int(b.group_id_B[0]) for b in got] == [0, B, 2 * B]
    with pytest.raises(worker_lib.RolloutWorkerError, match=r"ValueError: reward model .*batch 3"):
        buffer.get(timeout=10)
    worker.join(10)
    assert worker.next_index == 3  # batch 3 (and any generated after it) is made again
    spans = worker.timeline.spans()
    generate = [(s, e) for lane, s, e in spans if lane == "rollout/generate"]
    scored = [(s, e) for lane, s, e in spans if lane == "host/score"]
    # Batch i's scoring ran while batch i + 1 was generated.
    assert any(min(ge, se) - max(gs, ss) > 0.02 for gs, ge in generate for ss, se in scored)
    counts = admission.counts()
    assert counts.accepted == 3 * B and counts.running == 0
    assert counts.discarded["worker error"] >= B


def test_batches_streamed_several_per_call_stay_within_k_and_a_failure_discards_the_rest():
    """batches_per_call=3 with k = 2: the worker admits as many batches at once as the rule
    allows (never a sample staler than k), each reaches the learner as it is yielded; a
    failure after the first batch of a call reports the second and discards the rest."""
    calls = []

    def many(first, count, version, params, fail_at=None):
        calls.append((first, count))
        for i in range(first, first + count):
            if i == fail_at:
                raise OSError("the engine lost its device")
            yield fake_batch(i, version, params)

    worker, weights, buffer, _ = make_worker(2, end=12, generate_many=many, batches_per_call=3)
    worker.start()
    seen = []
    for step in range(12):
        batch = buffer.get(timeout=10)
        seen.append((step, int(batch.version_B[0]), int(batch.group_id_B[0]) // B))
        weights.publish(step + 1, float(step + 1))
    worker.stop(timeout=10)
    assert [i for _, _, i in seen] == list(range(12))
    assert all(0 <= step - v <= 2 for step, v, _ in seen), seen
    assert calls[0] == (0, 3) and sum(count for _, count in calls) == 12

    calls.clear()
    failing = lambda *args: many(*args, fail_at=1)
    worker, _, buffer, admission = make_worker(2, generate_many=failing, batches_per_call=3)
    worker.start()
    assert int(buffer.get(timeout=10).group_id_B[0]) == 0
    with pytest.raises(worker_lib.RolloutWorkerError, match="OSError: the engine lost its"):
        buffer.get(timeout=10)
    assert calls == [(0, 3)]
    assert admission.counts().discarded == {"worker error": 2 * B}  # batches 1 and 2
    assert worker.next_index == 1
    with pytest.raises(ValueError, match="batches_per_call=2: .* needs generate_many"):
        make_worker(2, batches_per_call=2)
