"""Tool calls in an assistant turn's text, per chat-template family.

    content, calls = parse_tool_calls("hermes", text)   # calls: [ToolCall(name, arguments)]

Families:
  hermes       Qwen2.5, Qwen3, Hermes: each call is
               `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (the
               arguments may also be a JSON string holding an object); text around the
               calls is the content.
  llama3_json  Llama 3.1 / 3.2 JSON tool calling: the whole message, optionally after
               `<|python_tag|>`, is `{"name": ..., "parameters": {...}}` ("arguments"
               accepted too), several separated by ";". A message that does not start with
               "{" is an answer.

A call the format recognises but cannot read raises `MalformedToolCall` (the episode
ends as a bad tool call). A task adds its own format with `register_parser`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable

Parser = Callable[[str], tuple[str, list["ToolCall"]]]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict


class MalformedToolCall(ValueError):
    """The text starts a tool call that cannot be read (what is wrong in the message)."""


def _call(obj, family: str, argument_keys: tuple[str, ...]) -> ToolCall:
    """The `ToolCall` of a decoded call object; MalformedToolCall saying what is wrong."""
    if not isinstance(obj, dict):
        raise MalformedToolCall(f"{family}: a call must be a JSON object, got {obj!r:.100}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedToolCall(f"{family}: the call has no 'name' string: {obj!r:.200}")
    key = next((k for k in argument_keys if k in obj), None)
    if key is None:
        raise MalformedToolCall(
            f"{family}: call {name!r} has no {' or '.join(map(repr, argument_keys))}"
        )
    arguments = obj[key]
    if isinstance(arguments, str):  # arguments written as a JSON string of an object
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise MalformedToolCall(
                f"{family}: call {name!r}: {key!r} is a string but not JSON ({e.msg}): "
                f"{obj[key]!r:.200}"
            ) from None
    if not isinstance(arguments, dict):
        raise MalformedToolCall(
            f"{family}: call {name!r}: {key!r} must be an object, got {arguments!r:.200}"
        )
    return ToolCall(name, arguments)


_HERMES_TAG = re.compile(r"</?tool_call>")


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """`<tool_call>{json}</tool_call>` blocks; the content is the text around them. A
    reasoning block (Qwen3's `<think>...</think>`) is not read: calls come after it (as
    reasoning parsers split it off before tool parsers run), and its text stays in the
    content."""
    thought, closed, answer = text.rpartition("</think>")
    if closed:
        content, calls = parse_hermes(answer)
        return (thought + closed + ("\n\n" + content if content else "")).strip(), calls
    content, calls, pos, opened = [], [], 0, None
    for tag in _HERMES_TAG.finditer(text):
        if tag[0] == "<tool_call>":
            if opened is not None:
                raise MalformedToolCall("hermes: <tool_call> opened inside another <tool_call>")
            content.append(text[pos : tag.start()])
            opened = tag.end()
            continue
        if opened is None:
            raise MalformedToolCall("hermes: </tool_call> without an opening <tool_call>")
        body = text[opened : tag.start()].strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            raise MalformedToolCall(
                f"hermes: <tool_call> body is not JSON ({e.msg} at char {e.pos}): {body!r:.200}"
            ) from None
        calls.append(_call(obj, "hermes", ("arguments",)))
        pos, opened = tag.end(), None
    if opened is not None:
        raise MalformedToolCall(
            f"hermes: <tool_call> opened but not closed: {text[opened:].strip()!r:.200}"
        )
    content.append(text[pos:])
    return "".join(content).strip(), calls


_SPACE = re.compile(r"\s*")
PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    """A message that is `{"name", "parameters"}` objects separated by ";" (content ""),
    optionally after `<|python_tag|>`; any other message is the content."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    if not body.startswith("{"):
        return text.strip(), []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            raise MalformedToolCall(
                f"llama3_json: call {len(calls) + 1} is not JSON ({e.msg} at char {e.pos}): "
                f"{body[pos:]!r:.200}"
            ) from None
        calls.append(_call(obj, "llama3_json", ("parameters", "arguments")))
        pos = _SPACE.match(body, pos).end()
        if pos < len(body):
            if body[pos] != ";":
                raise MalformedToolCall(
                    f"llama3_json: expected ';' or the end after call {len(calls)}, got "
                    f"{body[pos:]!r:.200}"
                )
            pos = _SPACE.match(body, pos + 1).end()
    return "", calls


PARSERS: dict[str, Parser] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def register_parser(family: str, fn: Parser) -> None:
    """Adds (or replaces) the parser of `family`: `fn(text) -> (content, calls)`, raising
    `MalformedToolCall` on a call it cannot read."""
    if not isinstance(family, str) or not family:
        raise ValueError(f"register_parser: family must be a non-empty string, got {family!r}")
    if not callable(fn):
        raise ValueError(f"register_parser {family!r}: fn is not callable ({fn!r})")
    PARSERS[family] = fn


def parser(family: str) -> Parser:
    """The parser of `family`; ValueError listing the known families."""
    if family not in PARSERS:
        raise ValueError(f"tool call format {family!r}: unknown; known: {', '.join(PARSERS)}")
    return PARSERS[family]


def parse_tool_calls(family: str, text: str) -> tuple[str, list[ToolCall]]:
    """(the content without the calls, stripped; the calls in order) of an assistant turn,
    read by `family`'s parser. MalformedToolCall on a call that cannot be read."""
    out = parser(family)(text)
    if (
        not isinstance(out, tuple)
        or len(out) != 2
        or not isinstance(out[0], str)
        or not isinstance(out[1], list)
        or not all(isinstance(c, ToolCall) for c in out[1])
    ):
        raise TypeError(
            f"tool call parser {family!r}: expected (str, [ToolCall, ...]), got {out!r:.200}"
        )
    return out


def family_of_template(source: str | None) -> str | None:
    """The tool-call family a chat template asks for: "hermes" when it mentions
    `<tool_call>`, "llama3_json" for Llama 3.x (`<|python_tag|>`, or `"parameters"` with
    `<|eot_id|>`), else None."""
    if not source:
        return None
    if "<tool_call>" in source:
        return "hermes"
    if PYTHON_TAG in source or ('"parameters"' in source and "<|eot_id|>" in source):
        return "llama3_json"
    return None
