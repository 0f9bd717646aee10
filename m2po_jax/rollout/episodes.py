"""Multi-turn episodes: an environment per episode, token in and token out.

    agent = Agent(env_factory, TemplateFormat(prompts), max_turns=4)
    sampled = sample_episodes(params, sampling_config, examples, prompts, rng,
                              n_samples=8, version=step, max_prompt_len=256,
                              engine=engine, agent=agent)

Each episode opens with its environment's `reset(example)` messages, rendered once with
the chat template (tools included) into the prompt. The continuous engine decodes until
the assistant's turn ends (a stop token); the host decodes that turn's tokens, calls the
environment's `step(text)` (tools run there, in worker threads with a timeout), renders
only what the environment answered (the template's delta after an assistant turn: the
tool messages and the next assistant header) and appends those tokens to the episode's
live slot. The history is never rendered again, so the trained tokens are exactly the
sampled ones: a template that strips earlier `<think>` blocks (Qwen3) does not change
them, and the reasoning stays in the trajectory as generated.

The rollout's rows are the episodes: the prompt, then every turn and every appended
answer in one completion. `loss_mask_BxT` is 1 on the assistant's (sampled) tokens only;
behaviour log-probs and policy versions are recorded on them (version -1 on appended
tokens). GRPO groups are the `n_samples` episodes of one problem. An episode ends with a
status (`tasks.environments.STATUSES`): done (the environment said so: the model answered
without a tool call), max_turns, max_tokens (the completion budget, or an answer that does
not fit), bad_tool_call (its reward is `bad_tool_call_reward`), tool_error / tool_timeout
(an environment that ends on tool failures), env_error (the environment raised).
Rewards: the environment's, when its last step gave one; else the task's reward of the
final assistant turn's text.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Protocol

import jax
import numpy as np

from m2po_jax.common.types import RolloutBatch
from m2po_jax.models import chat
from m2po_jax.rollout import sampling
from m2po_jax.tasks import environments as env_lib

STATUSES = env_lib.STATUSES
_CUT = (env_lib.MAX_TURNS, env_lib.MAX_TOKENS)  # the statuses of episodes a budget ended


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
    reward: float | None = None
    text: str = ""  # the last assistant turn's text
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
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
        )

    def metrics(self) -> dict[str, float]:
        """episode/turns_mean, episode/tool_calls_mean, episode/status/<status> (the share
        of episodes), tool errors and timeouts per episode, tool latency (ms)."""
        rows = max(len(self.status_B), 1)
        record = {
            "episode/turns_mean": float(np.mean(self.turns_B)),
            "episode/tool_calls_mean": float(np.mean(self.tool_calls_B)),
            "episode/tool_errors_mean": float(np.mean(self.tool_errors_B)),
            "episode/tool_timeouts_mean": float(np.mean(self.tool_timeouts_B)),
            "episode/env_step_s": self.env_step_s,
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
      workers: environment steps run at once (threads).
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
    ):
        for name, value in (("max_turns", max_turns), ("max_append", max_append)):
            if int(value) < 1:
                raise ValueError(f"agent.{name}: must be >= 1, got {value}")
        if not math.isfinite(bad_tool_call_reward):
            raise ValueError(
                f"agent.bad_tool_call_reward: must be finite, got {bad_tool_call_reward}"
            )
        self.env_factory = env_factory
        self.chat_format = chat_format
        self.max_turns, self.max_append = int(max_turns), int(max_append)
        self.bad_tool_call_reward = float(bad_tool_call_reward)
        self.pool = futures.ThreadPoolExecutor(max(int(workers), 1), "m2po-env")


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
    resets = agent.pool.map(
        lambda i: env_lib.run_env(episodes[i].env.reset, examples[i // n_samples]),
        range(len(episodes)),
    )
    messages = list(resets)
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


def _step(agent: Agent, episode: _Episode, text: str, room: int) -> list[int] | None:
    """The environment's answer to the turn `text`: tokens to append, or None (ended)."""
    episode.turns += 1
    episode.text = text
    try:
        result = env_lib.run_env(episode.env.step, text)
    except Exception as e:  # noqa: BLE001 (an environment's failure ends its episode only)
        episode.status = env_lib.ENV_ERROR
        episode.text = f"{type(e).__name__}: {e}"
        return None
    info = result.info or {}
    episode.tool_calls += int(info.get("tool_calls", 0))
    episode.tool_errors += int(info.get("tool_errors", 0))
    episode.tool_timeouts += int(info.get("tool_timeouts", 0))
    episode.tool_latency_s += [float(t) for t in info.get("tool_latency_s", ())]
    if result.done:
        episode.status = result.status or env_lib.DONE
        episode.reward = result.reward
        return None
    if episode.turns >= agent.max_turns:
        episode.status = env_lib.MAX_TURNS
        return None
    delta = agent.chat_format.delta_ids(result.messages)
    if not delta or len(delta) > room:
        episode.status = env_lib.MAX_TOKENS
        return None
    return delta


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
    if engine is None or not hasattr(engine, "episodes"):
        raise ValueError("agent: multi-turn episodes need rollout.engine='continuous'")
    episodes, prompt_ids = _open(agent, examples, n_samples)
    tokens_BxP, valid_BxP = sampling.pad_prompts(
        [ids[-max_prompt_len:] for ids in prompt_ids], prompts.pad_id, width=max_prompt_len
    )
    stop_ids = set(sampling_config.stop_token_ids)
    spent = [0.0]

    def on_turns(turns):
        t0 = time.perf_counter()

        def one(turn):
            episode = episodes[turn.row]
            ids = turn.tokens[:-1] if turn.tokens and turn.tokens[-1] in stop_ids else turn.tokens
            if turn.cut:
                episode.turns += 1
                episode.text = prompts.decode(ids)
                episode.status = env_lib.MAX_TOKENS
                return None
            return _step(agent, episode, prompts.decode(ids), turn.room)

        answers = list(agent.pool.map(one, turns))
        spent[0] += time.perf_counter() - t0
        return answers

    generation = engine.episodes(
        params,
        tokens_BxP,
        valid_BxP,
        rng,
        on_turns,
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
        env_step_s=spent[0],
    )
    return generation, [e.text for e in episodes], stats


def with_env_rewards(batch: RolloutBatch, stats: EpisodeStats) -> RolloutBatch:
    """`batch` with the environment's rewards where it gave them (a non-finite one is
    refused, as a reward function's is)."""
    given = ~np.isnan(stats.env_reward_B)
    if np.isinf(stats.env_reward_B).any():
        raise ValueError("agent.env: an environment returned an infinite reward")
    rewards = np.where(given, stats.env_reward_B, batch.rewards_B).astype(np.float32)
    return batch.replace(rewards_B=rewards)
