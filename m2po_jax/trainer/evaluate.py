"""Held-out evaluation: greedy completions of the task's eval examples, scored by its verifier."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from m2po_jax.rollout import batches as rollout_lib
from m2po_jax.trainer.setup import RunSetup


def evaluate(run: RunSetup, params, rng: jax.Array) -> float:
    """Fraction of the first `eval.num_examples` eval examples whose greedy answer verifies.

    The task's verifier decides (1 = right), not a custom `task.reward_fn`. Examples go in
    chunks of `eval.batch_size`; the last chunk is padded so every call has one shape.
    """
    cfg = run.cfg
    greedy = dataclasses.replace(run.sampling_config, greedy=True)
    verify = lambda example, text: run.task.verify(text, example.answer)
    params = run.placement.for_sampling(params)
    examples = run.task.eval_examples()[: cfg.eval.num_examples]
    size = cfg.eval.batch_size
    correct = []
    for start in range(0, len(examples), size):
        chunk = examples[start : start + size]
        # Pad the last chunk so every call has the same shape (no recompile).
        padded = chunk + [chunk[-1]] * (size - len(chunk))
        batch, _ = rollout_lib.generate_rollout(
            params,
            run.model_config,
            greedy,
            padded,
            run.prompts,
            verify,
            rng,
            n_samples=1,
            version=0,
            max_prompt_len=cfg.task.max_prompt_len,
            placement=run.placement,
        )
        correct.extend((batch.rewards_B[: len(chunk)] >= 1.0).tolist())
    return float(np.mean(correct))
