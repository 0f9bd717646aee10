"""Async rollouts through the trainer on 8 CPU devices (4 rollout + 4 train): the
staleness bound, prompts neither lost nor repeated across a SIGTERM and a resume, the
worker's failures, and sync mode's results unchanged."""

import json
import signal

import numpy as np
import pytest

from m2po_jax import config as config_lib
from m2po_jax import trainer as trainer_lib
from m2po_jax.configs import arith
from m2po_jax.rollout import worker as worker_lib
from m2po_jax.trainer import async_rollouts
from m2po_jax.trainer import metrics as metrics_lib

B = 8  # prompts per batch


def async_config(**changes):
    c = arith.get_config("m2po,tiny")
    c.task.format_reward = 0.5
    c.rollout.mode = "async"
    c.rollout.batch_size = B
    c.eval.batch_size = 16
    c.logging.tensorboard = False
    c.logging.progress = False
    config_lib.apply_dotted(c, changes)
    return config_lib.from_configdict(c)


def read(workdir):
    return metrics_lib.read_metrics(workdir / "metrics.jsonl")


def test_an_async_run_stays_within_k_and_resumes_without_losing_a_prompt(tmp_path):
    k = 2
    cfg = async_config(**{"total_steps": 6, "logging.plots": True, "rollout.reward_workers": 4})
    first = trainer_lib.Trainer(cfg, tmp_path)
    assert len(first.setup.rollout_placement.mesh.devices.flat) == 4
    assert first.placement.mesh.shape["data"] == 4
    real_step = first.train_step

    def step_then_sigterm(state, batch, rng, ref_params):
        step = int(state.step)
        out = real_step(state, batch, rng, ref_params)
        if step == 2:
            signal.raise_signal(signal.SIGTERM)
        return out

    first.train_step = step_then_sigterm
    result = first.run()
    assert result.interrupted and result.final_step == 3
    # The checkpoint holds the batches the worker had made ahead, every one of them
    # admitted under the rule: at most k + 1 ahead of the learner's version 3.
    restored = first.checkpointer.restore(3, state_like=first.state)
    queue = restored["queue"]
    assert 1 <= len(queue) <= k + 1
    position = restored["meta"]["data_position"]
    assert position == (3 + len(queue)) * B
    assert [int(b.group_id_B[0]) for b in queue] == [(3 + i) * B for i in range(len(queue))]
    assert all(3 - int(b.version_B.min()) <= k for b in queue)

    resumed = trainer_lib.Trainer(cfg, tmp_path)
    result = resumed.run()
    assert result.final_step == 6 and not result.interrupted
    records = read(tmp_path)
    assert [r["step"] for r in records] == list(range(6))
    for r in records:
        step = r["step"]
        assert r["data/first_prompt"] == step * B and r["data/prompts"] == B, r
        assert 0 <= r["staleness/min"] <= r["staleness/max"] <= k, r
        assert sum(r["staleness/hist_k"]) == B * cfg.gconfig.n_samples
        for key in ("time/wait_s", "time/train_s", "time/publish_s", "busy/rollout"):
            assert np.isfinite(r[key]) and r[key] >= 0, key
        assert 0 < r["busy/learner"] <= 1
    # The first step after the resume trains a batch made before the stop (stale), as
    # the worker ran ahead; a run that regenerated it would show staleness 0 there.
    assert records[3]["staleness/max"] >= 1
    assert "loss" in records[-1] and np.isfinite(records[-1]["loss"])
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_a_worker_exception_stops_the_run_with_its_traceback_and_a_checkpoint(
    tmp_path, monkeypatch
):
    real = async_rollouts.AsyncRollouts.score

    def fails_at_batch_2(self, sampled):
        if int(sampled.batch.group_id_B[0]) == 2 * B:
            raise OSError("the sandbox that scores completions went away")
        return real(self, sampled)

    monkeypatch.setattr(async_rollouts.AsyncRollouts, "score", fails_at_batch_2)
    cfg = async_config(**{"total_steps": 4, "rollout.max_head_offpolicyness": 0})
    trainer = trainer_lib.Trainer(cfg, tmp_path)
    with pytest.raises(worker_lib.RolloutWorkerError) as info:
        trainer.run()
    message = str(info.value)
    assert "OSError: the sandbox that scores completions went away (batch 2)" in message
    assert "in fails_at_batch_2" in message  # the worker's own traceback
    # The learner's state is saved; batch 2 is made again by a resumed run.
    assert trainer.checkpointer.latest_step() == 2
    meta = json.loads((trainer.checkpointer.step_dir(2) / "meta" / "metadata").read_text())
    assert meta["data_position"] == 2 * B and meta["queue_len"] == 0

    monkeypatch.setattr(async_rollouts.AsyncRollouts, "score", real)
    result = trainer_lib.Trainer(cfg, tmp_path).run()
    assert result.final_step == 4
    assert [r["data/first_prompt"] for r in read(tmp_path)] == [0, 8, 16, 24]


def test_async_settings_are_checked_before_any_work(tmp_path):
    with pytest.raises(config_lib.ConfigError, match=r"rollout.mode='overlap' is not one of"):
        async_config(**{"rollout.mode": "overlap"})
    with pytest.raises(ValueError, match="mesh.rollout_devices=8: each process has 8 devices"):
        trainer_lib.Trainer(async_config(**{"mesh.rollout_devices": 8}), tmp_path)
    with pytest.raises(ValueError, match="rollout.batch_size per process=6 must be divisible"):
        trainer_lib.Trainer(async_config(**{"rollout.batch_size": 6}), tmp_path)


# loss, reward/mean, train/param_norm of steps 0-3 of the tiny preset on 2 devices, as
# the trainer computed them before async rollouts existed (commit 83be609).
SYNC_BEFORE = [
    (-0.004632984753698111, 0.1875, 10.006616592407227),
    (-0.045836254954338074, 0.1875, 10.006958961486816),
    (0.04047203063964844, 0.1875, 10.0071382522583),
    (-0.08312029391527176, 0.125, 10.007341384887695),
]


def test_sync_mode_reproduces_the_results_from_before_async_rollouts(tmp_path):
    c = arith.get_config("m2po,tiny")
    c.task.format_reward = 0.5
    c.mesh.data = 2
    c.logging.plots = c.logging.tensorboard = c.logging.progress = False
    trainer_lib.Trainer(config_lib.from_configdict(c), tmp_path).run()
    got = [(r["loss"], r["reward/mean"], r["train/param_norm"]) for r in read(tmp_path)]
    np.testing.assert_allclose(got, SYNC_BEFORE, rtol=1e-6, atol=1e-7)
