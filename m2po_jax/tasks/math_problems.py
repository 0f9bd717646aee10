"""Competition math (MATH, AIME, AMC, Minerva, OlympiadBench): LaTeX answers, math-verify.

The records are as Hugging Face's MATH-style datasets have them: `problem`, and the
reference under `answer` or, without one, the last `\\boxed{...}` of `solution`. The
reward is HuggingFace's math-verify (`verifiers.MathVerifier`): fractions, radicals,
intervals, tuples, sets and plain numbers compared as mathematics, not as text. The
default prompt asks for the answer in `\\boxed{}`, the Qwen math prompt M2PO's
experiments use; with a base model (no chat template) it is the whole prompt.
"""

from __future__ import annotations

from m2po_jax.tasks.problems import ProblemTask

BOXED_TEMPLATE = (
    "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
)


class MathTask(ProblemTask):
    """Competition-math problems from local files (`problems.ProblemTask` with MATH's
    defaults: `problem` / `answer` / `solution` keys, the `\\boxed{}` prompt, math-verify)."""

    default_template = BOXED_TEMPLATE
    default_verifier = "math"
    default_question_key = "problem"
    default_solution_key = "solution"
