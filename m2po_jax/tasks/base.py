"""What every task provides: a tokenizer, deterministic train / eval examples, a reward.

The trainer checkpoints only an integer data position, so `train_examples(start, count)`
must return the same examples for the same seed and position after a restart.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from m2po_jax.common.errors import RewardError

RewardFn = Callable[[str, str], float]


@runtime_checkable
class Tokenizer(Protocol):
    """What tasks, the sampler and the trainer need from a tokenizer.

    `encode` adds no special tokens: callers prepend `bos_id` (when not None) and
    append `eos_id` themselves.
    """

    vocab_size: int
    pad_id: int
    eos_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class Example:
    """One problem: the prompt text, the reference answer, and a stable problem id.

    Equal `uid`s mean the same underlying problem.
    """

    prompt: str
    answer: str
    uid: int


def check_range(start: int, count: int) -> None:
    """Raises ValueError unless `start` and `count` are non-negative integers."""
    for name, value in (("start", start), ("count", count)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {value!r}")


def reward_fn_from_name(name: str) -> RewardFn:
    """Imports a reward function `(completion: str, answer: str) -> float` by name.

    Args:
      name: "package.module:function"; the part after ":" may be dotted
        ("package.module:Class.method").

    Returns:
      The callable.

    Raises:
      ValueError: malformed name, module not found, or attribute missing.
      TypeError: the attribute is not callable.
    """
    if not isinstance(name, str) or name.count(":") != 1 or "" in name.split(":"):
        raise ValueError(f"reward_fn: expected 'package.module:function', got {name!r}")
    target = import_by_name(name, "reward_fn")
    if not callable(target):
        raise TypeError(
            f"reward_fn {name!r}: expected a callable (completion, answer) -> float, "
            f"got {type(target).__name__}"
        )
    return target


def import_by_name(name: str, field: str):
    """The object `name` ("package.module:attr", attr may be dotted) names; ValueError
    naming `field` when the name is malformed, its module is missing or has no such
    attribute. A missing dependency of an existing module is raised as it is, so that its
    own name shows."""
    module_name, colon, attr_path = name.partition(":")
    if not colon or not module_name or not attr_path:
        raise ValueError(f"{field}: expected 'package.module:name', got {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(
                f"{field} {name!r}: module {module_name!r} not found (is it on PYTHONPATH?)"
            ) from e
        raise
    target = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise ValueError(
                f"{field} {name!r}: {getattr(target, '__name__', target)!r} has no attribute "
                f"{part!r}"
            )
        target = getattr(target, part)
    return target


class Task(abc.ABC):
    """Base class: subclasses provide examples and a verifier.

    `reward` calls a pluggable `reward_fn(completion, answer)` when one is given,
    else the task's own `verify`.
    """

    tokenizer: Tokenizer
    # What the trainer reads besides the methods; a subclass that screens its prompts
    # (GSM8K) fills them. Token counts of prompts the task has encoded (uid -> tokens),
    # so the trainer counts over-long prompts without encoding them again:
    prompt_lengths: dict[int, int]
    # Prompts dropped for being too long, per split ("train", "eval"); None: none dropped.
    prompts_filtered: dict[str, int] | None

    def __init__(self, tokenizer: Tokenizer, reward_fn: str | RewardFn | None = None):
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(
                "tokenizer: expected an object with encode, decode, vocab_size, pad_id, eos_id "
                f"and bos_id, got {type(tokenizer).__name__}"
            )
        if isinstance(reward_fn, str):
            reward_fn = reward_fn_from_name(reward_fn)
        elif reward_fn is not None and not callable(reward_fn):
            raise TypeError(
                f"reward_fn: expected a name, a callable or None, got {type(reward_fn).__name__}"
            )
        self.tokenizer = tokenizer
        self._reward_fn = reward_fn
        self.prompt_lengths = {}
        self.prompts_filtered = None

    @abc.abstractmethod
    def train_examples(self, start: int, count: int) -> list[Example]:
        """Training examples at positions start .. start + count - 1 (deterministic)."""

    @abc.abstractmethod
    def eval_examples(self) -> list[Example]:
        """The held-out split, disjoint from the training problems."""

    @abc.abstractmethod
    def verify(self, completion: str, answer: str) -> float:
        """The task's built-in reward for a decoded completion."""

    def sft_examples(self, start: int, count: int) -> list[tuple[str, str]]:
        """(prompt, target) pairs for a supervised warm-up; the caller appends EOS."""
        raise NotImplementedError(f"{type(self).__name__} has no supervised warm-up data")

    @classmethod
    def from_config(cls, task, tokenizer: Tokenizer, **kwargs) -> Task:
        """The task of a run whose `task.name` is "package.module:ThisClass".

        `task` is the config's task section (`task.train_path`, `task.eval_path`,
        `task.seed`, `task.reward_fn`, ... as attributes); `tokenizer` the model's (or None
        for a run without `model.path`: then the task brings its own); `kwargs` what the
        trainer offers besides (`prompt_encode`, `max_prompt_len`, `long_prompts`,
        `eval_sets`, `num_eval`). The default is `cls(tokenizer, reward_fn=task.reward_fn
        or None)`; override it to read more of the config.
        """
        del kwargs
        return cls(tokenizer, reward_fn=task.reward_fn or None)

    def eval_sets(self) -> dict[str, list[Example]]:
        """The held-out sets by name; the default is {"held_out": `eval_examples()`}."""
        return {"held_out": self.eval_examples()}

    @property
    def reward_name(self) -> str:
        """What scores completions: the reward function's name, or the task's verifier."""
        if self._reward_fn is None:
            return self.verifier_name
        return callable_name(self._reward_fn)

    @property
    def verifier_name(self) -> str:
        """The task's own verifier (`verify`), by name."""
        return f"{type(self).__name__}.verify"

    @property
    def scorer(self) -> RewardFn:
        """`(completion, answer) -> reward`, what `reward` calls: the reward function, or
        `verify`. A task whose verifier is a picklable object returns that object, so
        scoring can run in worker processes with a timeout (`rollout.reward_timeout_s`)."""
        return self._reward_fn if self._reward_fn is not None else self.verify

    def reward(self, example: Example, completion_text: str) -> float:
        """Reward of `completion_text` (decoded, up to EOS) for `example`.

        Raises `RewardError` naming the function, the problem and the completion when the
        function raises or returns anything but a finite number."""
        try:
            return call_reward(self.scorer, completion_text, example.answer)
        except RewardFailure as failure:
            raise reward_error(self.reward_name, failure.reason, example, completion_text) from (
                failure.__cause__
            )


class RewardFailure(Exception):
    """A reward function raised or returned a non-number (`reason` says which)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def call_reward(fn: RewardFn, completion: str, answer: str) -> float:
    """`fn(completion, answer)` as a finite float; `RewardFailure` otherwise."""
    try:
        value = fn(completion, answer)
    except Exception as e:  # noqa: BLE001 (any error of the user's function is reported)
        raise RewardFailure(f"raised {type(e).__name__}: {e}") from e
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardFailure(f"returned {value!r}; expected a finite number")
    value = float(value)
    if not math.isfinite(value):
        raise RewardFailure(f"returned {value}; expected a finite number")
    return value


def reward_error(name: str, reason: str, example: Example, completion: str) -> RewardError:
    """The one-line error of a failed reward: function, problem id, completion's start."""
    head = completion[:200]
    return RewardError(
        f"{name} {reason} (problem {example.uid}, completion: {head!r}"
        f"{' ...' if len(completion) > 200 else ''})"
    )


def callable_name(fn) -> str:
    """ "module:qualname" of a function or method; a callable object's class otherwise."""
    if not hasattr(fn, "__qualname__"):
        fn = type(fn)
    return f"{getattr(fn, '__module__', '?')}:{fn.__qualname__}"
