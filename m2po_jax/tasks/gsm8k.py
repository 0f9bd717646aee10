"""GSM8K-format math word problems with a numeric answer checker.

Each record has a question and an answer (keys / columns `question` and `answer` unless
configured); the answer ends with `#### <number>` (the GSM8K convention) or is the number
itself. The reward extracts the last number of the completion and compares it numerically
with the reference. Files are read as `problems.load_problems` reads them.
"""

from __future__ import annotations

from m2po_jax.tasks.problems import ProblemTask

DEFAULT_PROMPT_TEMPLATE = (
    "Solve the math problem step by step and end with the final numeric answer.\n"
    "Question: {question}\nAnswer:"
)


def format_number(value: float) -> str:
    """A canonical string: "72" for integral values, else the shortest float repr."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class GSM8KTask(ProblemTask):
    """GSM8K-format problems from local files (`problems.ProblemTask` with GSM8K's defaults).

    The reference is the text after the answer's `####`, as written (`1,002`); the reward
    compares the completion's last number with it (`NumericVerifier`); a reference that
    is not one plain number (`1/3`, `\\frac{1}{2}`) is refused naming its line: such data
    wants `task.name=math`. Arguments as `ProblemTask`; `prompt_template` names the
    problem `{question}` (or `{problem}`).
    """

    default_template = DEFAULT_PROMPT_TEMPLATE
    default_verifier = "numeric"


def __getattr__(name: str):
    # `numeric_reward` lives with the verifier it calls (m2po_jax.tasks.verifiers, which
    # imports this module); its old path still names it ("m2po_jax.tasks.gsm8k:numeric_reward").
    if name == "numeric_reward":
        from m2po_jax.tasks.verifiers import numeric_reward

        return numeric_reward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
