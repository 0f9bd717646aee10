"""Admission control (AReaL's staleness rule) and its counters, resumes included."""

import itertools

import pytest

from m2po_jax.rollout import staleness


def test_capacity_is_areals_formula_by_hand():
    # (v + k + 1) * B - (accepted + running): v=3, k=2, B=4 -> 24 - (10 + 4) = 10.
    assert staleness.capacity(3, 2, 4, accepted=10, running=4) == 10
    assert staleness.capacity(0, 0, 8, accepted=0, running=0) == 8
    assert staleness.capacity(0, 0, 8, accepted=8, running=0) == 0
    assert staleness.capacity(1, 0, 8, accepted=8, running=8) == 0
    assert staleness.capacity(0, 1, 8, accepted=16, running=8) == -8
    assert staleness.may_start(3, 2, 4, 10, 4, prompts=10)
    assert not staleness.may_start(3, 2, 4, 10, 4, prompts=11)


def simulate(k, batch, schedule, admission=None, version=0, buffer=()):
    """A learner and a worker taking turns as `schedule` says ("g": the worker starts and
    finishes a batch if admitted; "t": the learner trains on the oldest one if there is
    one). `buffer`: versions of batches waiting at the start. Returns the staleness of
    every trained batch and the final version."""
    admission = admission or staleness.Admission(k, batch)
    buffer, trained = list(buffer), []
    for move in schedule:
        if move == "g" and admission.try_start(version, batch):
            admission.accept(batch)
            buffer.append(version)
        elif move == "t" and buffer:
            trained.append(version - buffer.pop(0))
            version += 1
    return trained, version


@pytest.mark.parametrize("k", [0, 1, 3])
def test_no_trained_batch_is_staler_than_k_whatever_the_order(k):
    for schedule in itertools.product("gt", repeat=10):
        trained, _ = simulate(k, 4, schedule)
        assert all(0 <= s <= k for s in trained), (schedule, trained)
    # A worker always ahead reaches exactly k (the bound is used, not just respected).
    trained, _ = simulate(k, 4, "g" * (k + 3) + "tg" * 6)
    assert max(trained) == k


def test_the_worker_runs_at_most_k_plus_one_batches_ahead():
    admission = staleness.Admission(2, 8)
    started = sum(admission.try_start(0, 8) for _ in range(10))
    assert started == 3 and admission.counts().running == 24


def test_a_resume_restarts_the_counters_from_the_restored_version():
    """AReaL's issue 1388: counters restarted at zero with the version restored let the
    worker run far ahead, and staleness past the bound. `Admission.restored` counts the
    consumed and the buffered prompts, so the resumed run stays within k."""
    k, batch = 2, 4
    trained, version = simulate(k, batch, "ggtgtgtgt")
    assert version == 4 and trained == [0, 1, 1, 1]
    # The run stopped with one batch (made at version 3) in its buffer.
    resumed = staleness.Admission.restored(k, batch, version, buffered=batch)
    assert resumed.counts().accepted == (version + 1) * batch
    schedule = "g" * 10 + "t" * 10
    after, _ = simulate(k, batch, schedule, admission=resumed, version=version, buffer=[3])
    assert max(after) == k and len(after) == k + 1
    buggy = staleness.Admission(k, batch)  # the counters of a fresh run, at version 4
    after_bug, _ = simulate(k, batch, schedule, admission=buggy, version=version, buffer=[3])
    assert max(after_bug) == 7  # 7 batches admitted at version 4; the last trained at 11


def test_discards_are_counted_by_reason_and_free_their_slots():
    admission = staleness.Admission(0, 4)
    assert admission.try_start(0, 4)
    assert not admission.try_start(0, 4)
    admission.discard(4, "worker error")
    assert admission.try_start(0, 4)
    admission.discard(4, "worker error")
    counts = admission.counts()
    assert counts.discarded == {"worker error": 8} and counts.running == 0
    assert counts.accepted == 0
    with pytest.raises(RuntimeError, match="only 0 run"):
        admission.accept(4)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_staleness=-1"):
        staleness.Admission(-1, 4)
    with pytest.raises(ValueError, match="batch_size=0"):
        staleness.Admission(1, 0)
