"""Tools from typed functions: schemas exactly as transformers makes them, checked calls."""

import enum
import sys
from typing import Literal, Optional

import pytest

from m2po_jax.tasks.tools import Tool, ToolArgumentError, call_tool, load_tools, tool


def add(a: int, b: float = 1.5) -> float:
    """Adds two numbers.

    Args:
        a: The first number.
        b: The second number, which
            spans two lines.

    Returns:
        The sum.
    """
    return a + b


def search(
    query: str,
    tags: list[int],
    exact: bool = False,
    limit: Optional[int] = None,  # noqa: UP045
) -> list[str]:
    """Searches the notes.

    A second paragraph that is not part of the description's first line.

    Args:
        query (str): What to look for.
        tags: Tag ids to match.
        exact: Whether to match the whole phrase.
        limit: At most this many results.
    """
    return [query] * (limit or 1)


class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


def convert(
    value: float | int,
    unit: Unit,
    mode: Literal["round", "floor", 3],
    fmt: str,
    pair: tuple[int, str],
    table: dict[str, int],
    amount: int | list[int] = 0,
    key: int | str | None = None,
):
    """Converts a temperature.

    Args:
        value: The temperature.
        unit: Its unit.
        mode: How to round.
        fmt: The output format (choices: ["short", "long"])
        pair: A pair.
        table: Names to numbers.
        amount: One amount or several.
        key: An optional key.
    """
    return {"value": value, "unit": unit}


class Weather:
    def forecast(self, city: str, days: int = 1) -> str:
        """The forecast for a city.

        Args:
            city: The city.
            days: How many days ahead.
        """
        return f"sunny in {city} for {days} days"


@pytest.mark.parametrize("fn", [add, search, convert, Weather().forecast], ids=lambda f: f.__name__)
def test_schema_is_transformers_get_json_schema(fn):
    from transformers.utils import get_json_schema

    made = tool(fn)
    assert made.schema() == get_json_schema(fn)
    assert made.name == fn.__name__ and made.fn is fn


def test_schema_contents():
    # Spelled out, so that an implementation and transformers cannot agree on a wrong shape.
    assert tool(add).schema() == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Adds two numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {
                        "type": "number",
                        "description": "The second number, which spans two lines.",
                    },
                },
                "required": ["a"],
            },
            "return": {"type": "number", "description": "The sum."},
        },
    }
    props = tool(convert).parameters["properties"]
    assert props["unit"] == {
        "type": "string",
        "enum": ["celsius", "fahrenheit"],
        "description": "Its unit.",
    }
    assert props["mode"]["type"] == ["string", "integer"]
    assert props["fmt"] == {
        "type": "string",
        "enum": ["short", "long"],
        "description": "The output format",
    }
    assert props["key"] == {
        "type": ["integer", "string"],
        "nullable": True,
        "description": "An optional key.",
    }
    assert tool(convert).parameters["required"] == ["value", "unit", "mode", "fmt", "pair", "table"]
    assert "self" not in tool(Weather().forecast).parameters["properties"]


def test_tool_accepts_a_tool_and_rejects_what_it_cannot_describe():
    made = tool(add)
    assert tool(made) is made

    def no_hint(x, y: int):
        """Doc.

        Args:
            x: an x.
            y: a y.
        """

    def no_description(x: int, y: int):
        """Doc.

        Args:
            x: an x.
        """

    def custom_type(p: Weather):
        """Doc.

        Args:
            p: a p.
        """

    def variadic(*xs: int):
        """Doc.

        Args:
            xs: the xs.
        """

    def undocumented(x: int):
        pass

    for fn, message in [
        (no_hint, r"no_hint'.*parameter 'x' has no type hint"),
        (no_description, r"no_description'.*parameter 'y' has no description under Args:"),
        (custom_type, r"custom_type'.*parameter 'p'.*no JSON schema"),
        (variadic, r"variadic'.*parameter 'xs' is variadic"),
        (undocumented, r"undocumented'.*no docstring"),
    ]:
        with pytest.raises(ValueError, match=message) as e:
            tool(fn)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="type 'object'"):
        Tool("t", "d", {"type": "array"}, add)


def test_load_tools_by_name(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(
        "from m2po_jax.tasks.tools import tool\n"
        "def ping(n: int) -> str:\n"
        '    """Pings.\n\n    Args:\n        n: how often.\n    """\n'
        "    return 'pong' * n\n"
        "PING = tool(ping)\n"
        "NOT_CALLABLE = 3\n"
        "def bad(x):\n"
        '    """Bad.\n\n    Args:\n        x: an x.\n    """\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        (ping,) = load_tools(["my_tools:ping"])
        assert ping.name == "ping" and call_tool(ping, {"n": 2}) == "pongpong"
        assert load_tools(["my_tools:PING"])[0].schema() == ping.schema()
        with pytest.raises(ValueError, match=r"agent.tools: tool name 'ping' is given twice"):
            load_tools(["my_tools:ping", "my_tools:PING"])
        with pytest.raises(
            ValueError, match=r"agent.tools 'my_tools:bad': parameter 'x' has no type hint"
        ):
            load_tools(["my_tools:bad"])
        with pytest.raises(TypeError, match=r"agent.tools 'my_tools:NOT_CALLABLE'"):
            load_tools(["my_tools:NOT_CALLABLE"])
        with pytest.raises(ValueError, match=r"env.tools 'my_tools:missing'.*no attribute"):
            load_tools(["my_tools:missing"], field="env.tools")
        with pytest.raises(ValueError, match="expected a list"):
            load_tools("my_tools:ping")
    finally:
        sys.modules.pop("my_tools", None)


def test_call_tool_returns_text():
    assert call_tool(tool(add), {"a": 2, "b": 0.25}) == "2.25"  # json.dumps of a float
    assert call_tool(tool(add), {"a": 1, "b": 2}) == "3"  # an int passes for a number
    assert call_tool(tool(add), {"a": 1}) == "2.5"  # a default
    assert call_tool(tool(Weather().forecast), {"city": "Oslo"}) == "sunny in Oslo for 1 days"
    assert call_tool(tool(search), {"query": "q", "tags": [], "limit": None}) == '["q"]'


def test_call_tool_checks_arguments_before_calling():
    calls = []

    def record(**kwargs):
        calls.append(kwargs)
        return "ok"

    base = tool(convert)
    checked = Tool(base.name, base.description, base.parameters, record)
    good = {
        "value": 1.5,
        "unit": "celsius",
        "mode": 3,
        "fmt": "long",
        "pair": [1, "a"],
        "table": {},
    }
    assert call_tool(checked, good) == "ok" and calls == [good]
    cases = [
        ({**good, "extra": 1}, "unknown argument 'extra'"),
        ({k: v for k, v in good.items() if k != "unit"}, "missing required argument 'unit'"),
        ({**good, "value": "1.5"}, "'value' expected integer or number, got string"),
        ({**good, "unit": "kelvin"}, "'unit' expected one of"),
        ({**good, "mode": True}, "'mode' expected one of"),  # a bool is not the integer 3
        ({**good, "mode": "ceil"}, "'mode' expected one of"),
        ({**good, "fmt": "medium"}, "'fmt' expected one of"),
        ({**good, "pair": [1]}, "'pair' expected 2 items, got 1"),
        ({**good, "pair": [1, 2]}, r"'pair\[1\]' expected string, got integer"),
        ({**good, "table": {"a": "x"}}, "'table.a' expected integer"),
        ({**good, "amount": [1, "2"]}, "'amount' expected integer or array"),
        ({**good, "key": 1.5}, "'key' expected integer or string or null, got number"),
    ]
    for arguments, message in cases:
        with pytest.raises(ToolArgumentError, match=message) as e:
            call_tool(checked, arguments)
        assert "\n" not in str(e.value) and "tool 'convert'" in str(e.value)
    assert len(calls) == 1  # none of the bad calls reached the function
    assert call_tool(checked, {**good, "amount": [1, 2], "key": None}) == "ok"

    integer = tool(add)
    for bad, got in [(True, "boolean"), (1.0, "number"), ("1", "string"), (None, "null")]:
        with pytest.raises(ToolArgumentError, match=f"'a' expected integer, got {got}"):
            call_tool(integer, {"a": bad})
    with pytest.raises(ToolArgumentError, match=r"'tags\[1\]' expected integer"):
        call_tool(tool(search), {"query": "q", "tags": [1, True]})
    with pytest.raises(ToolArgumentError, match="arguments must be an object"):
        call_tool(integer, [1])
    assert issubclass(ToolArgumentError, ValueError)


def test_exceptions_of_the_function_propagate():
    def boom(x: int) -> int:
        """Fails.

        Args:
            x: ignored.
        """
        raise ZeroDivisionError("nope")

    with pytest.raises(ZeroDivisionError, match="nope"):
        call_tool(tool(boom), {"x": 1})
