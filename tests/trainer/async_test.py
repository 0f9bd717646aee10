"""Async rollouts through the trainer on 8 CPU devices (4 rollout + 4 train; the learning
run on 1 + 1): the staleness bound, prompts neither lost nor repeated across a SIGTERM and
a resume, the worker's failures, and sync mode's results unchanged."""

import dataclasses
import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax import config as config_lib
from m2po_jax import trainer as trainer_lib
from m2po_jax.configs import arith, default
from m2po_jax.rollout import worker as worker_lib
from m2po_jax.run import metrics as metrics_lib
from m2po_jax.trainer import async_rollouts

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


def test_an_async_run_learns_within_k_and_trains_every_prompt_once(tmp_path):
    """The built-in default (warm-up, then M2PO at k = 4), async on 1 + 1 devices for 50
    steps, stopped after 25 with several batches buffered and resumed: held-out accuracy
    rises, every step trains the next 64 prompts, no sample is staler than k before or
    after the resume (counters restored in batches instead of prompts would admit one
    batch too many: AReaL's issue 1388 by another door), and the worker runs ahead by the
    k + 1 batches the rule allows.

    One rollout and one train device (the split over several devices and processes:
    the other tests here, tests/parallel/parallel_test.py, tests/trainer/lora_async_test.py)
    take a fifth less CPU time than 4 + 4. Held-out gain by seed (c.seed 0-4) on 1 + 1:
    +0.145, +0.102, +0.203, +0.172, +0.129, the worker 5 batches ahead at the stop and
    the stalest sample k old in each."""
    k, prompts = 4, 64
    c = default.get_config()
    changes = {
        "total_steps": 50,
        "rollout.mode": "async",
        "eval.every": 0,  # steps 0 and 49
        "sft.eval_every": 50,
        "checkpoint.every": 0,
        "logging.tensorboard": False,
        "logging.progress": False,
        "mesh.rollout_devices": 1,
        "mesh.data": 1,
    }
    config_lib.apply_dotted(c, changes)
    cfg = config_lib.from_configdict(c)
    # The resumed run plots every step and its own timeline (the one read below): no plots
    # at the stop (2 s; logging settings may change on a resume).
    first = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, plots=False))
    trainer = trainer_lib.Trainer(first, tmp_path)
    assert len(trainer.setup.rollout_placement.mesh.devices.flat) == 1
    assert trainer.placement.mesh.shape["data"] == 1
    assert trainer.run(stop_after=25).final_step == 25
    # The learner is the slower side: the checkpoint holds the batches the worker was ahead.
    assert trainer.checkpointer.meta(25)["queue_len"] >= 2
    result = trainer_lib.Trainer(cfg, tmp_path).run()
    assert result.final_step == 50
    records = read(tmp_path)
    assert [r["step"] for r in records] == list(range(50))
    for r in records:
        step = r["step"]
        assert r["data/first_prompt"] == step * prompts and r["data/prompts"] == prompts, r
        assert 0 <= r["staleness/min"] <= r["staleness/max"] <= k, r
        assert sum(r["staleness/hist_k"]) == prompts * c.gconfig.n_samples
        for key in ("time/wait_s", "time/train_s", "time/publish_s", "busy/rollout"):
            assert np.isfinite(r[key]) and r[key] >= 0, key
        assert 0 < r["busy/learner"] <= 1
    # The learner is the slower side here, so the worker stays k + 1 batches ahead and
    # each batch is trained exactly k updates after the weights that made it.
    assert max(r["staleness/max"] for r in records) == k
    accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    assert len(accuracy) == 2
    assert accuracy[-1] >= accuracy[0] + 0.05, accuracy
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
    # Through the paged engine (the continuous one: the next test), polling for new weights
    # after every decode step (its pool's figures in the records say the worker used it).
    engine = {
        "rollout.engine": "paged",
        "rollout.engine_slots": 4,
        "rollout.inflight_updates": True,
        "rollout.chunk_steps": 1,
    }
    one_each = {"mesh.rollout_devices": 1, "mesh.data": 1}  # the split is not what is tested
    cfg = async_config(
        **{"total_steps": 4, "rollout.max_head_offpolicyness": 0, **engine, **one_each}
    )
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
    records = read(tmp_path)
    assert [r["data/first_prompt"] for r in records] == [0, 8, 16, 24]
    for r in records:  # on-policy (k = 0): no newer weights exist while a batch is made
        assert r["staleness/max"] == 0 and r["staleness/token_mean"] == 0.0
        # Every token fresh; the paged engine's float32 log-probs are the trainer's to
        # rounding (1e-7 measured).
        assert r["mismatch/stale/tokens"] == 0 and r["mismatch/fresh/tokens"] > 0
        assert r["mismatch/fresh/abs_mean"] < 1e-5, r
        assert 0 <= r["rollout/decode_idle_fraction"] <= 1 and "rollout/inflight_updates" not in r
        assert 0 < r["rollout/kv_pages_peak_fraction"] <= 1


def test_async_settings_are_checked_before_any_work(tmp_path):
    with pytest.raises(config_lib.ConfigError, match=r"rollout.mode='overlap' is not one of"):
        async_config(**{"rollout.mode": "overlap"})
    inflight = {"rollout.inflight_updates": True, "rollout.engine": "continuous"}
    with pytest.raises(config_lib.ConfigError, match="needs rollout.mode=async and rollout.en"):
        async_config(**inflight, **{"rollout.mode": "sync"})
    with pytest.raises(config_lib.ConfigError, match=r"rollout.engine='vllm' is not one of"):
        async_config(**{"rollout.engine": "vllm"})
    with pytest.raises(ValueError, match="mesh.rollout_devices=8: each process has 8 devices"):
        trainer_lib.Trainer(async_config(**{"mesh.rollout_devices": 8}), tmp_path)
    with pytest.raises(ValueError, match="rollout.batch_size per process=6 must be divisible"):
        trainer_lib.Trainer(async_config(**{"rollout.batch_size": 6}), tmp_path)


_SLOW = {"calls": 0, "starts": []}


def slow_first_reward(completion, answer):
    """The arithmetic reward, but the first completion it scores takes 4 s."""
    _SLOW["calls"] += 1
    _SLOW["starts"].append(time.monotonic())
    if _SLOW["calls"] == 1:
        time.sleep(4.0)
    return float(completion.strip() == answer)


def test_each_async_rollout_field_reaches_the_worker(tmp_path, monkeypatch):
    """publish_dtype, stream_batches, reward_workers and reward_timeout_s change what an
    async run does: the weights the worker samples with are bfloat16, the engine is asked
    for two batches at once, and one slow completion scores 0 and is counted once while
    the second reward thread scores the next one beside it (one thread would start it
    only once the slow one timed out, 1 s later)."""
    counts = []
    real = async_rollouts.AsyncRollouts.generate_many

    def spy(self, first, count, version, params):
        counts.append(count)
        return real(self, first, count, version, params)

    monkeypatch.setattr(async_rollouts.AsyncRollouts, "generate_many", spy)
    _SLOW["calls"], _SLOW["starts"] = 0, []
    cfg = async_config(
        **{
            "total_steps": 3,
            "rollout.engine": "continuous",
            "rollout.engine_slots": 4,
            "rollout.stream_batches": 2,
            "rollout.publish_dtype": "bfloat16",
            "rollout.reward_workers": 2,
            "rollout.reward_timeout_s": 1.0,
            "task.reward_fn": f"{__name__}:slow_first_reward",
            "mesh.rollout_devices": 1,
            "mesh.data": 1,
        }
    )
    trainer = trainer_lib.Trainer(cfg, tmp_path)
    assert trainer.run().final_step == 3
    _, published = trainer.async_rollouts.weights.latest()
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(published)}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}, dtypes
    assert {leaf.dtype for leaf in jax.tree.leaves(trainer.state.params)} == {jnp.dtype("float32")}
    assert max(counts) == 2, counts
    records = read(tmp_path)
    assert sum(r["reward/timeouts"] for r in records) == 1, [r["reward/timeouts"] for r in records]
    first, second = _SLOW["starts"][:2]
    assert second - first < 0.5, second - first


def test_a_stalled_worker_ends_the_run_after_worker_timeout_s(tmp_path, monkeypatch):
    release = threading.Event()
    real = async_rollouts.AsyncRollouts.generate

    def stalls_at_batch_0(self, index, version, params):
        # The first batch: its timeout must not race the sampler's compile on a busy host.
        if index == 0:
            release.wait(30.0)
        return real(self, index, version, params)

    monkeypatch.setattr(async_rollouts.AsyncRollouts, "generate", stalls_at_batch_0)
    one_each = {"mesh.rollout_devices": 1, "mesh.data": 1}
    cfg = async_config(**{"total_steps": 3, "rollout.worker_timeout_s": 1.5, **one_each})
    trainer = trainer_lib.Trainer(cfg, tmp_path)
    try:
        with pytest.raises(
            worker_lib.RolloutWorkerError,
            match=r"rollout.worker_timeout_s: no rollout batch in 1.5 s",
        ):
            trainer.run()
    finally:
        release.set()
    assert trainer.checkpointer.latest_step() == 0  # the state so far is saved


@pytest.mark.parametrize("rank", [0, 4])
def test_async_publishes_the_int8_copy_and_under_lora_quantises_the_base_once(rank):
    """rollout.weight_dtype=int8, async: the publisher quantises on the train devices and
    copies the codes and scales to the rollout devices, in the rollout config's layout
    (the engine runs that config); under LoRA the base goes quantised with the worker's
    start and each step's adapters stay float32."""
    from m2po_jax.models import lora, quant
    from m2po_jax.trainer import setup as setup_lib

    changes = {"rollout.weight_dtype": "int8"}
    if rank:
        changes.update({"model.lora.rank": rank, "model.lora.targets": "q,v,down"})
    run = setup_lib.build(async_config(**changes))
    assert run.engine.model_config == run.model_config.replace(weight_quant="int8")
    params = setup_lib.initial_params(run, jax.random.key(0))
    rollouts = async_rollouts.AsyncRollouts(run, jax.random.key(0), 0)
    copy, base = rollouts._copies(params, with_base=True)
    whole = copy if base is None else lora.merge(copy, base)
    want = quant.convert_weights(jax.device_get(params), "int8")
    rollout_devices = set(run.rollout_placement.mesh.devices.flat)
    shardings = jax.tree.leaves(run.rollout_placement.sample_params)
    leaves = (jax.tree.leaves(whole), jax.tree.leaves(want), shardings)
    for got, expected, sh in zip(*leaves, strict=True):
        assert got.dtype == expected.dtype and got.sharding.is_equivalent_to(sh, got.ndim)
        assert got.sharding.device_set <= rollout_devices
        np.testing.assert_array_equal(got, expected)
    assert jax.tree.structure(whole) == jax.tree.structure(want)
    dtypes = {str(x.dtype) for x in jax.tree.leaves(whole)}
    assert dtypes == {"int8", "float32"}
    if rank:  # the adapters alone each step, float32
        assert base is not None and lora.has_adapters(copy)
        assert {x.dtype for x in jax.tree.leaves(copy)} == {jnp.dtype("float32")}
        assert not any(
            str(x.dtype) == "int8" for x in jax.tree.leaves(rollouts._copies(params, False)[0])
        )
