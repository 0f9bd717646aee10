"""Tools a model may call, made from typed Python functions.

    def add(a: int, b: int) -> int:
        \"""Adds two integers.

        Args:
          a: the first summand.
          b: the second summand.
        \"""
        return a + b

    calc = tool(add)                     # Tool(name="add", parameters={...}, fn=add)
    calc.schema()                        # what chat templates list ({"type": "function", ...})
    call_tool(calc, {"a": 1, "b": 2})    # "3"

The schema follows transformers' `get_json_schema` rules (type hints: int, float, str,
bool, None, Any, list / tuple / dict and their parameters, Optional / Union, Literal,
Enum; a Google-style docstring gives the descriptions, a trailing `(choices: [...])` an
enum), so a template renders the same tool section as `apply_chat_template(tools=[fn])`
without transformers installed.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from m2po_jax.tasks.base import import_by_name

# transformers' docstring rules (utils/chat_template_utils.py), verbatim.
_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_ARG_SPLIT = re.compile(
    r"""
(?:^|\n)
([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*
(.*?)\s*
(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)
""",
    re.DOTALL | re.VERBOSE,
)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE = {**{t: {"type": name} for t, name in _SCALARS.items()}, list: {"type": "array"}}
_BARE |= {tuple: {"type": "array"}, dict: {"type": "object"}, Any: {}}


class ToolArgumentError(ValueError):
    """A call's arguments do not fit the tool's schema (the tool was not called)."""


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function the model may call, with the JSON schema of its parameters.

    `parameters` is {"type": "object", "properties": {...}, "required": [...]} ("required"
    left out when empty, as transformers does); `returns` the schema of the return type
    hint (rendered by templates that print whole tool schemas, so kept for parity).
    """

    name: str
    description: str
    parameters: dict
    fn: Callable
    returns: dict | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Tool.name: expected a non-empty string, got {self.name!r}")
        if not isinstance(self.parameters, Mapping) or self.parameters.get("type") != "object":
            raise ValueError(
                f"tool {self.name!r}: parameters must be a JSON schema of type 'object', "
                f"got {self.parameters!r}"
            )
        if not callable(self.fn):
            raise ValueError(f"tool {self.name!r}: fn is not callable ({self.fn!r})")

    def schema(self) -> dict:
        """{"type": "function", "function": {"name", "description", "parameters"}}: what
        `transformers.utils.get_json_schema(fn)` gives and chat templates expect."""
        function = {
            "name": self.name,
            "description": self.description,
            "parameters": copy.deepcopy(self.parameters),
        }
        if self.returns is not None:
            function["return"] = copy.deepcopy(self.returns)
        return {"type": "function", "function": function}


def tool(fn: Callable | Tool) -> Tool:
    """The `Tool` of a function with type hints and a Google-style docstring (a `Tool` is
    returned unchanged). ValueError naming the function and the parameter when a parameter
    has no type hint, no description under `Args:`, or a type with no JSON schema."""
    if isinstance(fn, Tool):
        return fn
    return _make_tool(fn, f"tool {getattr(fn, '__qualname__', fn)!r}")


def load_tools(names: Sequence[str], field: str = "agent.tools") -> list[Tool]:
    """The tools named "package.module:function" (or naming a `Tool`); ValueError naming
    `field` on a bad name or function, or when two share a tool name (TypeError when a
    name is neither a function nor a `Tool`)."""
    if isinstance(names, str):
        raise ValueError(f"{field}: expected a list of 'package.module:function', got {names!r}")
    tools, seen = [], {}
    for name in names:
        target = import_by_name(name, field)
        if isinstance(target, Tool):
            made = target
        elif callable(target):
            made = _make_tool(target, f"{field} {name!r}")
        else:
            raise TypeError(
                f"{field} {name!r}: expected a function or a Tool, got {type(target).__name__}"
            )
        if made.name in seen:
            raise ValueError(
                f"{field}: tool name {made.name!r} is given twice ({seen[made.name]!r}, {name!r})"
            )
        seen[made.name] = name
        tools.append(made)
    return tools


def call_tool(tool: Tool, arguments: Mapping) -> str:
    """`tool.fn(**arguments)` as text (a str as is, anything else JSON), after checking
    the arguments against the schema: unknown or missing ones, or a wrong JSON type
    (an int passes for a number, a bool does not pass for an integer), raise
    `ToolArgumentError` without calling. Exceptions of the function propagate."""
    if not isinstance(arguments, Mapping):
        raise ToolArgumentError(
            f"tool {tool.name!r}: arguments must be an object, got {type(arguments).__name__}"
        )
    properties = tool.parameters.get("properties", {})
    for key in arguments:
        if key not in properties:
            raise ToolArgumentError(
                f"tool {tool.name!r}: unknown argument {key!r} (expected: "
                f"{', '.join(properties) or 'none'})"
            )
    for key in tool.parameters.get("required", ()):
        if key not in arguments:
            raise ToolArgumentError(f"tool {tool.name!r}: missing required argument {key!r}")
    for key, value in arguments.items():
        problem = _check(value, properties[key], key)
        if problem is not None:
            raise ToolArgumentError(f"tool {tool.name!r}: argument {problem}")
    result = tool.fn(**arguments)
    return result if isinstance(result, str) else json.dumps(result)


def _make_tool(fn: Callable, where: str) -> Tool:
    if not callable(fn):
        raise TypeError(f"{where}: expected a function, got {type(fn).__name__}")
    doc = inspect.getdoc(fn)
    if not doc:
        raise ValueError(f"{where}: has no docstring (it gives the tool's descriptions)")
    description, arg_docs, return_doc = _parse_docstring(doc.strip())
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # noqa: BLE001 (an unresolvable annotation, reported in one line)
        raise ValueError(
            f"{where}: cannot resolve its type hints ({type(e).__name__}: {e})"
        ) from None
    params = list(inspect.signature(fn).parameters.values())
    # A method's receiver (an unannotated first `self` / `cls`) is not an argument.
    if params and params[0].name in ("self", "cls") and params[0].annotation is params[0].empty:
        params = params[1:]
    properties, required = {}, []
    for param in params:
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise ValueError(
                f"{where}: parameter {param.name!r} is {param.kind.description}; a tool takes "
                "named parameters only"
            )
        if param.name not in hints:
            raise ValueError(f"{where}: parameter {param.name!r} has no type hint")
        if param.name not in arg_docs:
            raise ValueError(f"{where}: parameter {param.name!r} has no description under Args:")
        try:
            schema = _type_schema(hints[param.name])
        except TypeError as e:
            raise ValueError(f"{where}: parameter {param.name!r}: {e}") from None
        text = arg_docs[param.name]
        choices = _CHOICES.search(text)
        if choices:
            try:
                values = json.loads(choices[1])
            except json.JSONDecodeError:
                raise ValueError(
                    f"{where}: parameter {param.name!r}: (choices: ...) must be a JSON list, "
                    f"got {choices[1]!r}"
                ) from None
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in values]
            text = text[: choices.start()].strip()
        schema["description"] = text
        properties[param.name] = schema
        if param.default is param.empty:
            required.append(param.name)
    parameters = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    returns = None
    if "return" in hints:
        try:  # the model never writes the return value: a hint without a schema is left out
            returns = _type_schema(hints["return"])
        except TypeError:
            pass
        else:
            if return_doc is not None:
                returns["description"] = return_doc
    return Tool(fn.__name__, description, parameters, fn, returns)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """(description, {argument: description}, returns) of a Google-style docstring."""
    description = _DESCRIPTION.search(doc)
    args = _ARGS.search(doc)
    returns = _RETURNS.search(doc)
    arg_docs = {}
    if args:
        block = "\n".join(line for line in args[1].split("\n") if line.strip())
        for match in _ARG_SPLIT.findall(block):
            arg_docs[match[1]] = re.sub(r"\s*\n+\s*", " ", match[2].strip())
    return (
        description[1].strip() if description else "",
        arg_docs,
        returns[1].strip() if returns else None,
    )


def _enum_schema(values: list) -> dict:
    names = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": names[0] if len(names) == 1 else names, "enum": values}


def _type_schema(hint) -> dict:
    """The JSON schema of a type hint, as transformers' `_parse_type_hint`; TypeError
    when the hint has none."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [member.value for member in hint]
        if not values or any(type(v) not in _SCALARS for v in values):
            raise TypeError(f"Enum {hint.__name__} needs members with JSON scalar values")
        return _enum_schema(values)
    if origin is None:
        if hint not in _BARE:
            raise TypeError(f"no JSON schema for the type hint {hint!r}")
        return dict(_BARE[hint])
    if origin is typing.Union or origin is types.UnionType:
        subtypes = [_type_schema(t) for t in args if t is not type(None)]
        if len(subtypes) == 1:
            out = subtypes[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subtypes):
            names = sorted({s["type"] for s in subtypes})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subtypes}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is typing.Literal and args:
        if any(type(a) not in _SCALARS for a in args):
            raise TypeError(f"Literal values must be JSON scalars, got {hint!r}")
        return _enum_schema(list(args))
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise TypeError(f"tuple hints need two or more fixed items (use list[...]): {hint!r}")
        return {"type": "array", "prefixItems": [_type_schema(t) for t in args]}
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = _type_schema(args[1])
        return out
    raise TypeError(f"no JSON schema for the type hint {hint!r}")


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _is_type(value, name: str) -> bool:
    actual = _json_type(value)
    if name == "number":
        return actual in ("integer", "number")
    if name in ("integer", "string", "boolean", "null", "array", "object"):
        return actual == name
    return True  # a type JSON does not define (a hand-written schema's): not checked


def _describe(schema: Mapping) -> str:
    if "enum" in schema:
        text = f"one of {json.dumps(schema['enum'])}"
    elif "anyOf" in schema:
        text = " or ".join(_describe(s) for s in schema["anyOf"])
    else:
        names = schema.get("type", "any value")
        text = " or ".join(names) if isinstance(names, list) else names
    return text + (" or null" if schema.get("nullable") else "")


def _check(value, schema: Mapping, path: str) -> str | None:
    """What is wrong with `value` under `schema` ("'x[1]' expected integer, got string
    'a'"), or None when it fits."""
    if value is None and schema.get("nullable"):
        return None
    wrong = f"{path!r} expected {_describe(schema)}, got {_json_type(value)} {value!r}"
    if "anyOf" in schema:
        return None if any(_check(value, s, path) is None for s in schema["anyOf"]) else wrong
    names = schema.get("type")
    if names is not None:
        names = names if isinstance(names, list) else [names]
        if not any(_is_type(value, name) for name in names):
            return wrong
    if "enum" in schema and not any(
        value == e and isinstance(value, bool) == isinstance(e, bool) for e in schema["enum"]
    ):
        return wrong
    if isinstance(value, (list, tuple)):
        items = schema.get("prefixItems")
        if items is not None and len(items) != len(value):
            return f"{path!r} expected {len(items)} items, got {len(value)}"
        for i, item in enumerate(value):
            item_schema = items[i] if items is not None else schema.get("items")
            if item_schema is not None and (problem := _check(item, item_schema, f"{path}[{i}]")):
                return problem
    if isinstance(value, Mapping) and "additionalProperties" in schema:
        for key, item in value.items():
            problem = _check(item, schema["additionalProperties"], f"{path}.{key}")
            if problem:
                return problem
    return None
