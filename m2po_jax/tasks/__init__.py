"""Tasks: prompts, reference answers and verifiers, by name.

task = make_task("arith", seed=0, ops="+-", max_digits=3)
task = make_task("gsm8k", path="train.jsonl", tokenizer=tok)
task = make_task("math", path="math_train.jsonl", tokenizer=tok, eval_sets={"math500": p})
task = make_task("my_pkg.tasks:MyTask", tokenizer=tok)   # a Task subclass of yours
"""

from __future__ import annotations

from typing import Any

from m2po_jax.tasks.arith import ArithTask, CharTokenizer
from m2po_jax.tasks.base import (
    Example,
    RewardFn,
    Task,
    Tokenizer,
    import_by_name,
    reward_fn_from_name,
)
from m2po_jax.tasks.calculator import CalculatorTask
from m2po_jax.tasks.gsm8k import GSM8KTask
from m2po_jax.tasks.math_problems import MathTask
from m2po_jax.tasks.problems import (
    ProblemTask,
    load_problems,
    parse_eval_sets,
    prompt_template_text,
)
from m2po_jax.tasks.verifiers import (
    VERIFIERS,
    Verifier,
    extract_last_number,
    make_verifier,
    numeric_reward,
)

TASKS: dict[str, type[Task]] = {
    "arith": ArithTask,
    "calculator": CalculatorTask,
    "gsm8k": GSM8KTask,
    "math": MathTask,
}


def task_class(name: str) -> type[Task]:
    """The task class registered as `name`, or imported from "package.module:Class"."""
    if name in TASKS:
        return TASKS[name]
    if ":" not in name:
        raise ValueError(
            f"task.name: unknown {name!r}; expected one of {sorted(TASKS)} or "
            "'package.module:TaskClass'"
        )
    target = import_by_name(name, "task.name")
    if not (isinstance(target, type) and issubclass(target, Task)):
        raise TypeError(
            f"task.name {name!r}: expected a subclass of m2po_jax.tasks.Task, got {target!r}"
        )
    return target


def make_task(name: str, **kwargs: Any) -> Task:
    """Builds the task `name` ("arith", "gsm8k", "math", or "package.module:Class") with its
    keyword arguments."""
    cls = task_class(name)
    try:
        return cls(**kwargs)
    except TypeError as e:
        # Wrong keyword names surface as a TypeError from __init__; say which task.
        if "argument" in str(e):
            raise TypeError(f"make_task({name!r}, ...): {e}") from e
        raise


__all__ = [
    "TASKS",
    "VERIFIERS",
    "ArithTask",
    "CharTokenizer",
    "Example",
    "GSM8KTask",
    "MathTask",
    "ProblemTask",
    "RewardFn",
    "Task",
    "Tokenizer",
    "Verifier",
    "extract_last_number",
    "load_problems",
    "make_task",
    "make_verifier",
    "numeric_reward",
    "parse_eval_sets",
    "prompt_template_text",
    "reward_fn_from_name",
    "task_class",
]
