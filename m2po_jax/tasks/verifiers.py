"""Verifiers: is a completion's final answer the reference's? One interface, two readings.

    verifier = make_verifier("math")          # or "numeric"
    verifier.check_reference("\\frac{1}{2}")   # ValueError if it cannot read the reference
    verifier("... so \\boxed{0.5}", "\\frac{1}{2}")   # 1.0

`numeric` (GSM8K): the completion's last number equals the reference, a single plain number
(`72`, `1,234`, `-5`, `$18`, `0.5`, `15%`), within 1e-6. A reference that is anything else
(`1/3`, `\\frac{1}{2}`, `1e3`, `x^2+1`, `(2, 3)`) is refused: read as a number it would
become another one.

`math` (competition math): HuggingFace's math-verify. The completion's answer is its last
`\\boxed{}` when it has one, else the last LaTeX or plain expression; the reference is read
as LaTeX (or as a plain number); the two are compared as mathematics (sympy): fractions,
radicals, intervals, tuples, sets, matrices, `\\text{}` answers, with percentages and units
normalised. Its own signal-based timeouts are off: the caller bounds the time
(`rollout.rewards.RewardScorer`), since an alarm works only in a main thread.
"""

from __future__ import annotations

import abc
import functools
import re
from collections.abc import Callable

from m2po_jax.tasks.gsm8k import TOLERANCE, extract_last_number

RewardFn = Callable[[str, str], float]

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) of `text`, nested braces
    included; None when there is none or its braces do not close."""
    starts = [m.end() for m in _BOX.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
        return None  # the last box does not close
    return None


def extract_reference(text: str) -> str:
    """A reference answer as a dataset gives it: the last `\\boxed{}`'s content, else the
    text after the last `####` (GSM8K), else the whole text; stripped, never converted."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return text.strip()


class Verifier(abc.ABC):
    """Scores a completion against a reference answer: 1.0 right, 0.0 not."""

    name: str = ""
    # True when one call can take unbounded time on adversarial input: the trainer then
    # scores in worker processes where a timeout can stop it (`RewardScorer`).
    may_hang: bool = False

    @abc.abstractmethod
    def check_reference(self, reference: str) -> None:
        """Raises ValueError (a one-line reason) if this verifier cannot read `reference`."""

    @abc.abstractmethod
    def __call__(self, completion: str, reference: str) -> float:
        """1.0 when the completion's answer is the reference's, else 0.0."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# One plain number as GSM8K writes its answers: sign, digits (thousands grouped by commas),
# decimals, a leading "$" or a trailing "%".
_PLAIN_NUMBER = re.compile(r"[-+]?\$?[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?%?|[-+]?\.\d+%?")


class NumericVerifier(Verifier):
    """GSM8K's check: the completion's last number equals the reference number."""

    name = "numeric"

    def check_reference(self, reference: str) -> None:
        text = reference.strip()
        if not text:
            raise ValueError("empty reference")
        if not _PLAIN_NUMBER.fullmatch(text):
            raise ValueError(
                f"{text[:60]!r} is not a plain number; task.verifier='math' (task.name=math) "
                "reads fractions, LaTeX, intervals, tuples and expressions"
            )

    def __call__(self, completion: str, reference: str) -> float:
        predicted = extract_last_number(completion)
        value = extract_last_number(reference)
        if predicted is None or value is None:
            return 0.0
        return 1.0 if abs(predicted - value) <= TOLERANCE else 0.0


_FLOATISH = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")


@functools.lru_cache(maxsize=4096)
def _gold(reference: str):
    """The reference as math-verify reads it (a tuple, cached: a group's completions share
    one reference); empty when it cannot."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    text = reference.strip()
    if _FLOATISH.fullmatch(text):  # a plain number: as a number ("1e3" is 1000, not 1*e*3)
        parsed = parse(text.replace(",", ""), [ExprExtractionConfig()], parsing_timeout=None)
        if parsed:
            return tuple(parsed)
    if "$" not in text and "\\(" not in text and "\\[" not in text:
        text = f"${text}$"
    parsed = parse(text, [LatexExtractionConfig()], parsing_timeout=None)
    if not parsed:
        parsed = parse(reference, [ExprExtractionConfig()], parsing_timeout=None)
    return tuple(parsed)


class MathVerifier(Verifier):
    """math-verify's equivalence of the completion's answer and the reference."""

    name = "math"
    may_hang = True

    def check_reference(self, reference: str) -> None:
        if not reference.strip():
            raise ValueError("empty reference")
        if not _gold(reference):
            raise ValueError(f"math-verify cannot read {reference[:60]!r} as LaTeX or a number")

    def __call__(self, completion: str, reference: str) -> float:
        from math_verify import parse, verify

        gold = _gold(reference)
        if not gold:
            return 0.0
        predicted = parse(completion, parsing_timeout=None)
        if not predicted:
            return 0.0
        return 1.0 if verify(list(gold), predicted, timeout_seconds=None) else 0.0


VERIFIERS: dict[str, type[Verifier]] = {"math": MathVerifier, "numeric": NumericVerifier}


def make_verifier(name: str) -> Verifier:
    """The verifier named `name` (`VERIFIERS`)."""
    if name not in VERIFIERS:
        raise ValueError(f"task.verifier: unknown {name!r}; expected one of {sorted(VERIFIERS)}")
    return VERIFIERS[name]()
