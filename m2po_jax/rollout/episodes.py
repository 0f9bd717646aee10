"""Multi-turn episodes: an environment per episode, token in and token out.

    agent = Agent(env_factory, TemplateFormat(prompts), max_turns=4)
    sampled = sample_episodes(params, sampling_config, examples, prompts, rng,
                              n_samples=8, version=step, max_prompt_len=256,
                              engine=engine, agent=agent)

Each episode opens with its environment's `reset(example)` messages, rendered once with
the chat template (tools included) into the prompt. The engine decodes until the
assistant's turn ends (a stop token); the host decodes that turn's tokens, calls the
environment's `step(text)` (tools run there, in worker threads with a timeout; async
environments on the agent's one event loop), renders
only what the environment answered (the template's delta after an assistant turn: the
tool messages and the next assistant header) and appends those tokens to the episode's
live slot. The steps are the engine's `TurnQueue` (`_Steps`): the paged engine decodes
the other episodes while a step runs; the continuous engine waits for every held turn's.
The history is never rendered again, so the trained tokens are exactly the
sampled ones: a template that strips earlier `<think>` blocks (Qwen3) does not change
them, and the reasoning stays in the trajectory as generated.

The rollout's rows are the episodes: the prompt, then every turn and every appended
answer in one completion. `loss_mask_BxT` is 1 on the assistant's (sampled) tokens only;
behaviour log-probs and policy versions are recorded on them (version -1 on appended
tokens). GRPO groups are the `n_samples` episodes of one problem. An episode ends with a
status (`tasks.environments.STATUSES`): done (the environment said so: the model answered
without a tool call), max_turns, max_tokens (the completion budget, or an answer that does
not fit), bad_tool_call (its reward is `bad_tool_call_reward`), tool_error / tool_timeout
(an environment that ends on tool failures), env_error (the environment raised: the
exception is logged, never trained on or scored), env_timeout (a reset or step ran past
`step_timeout_s`), prompt_too_long (`long_prompts="filter"`: the opening prompt is over
`max_prompt_len`; not run). Failed episodes (env_error, env_timeout) and, when asked,
budget-cut ones (max_turns, max_tokens) are taken out of the loss: their `loss_mask_BxT`
rows are zeroed (`EpisodeStats.masked_B`; their rewards stay in their GRPO group's
statistics, as TRL's `mask_truncated_completions` does). Rewards: the sum of those the
environment gave on the episode's steps; when it gave none, the task's reward of the final
assistant turn's text.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Protocol

import jax
import numpy as np

from m2po_jax.common.types import RolloutBatch
from m2po_jax.models import chat
from m2po_jax.models import prompts as prompts_lib
from m2po_jax.rollout import sampling
from m2po_jax.tasks import environments as env_lib

STATUSES = env_lib.STATUSES
_CUT = (env_lib.MAX_TURNS, env_lib.MAX_TOKENS)  # the statuses of episodes a budget ended
FAILED = (env_lib.ENV_ERROR, env_lib.ENV_TIMEOUT)  # the environment failed, not the model


class ChatFormat(Protocol):
    """How messages become token ids: the opening prompt, and the delta appended after an
    assistant turn (the answer's messages and the next assistant header)."""

    def prompt_ids(self, messages: Sequence[Mapping], tools: Sequence) -> list[int]: ...

    def delta_ids(self, messages: Sequence[Mapping]) -> list[int]: ...


class TemplateFormat:
    """A checkpoint's chat template (`prompts.PromptEncoder`'s): the prompt is rendered with
    the tools' schemas; a delta is `chat.turn_delta` after the model's end-of-turn token
    (the template's `eos_token`, or `end_of_turn`)."""

    def __init__(self, encoder, end_of_turn: str | None = None):
        if encoder.chat_template is None:
            raise ValueError(
                "agent: multi-turn episodes need a chat template (the tokenizer has none, or "
                "task.chat_template='off'), or a task that defines chat_format()"
            )
        self.encoder = encoder
        self.end_of_turn = end_of_turn or encoder.template_kwargs.get("eos_token")
        if not self.end_of_turn:
            raise ValueError("agent: the chat template's eos_token (end of a turn) is unknown")
        self._deltas: dict[str, list[int]] = {}

    def prompt_ids(self, messages, tools) -> list[int]:
        text = chat.render(
            self.encoder.chat_template,
            messages,
            add_generation_prompt=True,
            tools=[t.schema() for t in tools] or None,
            **self.encoder.template_kwargs,
        )
        return list(self.encoder.tokenizer.encode(text))

    def delta_ids(self, messages) -> list[int]:
        text = chat.turn_delta(
            self.encoder.chat_template,
            messages,
            end_of_turn=self.end_of_turn,
            **self.encoder.template_kwargs,
        )
        return list(self.encoder.tokenizer.encode(text))


@dataclasses.dataclass
class _Episode:
    """One episode's host record."""

    env: env_lib.Environment
    turns: int = 0
    status: str | None = None
    reward: float | None = None  # the sum of the rewards its steps gave
    text: str = ""  # the last assistant turn's text (the model's, never an error's)
    error: str = ""  # what the environment raised (env_error / env_timeout)
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_abandoned: int = 0
    tool_latency_s: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class EpisodeStats:
    """Per-episode outcomes of a rollout (rows as the batch's)."""

    status_B: tuple[str, ...]
    turns_B: np.ndarray
    tool_calls_B: np.ndarray
    tool_errors_B: np.ndarray
    tool_timeouts_B: np.ndarray
    env_reward_B: np.ndarray  # float32, NaN where the environment gave none
    tool_latency_s: tuple[float, ...]
    env_step_s: float  # host time in environment steps (tools included)
    masked_B: np.ndarray | None = None  # bool: out of the loss (failed / cut / not run)
    tool_abandoned_B: np.ndarray | None = None  # tool threads left running past a timeout
    prompts_truncated: int = 0  # problems whose opening prompt was cut from the left
    prompts_filtered: int = 0  # problems not run: their prompt is too long ("filter")
    masked_failed: int = 0  # episodes out of the loss: env_error / env_timeout
    masked_truncated: int = 0  # episodes out of the loss: max_turns / max_tokens
    decode_steps_while_waiting: int = 0  # engine decode steps run while steps were pending

    def rows(self, count: int) -> EpisodeStats:
        """The first `count` episodes' outcomes (an evaluation drops its padding rows)."""
        return dataclasses.replace(
            self,
            status_B=self.status_B[:count],
            turns_B=self.turns_B[:count],
            tool_calls_B=self.tool_calls_B[:count],
            tool_errors_B=self.tool_errors_B[:count],
            tool_timeouts_B=self.tool_timeouts_B[:count],
            env_reward_B=self.env_reward_B[:count],
            masked_B=None if self.masked_B is None else self.masked_B[:count],
            tool_abandoned_B=(
                None if self.tool_abandoned_B is None else self.tool_abandoned_B[:count]
            ),
        )

    def metrics(self) -> dict[str, float]:
        """episode/turns_mean, episode/tool_calls_mean, episode/status/<status> (the share
        of episodes), tool errors and timeouts per episode, tool threads abandoned, tool
        latency (ms), decode steps the engine ran while environment steps were pending
        (decode_steps_while_waiting), the share of episodes out of the loss (masked_failed,
        masked_truncated), prompts cut from the left (prompts_truncated) or not run
        (prompts_filtered)."""
        rows = max(len(self.status_B), 1)
        abandoned = 0 if self.tool_abandoned_B is None else int(np.sum(self.tool_abandoned_B))
        record = {
            "episode/turns_mean": float(np.mean(self.turns_B)),
            "episode/tool_calls_mean": float(np.mean(self.tool_calls_B)),
            "episode/tool_errors_mean": float(np.mean(self.tool_errors_B)),
            "episode/tool_timeouts_mean": float(np.mean(self.tool_timeouts_B)),
            "episode/tool_abandoned": abandoned,
            "episode/env_step_s": self.env_step_s,
            "episode/decode_steps_while_waiting": self.decode_steps_while_waiting,
            "episode/masked_failed": self.masked_failed / rows,
            "episode/masked_truncated": self.masked_truncated / rows,
            "episode/prompts_truncated": self.prompts_truncated,
            "episode/prompts_filtered": self.prompts_filtered,
        }
        for status in STATUSES:
            record[f"episode/status/{status}"] = self.status_B.count(status) / rows
        latency = np.asarray(self.tool_latency_s, np.float64) * 1e3
        record["episode/tool_latency_ms_mean"] = float(latency.mean()) if latency.size else 0.0
        record["episode/tool_latency_ms_max"] = float(latency.max()) if latency.size else 0.0
        return record


class Agent:
    """What multi-turn rollouts need besides the engine (`cfg.agent`).

    Args:
      env_factory: a zero-argument callable giving a new `Environment` per episode.
      chat_format: the `ChatFormat` of the model's template.
      max_turns: assistant turns per episode; an episode still calling tools after its
        last turn ends with status max_turns.
      max_append: tokens one environment answer may add; a longer one ends the episode
        (max_tokens).
      bad_tool_call_reward: the reward of an episode ended by a malformed tool call.
      workers: plain (not async) environment steps run at once (threads of a
        `WorkerPool`: a step past `step_timeout_s` leaves its thread, a fresh one
        replaces it).
      step_timeout_s: seconds one reset or step may take (None: no bound); a step past it
        ends its episode as env_timeout, a reset past it fails the rollout.
      mask_failed: take failed episodes (env_error, env_timeout) out of the loss.
      mask_truncated: take budget-cut episodes (max_turns, max_tokens) out of the loss.
      long_prompts: an opening prompt over `max_prompt_len` tokens: "left" (cut from the
        left, counted), "filter" (its problem's episodes are not run: prompt_too_long,
        out of the loss) or "error" (ValueError before generation), as
        `task.long_prompts`.
      pools: `WorkerPool`s the environments use (ToolEnv's shared tool pool), shut down
        with the agent's own by `close()`.

    Async environment methods run on the agent's own event loop (`EnvLoop`); `close()`
    ends its threads.
    """

    def __init__(
        self,
        env_factory: Callable[[], env_lib.Environment],
        chat_format: ChatFormat,
        *,
        max_turns: int = 4,
        max_append: int = 256,
        bad_tool_call_reward: float = 0.0,
        workers: int = 4,
        step_timeout_s: float | None = None,
        mask_failed: bool = True,
        mask_truncated: bool = False,
        long_prompts: str = "left",
        pools: Sequence[env_lib.WorkerPool] = (),
    ):
        for name, value in (("max_turns", max_turns), ("max_append", max_append)):
            if int(value) < 1:
                raise ValueError(f"agent.{name}: must be >= 1, got {value}")
        if not math.isfinite(bad_tool_call_reward):
            raise ValueError(
                f"agent.bad_tool_call_reward: must be finite, got {bad_tool_call_reward}"
            )
        if step_timeout_s is not None and not (0 < step_timeout_s < math.inf):
            raise ValueError(f"agent.step_timeout_s: expected seconds > 0, got {step_timeout_s}")
        if long_prompts not in prompts_lib.LONG_PROMPT_MODES:
            raise ValueError(
                f"task.long_prompts: expected one of {', '.join(prompts_lib.LONG_PROMPT_MODES)}, "
                f"got {long_prompts!r}"
            )
        self.env_factory = env_factory
        self.chat_format = chat_format
        self.max_turns, self.max_append = int(max_turns), int(max_append)
        self.bad_tool_call_reward = float(bad_tool_call_reward)
        self.step_timeout_s = None if step_timeout_s is None else float(step_timeout_s)
        self.mask_failed, self.mask_truncated = bool(mask_failed), bool(mask_truncated)
        self.long_prompts = long_prompts
        self.pool = env_lib.WorkerPool(max(int(workers), 1), "m2po-env")
        self.pools = tuple(pools)
        self._loop: env_lib.EnvLoop | None = None
        self._loop_lock = threading.Lock()  # the rollout worker and an evaluation may race
        self._warned_long = False

    @property
    def loop(self) -> env_lib.EnvLoop:
        """The event loop of the environments' async methods (started on first use)."""
        with self._loop_lock:
            if self._loop is None:
                self._loop = env_lib.EnvLoop()
            return self._loop

    def masked(self, status: str) -> bool:
        """Whether an episode that ended with `status` is out of the loss."""
        if status == env_lib.PROMPT_TOO_LONG:
            return True
        return (self.mask_failed and status in FAILED) or (self.mask_truncated and status in _CUT)

    def close(self) -> None:
        """Ends the agent's threads, its event loop and those of `pools` (the tool pool its
        environments share); the next episode starts them again."""
        self.pool.shutdown()
        for pool in self.pools:
            pool.shutdown()
        with self._loop_lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.close()


class _StepTimeout(Exception):
    """An environment call ran past `agent.step_timeout_s`."""


def _start(agent: Agent, fn: Callable, *args) -> Callable[[], object]:
    """Starts the environment call `fn(*args)`: an `async def` on the agent's loop, a plain
    one on its pool. Returns the wait for its result (`_StepTimeout` past the bound)."""
    timeout_s = agent.step_timeout_s
    if inspect.iscoroutinefunction(fn):
        job = agent.loop.submit(fn(*args))
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s

        def wait_async():
            left = None if deadline is None else max(deadline - time.perf_counter(), 0.0)
            try:
                return job.result(left)
            except futures.TimeoutError:
                if job.cancel():
                    raise _StepTimeout(f"ran past agent.step_timeout_s={timeout_s:g}s") from None
                return job.result()

        return wait_async
    call = functools.partial(env_lib.run_env, fn, loop=agent.loop)
    job = agent.pool.submit(call, *args)

    def wait_thread():
        try:
            return agent.pool.wait(job, timeout_s)
        except TimeoutError:
            if job.abandoned:
                raise _StepTimeout(f"ran past agent.step_timeout_s={timeout_s:g}s") from None
            raise

    return wait_thread


def _new_env(agent: Agent) -> env_lib.Environment:
    env = agent.env_factory()
    if not isinstance(env, env_lib.Environment):
        raise TypeError(
            f"agent.env: the factory returned a {type(env).__name__}, not an Environment"
        )
    return env


def _open(agent: Agent, examples: Sequence, n_samples: int):
    """A new environment per episode, reset on its problem; the prompt of each problem
    (its episodes must open alike: their prompt is prefilled once)."""
    episodes = [_Episode(_new_env(agent)) for _ in range(len(examples) * n_samples)]
    waits = [_start(agent, e.env.reset, examples[i // n_samples]) for i, e in enumerate(episodes)]
    messages = []
    for i, wait in enumerate(waits):
        try:
            messages.append(wait())
        except _StepTimeout as e:
            raise TimeoutError(
                f"agent.env: reset of an episode of problem {examples[i // n_samples].uid} {e}"
            ) from None
    prompts = []
    for b, example in enumerate(examples):
        first = messages[b * n_samples]
        for k in range(1, n_samples):
            if messages[b * n_samples + k] != first:
                raise ValueError(
                    f"agent.env: reset gave different opening messages to the episodes of "
                    f"problem {example.uid} (every episode of a problem shares its prompt)"
                )
        prompts.append(agent.chat_format.prompt_ids(first, episodes[b * n_samples].env.tools))
    return episodes, prompts


def _step(agent: Agent, episode: _Episode, text: str, wait, room: int) -> list[int] | None:
    """The environment's answer to the turn `text` (`wait` gives its `StepResult`): tokens
    to append, or None (ended). Rewards of every step add up, whichever way it ends."""
    episode.turns += 1
    episode.text = text
    try:
        result = wait()
    except _StepTimeout as e:
        episode.status, episode.error = env_lib.ENV_TIMEOUT, f"step {e}"
        return None
    except Exception as e:  # noqa: BLE001 (an environment's failure ends its episode only)
        episode.status, episode.error = env_lib.ENV_ERROR, f"{type(e).__name__}: {e}"
        return None
    info = result.info or {}
    episode.tool_calls += int(info.get("tool_calls", 0))
    episode.tool_errors += int(info.get("tool_errors", 0))
    episode.tool_timeouts += int(info.get("tool_timeouts", 0))
    episode.tool_abandoned += int(info.get("tool_abandoned", 0))
    episode.tool_latency_s += [float(t) for t in info.get("tool_latency_s", ())]
    if result.reward is not None:
        episode.reward = (episode.reward or 0.0) + float(result.reward)
    if result.done:
        episode.status = result.status or env_lib.DONE
        return None
    if episode.turns >= agent.max_turns:
        episode.status = env_lib.MAX_TURNS
        return None
    delta = agent.chat_format.delta_ids(result.messages)
    if not delta or len(delta) > room:
        episode.status = env_lib.MAX_TOKENS
        return None
    return delta


def _check_prompt_lengths(agent: Agent, episodes, examples, prompt_ids, n_samples, width):
    """`agent.long_prompts` on the opening prompts: (problems cut, problems filtered)."""
    long = [b for b, ids in enumerate(prompt_ids) if len(ids) > width]
    if not long:
        return 0, 0
    b = long[0]
    where = (
        f"agent: the opening prompt of problem {examples[b].uid} (reset messages and tool "
        f"schemas, rendered) is {len(prompt_ids[b])} tokens, over task.max_prompt_len={width}"
    )
    if agent.long_prompts == "error":
        raise ValueError(f"{where} (task.long_prompts='error')")
    if agent.long_prompts == "filter":
        for b in long:
            for k in range(n_samples):
                episodes[b * n_samples + k].status = env_lib.PROMPT_TOO_LONG
        return 0, len(long)
    if not agent._warned_long:
        agent._warned_long = True
        logging.warning(
            "%s; kept its last tokens (task.long_prompts='left'; counted in "
            "rollout/prompts_truncated; logged once)",
            where,
        )
    return len(long), 0


class _Steps:
    """The episodes' environment steps as the engine's `TurnQueue`: `submit` starts each
    held turn's step (on the agent's pool or event loop, a waiter thread per step) and
    returns; `poll` turns the steps that ended into answers (`_step`, on the caller's
    thread: the episodes' records are only touched there). Called as `on_turns(turns)`
    (an engine that waits, the continuous one), it submits and waits for all of them.
    `spent_s`: the time during which at least one step was running."""

    def __init__(self, agent: Agent, episodes, prompts, stop_ids):
        self.agent, self.episodes, self.prompts, self.stop_ids = agent, episodes, prompts, stop_ids
        self.spent_s = 0.0
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running, self._since = 0, 0.0

    def __call__(self, turns):
        self.submit(turns)
        answers: dict[int, list[int] | None] = {}
        while len(answers) < len(turns):
            answers.update((turn.row, answer) for turn, answer in self.poll(None))
        return [answers[turn.row] for turn in turns]

    def submit(self, turns) -> None:
        for turn in turns:
            episode = self.episodes[turn.row]
            ids = turn.tokens
            if ids and ids[-1] in self.stop_ids:
                ids = ids[:-1]
            text = self.prompts.decode(ids)
            if episode.status == env_lib.PROMPT_TOO_LONG:
                self._done.put((turn, None))
            elif turn.cut:  # the budget ran out mid-turn: the text is the cut turn's
                episode.turns += 1
                episode.text = text
                episode.status = env_lib.MAX_TOKENS
                self._done.put((turn, None))
            else:
                with self._lock:
                    if not self._running:
                        self._since = time.perf_counter()
                    self._running += 1
                wait = _start(self.agent, episode.env.step, text)
                threading.Thread(
                    target=self._wait, args=(turn, text, wait), name="m2po-env-wait", daemon=True
                ).start()

    def _wait(self, turn, text, wait) -> None:
        try:
            outcome = (True, wait())
        except BaseException as e:  # noqa: BLE001 (handed to `poll`, which `_step` judges)
            outcome = (False, e)
        with self._lock:
            self._running -= 1
            if not self._running:
                self.spent_s += time.perf_counter() - self._since
        self._done.put((turn, (text, outcome)))

    def poll(self, timeout_s: float | None):
        """(turn, answer) of the steps that ended; waits up to `timeout_s` (None: without
        bound, 0: not at all) for the first."""
        ready = []
        try:
            ready.append(self._done.get(timeout_s != 0, timeout_s))
            while True:
                ready.append(self._done.get_nowait())
        except queue.Empty:
            pass
        return [(turn, None if step is None else self._answer(turn, *step)) for turn, step in ready]

    def _answer(self, turn, text, outcome):
        ok, value = outcome

        def result():
            if not ok:
                raise value
            return value

        return _step(self.agent, self.episodes[turn.row], text, result, turn.room)


def run_episodes(
    params,
    sampling_config: sampling.SamplingConfig,
    examples: Sequence,
    prompts,
    rng,
    *,
    n_samples: int,
    version: int,
    max_prompt_len: int,
    engine,
    agent: Agent,
    weights=None,
):
    """Multi-turn episodes of `examples` (`n_samples` each) through `engine.episodes`
    (see the module doc): (the engine's `Generation` on the host, the final assistant
    turns' texts, the `EpisodeStats`). `rollout.batches.sample_rollout(agent=...)` makes
    the rollout batch of them."""
    if not getattr(engine, "multi_turn", True):  # (an engine of the interface says so)
        raise ValueError(
            f"agent: multi-turn episodes need rollout.engine='continuous' or 'paged' (got "
            f"{engine.name!r})"
        )
    episodes, prompt_ids = _open(agent, examples, n_samples)
    truncated, filtered = _check_prompt_lengths(
        agent, episodes, examples, prompt_ids, n_samples, max_prompt_len
    )
    tokens_BxP, valid_BxP = sampling.pad_prompts(
        [ids[-max_prompt_len:] for ids in prompt_ids], prompts.pad_id, width=max_prompt_len
    )
    steps = _Steps(agent, episodes, prompts, set(sampling_config.stop_token_ids))
    generation = engine.episodes(
        params,
        tokens_BxP,
        valid_BxP,
        rng,
        steps,
        n_samples=n_samples,
        version=version,
        weights=weights,
        max_append=agent.max_append,
    )
    out = jax.device_get(generation.out)
    for e in episodes:
        e.status = e.status or env_lib.MAX_TOKENS
    # A row "stopped" unless a budget cut its episode (turns or tokens).
    stopped_B = np.asarray([e.status not in _CUT for e in episodes], bool)
    generation = dataclasses.replace(generation, out=out.replace(stopped_B=stopped_B))
    stats = EpisodeStats(
        status_B=tuple(e.status for e in episodes),
        turns_B=np.asarray([e.turns for e in episodes], np.int32),
        tool_calls_B=np.asarray([e.tool_calls for e in episodes], np.int32),
        tool_errors_B=np.asarray([e.tool_errors for e in episodes], np.int32),
        tool_timeouts_B=np.asarray([e.tool_timeouts for e in episodes], np.int32),
        env_reward_B=np.asarray(
            [
                agent.bad_tool_call_reward
                if e.status == env_lib.BAD_TOOL_CALL and e.reward is None
                else (np.nan if e.reward is None else e.reward)
                for e in episodes
            ],
            np.float32,
        ),
        tool_latency_s=tuple(t for e in episodes for t in e.tool_latency_s),
        env_step_s=steps.spent_s,
        masked_B=np.asarray([agent.masked(e.status) for e in episodes], bool),
        tool_abandoned_B=np.asarray([e.tool_abandoned for e in episodes], np.int32),
        prompts_truncated=truncated,
        prompts_filtered=filtered,
        masked_failed=sum(agent.masked(e.status) and e.status in FAILED for e in episodes),
        masked_truncated=sum(agent.masked(e.status) and e.status in _CUT for e in episodes),
        decode_steps_while_waiting=int(getattr(generation, "decode_steps_while_waiting", 0)),
    )
    _log_failures(episodes)
    return generation, [e.text for e in episodes], stats


def _log_failures(episodes) -> None:
    """One warning per rollout naming the first environment failure (never trained on)."""
    failed = [e for e in episodes if e.status in FAILED]
    if failed:
        logging.warning(
            "agent.env: %d of %d episodes ended by the environment failing (env_error / "
            "env_timeout); the first: %s",
            len(failed),
            len(episodes),
            failed[0].error,
        )


def without_masked(batch: RolloutBatch, stats: EpisodeStats) -> RolloutBatch:
    """`batch` with the loss mask of the episodes out of the loss (`stats.masked_B`)
    zeroed: their tokens carry no gradient and no advantage (the advantages and losses
    are zero outside the mask, their token counts at least 1)."""
    if stats.masked_B is None or not stats.masked_B.any():
        return batch
    keep_BxT = np.asarray(batch.loss_mask_BxT, bool) & ~stats.masked_B[:, None]
    return batch.replace(loss_mask_BxT=keep_BxT)


def with_env_rewards(batch: RolloutBatch, stats: EpisodeStats) -> RolloutBatch:
    """`batch` with the environment's rewards where it gave them (a non-finite one is
    refused, as a reward function's is)."""
    given = ~np.isnan(stats.env_reward_B)
    if np.isinf(stats.env_reward_B).any():
        raise ValueError("agent.env: an environment returned an infinite reward")
    rewards = np.where(given, stats.env_reward_B, batch.rewards_B).astype(np.float32)
    return batch.replace(rewards_B=rewards)
