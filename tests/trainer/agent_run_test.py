"""Multi-turn tool use through the trainer (configs/arith.py:calculator): on-policy the
trainer's log-probs are the engine's on every assistant token, async runs take weights
between turns and resume without losing or repeating an episode, and the demonstration
learns to call its calculator."""

import threading
import time

import numpy as np

from m2po_jax import config as config_lib
from m2po_jax import trainer as trainer_lib
from m2po_jax.configs import arith
from m2po_jax.run import metrics as metrics_lib
from m2po_jax.tasks import environments


class Echo(environments.Environment):
    """Answers each of the first two turns with its length: every episode has appended
    answers between its turns, whatever the (barely trained) policy writes."""

    def __init__(self):
        self.turns = 0

    def step(self, text):
        self.turns += 1
        if self.turns > 2:
            return environments.StepResult([], done=True)
        return environments.StepResult([{"role": "tool", "content": str(len(text))}])


ECHO = {"agent.env": "agent_run_test:Echo", "agent.max_turns": 3, "gconfig.max_new_tokens": 40}


def run_leaves_no_threads(trainer, **kwargs):
    """`trainer.run(**kwargs)`, then the agent's environment and tool threads and its event
    loop that the run started have ended (a notebook's runs would otherwise pile them up)."""
    before = set(threading.enumerate())
    result = trainer.run(**kwargs)
    end = time.monotonic() + 5.0
    while time.monotonic() < end:
        left = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("m2po-")]
        if not left:
            return result
        time.sleep(0.05)
    raise AssertionError(f"threads the run left running: {sorted(left)}")


def calculator_config(presets="calculator,tiny", **changes):
    c = arith.get_config(presets)
    c.logging.tensorboard = False
    c.logging.progress = False
    config_lib.apply_dotted(c, changes)
    return config_lib.from_configdict(c)


def test_on_policy_the_trainer_recomputes_the_engine_s_log_probs_on_assistant_tokens(tmp_path):
    """k = 0: the proximal policy is the one that sampled, so the M2PO statistic (behaviour
    vs recomputed log-prob, over the loss mask) is zero up to float error on every step,
    with tool answers appended in the rows (a mask that took them in, or a cache that
    disagreed with a forward over the row, would not be)."""
    cfg = calculator_config(
        "grpo,calculator,tiny",
        **{"total_steps": 3, "rollout.batch_size": 8, "eval.every": 0, "mesh.data": 1, **ECHO},
    )
    run_leaves_no_threads(trainer_lib.Trainer(cfg, tmp_path))
    records = metrics_lib.read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["episode/turns_mean"] > 2.0  # most episodes: three turns, two answers
        assert r["m2po/m2_before"] < 1e-9, r["m2po/m2_before"]
        assert r["staleness/token_mean"] == 0.0
        statuses = sum(v for k, v in r.items() if k.startswith("episode/status/"))
        assert abs(statuses - 1.0) < 1e-6


def test_async_episodes_take_weights_between_turns_and_resume_without_a_lost_episode(
    tmp_path,
):
    """Async with in-flight updates (1 rollout + 1 train device): stopped after 3 steps
    with batches buffered and resumed to 6; every step trains the next batch's episodes
    once, no assistant token is staler than k."""
    k, prompts = 2, 8
    cfg = calculator_config(
        **{
            "total_steps": 6,
            "rollout.mode": "async",
            "rollout.batch_size": prompts,
            "rollout.inflight_updates": True,
            "rollout.chunk_steps": 2,
            "rollout.max_head_offpolicyness": k,
            "eval.every": 0,
            "mesh.rollout_devices": 1,
            "mesh.data": 1,
            **ECHO,
        }
    )
    stopped = run_leaves_no_threads(trainer_lib.Trainer(cfg, tmp_path), stop_after=3)
    assert stopped.final_step == 3
    assert run_leaves_no_threads(trainer_lib.Trainer(cfg, tmp_path)).final_step == 6
    records = metrics_lib.read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(6))
    for r in records:
        assert r["data/first_prompt"] == r["step"] * prompts and r["data/prompts"] == prompts
        assert 0 <= r["staleness/min"] <= r["staleness/max"] <= k
        assert 0 <= r["staleness/token_mean"] <= k
        assert np.isfinite(r["reward/mean"])
    # Episodes generated in this process report their outcomes (the batches a resume
    # restores from the checkpoint carry their tokens, not their statuses), and the worker
    # took newer weights between turns.
    made_here = [r for r in records if "episode/turns_mean" in r]
    assert len(made_here) >= 4 and all(r["episode/turns_mean"] > 1.5 for r in made_here)
    assert sum(r.get("rollout/inflight_updates", 0) for r in records) >= 1


def test_the_calculator_demonstration_learns_to_call_its_tool(tmp_path):
    """configs/arith.py:calculator at a sixth of its size, on one device: after the warm-up
    (a fifth of its examples demonstrate the call) ten RL steps make greedy episodes call
    the calculator (>= 0.6 calls per episode, more than before) and get 2-3 digit products
    right more often (+0.2 held-out accuracy). Measured by seed (c.seed 0-4, on a 2-core
    x86 machine): accuracy 0.34 -> 0.61, 0.02 -> 0.50, 0.00 -> 0.53, 0.06 -> 0.50,
    0.08 -> 0.58; calls 0.52 -> 1.00, 0.05 -> 0.73, 0.00 -> 0.95, 0.09 -> 0.80,
    0.09 -> 0.98. (Seed 0 warmed up to 0.34 here, where another machine's rounding gave
    under 0.3: a +0.3 gain and fewer than 0.6 calls before were one machine's figures.)"""
    cfg = calculator_config(
        "calculator",
        **{
            "total_steps": 10,
            "eval.every": 5,
            "eval.num_examples": 64,
            "eval.batch_size": 64,
            "rollout.batch_size": 32,
            "sft.max_steps": 200,
            "task.tool_demos": 0.2,
            "checkpoint.every": 0,
            "logging.plots": False,
            "mesh.data": 1,
        },
    )
    run_leaves_no_threads(trainer_lib.Trainer(cfg, tmp_path))  # the tool pool's too
    records = metrics_lib.read_metrics(tmp_path / "metrics.jsonl")
    evals = [
        (r["step"], r["eval/accuracy"], r["eval/tool_calls_mean"])
        for r in records
        if "eval/accuracy" in r
    ]
    (_, accuracy0, calls0), (_, accuracy, calls) = evals[0], evals[-1]
    assert accuracy >= accuracy0 + 0.2 and calls >= 0.6 and calls > calls0, evals
    sampled = [r["episode/tool_calls_mean"] for r in records]
    assert np.mean(sampled[-3:]) > np.mean(sampled[:3]) + 0.2, sampled
