"""Held-out evaluation: each held-out set's problems, `eval.n_samples` completions each,
scored as training scores them (or by the task's verifier), as avg@k and pass@k."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from m2po_jax.rollout import batches as rollout_lib
from m2po_jax.trainer.setup import RunSetup, build_engine

_ENGINES: dict = {}  # (id of the run's placement, decoding) -> the evaluation's engine


def decoding(run: RunSetup):
    """The evaluation's sampling settings: greedy at `eval.temperature` 0, else sampled."""
    return eval_decoding(run.cfg, run.sampling_config)


def eval_decoding(cfg, sampling_config):
    """`decoding` of a config and the run's sampling settings (the dry run compiles the
    evaluation with these, as the run evaluates)."""
    e = cfg.eval
    sampling_config = dataclasses.replace(sampling_config, record_experts=False)  # no replay
    if e.temperature == 0:
        return dataclasses.replace(sampling_config, greedy=True)
    return dataclasses.replace(sampling_config, greedy=False, temperature=float(e.temperature))


def _engine(run: RunSetup, settings):
    """The run's rollout engine (`rollout.engine`) for evaluation, over the training devices
    with the evaluation's decoding and the trained weights (not `rollout.weight_dtype`'s
    copy: held-out accuracy measures the trained policy)."""
    key = (id(run.placement), settings)
    if key not in _ENGINES:
        _ENGINES.clear()  # one run's at a time
        _ENGINES[key] = build_engine(
            run.cfg, run.model_config, settings, run.placement, trained_weights=True
        )
    return _ENGINES[key]


def evaluate(run: RunSetup, params, rng: jax.Array) -> dict[str, float]:
    """The held-out metrics of `params`.

    Every set of `task.eval_sets()` (the first `eval.num_examples` problems of each) gets
    `eval.n_samples` = k completions per problem, in chunks of `eval.batch_size` prompts
    (the last chunk padded so every call has one shape), through the rollout engine. A
    completion is right when its reward is >= 1: the training reward (`task.reward_fn`
    if set, else the task's verifier) with `eval.reward="train"`, the verifier alone with
    "verifier". Returns `eval/accuracy` (avg@k, the mean over sets), with `eval.sets` also
    `eval/<set>/avg@k` and `eval/<set>/pass@k`, and with k > 1 `eval/pass@k`.
    """
    cfg = run.cfg
    k = cfg.eval.n_samples
    settings = decoding(run)
    if cfg.eval.reward == "train" and run.rewards is not None:
        score = run.rewards
    else:
        score = lambda example, text: run.task.verify(text, example.answer)
    params = run.placement.for_sampling(params)
    engine = _engine(run, settings)
    size = cfg.eval.batch_size
    out: dict[str, float] = {}
    avg, passed, calls = [], [], []
    for index, (name, examples) in enumerate(run.task.eval_sets().items()):
        examples = examples[: cfg.eval.num_examples]
        if not examples:
            continue
        right = []
        for start in range(0, len(examples), size):
            chunk = examples[start : start + size]
            padded = chunk + [chunk[-1]] * (size - len(chunk))
            sampled = rollout_lib.sample_rollout(
                params,
                run.model_config,
                settings,
                padded,
                run.prompts,
                jax.random.fold_in(jax.random.fold_in(rng, index), start),
                n_samples=k,
                version=0,
                max_prompt_len=cfg.task.max_prompt_len,
                placement=run.placement,
                engine=engine,
                agent=run.agent,
            )
            rows = len(chunk) * k  # the padding's rows are not scored
            batch = jax.tree.map(lambda x, rows=rows: x[:rows], sampled.batch)
            episodes = sampled.episodes and sampled.episodes.rows(rows)
            kept = dataclasses.replace(
                sampled, texts=sampled.texts[:rows], batch=batch, episodes=episodes
            )
            rewards = rollout_lib.score_rollout(kept, score).rewards_B
            right.append(np.asarray(rewards >= 1.0).reshape(len(chunk), k))
            if episodes is not None:
                calls.append(episodes.tool_calls_B)
        correct = np.concatenate(right)
        avg.append(float(correct.mean()))
        passed.append(float(correct.any(axis=1).mean()))
        if cfg.eval.sets:
            out[f"eval/{name}/avg@{k}"] = avg[-1]
            out[f"eval/{name}/pass@{k}"] = passed[-1]
    out["eval/accuracy"] = float(np.mean(avg)) if avg else float("nan")
    if calls:  # multi-turn: how often the held-out episodes call a tool
        out["eval/tool_calls_mean"] = float(np.mean(np.concatenate(calls)))
    if k > 1:
        out[f"eval/pass@{k}"] = float(np.mean(passed)) if passed else float("nan")
    return out
