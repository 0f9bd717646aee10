"""Verifiers: is a completion's final answer the reference's? One interface, two readings.

    verifier = make_verifier("math")          # or "numeric"
    verifier.check_reference("\\frac{1}{2}")   # ValueError if it cannot read the reference
    verifier("... so \\boxed{0.5}", "\\frac{1}{2}")   # 1.0

`numeric` (GSM8K): the completion's last number (`extract_last_number`) equals the
reference within 1e-6. The reference must be one plain number as GSM8K writes them: a sign,
digits with thousands grouped by commas, decimals, a leading `$`, a trailing `%` (`72`,
`1,234`, `-5`, `$18`, `-$5`, `0.5`, `15%`). Anything else (`1/3`, `\\frac{1}{2}`, `1e3`,
`x^2+1`, `(2, 3)`) is refused: read as a number it would become another one.

`math` (competition math): HuggingFace's math-verify. The completion's answer is what its
default extraction finds: its `\\boxed{}` (or `\\fbox{}`) answers first, several boxes read
together as one set (so hedging between two answers scores 0); else what follows "the
answer is" / "Answer:"; else its last LaTeX or plain expression. The reference is read as a
plain number when it is one (`1e3` and `1,000` are 1000), else as LaTeX, else as a plain
expression that is the whole reference; one that none of these reads (`0.\\overline{3}`,
`???`) is refused. The two are compared as mathematics (sympy): fractions, radicals,
intervals, tuples, sets, matrices, polynomials, `\\text{}` answers, with `\\%` (25\\% is 25
or 0.25), degrees and `\\text{}` units normalised. Its own signal-based timeouts are
off: the caller bounds the time (`rollout.rewards.RewardScorer`), since an alarm works only
in a main thread.
"""

from __future__ import annotations

import abc
import decimal
import functools
import re
from collections.abc import Callable

TOLERANCE = 1e-6

# A sign counts only when it is not a hyphen or minus between two terms ("5-3", "x-3").
# Thousands separators must group by three, so "1,2,3" reads as three numbers.
_NUMBER_RE = re.compile(
    r"(?P<sign>(?<![0-9A-Za-z)])-)?\$?(?P<number>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
)


def extract_last_number(text: str) -> float | None:
    """The last number in `text` ("The answer is $1,234.50." -> 1234.5), or None.

    Commas, "$" and trailing units or "%" are ignored; a leading "-" makes it negative.
    """
    matches = _NUMBER_RE.findall(text)
    if not matches:
        return None
    sign, number = matches[-1]
    value = float(number.replace(",", ""))
    return -value if sign else value


RewardFn = Callable[[str, str], float]

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) of `text`, nested braces
    included; None when there is none or its braces do not close."""
    starts = [m.end() for m in _BOX.finditer(text)]
    if not starts:
        return None
    start = starts[-1]
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None  # the last box does not close


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


# One plain number as GSM8K writes its answers: a sign, digits (thousands grouped by commas),
# decimals, a leading "$" (before or after the sign), a trailing "%".
_PLAIN_NUMBER = re.compile(r"(?:-\$?|\$-?)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?%?")


class NumericVerifier(Verifier):
    """GSM8K's check: the completion's last number equals the reference number."""

    name = "numeric"

    def check_reference(self, reference: str) -> None:
        text = reference.strip()
        if not text:
            raise ValueError("empty reference")
        if not _PLAIN_NUMBER.fullmatch(text):
            raise ValueError(
                f"{text[:60]!r} is not a plain number; task.verifier='math' reads fractions, "
                "LaTeX, intervals and tuples"
            )

    def __call__(self, completion: str, reference: str) -> float:
        """Raises ValueError (`check_reference`'s) for a reference that is not a plain number."""
        self.check_reference(reference)
        value = float(re.sub(r"[$,%]", "", reference.strip()))
        predicted = extract_last_number(completion)
        if predicted is None:
            return 0.0
        return 1.0 if abs(predicted - value) <= TOLERANCE else 0.0


def numeric_reward(completion: str, answer: str) -> float:
    """1.0 if the last number of `completion` equals the reference of `answer` (the text
    after its last `####`, or its last `\\boxed{}`, else the whole text; |diff| <= 1e-6),
    as the trainer's GSM8K reward scores it (`NumericVerifier`).

    Raises ValueError when the reference is not one plain number (`1/3`, `\\frac{1}{2}`):
    reading its last digits would score a wrong answer right; such answers want
    `MathVerifier` (task.verifier='math')."""
    return NumericVerifier()(completion, extract_reference(answer))


# A plain number for math-verify: its expression reader takes "1e3" for 1 and its LaTeX
# reader for 1*e*3, so such a reference is written out first (`_plain_number`).
_FLOATISH = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def _plain_number(text: str) -> str:
    """A `_FLOATISH` number as math-verify's expression reader reads it: "1e3" -> "1000",
    "1,000" -> "1000", "2.5e-400" -> "2.5*10**(-400)" (no 400 digits)."""
    value = decimal.Decimal(text.replace(",", ""))
    exponent = value.adjusted()
    if abs(exponent) <= 100:
        return format(value, "f")
    return f"{format(value.scaleb(-exponent), 'f')}*10**({exponent})"


# LaTeX already between math delimiters ("$x$", "\\(x\\)", "\\[x\\]"; not an escaped "\\$").
_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[")


def _read(text: str, latex: bool) -> tuple:
    """math-verify's reading of `text` as LaTeX or as a plain expression; () unless it is a
    mathematical object (not only the raw string `parse` falls back to). A plain expression
    must be the whole text: that reader picks a number out of anything ("\\approx 3" -> 3,
    "0.\\overline{3}" -> 0)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse
    from sympy import Basic, MatrixBase

    config = LatexExtractionConfig() if latex else ExprExtractionConfig()
    parsed = parse(text, [config], parsing_timeout=None, raise_on_error=False)
    if not any(isinstance(p, (Basic, MatrixBase)) for p in parsed):
        return ()
    if not latex:
        matched = next((p for p in parsed if isinstance(p, str)), "")
        if "".join(matched.split()) != "".join(text.split()):
            return ()
    return tuple(parsed)


@functools.lru_cache(maxsize=4096)
def _gold(reference: str) -> tuple:
    """The reference as math-verify reads it (cached: a group's completions share one
    reference): a plain number as that number, else LaTeX, else a plain expression; ()
    when none reads it."""
    text = reference.strip()
    if not text:
        return ()
    if _FLOATISH.fullmatch(text):
        return _read(_plain_number(text), latex=False)
    latex = text if _DELIMITED.search(text) else f"${text}$"
    return _read(latex, latex=True) or _read(text, latex=False)


_FBOX = re.compile(r"\\fbox(?=\s*\{)")


class MathVerifier(Verifier):
    """math-verify's equivalence of the completion's answer and the reference."""

    name = "math"
    may_hang = True

    def check_reference(self, reference: str) -> None:
        if not reference.strip():
            raise ValueError("empty reference")
        if not _gold(reference):
            raise ValueError(
                f"math-verify cannot read {reference.strip()[:60]!r} as LaTeX, a number or an "
                "expression"
            )

    def __call__(self, completion: str, reference: str) -> float:
        """Raises ValueError (`check_reference`'s) for a reference math-verify cannot read."""
        from math_verify import parse, verify

        gold = _gold(reference)
        if not gold:
            self.check_reference(reference)
        completion = _FBOX.sub(r"\\boxed", completion)  # math-verify reads only \boxed
        predicted = parse(completion, parsing_timeout=None, raise_on_error=False)
        if not predicted:
            return 0.0
        ok = verify(list(gold), predicted, timeout_seconds=None, raise_on_error=False)
        return 1.0 if ok else 0.0


VERIFIERS: dict[str, type[Verifier]] = {"math": MathVerifier, "numeric": NumericVerifier}


def make_verifier(name: str) -> Verifier:
    """The verifier named `name` (`VERIFIERS`)."""
    if name not in VERIFIERS:
        raise ValueError(f"task.verifier: unknown {name!r}; expected one of {sorted(VERIFIERS)}")
    return VERIFIERS[name]()
