"""What every task provides: a tokenizer, deterministic train / eval examples, a reward.

The trainer checkpoints only an integer data position, so `train_examples(start, count)`
must return the same examples for the same seed and position after a restart.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

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
    if not isinstance(name, str) or name.count(":") != 1:
        raise ValueError(f"reward_fn: expected 'package.module:function', got {name!r}")
    module_name, attr_path = name.split(":")
    if not module_name or not attr_path:
        raise ValueError(f"reward_fn: expected 'package.module:function', got {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only a missing target module is the user's typo; a missing dependency of an
        # existing module is re-raised as is so its own name shows.
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(
                f"reward_fn {name!r}: module {module_name!r} not found (is it on PYTHONPATH?)"
            ) from e
        raise
    target = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise ValueError(
                f"reward_fn {name!r}: {getattr(target, '__name__', target)!r} has no attribute "
                f"{part!r}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(
            f"reward_fn {name!r}: expected a callable (completion, answer) -> float, "
            f"got {type(target).__name__}"
        )
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

    def reward(self, example: Example, completion_text: str) -> float:
        """Reward of `completion_text` (decoded, up to EOS) for `example`."""
        fn = self._reward_fn if self._reward_fn is not None else self.verify
        value = fn(completion_text, example.answer)
        try:
            return float(value)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"reward_fn {fn!r} returned {value!r}; expected a float-convertible number"
            ) from e
