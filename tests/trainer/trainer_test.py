"""End-to-end runs of the trainer on the tiny arithmetic preset."""

import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax import config as config_lib
from m2po_jax import trainer as trainer_lib
from m2po_jax.configs import arith
from m2po_jax.learner import batching
from m2po_jax.run import metrics as metrics_lib
from m2po_jax.trainer import sft

CONTRACT_KEYS = (
    "step",
    "reward/mean",
    "m2po/masked_fraction",
    "m2po/m2_before",
    "m2po/m2_after",
    "staleness/mean",
)


def tiny_config(preset="m2po,tiny", **changes):
    c = arith.get_config(preset)
    # Partial credit for well-formed answers: an untrained tiny policy gets varied rewards.
    c.task.format_reward = 0.5
    c.mesh.data = 1  # one device (the sharded runs have their own tests)
    config_lib.apply_dotted(c, changes)
    return config_lib.from_configdict(c)


def read(workdir):
    return metrics_lib.read_metrics(workdir / "metrics.jsonl")


def strip_times(records):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight")
    trainer = trainer_lib.Trainer(tiny_config(**{"logging.plots": True}), workdir)
    result = trainer.run()
    return workdir, trainer, result


def test_end_to_end_writes_contract_metrics_and_checkpoints(straight_run):
    workdir, trainer, result = straight_run
    records = read(workdir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records:
        for key in CONTRACT_KEYS:
            assert key in r, key
        assert np.isfinite(r["loss"])
    # Evaluations at step 0, every eval.every (2) and at the last step.
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 1, 3]
    # Stale-2 queue: step 0 and 1 train on version-0 batches, then staleness is 2.
    assert [r["staleness/mean"] for r in records] == [0.0, 1.0, 2.0, 2.0]
    assert result.final_step == 4
    assert trainer.checkpointer.latest_step() == 4
    assert (workdir / "tensorboard").is_dir()
    for panel in ("summary", "m2", "loss", "grad_norm", "entropy"):  # the run's own plots
        assert (workdir / f"{panel}.png").read_bytes()[:4] == b"\x89PNG", panel


# loss, reward/mean, train/param_norm of the straight run's steps 0-3, as the trainer
# computed them before async rollouts existed (commit 83be609): sync mode is unchanged.
SYNC_BEFORE_ASYNC = [
    (-0.004632968455553055, 0.1875, 10.006616592407227),
    (-0.04583622142672539, 0.1875, 10.006958961486816),
    (0.04047202318906784, 0.1875, 10.0071382522583),
    (-0.08312029391527176, 0.125, 10.007341384887695),
]


def test_sync_mode_reproduces_the_results_from_before_async_rollouts(straight_run):
    workdir, _, _ = straight_run
    got = [(r["loss"], r["reward/mean"], r["train/param_norm"]) for r in read(workdir)]
    np.testing.assert_allclose(got, SYNC_BEFORE_ASYNC, rtol=1e-6, atol=1e-7)


def test_sigterm_checkpoint_and_resume_match_a_straight_run(straight_run, tmp_path):
    straight_dir, straight, _ = straight_run
    cfg = tiny_config()
    first = trainer_lib.Trainer(cfg, tmp_path)
    real_step = first.train_step

    def step_then_sigterm(state, batch, rng, ref_params):
        step = int(state.step)  # read before the step donates the state
        out = real_step(state, batch, rng, ref_params)
        if step == 1:
            signal.raise_signal(signal.SIGTERM)
        return out

    first.train_step = step_then_sigterm
    result = first.run()
    assert result.interrupted and result.final_step == 2
    assert first.checkpointer.latest_step() == 2

    resumed = trainer_lib.Trainer(cfg, tmp_path)
    result = resumed.run()
    assert result.final_step == 4 and not result.interrupted
    assert strip_times(read(tmp_path)) == strip_times(read(straight_dir))
    for a, b in zip(
        jax.tree.leaves(resumed.state.params), jax.tree.leaves(straight.state.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sigterm_in_the_warmup_stops_after_that_warmup_step_and_the_resume_continues_it(
    straight_run, tmp_path, monkeypatch
):
    """The tiny preset warms up for 4 steps: SIGTERM during warm-up step 2 stops after it
    with a checkpoint of the warm-up (params and AdamW state at step 0), and the resumed run
    (warm-up steps 3-4, then RL) equals a straight one, rows and params."""
    straight_dir, straight, _ = straight_run
    cfg = tiny_config()
    real_batch = sft.sft_batch
    calls, fired = [], []

    def batch_then_sigterm(run, start, count):
        calls.append(start)
        if len(calls) == 2 and not fired:
            fired.append(start)
            signal.raise_signal(signal.SIGTERM)
        return real_batch(run, start, count)

    monkeypatch.setattr(sft, "sft_batch", batch_then_sigterm)
    bars = []  # warm-up batches made when the RL progress bar opened: after the warm-up only
    real_bar = metrics_lib.ProgressBar
    monkeypatch.setattr(
        metrics_lib, "ProgressBar", lambda *a, **k: bars.append(len(calls)) or real_bar(*a, **k)
    )
    first = trainer_lib.Trainer(cfg, tmp_path)
    result = first.run()
    assert result.interrupted and result.signal == signal.SIGTERM and result.final_step == 0
    assert bars == []  # stopped in the warm-up: no RL bar was drawn under its lines
    assert len(calls) == 2 and first.sft_steps == 2
    assert first.checkpointer.all_steps() == [0]
    assert first.checkpointer.meta(0)["warmup_unfinished"] is True
    assert not (tmp_path / "metrics.jsonl").exists() or read(tmp_path) == []

    calls.clear()
    resumed = trainer_lib.Trainer(cfg, tmp_path)
    result = resumed.run()
    assert not result.interrupted and result.final_step == 4
    assert calls == [2 * cfg.sft.batch_size, 3 * cfg.sft.batch_size]  # steps 3 and 4 only
    assert bars == [2]  # the bar opened once, after both warm-up steps
    assert resumed.sft_steps == straight.sft_steps and resumed.sft_log == straight.sft_log
    assert strip_times(read(tmp_path)) == strip_times(read(straight_dir))
    for a, b in zip(
        jax.tree.leaves(resumed.state.params), jax.tree.leaves(straight.state.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_m2po_masks_stale_rollouts(tmp_path):
    tau = 1e-4
    stale = trainer_lib.Trainer(
        tiny_config("m2po,tiny", **{"actor.m2_threshold": tau, "actor.optimizer.lr": 1e-3}),
        tmp_path / "stale",
    )
    stale.run()
    records = read(tmp_path / "stale")
    # Steps >= 1 train on batches made before an update: the behaviour and proximal
    # policies differ and M2PO drops tokens.
    assert max(r["m2po/masked_fraction"] for r in records[1:]) > 0
    for r in records:
        # docs/algorithm.md (lt rule): the kept tokens' mean m2 is below tau, except when
        # even the smallest m2 alone is not: then exactly that one token is kept.
        kept = r["train/tokens"] - r["m2po/masked_tokens"]
        assert r["m2po/nonfinite_tokens"] == 0
        assert kept >= 1
        assert r["m2po/m2_after"] < tau or kept == 1, r
        # Tokens are dropped only when the whole batch's mean is not below tau.
        assert (r["m2po/masked_tokens"] > 0) == (r["m2po/m2_before"] >= tau), r
    # Step 0 trains on version 0's batch (fresh), the later steps on older ones (stale):
    # then the stale tokens carry the whole second moment and every drop.
    assert records[0]["mismatch/fresh/tokens"] == records[0]["train/tokens"]
    for r in records[1:]:
        assert (r["mismatch/fresh/tokens"], r["mismatch/m2_fresh_share"]) == (0, 0.0), r
        assert r["mismatch/stale/tokens"] == r["train/tokens"]
        np.testing.assert_allclose(r["mismatch/stale/m2"], r["m2po/m2_before"], rtol=1e-5)
        assert r["mismatch/stale/m2po_dropped"] == r["m2po/masked_fraction"]


def test_on_policy_float32_rollouts_show_no_engine_trainer_mismatch(tmp_path):
    """The issue's same-weights check: float32 weights, the static sampler's rollouts
    trained at once (k = 0) by the real step (its proximal pass): every token is fresh,
    behaviour and recomputed log-probs agree to float32 rounding, M2PO does nothing."""
    on_policy = trainer_lib.Trainer(
        tiny_config(
            "m2po,tiny", **{"actor.m2_threshold": 1e-4, "rollout.max_head_offpolicyness": 0}
        ),
        tmp_path / "on",
    )
    assert on_policy.cfg.model.dtype == "float32" and on_policy.cfg.rollout.mode == "sync"
    on_policy.run()
    records = read(tmp_path / "on")
    assert [r["staleness/mean"] for r in records] == [0.0] * 4
    assert all(r["m2po/masked_fraction"] == 0 for r in records)
    assert all(r["m2po/m2_before"] < 1e-8 for r in records)
    for r in records:
        assert r["train/prox_pass"] == 1  # the tiny preset's two minibatches
        assert r["mismatch/stale/tokens"] == 0
        assert r["mismatch/fresh/tokens"] == r["train/tokens"] > 0
        assert r["mismatch/fresh/abs_mean"] < 1e-5, r
        assert r["mismatch/fresh/m2po_drop_alone"] == r["mismatch/fresh/m2po_dropped"] == 0


def test_a_new_mixture_of_experts_from_the_config_trains_on_policy_without_mismatch(tmp_path):
    """arith's `moe` preset on `tiny`: a new Qwen3-MoE (8 experts of 8, top-2) whose
    param tree holds the stacked experts and the router, no dense MLP; three on-policy
    float32 steps with finite losses, rollouts whose behaviour log-probs the trainer's
    pass recomputes to float32 rounding, and every layer's experts updated."""
    trainer = trainer_lib.Trainer(
        tiny_config("m2po,tiny,moe", **{"total_steps": 3, "sft.max_steps": 0,
                    "rollout.max_head_offpolicyness": 0, "eval.every": 0}),
        tmp_path,
    )  # fmt: skip
    c = trainer.model_config
    assert (c.model_type, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (
        "qwen3_moe",
        8,
        2,
        8,
    )
    first = {}
    step = trainer.train_step

    def watched(state, *args):
        if not first:
            first.update(jax.device_get(state.params["layers_0"]["mlp"]))
        return step(state, *args)

    trainer.train_step = watched
    trainer.run()
    mlp = jax.device_get(trainer.state.params["layers_0"]["mlp"])
    shapes = {name: x.shape for name, x in mlp.items()}
    assert shapes == {
        "router_kernel": (32, 8),
        "gate_experts": (8, 32, 8),
        "up_experts": (8, 32, 8),
        "down_experts": (8, 8, 32),
    }
    records = read(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in records)
    assert all(r["mismatch/fresh/abs_mean"] < 1e-5 for r in records)
    assert np.max(np.abs(mlp["down_experts"] - first["down_experts"])) > 0


def test_bfloat16_rollout_weights_show_a_mismatch_far_above_float32_rounding(tmp_path):
    """The same run with the rollout engine's weights in bfloat16 (`rollout.weight_dtype`):
    every token is still fresh, and the engine/trainer gap is the cast's. Measured on this
    tiny model: mean |behav - prox| 3.4e-4 and 3.7e-4 per step (float32: 3e-8 to 8e-8)."""
    cast = trainer_lib.Trainer(
        tiny_config(
            "m2po,tiny",
            **{
                "actor.m2_threshold": 1e-4,
                "rollout.max_head_offpolicyness": 0,
                "rollout.weight_dtype": "bfloat16",
                "total_steps": 2,
            },
        ),
        tmp_path / "bf16",
    )
    cast.run()
    for r in read(tmp_path / "bf16"):
        assert r["mismatch/stale/tokens"] == 0
        assert r["mismatch/fresh/tokens"] == r["train/tokens"] > 0
        assert 1e-4 < r["mismatch/fresh/abs_mean"] < 1e-2, r
        assert r["mismatch/fresh/m2"] > 1e-8


def test_an_injected_step_trains_on_the_stale_batches_and_fills_the_rows(tmp_path):
    calls = []

    def fake_step(state, batch, rng, ref_params):
        calls.append(
            (int(state.step), np.asarray(batch.version_B), np.asarray(jax.random.key_data(rng)))
        )
        assert ref_params is None  # no KL penalty in this config
        metrics = {"loss": jnp.float32(10 * len(calls)), "train/nonfinite": jnp.int32(0)}
        return state.replace(step=state.step + 1), metrics

    cfg = tiny_config(**{"sft.max_steps": 0})
    trainer = trainer_lib.Trainer(cfg, tmp_path, train_step=fake_step)
    assert trainer.train_step is fake_step
    result = trainer.run()
    assert result.final_step == 4 and trainer.checkpointer.latest_step() == 4
    assert [step for step, _, _ in calls] == [0, 1, 2, 3]
    # Stale-2: step s trains on the batch generated by policy version max(s - 2, 0).
    rows = cfg.rollout.batch_size * cfg.gconfig.n_samples
    for step, versions, _ in calls:
        np.testing.assert_array_equal(versions, np.full(rows, max(step - 2, 0)))
    assert len({key.tobytes() for _, _, key in calls}) == 4  # a new key every step
    records = read(tmp_path)
    assert [r["loss"] for r in records] == [10.0, 20.0, 30.0, 40.0]
    assert [r["staleness/mean"] for r in records] == [0.0, 1.0, 2.0, 2.0]


def test_repeated_non_finite_steps_stop_with_a_checkpoint(tmp_path):
    trainer = trainer_lib.Trainer(tiny_config(), tmp_path)
    real_step = trainer.train_step
    seen = []  # host copies of the params each RL step received (the state is donated)

    def poisoned(state, batch, rng, ref_params):
        seen.append(jax.tree.map(lambda x: np.array(x, copy=True), state.params))
        batch = batch.replace(rewards_B=batch.rewards_B * np.nan)
        return real_step(state, batch, rng, ref_params)

    trainer.train_step = poisoned
    with pytest.raises(trainer_lib.NonFiniteError, match="3 consecutive steps"):
        trainer.run()
    # Metrics arrive a step late: the third skipped step is seen after the fourth was
    # dispatched (skipped too), and that one has its row and is in the checkpoint.
    assert trainer.checkpointer.latest_step() == 4
    assert len(seen) == 4
    # Every skipped step left the post-warm-up params untouched, and the checkpoint holds them.
    restored = trainer_lib.Trainer(tiny_config(), tmp_path)
    assert restored.try_resume()
    assert int(restored.state.nonfinite_steps) == 4
    for params in (seen[1], seen[2], seen[3], jax.tree.map(np.asarray, restored.state.params)):
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(seen[0]), strict=True):
            np.testing.assert_array_equal(a, b)
    records = read(tmp_path)
    # The failing step has its row too: a resumed run's metrics skip no step.
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["train/nonfinite"] == 1 for r in records)


def test_kl_penalty_against_the_reference_policy_trains_and_resumes(tmp_path):
    cfg = tiny_config(**{"actor.kl_ctl": 0.1, "actor.kl_estimator": "k3"})
    first = trainer_lib.Trainer(cfg, tmp_path)
    first.run(stop_after=2)
    assert first.ref_params is not None
    resumed = trainer_lib.Trainer(cfg, tmp_path)
    resumed.run()
    # The reference policy is the post-warm-up policy, restored from the checkpoint.
    for a, b in zip(
        jax.tree.leaves(resumed.ref_params), jax.tree.leaves(first.ref_params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    records = read(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in records)


def test_steps_train_on_the_generated_columns_only(tmp_path):
    # Every batch is cut to the smallest bucket that holds its longest completion (an
    # untrained policy may fill the buffer: then the bucket is the buffer), losing nothing.
    seen = []

    def recording_step(state, batch, rng, ref_params):
        seen.append((np.asarray(batch.valid_BxT), np.asarray(batch.loss_mask_BxT)))
        metrics = {"loss": jnp.float32(0.0), "train/nonfinite": jnp.int32(0)}
        return state.replace(step=state.step + 1), metrics

    cfg = tiny_config(**{"sft.max_steps": 0, "gconfig.max_new_tokens": 40})
    trainer = trainer_lib.Trainer(cfg, tmp_path, train_step=recording_step)
    trainer.run()
    prompt = cfg.task.max_prompt_len
    records = read(tmp_path)
    assert len(seen) == len(records) == 4
    for (valid, loss_mask), record in zip(seen, records, strict=True):
        longest = int(valid[:, prompt:].sum(axis=1).max())
        width = batching.completion_width(longest, 40)
        assert valid.shape[1] == prompt + width <= prompt + 40
        # Nothing generated was cut: the record counts the untrimmed batch's completions.
        rows = valid.shape[0]
        assert valid[:, prompt:].sum() == round(record["rollout/completion_len_mean"] * rows)
        assert record["train/completion_width"] == width
        pad = 1 - loss_mask.sum() / (loss_mask.shape[0] * width)
        assert record["train/padding_fraction"] == pytest.approx(pad)


def text_reward(completion: str, answer: str) -> float:
    """A reward that differs between greedy completions (a wrong answer has one too)."""
    return float(sum(map(ord, completion)) % 5)


def test_the_continuous_and_paged_engines_train_as_the_static_sampler_with_greedy_decoding(
    tmp_path,
):
    """Greedy rollouts are the same whichever engine makes them, so a run with the
    continuous or the paged engine (4 slots for 16 rows per batch) trains exactly as the
    static one:
    same losses, rewards and params (batch-centred rewards of the completions' text, so the
    greedy groups of equal completions still have advantages)."""
    changes = {
        "gconfig.greedy": True,
        "actor.reward_norm.mean_level": "batch",
        "total_steps": 3,
        "sft.max_steps": 12,
        "task.reward_fn": "trainer_test:text_reward",
        # held-out accuracy (and the warm-up's stop) by the task's verifier, not this reward
        "eval.reward": "verifier",
    }
    static = trainer_lib.Trainer(tiny_config(**changes), tmp_path / "static")
    static.run()
    want = read(tmp_path / "static")
    assert max(abs(r["loss"]) for r in want) > 0  # the updates are not all zero
    # The paged engine with a pool short of one whole batch: sequences are preempted.
    paged = {"rollout.kv_pages": 19, "rollout.page_size": 2, "eval.batch_size": 4}
    for engine, extra in (("continuous", {}), ("paged", paged)):
        other = trainer_lib.Trainer(
            tiny_config(
                **changes, **{"rollout.engine": engine, "rollout.engine_slots": 4}, **extra
            ),
            tmp_path / engine,
        )
        assert other.setup.engine.name == engine
        other.run()
        keys = ("loss", "reward/mean", "train/param_norm", "rollout/completion_len_mean")
        got = read(tmp_path / engine)
        assert len(got) == len(want) == 3
        for a, b in zip(got, want, strict=True):
            for key in keys:
                np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-7, err_msg=key)
            assert a["staleness/token_mean"] == b["staleness/token_mean"]
            for r in (a, b):  # every engine reports its decode counters
                assert 0 <= r["rollout/decode_idle_fraction"] <= 1
                assert r["rollout/decode_steps"] >= 0
            for name in ("continuous", "paged"):
                flag = f"rollout/{name}_engine"
                assert (a[flag], b[flag]) == (float(engine == name), 0.0), flag
        if engine == "paged":
            assert sum(r["rollout/preemptions"] for r in got) > 0, got
        for a, b in zip(
            jax.tree.leaves(other.state.params), jax.tree.leaves(static.state.params), strict=True
        ):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("budget, paged", [(127, False), (128, True)])
def test_the_auto_engine_is_paged_from_a_long_completion_budget(tmp_path, budget, paged):
    """rollout.engine=auto (the default): short completions (which end together) through
    the static sampler, long ones (whose lengths spread) through the paged engine."""
    cfg = tiny_config(**{"gconfig.max_new_tokens": budget})
    assert cfg.rollout.engine == "auto"
    want = "paged" if paged else "static"
    assert config_lib.rollout_engine(cfg) == want
    trainer = trainer_lib.Trainer(cfg, tmp_path)
    assert trainer.setup.engine.name == want
    # A setting only the continuous-batching engines have is refused with "auto" short.
    if not paged:
        with pytest.raises(config_lib.ConfigError, match=r"engine=auto -> static\)"):
            tiny_config(**{"gconfig.max_new_tokens": budget, "rollout.mode": "async",
                           "rollout.inflight_updates": True})  # fmt: skip


def test_the_warm_up_keeps_at_most_two_steps_in_flight(monkeypatch):
    """Unbounded, the host queued a warm-up step per batch until the next evaluation; on a
    host with few cores and 8 fake CPU devices one step's all-reduce then waited past
    XLA:CPU's 40 s rendezvous timeout and the process aborted (a whole-suite run died in
    the LoRA run's warm-up). Each step waits for the one before the last."""
    from types import SimpleNamespace

    pending, most = [], [0]

    class Loss:  # a dispatched step's loss: done once waited on (in order, as a stream)
        def block_until_ready(self):
            if self in pending:
                del pending[: pending.index(self) + 1]
            return self

        def __float__(self):
            self.block_until_ready()
            return 1.0

    def fake_step(params, opt_state, *batch):
        loss = Loss()
        pending.append(loss)
        most[0] = max(most[0], len(pending))
        return params, opt_state, loss

    monkeypatch.setattr(sft, "make_sft_step", lambda *a, **k: fake_step)
    monkeypatch.setattr(sft, "sft_batch", lambda run, start, count: ())
    s = SimpleNamespace(max_steps=30, batch_size=1, eval_every=30, stop_at_accuracy=2.0, lr=0.1)
    run = SimpleNamespace(
        cfg=SimpleNamespace(sft=s),
        model_config=None,
        placement=SimpleNamespace(mesh=None, to_global=lambda batch: batch),
    )
    resume = sft.Warmup(params={}, steps=0, log=[], opt_state={})
    done = sft.supervised_warmup(run, {}, lambda params: 0.0, resume=resume)
    assert done.steps == 30 and most[0] == 2


def test_a_warm_up_answer_longer_than_the_budget_is_cut_and_said(monkeypatch):
    """The reference answer is trained up to gconfig.max_new_tokens (its end and EOS are
    not), and the run says so: a cut is never silent."""
    from types import SimpleNamespace

    said = []
    monkeypatch.setattr(
        sft.logging, "log_first_n", lambda level, msg, n, *args: said.append(msg % args)
    )
    tok = SimpleNamespace(pad_id=256, bos_id=257, eos_id=258, encode=lambda t: list(t.encode()))
    pairs = [("1+1=", "2"), ("2+2=", "four, surely")]  # 1 + EOS fits 4; 12 + EOS does not
    run = SimpleNamespace(
        tokenizer=tok,
        cfg=SimpleNamespace(
            task=SimpleNamespace(max_prompt_len=6), gconfig=SimpleNamespace(max_new_tokens=4)
        ),
        task=SimpleNamespace(sft_examples=lambda start, count: pairs[start : start + count]),
        prompts=SimpleNamespace(encode=lambda text: [tok.bos_id, *tok.encode(text)]),
    )
    tokens, valid, target = sft.sft_batch(run, 0, 2)
    assert list(tokens[0, 6:]) == [ord("2"), tok.eos_id, tok.pad_id, tok.pad_id]
    assert list(tokens[1, 6:]) == list(b"four") and target[1, 6:].all()
    assert len(said) == 1 and "1 of 2 reference answers (examples 0..) are longer than" in said[0]
    assert "gconfig.max_new_tokens=4" in said[0]
    sft.sft_batch(run, 0, 1)  # nothing cut: nothing said
    assert len(said) == 1


def test_int8_rollout_weights_generate_each_step_and_their_log_probs_are_the_copy_s(tmp_path):
    """rollout.weight_dtype=int8, sync: every step's rollout runs the int8 copy of that
    step's params under the rollout model config (the behaviour log-probs the step trains
    on are that model's, not the float one's), the copy is gone while the step trains,
    evaluation runs the trained weights, and the memory plan counts the copy's bytes."""
    from m2po_jax.models import model as model_lib
    from m2po_jax.models import quant

    cfg = tiny_config(
        **{
            "rollout.weight_dtype": "int8",
            "rollout.max_head_offpolicyness": 1,
            "sft.max_steps": 0,
            "total_steps": 3,
            "checkpoint.every": 0,
        }
    )
    trainer = trainer_lib.Trainer(cfg, tmp_path)
    rollout_config = trainer.setup.engine.model_config
    assert rollout_config == trainer.model_config.replace(weight_quant="int8")
    seen = []
    jitted = trainer.train_step

    def spy(state, batch, rng, ref_params):
        params = jax.tree.map(np.asarray, state.params)
        seen.append((params, jax.device_get(batch), trainer.rollout_weights.held))
        return jitted(state, batch, rng, ref_params)

    trainer.train_step = spy
    assert trainer.run().final_step == 3
    # The fill's, then one per step (dropped after the fill: step 0 evaluates first).
    assert trainer.rollout_weights.made == 4
    assert not any(held for _, _, held in seen)
    # Stale-1: step 2 trains on the batch step 1 generated with the params it trained from.
    params, batch, _ = seen[2]
    np.testing.assert_array_equal(batch.version_B, 1)
    temperature = cfg.gconfig.temperature
    mask = np.asarray(batch.loss_mask_BxT)

    def forward(weights, config):
        logits = model_lib.apply(weights, config, batch.tokens_BxT, valid_BxT=batch.valid_BxT)
        return np.asarray(model_lib.token_logp(logits, batch.tokens_BxT, temperature))[mask]

    copy = quant.convert_weights(seen[1][0], "int8")
    behav = np.asarray(batch.behav_logp_BxT)[mask]
    np.testing.assert_allclose(behav, forward(copy, rollout_config), atol=2e-5, rtol=0)
    assert np.max(np.abs(behav - forward(seen[1][0], trainer.model_config))) > 1e-4
    records = read(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["eval/accuracy"]) for r in records[::2])
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(copy))
    assert trainer.memory_plan.sampling_weights == nbytes
