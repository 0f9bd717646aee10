"""How a config field is declared: `knob(default, doc, ...)` and `section(cls, doc)`.

A field of a section dataclass (`config_schema`) declared with `knob` carries a `Knob` in
its metadata: its doc and what it allows. What is read from the declarations: the
ConfigDict of defaults (`default_configdict`), the check of a built config
(`check_declared`), and the manual's field tables (`fields`, by docs/hooks.py).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from typing import Any

import ml_collections
from ml_collections.config_dict import placeholder

from m2po_jax.common.checks import check_choice, check_range, interval
from m2po_jax.common.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Knob:
    """What one field means and allows: its doc, and a range or a tuple of choices."""

    doc: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple | None = None

    def allowed(self) -> str:
        """The allowed values as the manual shows them: `[0.0, 1.0)`, `sort | bisect`, or
        "" where any value of the type is allowed."""
        if self.choices is not None:
            return " | ".join('""' if c == "" else str(c) for c in self.choices)
        if self.low is None and self.high is None:
            return ""
        return interval(self.low, self.high, self.low_open, self.high_open)

    def check(self, where: str, value: Any) -> None:
        """Raises ConfigError naming `where` unless `value` is allowed (None always is: an
        unset optional field; a float must be finite)."""
        if self.choices is not None:
            check_choice(where, value, self.choices, error=ConfigError)
        elif self.low is not None or self.high is not None or isinstance(value, float):
            check_range(
                where, value, self.low, self.high, self.low_open, self.high_open, ConfigError
            )


def knob(
    default: Any,
    doc: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    choices: tuple | None = None,
) -> Any:
    """A field's declaration: `eps_clip: float | None = knob(0.2, "...", low=0.0, high=1.0,
    high_open=True)`; `None` as default makes it optional (unset until a config sets it)."""
    spec = Knob(doc, low, high, low_open, high_open, None if choices is None else tuple(choices))
    return dataclasses.field(default=default, metadata={"knob": spec})


def section(cls: type, doc: str = "") -> Any:
    """A nested section's declaration: `lora: LoraSection = section(LoraSection, "...")`."""
    return dataclasses.field(default_factory=cls, metadata={"section": doc})


def fields(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """(dotted path, field) of every section and field of the section dataclass `cls`, in
    declaration order, each section before its own fields."""
    for f in dataclasses.fields(cls):
        yield prefix + f.name, f
        if "section" in f.metadata:
            yield from fields(f.default_factory, f"{prefix}{f.name}.")


def knobs(cls: type) -> Iterator[tuple[str, Knob]]:
    """(dotted path, Knob) of every field (not the sections) under `cls`, in order."""
    for path, f in fields(cls):
        if "knob" in f.metadata:
            yield path, f.metadata["knob"]


def check_declared(cfg: Any) -> None:
    """Checks every field of a built config (a `Config` or one of its sections) against
    its declaration, in declaration order; raises ConfigError naming the first bad one."""
    for path, spec in knobs(type(cfg)):
        value = cfg
        for part in path.split("."):
            value = getattr(value, part)
        spec.check(path, value)


def _optional_type(tp: Any) -> type:
    """The type a `placeholder` of a field annotated `tp` holds: `float | None` -> float."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def default_configdict(cls: type) -> ml_collections.ConfigDict:
    """The declared defaults of the section dataclass `cls` as a ConfigDict (of `Config`:
    `configs/default.py`): a section per nested section, `placeholder(type)` for a None
    default."""
    hints = typing.get_type_hints(cls)
    c = ml_collections.ConfigDict()
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            c[f.name] = default_configdict(f.default_factory)
        elif f.default is None:
            c[f.name] = placeholder(_optional_type(hints[f.name]))
        else:
            c[f.name] = f.default
    return c
