"""Tool-call parsers per template family, read back from what the real templates write."""

import json
from pathlib import Path

import pytest

from m2po_jax.models import chat
from m2po_jax.tasks.tool_calls import (
    PARSERS,
    MalformedToolCall,
    ToolCall,
    family_of_template,
    parse_tool_calls,
    register_parser,
)

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
CALLS = [
    ToolCall("add", {"a": 1, "b": 2}),
    ToolCall("search", {"query": "a;b }", "tags": [1, 2], "nested": {"x": None}}),
]


def assistant_turn(template: str, message: dict, start: str, end: str) -> str:
    """The text the template writes for an assistant message with tool_calls."""
    text = chat.render(
        template,
        [{"role": "user", "content": "Q"}, message],
        add_generation_prompt=False,
        bos_token="",
        date_string="1 Jan 2025",
    )
    return text[text.rindex(start) + len(start) : text.rindex(end)]


def openai_calls(calls, as_string=False):
    return [
        {
            "type": "function",
            "function": {
                "name": c.name,
                "arguments": json.dumps(c.arguments) if as_string else c.arguments,
            },
        }
        for c in calls
    ]


@pytest.mark.parametrize(
    "name, content",
    [
        ("qwen2.5-instruct", "Let me look."),
        ("qwen3", "<think>\n\n</think>\n\nLet me look."),  # Qwen3 writes a last turn's think
    ],
)
def test_hermes_reads_what_qwen_templates_write(name, content):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    message = {"role": "assistant", "content": "Let me look.", "tool_calls": openai_calls(CALLS)}
    text = assistant_turn(template, message, "<|im_start|>assistant", "<|im_end|>")
    assert text.count("<tool_call>") == 2
    assert parse_tool_calls("hermes", text) == (content, CALLS)


def test_hermes_forms_and_content():
    text = (
        "Before.\n<tool_call>\n"
        '{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n'  # arguments as a JSON string
        "</tool_call>\nBetween.\n<tool_call>"
        + json.dumps({"name": CALLS[1].name, "arguments": CALLS[1].arguments})
        + "</tool_call>  "
    )
    assert parse_tool_calls("hermes", text) == ("Before.\n\nBetween.", CALLS)
    assert parse_tool_calls("hermes", "  The answer is 3.\n") == ("The answer is 3.", [])
    assert parse_tool_calls("hermes", "<think>\nhmm\n</think>\n\n42") == (
        "<think>\nhmm\n</think>\n\n42",
        [],
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ('ok <tool_call>\n{"name": "add", "arguments": {}}', "opened but not closed"),
        ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"na', "not closed"),
        ("<tool_call>\n{name: add}\n</tool_call>", "body is not JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no 'name' string"),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', "no 'name' string"),
        ('<tool_call>{"name": "add"}</tool_call>', "call 'add' has no 'arguments'"),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "must be an object"),
        ('<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>', "a string but not JSON"),
        ('<tool_call>{"name": "add", "arguments": "[1]"}</tool_call>', "must be an object"),
        ('<tool_call>["add"]</tool_call>', "must be a JSON object"),
        ("<tool_call><tool_call></tool_call>", "opened inside another"),
        ('{"name": "add"}</tool_call>', "without an opening"),
    ],
)
def test_hermes_malformed(text, message):
    with pytest.raises(MalformedToolCall, match=message) as e:
        parse_tool_calls("hermes", text)
    assert "\n" not in str(e.value)


def test_llama3_json_reads_what_the_llama_template_writes():
    template = (TEMPLATES / "llama-3.2-instruct.jinja").read_text()
    for calls in ([CALLS[0]], [CALLS[1]]):  # the template writes one call per message
        message = {"role": "assistant", "content": "", "tool_calls": openai_calls(calls)}
        text = assistant_turn(
            template, message, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"
        )
        assert text.startswith('{"name": ') and '"parameters": ' in text
        assert parse_tool_calls("llama3_json", text) == ("", calls)


def test_llama3_json_forms():
    two = (
        '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
        + json.dumps({"name": CALLS[1].name, "arguments": CALLS[1].arguments})  # ";" inside
        + " ;\n"
    )
    assert parse_tool_calls("llama3_json", two) == ("", CALLS)
    assert parse_tool_calls("llama3_json", ' \n{"name": "add", "parameters": {}}') == (
        "",
        [ToolCall("add", {})],
    )
    for answer in ["The answer is 3.", "  It is {a: 1} ", "<|python_tag|>print(1)"]:
        assert parse_tool_calls("llama3_json", answer) == (answer.strip(), [])


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"name": "add", "parameters": {"a": 1}', "call 1 is not JSON"),
        ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": ', "call 2 is not JSON"),
        ('{"name": "add", "parameters": {}} and some text', "expected ';' or the end after call 1"),
        ('{"name": "add"}', "call 'add' has no 'parameters' or 'arguments'"),
        ('{"parameters": {}}', "no 'name' string"),
        ('<|python_tag|>{"name": "add", "parameters": 3}', "must be an object"),
    ],
)
def test_llama3_json_malformed(text, message):
    with pytest.raises(MalformedToolCall, match=message):
        parse_tool_calls("llama3_json", text)


def test_registered_parser_and_unknown_family():
    def shout(text):
        if text.startswith("CALL "):
            return "", [ToolCall(text[5:], {})]
        return text, []

    register_parser("shout", shout)
    try:
        assert parse_tool_calls("shout", "CALL ping") == ("", [ToolCall("ping", {})])
        assert parse_tool_calls("shout", "hi") == ("hi", [])
        register_parser("shout", lambda text: (text, ["not a call"]))
        with pytest.raises(TypeError, match=r"parser 'shout': expected \(str, \[ToolCall"):
            parse_tool_calls("shout", "x")
    finally:
        PARSERS.pop("shout")
    with pytest.raises(ValueError, match="'shout': unknown; known: hermes, llama3_json"):
        parse_tool_calls("shout", "CALL ping")
    with pytest.raises(ValueError, match="not callable"):
        register_parser("x", "not a function")


def test_family_of_template():
    assert family_of_template((TEMPLATES / "qwen2.5-instruct.jinja").read_text()) == "hermes"
    assert family_of_template((TEMPLATES / "qwen3.jinja").read_text()) == "hermes"
    llama = (TEMPLATES / "llama-3.2-instruct.jinja").read_text()
    assert family_of_template(llama) == "llama3_json"
    assert family_of_template("{{ '<|python_tag|>' }}") == "llama3_json"  # Llama 3.1
    assert family_of_template(None) is None
    assert (
        family_of_template("{% for m in messages %}{{ m.content }}<|eot_id|>{% endfor %}") is None
    )


def test_hermes_reads_calls_after_the_reasoning_only():
    call = '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
    # A call drafted inside <think> is not made; the one after it is.
    text = f"<think>maybe {call} or <tool_call> unclosed</think>\n\n{call}"
    content, calls = parse_tool_calls("hermes", text)
    assert calls == [ToolCall("a", {"x": 1})]
    assert content.startswith("<think>maybe") and content.endswith("</think>")
    assert parse_tool_calls("hermes", "<think>r</think>\n\nIt is 4.") == (
        "<think>r</think>\n\nIt is 4.",
        [],
    )
