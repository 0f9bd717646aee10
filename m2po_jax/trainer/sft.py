"""The supervised warm-up: a few steps of next-token likelihood on the task's reference answers.

It makes an untrained policy sometimes right, so that RL has rewards to work with
(`cfg.sft`); the RL run then starts from the warmed-up params with a fresh optimizer.
Under LoRA it trains the base on a float base, the adapters on a quantised one
(`warmup_split`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from m2po_jax.learner import logprobs
from m2po_jax.models import lora
from m2po_jax.models.model_config import ModelConfig
from m2po_jax.parallel import sharding
from m2po_jax.run import metrics as metrics_lib
from m2po_jax.trainer.setup import RunSetup


def sft_loss(params, model_config, tokens_BxT, valid_BxT, target_mask_BxT):
    """Mean negative log-likelihood of the target tokens (supervised warm-up)."""
    logp, _ = logprobs.sequence_logp(
        params, model_config, tokens_BxT, valid_BxT, 1.0, logprobs.DEFAULT_CHUNK, False
    )
    count = jnp.maximum(jnp.sum(target_mask_BxT), 1)
    return -jnp.sum(logp * target_mask_BxT) / count


def make_sft_step(model_config, tx, mesh=None):
    """Jitted supervised step: (params, opt_state, tokens, valid, target) -> (params, opt_state, loss).

    `mesh`: the run's train mesh, the devices the step is compiled for (`sharding.on_mesh`).
    Under LoRA the warm-up trains the base, or under a quantised base the adapters
    (`warmup_split`); what it leaves is passed to the jitted step, not donated.
    """

    def step(trainable, opt_state, frozen, tokens_BxT, valid_BxT, target_mask_BxT):
        def loss_fn(trainable):
            full = lora.merge(trainable, frozen)
            return sft_loss(full, model_config, tokens_BxT, valid_BxT, target_mask_BxT)

        loss, grads = jax.value_and_grad(loss_fn)(trainable)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss

    jitted = jax.jit(sharding.on_mesh(step, mesh), donate_argnums=(0, 1))

    def sft_step(params, opt_state, tokens_BxT, valid_BxT, target_mask_BxT):
        trainable, frozen = warmup_split(params, model_config)
        trainable, opt_state, loss = jitted(
            trainable, opt_state, frozen, tokens_BxT, valid_BxT, target_mask_BxT
        )
        return lora.merge(trainable, frozen), opt_state, loss

    def lower(params, opt_state, *batch):  # the compile-only check lowers the jitted step
        trainable, frozen = warmup_split(params, model_config)
        return jitted.lower(trainable, opt_state, frozen, *batch)

    sft_step.lower = lower
    return sft_step


def sft_batch(run: RunSetup, start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, valid, target) [count, max_prompt_len + max_new_tokens] of examples from `start`.

    Prompts are encoded as in rollouts and left-padded to `task.max_prompt_len` (longer ones
    keep their last tokens, as `task.long_prompts='left'` does in rollouts); the answer plus
    EOS follows, cut at `gconfig.max_new_tokens` (said in a warning, once), and only its
    tokens are targets. A multi-turn task's answer is an episode's segments
    (`tasks.calculator.CalculatorTask.sft_examples`): its assistant turns are the targets.
    """
    tokenizer = run.tokenizer
    width = run.cfg.task.max_prompt_len
    new = run.cfg.gconfig.max_new_tokens
    tokens = np.full((count, width + new), tokenizer.pad_id, np.int32)
    valid = np.zeros_like(tokens, bool)
    target = np.zeros_like(tokens, bool)
    cut = 0
    for row, (prompt, answer) in enumerate(run.task.sft_examples(start, count)):
        p = run.prompts.encode(prompt)[-width:]
        c, t = [], []
        # An answer, or an episode's segments: (text, True) an assistant turn (a target,
        # with its EOS), (text, False) what an environment appended (context only).
        for text, trained in [(answer, True)] if isinstance(answer, str) else answer:
            ids = list(tokenizer.encode(text)) + ([tokenizer.eos_id] if trained else [])
            c += ids
            t += [trained] * len(ids)
        if len(c) > new:
            cut += 1
        c, t = c[:new], t[:new]
        tokens[row, width - len(p) : width] = p
        tokens[row, width : width + len(c)] = c
        valid[row, width - len(p) : width + len(c)] = True
        target[row, width : width + len(c)] = t
    if cut:
        logging.log_first_n(
            logging.WARNING,
            "warm-up: %d of %d reference answers (examples %d..) are longer than "
            "gconfig.max_new_tokens=%d tokens with their EOS and are cut there (their end and "
            "EOS are not trained); said once",
            1,
            cut,
            count,
            start,
            new,
        )
    return tokens, valid, target


@dataclasses.dataclass
class Warmup:
    """What the warm-up left: its params, the steps it took, and its evaluation rows.

    `stopped`: a stop was agreed after step `steps` (a signal): the warm-up is unfinished,
    and `opt_state` (its AdamW state) continues it from a checkpoint."""

    params: Any
    steps: int
    log: list[dict]
    stopped: bool = False
    opt_state: Any = None


def optimizer(run: RunSetup) -> optax.GradientTransformation:
    return optax.adamw(run.cfg.sft.lr, weight_decay=0.0)


def init_opt_state(run: RunSetup, params) -> Any:
    """The warm-up's fresh optimizer state for `params`, laid out as the train state's
    (moments like the params, the step count replicated over the mesh: a scalar left on one
    device is not addressable by the other processes of a multi-process run)."""
    init = optimizer(run).init
    trainable = warmup_split(params, run.model_config)[0]
    shape = jax.eval_shape(init, trainable)
    placement = run.placement
    layout = sharding.opt_state_shardings(
        shape, warmup_split(placement.train_params, run.model_config)[0], placement.mesh
    )
    return jax.jit(init, out_shardings=layout)(trainable)


def warmup_split(params, model_config: ModelConfig):
    """(what the warm-up trains, what it leaves): everything without LoRA; under LoRA on a
    float base the base, with the adapters left at zero: the warm-up makes the base model
    that RL then adapts (as a pretrained checkpoint would be), and the KL reference is that
    base, adapters off. Under a quantised base (`lora_base` int8 / nf4: integer codes, no
    gradient) the adapters, the base frozen as it was quantised: RL continues from the
    warmed-up adapters, and the KL reference (adapters off) is the base before the
    warm-up."""
    adapters, base = lora.split(params)
    if base is None:
        return adapters, None
    if model_config.lora_base != "float":
        return adapters, base
    return base, adapters


def supervised_warmup(
    run: RunSetup,
    params,
    evaluate: Callable[[Any], float],
    *,
    resume: Warmup | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Warmup:
    """Up to `sft.max_steps` AdamW steps on a copy of `params`.

    Every `sft.eval_every` steps (and at the last) `evaluate(params)` gives the held-out
    accuracy; the warm-up stops early once it reaches `sft.stop_at_accuracy`.
    `resume`: an unfinished warm-up (params, AdamW state, steps, log) to continue.
    `should_stop()`, asked after every step, ends the warm-up there (`Warmup.stopped`).
    """
    s = run.cfg.sft
    sft_step = make_sft_step(run.model_config, optimizer(run), run.placement.mesh)
    if resume is not None:
        params, opt_state, done, log = resume.params, resume.opt_state, resume.steps, resume.log
    else:
        params = jax.tree.map(jnp.copy, params)  # the step donates its input
        opt_state, done, log = init_opt_state(run, params), 0, []
    in_flight = collections.deque()  # the losses of the steps dispatched, not waited on
    for i in range(done, s.max_steps):
        batch = run.placement.to_global(sft_batch(run, i * s.batch_size, s.batch_size))
        if len(in_flight) == 2:
            # At most two steps in flight (the device never waits for the host). Unbounded,
            # the host queued up to `eval_every` steps; with many multi-device programs in
            # flight XLA:CPU (fake CPU devices) now and then deadlocks in an all-reduce (7
            # of 8 participants arrive) and aborts the process at the rendezvous timeout.
            in_flight.popleft().block_until_ready()
        params, opt_state, loss = sft_step(params, opt_state, *batch)
        in_flight.append(loss)
        done = i + 1
        if done % s.eval_every == 0 or done == s.max_steps:
            accuracy = evaluate(params)
            if jax.process_index() == 0:
                metrics_lib.say(
                    f"warm-up step {done}: loss {float(loss):.3f}, held-out accuracy {accuracy:.3f}"
                )
            log.append({"sft_step": done, "sft/loss": float(loss), "sft/accuracy": accuracy})
            if accuracy >= s.stop_at_accuracy:
                break
        if should_stop is not None and should_stop() and done < s.max_steps:
            return Warmup(params, done, log, stopped=True, opt_state=opt_state)
    return Warmup(params, done, log)
