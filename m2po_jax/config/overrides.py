"""Overrides on a ConfigDict: nested YAML / JSON files (AReaL-style) and dotted keys.

Unknown keys are refused with the closest valid key; values must have the field's type.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ml_collections

from m2po_jax.common.checks import did_you_mean
from m2po_jax.common.errors import ConfigError

_FLOAT = re.compile(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*|\s*[-+]?(inf|nan)\s*", re.I)


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict, prefix: str = "") -> None:
    """Overlays a nested dict (from YAML/JSON) onto `config`, rejecting unknown keys."""
    for key, value in overrides.items():
        full = f"{prefix}{key}"
        if key not in config:
            valid = [f"{prefix}{k}" for k in config.keys()]
            raise ConfigError(
                f"unknown config key {full!r} in overrides{did_you_mean(full, valid)}"
            )
        current = config[key]
        if isinstance(current, ml_collections.ConfigDict):
            if not isinstance(value, dict):
                raise ConfigError(f"{full}: expected a section (mapping), got {value!r}")
            apply_overrides(current, value, full + ".")
        else:
            value = _yaml_float(config, key, value)
            kind = _field_type(config, key)
            # ConfigDict would store True as 1.0 in a number field, and 1 as True in a bool one.
            if isinstance(value, bool) and kind in (int, float):
                what = "an integer" if kind is int else "a number"
                raise ConfigError(f"{full}: expected {what}, got {value!r}")
            if kind is bool and value is not None and not isinstance(value, bool):
                raise ConfigError(f"{full}: expected true or false, got {value!r}")
            try:
                with config.unlocked():
                    config[key] = value
            except (TypeError, ValueError):
                # ConfigDict refuses a value of another type than the default's (for a
                # placeholder whose value is None: the type it was declared with).
                kind = type(current).__name__
                if current is None:
                    kind = config.get_ref(key).get_type().__name__
                raise ConfigError(f"{full}: expected a {kind}, got {value!r}") from None


def _field_type(config: ml_collections.ConfigDict, key: str) -> type:
    current = config[key]
    return type(current) if current is not None else config.get_ref(key).get_type()


def _yaml_float(config: ml_collections.ConfigDict, key: str, value: Any) -> Any:
    """`1e-8` for a float field: PyYAML reads exponents without a dot as strings."""
    if isinstance(value, str) and _field_type(config, key) is float and _FLOAT.fullmatch(value):
        return float(value)
    return value


def dotted_keys(config: ml_collections.ConfigDict, prefix: str = "") -> set[str]:
    """Every leaf key of `config`, dotted ("actor.optimizer.lr")."""
    keys = set()
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            keys |= dotted_keys(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys


def overlay_file(
    config: ml_collections.ConfigDict,
    path: str,
    verl_args: dict | None = None,
    native_keys: Iterable[str] = (),
) -> list[str]:
    """Applies an overrides file: this config's nested keys, or an AReaL experiment file
    (`m2po_jax.config.areal`), either beside verl's `algorithm.rollout_correction` section
    (`m2po_jax.config.verl`); `${a.b}` interpolations are resolved in all. `verl_args`: verl
    keys of the command line (they win over the file's), `native_keys`: this config's keys
    it sets (none may be one a verl section decides). Returns the AReaL launcher keys that
    were ignored."""
    from m2po_jax.config import areal, verl

    data = areal.resolve(load_overrides(path), path)
    data, section = verl.split(data, path)
    ignored: list[str] = []
    if not areal.is_areal_file(data):
        apply_overrides(config, data)
        keys = _leaf_keys(data)
    else:
        dotted, ignored = areal.translate(data, dotted_keys(config), path)
        apply_dotted(config, dotted)
        keys = set(dotted)
    apply_verl(config, {**section, **(verl_args or {})}, {*keys, *native_keys}, path)
    return ignored


def apply_verl(
    config: ml_collections.ConfigDict, section: dict, native_keys: Iterable[str], source: str
) -> None:
    """verl's `algorithm.rollout_correction` keys (`section`, without the prefix) over
    `config`; refused beside any of `native_keys` that a verl section decides."""
    from m2po_jax.config import verl

    if not section:
        return
    sections = tuple(f"{name}." for name in verl.CORRECTION_SECTIONS)
    clash = sorted(k for k in native_keys if k.startswith(sections))
    if clash:
        raise ConfigError(
            f"{source}: {verl.PREFIX} decides {' and '.join(verl.CORRECTION_SECTIONS)} "
            f"whole, and {clash[0]} is set too: use verl's keys or these, not both"
        )
    apply_dotted(config, verl.translate(section, source))


def _leaf_keys(node: dict, prefix: str = "") -> set[str]:
    """The dotted keys of a nested overrides dict."""
    keys = set()
    for key, value in node.items():
        if isinstance(value, dict):
            keys |= _leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys


def apply_dotted(config: ml_collections.ConfigDict, values: dict) -> None:
    """`apply_overrides` for {"section.field": value} keys, as the command line writes them."""
    for dotted, value in values.items():
        *parents, leaf = dotted.split(".")
        nested: dict = {leaf: value}
        for name in reversed(parents):
            nested = {name: nested}
        apply_overrides(config, nested)


def load_overrides(path: str) -> dict:
    """Reads a YAML or JSON overrides file."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--overrides: file {path!r} does not exist")
    if file.suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(f"--overrides: {path!r} must end in .yaml, .yml or .json")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if file.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg})") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--overrides: {path!r} must hold a mapping at the top level")
    return data
