"""Tasks: prompts, reference answers and verifiers, by name.

task = make_task("arith", seed=0, ops="+-", max_digits=3)
task = make_task("gsm8k", path="train.jsonl", tokenizer=tok)
"""

from __future__ import annotations

from typing import Any

from m2po_jax.tasks.arith import ArithTask, CharTokenizer
from m2po_jax.tasks.base import Example, RewardFn, Task, Tokenizer, reward_fn_from_name
from m2po_jax.tasks.gsm8k import GSM8KTask, extract_last_number, numeric_reward

TASKS: dict[str, type[Task]] = {"arith": ArithTask, "gsm8k": GSM8KTask}


def make_task(name: str, **kwargs: Any) -> Task:
    """Builds the task registered as `name` ("arith", "gsm8k") with its keyword arguments."""
    if name not in TASKS:
        raise ValueError(f"task name: unknown {name!r}; expected one of {sorted(TASKS)}")
    try:
        return TASKS[name](**kwargs)
    except TypeError as e:
        # Wrong keyword names surface as a TypeError from __init__; say which task.
        if "argument" in str(e):
            raise TypeError(f"make_task({name!r}, ...): {e}") from e
        raise


__all__ = [
    "TASKS",
    "ArithTask",
    "CharTokenizer",
    "Example",
    "GSM8KTask",
    "RewardFn",
    "Task",
    "Tokenizer",
    "extract_last_number",
    "make_task",
    "numeric_reward",
    "reward_fn_from_name",
]
