"""Input checks shared by the library and the config: one message format for each.

Library functions raise ValueError / TypeError; `m2po_jax.config` passes
`error=ConfigError` so that the same check names a config field instead.
"""

from __future__ import annotations

import difflib
import json
import math
import numbers
import os
from collections.abc import Iterable
from typing import Any


def check_choice(
    name: str, value: object, choices: Iterable, error: type[Exception] = ValueError
) -> None:
    """Raises `error("<name>=<value!r> is not one of [<choices>]")` unless `value` is one."""
    choices = tuple(choices)
    if value not in choices:
        raise error(f"{name}={value!r} is not one of {list(choices)}")


def interval(low=None, high=None, low_open: bool = False, high_open: bool = False) -> str:
    """An interval as the messages and the manual write it: `[0.0, 1.0)`, `(0.0, inf)`; an
    unbounded end is open (inf itself is never allowed)."""
    lo = "-inf" if low is None else str(low)
    hi = "inf" if high is None else str(high)
    text = ("(" if low_open or low is None else "[") + f"{lo}, {hi}"
    return text + (")" if high_open or high is None else "]")


def check_range(
    name: str,
    value: Any,
    low=None,
    high=None,
    low_open: bool = False,
    high_open: bool = False,
    error: type[Exception] = ValueError,
) -> None:
    """Raises `error("<name>=<value!r> is out of range; allowed <interval>")` unless `value`
    lies in the interval (None passes: an unset optional value); a non-finite float never
    does."""
    if value is None:
        return
    allowed = interval(low, high, low_open, high_open)
    if isinstance(value, float) and not math.isfinite(value):
        raise error(f"{name}={value!r} is not a finite number; allowed {allowed}")
    bad = (low is not None and (value <= low if low_open else value < low)) or (
        high is not None and (value >= high if high_open else value > high)
    )
    if bad:
        raise error(f"{name}={value!r} is out of range; allowed {allowed}")


def is_number(x: Any) -> bool:
    """True for a concrete Python / numpy real number (not a bool, not a jax array).

    A traced value is not a number here, so range checks skip it instead of failing
    under `jax.jit`.
    """
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def read_json(path: str | os.PathLike) -> Any:
    """The parsed JSON file at `path`, or None when there is no such file."""
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        try:
            return json.load(fh)
        except json.JSONDecodeError as e:  # a truncated or hand-edited file: name it
            raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from e


def did_you_mean(key: str, valid: Iterable[str]) -> str:
    """`"; did you mean 'x'?"` with the closest of `valid` to `key` ("" when none)."""
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.0)
    return f"; did you mean {match[0]!r}?" if match else ""
