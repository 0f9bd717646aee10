"""Sharded training and sampling equal the single-device run; multi-process runs equal one process.

Uses the 8 fake CPU devices of tests/conftest.py; the multi-process run is two processes of
two CPU devices each against one process of four (each fake device runs every op: fewer
are cheaper).
"""

import functools
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from m2po_jax import config as config_lib
from m2po_jax import trainer as trainer_lib
from m2po_jax.common.types import TrainBatch
from m2po_jax.configs import arith
from m2po_jax.learner import logprobs, optim
from m2po_jax.learner import train_step as step_lib
from m2po_jax.models import model as model_lib
from m2po_jax.models import model_config
from m2po_jax.parallel import placement as placement_lib
from m2po_jax.rollout import sampling
from m2po_jax.run import checkpoint as ckpt_lib
from m2po_jax.run import metrics as metrics_lib

REPO = Path(__file__).resolve().parents[2]
FLAGS = os.environ["M2PO_TEST_XLA_FLAGS"]  # the suite's compile flags (conftest)
MODEL = model_config.ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
)
MESHES = {
    "data8": {"data": 8, "fsdp": 1, "tensor": 1},
    "fsdp8": {"data": 1, "fsdp": 8, "tensor": 1},
    "2x2x2": {"data": 2, "fsdp": 2, "tensor": 2},
}


def actor_section(**changes):
    c = arith.get_config("m2po")
    c.actor.ppo_n_minibatches = 2
    c.actor.optimizer.lr = 1e-3
    for key, value in changes.items():
        c.actor[key] = value
    return config_lib.from_configdict(c).actor


def synthetic_batch(rows=16, prompt=4, new=6, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, MODEL.vocab_size, (rows, prompt + new)).astype(np.int32)
    valid = np.ones_like(tokens, bool)
    valid[::3, 0] = False  # some left padding
    loss_mask = np.zeros_like(valid)
    loss_mask[:, prompt:] = True
    loss_mask[1::4, -2:] = False  # some rows stopped early
    behav = np.where(loss_mask, -rng.uniform(0.5, 4.0, tokens.shape), 0.0).astype(np.float32)
    rewards = rng.integers(0, 2, rows).astype(np.float32)
    return TrainBatch(
        tokens_BxT=tokens,
        valid_BxT=valid & (loss_mask | (np.arange(prompt + new) < prompt)),
        behav_logp_BxT=behav,
        loss_mask_BxT=loss_mask,
        rewards_B=rewards,
        version_B=np.zeros(rows, np.int32),
        version_BxT=np.zeros(tokens.shape, np.int32),
    )


def two_steps(mesh_shape, actor, batch=None, with_layout=False):
    placement = placement_lib.Placement.from_shape(mesh_shape, MODEL)
    tx, schedule = optim.make_optimizer(actor.optimizer, 10)
    params = placement.init_params(jax.random.key(0))
    init_fn = functools.partial(step_lib.init_train_state, tx=tx)
    state_sh = placement.state_shardings(jax.eval_shape(init_fn, params))
    state = jax.jit(init_fn, out_shardings=state_sh)(params)
    batch = synthetic_batch() if batch is None else batch
    step = step_lib.make_train_step(
        MODEL,
        actor,
        tx,
        schedule,
        jit_kwargs=dict(
            in_shardings=(state_sh, placement.batch_shardings(batch), placement.replicated, None),
            out_shardings=(state_sh, placement.replicated),
        ),
        layout=placement.layout if with_layout else None,
    )
    metrics = []
    for i in range(2):
        state, m = step(state, placement.to_global(batch), jax.random.key(i), None)
        metrics.append(jax.device_get(m))
    return jax.device_get(state.params), metrics


@pytest.fixture(scope="module")
def single_device_run():
    return two_steps({"data": 1, "fsdp": 1, "tensor": 1}, actor_section())


@pytest.mark.parametrize("name", sorted(MESHES))
def test_sharded_train_step_equals_single_device(single_device_run, name):
    ref_params, ref_metrics = single_device_run
    params, metrics = two_steps(MESHES[name], actor_section())
    # Four AdamW updates of ~1e-3 each: summing in another order across shards moves the
    # normalised update of a near-zero gradient by up to ~1% of one step.
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)
    for key in ("loss", "m2po/masked_fraction", "train/param_norm"):
        np.testing.assert_allclose(metrics[1][key], ref_metrics[1][key], rtol=1e-5, atol=1e-6)
    # The step is not a no-op, and M2PO masked something in this off-policy batch.
    moved = max(
        float(np.abs(a - b).max())
        for a, b in zip(
            jax.tree.leaves(params),
            jax.tree.leaves(model_lib.init_params(MODEL, jax.random.key(0))),
            strict=True,
        )
    )
    assert moved > 1e-4
    assert metrics[0]["m2po/masked_fraction"] > 0


def _ref_masked(m2, valid, tau):
    """Tokens docs/algorithm.md masks in one set: keep the longest ascending prefix whose
    mean is below tau (at least one)."""
    values = np.sort(m2[valid])
    means = np.cumsum(values) / np.arange(1, values.size + 1)
    keep = max([k + 1 for k in range(values.size) if means[k] < tau], default=1)
    return values.size - keep


def test_per_shard_mask_scope_differs_from_global_and_trains():
    """Shard 0 (rows 0-1 of 16 on 8 data shards) is far off-policy, the rest on-policy: the
    global set keeps a few of shard 0's tokens (their share of the mean fits tau), while
    shard 0 alone keeps exactly one, and the on-policy shards keep everything."""
    batch = synthetic_batch()
    initial = model_lib.init_params(MODEL, jax.random.key(0))
    prox, _ = jax.jit(lambda p, t, v: logprobs.sequence_logp(p, MODEL, t, v, 1.0))(
        initial, batch.tokens_BxT, batch.valid_BxT
    )
    prox = np.asarray(prox, np.float64)
    valid = batch.loss_mask_BxT
    delta = np.zeros(prox.shape)
    delta[:2] = np.random.default_rng(1).uniform(0.8, 1.2, (2, prox.shape[1]))
    behav = np.where(valid, prox + delta, 0.0).astype(np.float32)
    batch = batch.replace(behav_logp_BxT=behav)
    m2 = np.square(behav - prox)
    tau = 0.04
    want_global = _ref_masked(m2, valid, tau)
    want_shard = sum(_ref_masked(m2[i : i + 2], valid[i : i + 2], tau) for i in range(0, 16, 2))
    assert want_shard == valid[:2].sum() - 1 and want_global < want_shard  # the batch's design

    runs = {}
    for scope in ("global", "shard"):
        actor = actor_section(m2po_scope=scope, m2_threshold=tau)
        runs[scope] = two_steps(MESHES["data8"], actor, batch, with_layout=True)
    for scope, want in (("global", want_global), ("shard", want_shard)):
        first = runs[scope][1][0]
        assert int(first["m2po/masked_tokens"]) == want, scope
        np.testing.assert_allclose(first["m2po/masked_fraction"], want / valid.sum(), rtol=1e-6)
    params, metrics = runs["shard"]
    assert all(np.isfinite(m["loss"]) and int(m["train/nonfinite"]) == 0 for m in metrics)
    moved = max(
        float(np.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(initial), strict=True)
    )
    assert moved > 1e-4


def test_sharded_sampler_matches_unsharded_tokens():
    params = model_lib.init_params(MODEL, jax.random.key(1))
    prompts, valid = sampling.pad_prompts([[5, 6, 7], [8, 9], [10], [11, 12, 13]] * 2, 0)
    config = sampling.SamplingConfig(max_new_tokens=5, temperature=1.0, stop_token_ids=(2,))
    rng = jax.random.key(3)
    ref = jax.device_get(sampling.generate(params, MODEL, prompts, valid, rng, config, 2))
    placement = placement_lib.Placement.from_shape(MESHES["2x2x2"], MODEL)
    sharded_params = placement.for_sampling(placement.put_params(params))
    g_prompts, g_valid = placement.to_global((prompts, valid))
    out = placement.to_host(
        sampling.generate(sharded_params, MODEL, g_prompts, g_valid, rng, config, 2)
    )
    np.testing.assert_array_equal(out.tokens_BxT, ref.tokens_BxT)
    np.testing.assert_allclose(out.behav_logp_BxT, ref.behav_logp_BxT, atol=1e-5)


def test_memory_plan_refuses_a_config_too_large_for_the_device(tmp_path):
    c = arith.get_config("m2po,tiny")
    c.mesh.data = 1
    c.mesh.device_memory_gib = 1e-4  # ~100 KiB: the tiny model's plan needs more
    cfg = config_lib.from_configdict(c)
    with pytest.raises(MemoryError, match="exceeds the device memory"):
        trainer_lib.Trainer(cfg, tmp_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(workdir, steps, env_extra, n_procs, extra=()):
    args = [
        sys.executable,
        "-m",
        "m2po_jax.cli.train",
        "--config=configs/arith.py:m2po,tiny",
        f"--workdir={workdir}",
        f"--config.total_steps={steps}",
        "--config.rollout.batch_size=8",
        "--config.task.format_reward=0.5",
        "--config.logging.tensorboard=False",
        *extra,
    ]
    port = _free_port()
    procs = []
    for pid in range(n_procs):
        env = dict(os.environ, JAX_PLATFORMS="cpu", **env_extra(pid, port))
        procs.append(
            subprocess.Popen(
                args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]


def _two_processes(devices_each):
    """`_train`'s environment of one of two processes with `devices_each` CPU devices."""

    def env(pid, port):
        return {
            "XLA_FLAGS": f"{FLAGS} --xla_force_host_platform_device_count={devices_each}",
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(pid),
        }

    return env


def _drill():
    spec = importlib.util.spec_from_file_location(
        "fault_drill", REPO / "benchmarks" / "fault_drill.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_signal_to_one_of_two_processes_stops_both_after_one_step_then_resumes_like_one(
    tmp_path,
):
    """SIGINT to process 1 only: both processes stop after the same step with one
    checkpoint and exit 130, the signal process 1 got (the runtime's preemption sync point,
    not a deadlock; process 0 reads the signal from the runtime's key-value store); the
    same command resumes to the end; the rows equal one process with both devices."""
    drill = _drill()
    # Steps of a fraction of a second here; a stop is agreed about a second after its signal
    # (the runtime's notifier polls once a second).
    steps = ("--config.total_steps=12",)
    stopped = drill.train_processes(
        tmp_path / "multi", 2, {1: "signal:2:INT"}, *steps, xla_flags=FLAGS
    )
    assert [r[0] for r in stopped] == [130, 130], stopped[0][2][-2000:] + stopped[1][2][-2000:]
    at = {drill._interrupted_step(r[1]) for r in stopped}
    assert len(at) == 1 and 2 <= at.pop() < 11
    assert "every process stops after the same step" in stopped[1][2]
    resumed = drill.train_processes(tmp_path / "multi", 2, None, *steps, xla_flags=FLAGS)
    assert [r[0] for r in resumed] == [0, 0], resumed[0][2][-3000:]

    def single(pid, port):
        return {"XLA_FLAGS": f"{FLAGS} --xla_force_host_platform_device_count=2"}

    _train(tmp_path / "single", 12, single, 1)
    multi_records = metrics_lib.read_metrics(tmp_path / "multi" / "metrics.jsonl")
    single_records = metrics_lib.read_metrics(tmp_path / "single" / "metrics.jsonl")
    assert [r["step"] for r in multi_records] == list(range(12))
    for a, b in zip(multi_records, single_records, strict=True):
        for key in ("train/param_norm", "loss", "reward/mean", "m2po/masked_fraction"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_a_killed_process_ends_the_other_in_one_line_with_exit_75(tmp_path):
    """SIGKILL of process 1: process 0 does not wait in a collective forever; it names the
    lost process in one line and exits 75 with its checkpoints intact."""
    drill = _drill()
    extra = ("--config.checkpoint.every=1",)
    ended = drill.train_processes(
        tmp_path, 2, {1: "kill:step:2"}, *extra, xla_flags=FLAGS, heartbeat_s=5
    )
    assert ended[1][0] == -signal.SIGKILL
    code, _, err, after = ended[0]
    lines = [x for x in err.splitlines() if x.startswith("m2po-train: lost process")]
    assert code == 75 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("m2po-train: lost process 1 of 2 (") and "checkpoints/2" in lines[0]
    assert after < 5 + 30  # the heartbeat, and the poll
    checkpointer = ckpt_lib.Checkpointer(tmp_path)
    assert checkpointer.all_steps() == [1, 2] and checkpointer.verify(2) is None


def test_two_processes_train_async_checkpoint_and_resume_without_losing_a_prompt(tmp_path):
    """2 processes x 4 CPU devices: each gives 2 devices to rollouts and 2 to training (a
    train mesh over both processes); a resume from a checkpoint taken while the workers
    ran ahead neither loses nor repeats a prompt, and no sample is staler than k = 2. The
    workers use the continuous engine, streaming up to 2 batches per call through the same
    slots and taking new weights in flight."""

    multi = _two_processes(4)
    extra = (
        "--config.rollout.mode=async",
        "--config.checkpoint.every=2",
        "--config.rollout.engine=continuous",
        "--config.rollout.stream_batches=2",
        "--config.rollout.inflight_updates=True",
        "--config.rollout.chunk_steps=1",
    )
    workdir = tmp_path / "async"
    _train(workdir, 6, multi, 2, extra)
    checkpointer = ckpt_lib.Checkpointer(workdir)
    assert checkpointer.all_steps() == [4, 6]
    meta = json.loads((checkpointer.step_dir(4) / "meta" / "metadata").read_text())
    assert meta["queue_len"] >= 1 and meta["data_position"] == (4 + meta["queue_len"]) * 8
    _train(workdir, 6, multi, 2, (*extra, "--restore_step=4"))  # 4 -> 6 again, from the buffer
    records = metrics_lib.read_metrics(workdir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(6))
    for r in records:
        assert r["data/first_prompt"] == 8 * r["step"] and r["data/prompts"] == 8, r
        assert 0 <= r["staleness/max"] <= 2 and sum(r["staleness/hist_k"]) == 8 * 4, r
        assert 0 <= r["staleness/token_mean"] <= r["staleness/max"], r
        assert np.isfinite(r["loss"])
    assert records[4]["staleness/max"] >= 1  # a batch made before the checkpoint
