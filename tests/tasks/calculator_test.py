"""The built-in tool-use task's pieces: its tools, its tool-call format and chat format."""

import pytest

from m2po_jax.tasks import calculator, tool_calls, tools


def test_the_calculators_compute_and_refuse_what_is_not_arithmetic():
    assert calculator.calculator("347*86") == "29842"
    assert calculator.calculator(" 12-345 ") == "-333"
    with pytest.raises(ValueError, match="expected 'a op b'"):
        calculator.calculator("3*4*5")
    py = calculator.python_calculator
    assert py("(48 - 12) / 4 * 2.5") == "22.5"
    assert py("7 / 2") == "3.5" and py("6 / 2") == "3" and py("7 // 2") == "3"
    assert py("sqrt(16) + 2**10 - abs(-3)") == "1025" and py("-(3 % 2)") == "-1"
    for bad in ('__import__("os")', "x + 1", "(1).real", "9 ** 999", "'a' * 3"):
        with pytest.raises(ValueError):
            py(bad)
    # Both are tools with a schema from their signature and docstring.
    schema = tools.tool(calculator.python_calculator).schema()["function"]
    assert schema["name"] == "python_calculator"
    assert schema["parameters"]["required"] == ["expression"]


def test_the_calc_format_reads_calls_and_refuses_half_calls():
    assert tool_calls.parse_tool_calls("calc", "(347*86)") == (
        "",
        [tool_calls.ToolCall("calculator", {"expression": "347*86"})],
    )
    assert tool_calls.parse_tool_calls("calc", "29842") == ("29842", [])
    for bad in ("(347*86", "(3)(4)", "((3*4)"):
        with pytest.raises(tool_calls.MalformedToolCall):
            tool_calls.parse_tool_calls("calc", bad)


def test_the_char_format_opens_with_the_prompt_and_appends_answers_then_equals():
    task = calculator.CalculatorTask(seed=0, eval_size=4)
    fmt, tok = task.chat_format(), task.tokenizer
    assert fmt.parser == "calc"
    assert fmt.prompt_ids([{"role": "user", "content": "12*34="}]) == [
        tok.bos_id,
        *tok.encode("12*34="),
    ]
    assert fmt.delta_ids([{"role": "tool", "content": "408"}]) == tok.encode("408=")
    # An answer the alphabet cannot spell (an error) shows as nothing.
    assert fmt.delta_ids([{"role": "tool", "content": "error: no"}]) == tok.encode("=")
    with pytest.raises(ValueError, match="expected one user message"):
        fmt.prompt_ids([{"role": "system", "content": "x"}, {"role": "user", "content": "1"}])
    assert all(e.prompt.count("*") == 1 for e in task.eval_examples())
