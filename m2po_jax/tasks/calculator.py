"""The built-in tool-use task: arithmetic with a calculator the model may call.

An episode, in the character tokenizer's tokens (`CharFormat`):

    prompt      347*86=
    turn 1      (347*86)<eos>       a call: the expression in parentheses ("calc" parser)
    appended    29842=              the calculator's answer, then "=" (not trained)
    turn 2      29842<eos>          the final answer, scored by the task

A small model does not learn three-digit products in minutes, but it learns to copy a
number it has read: with the tool it can be right, without it mostly not. The warm-up
shows the format: a share `tool_demos` of its examples are episodes that call the
calculator, the rest answer directly. RL then finds out which pays (`configs/arith.py:
calculator`: held-out accuracy and tool calls per episode rise together).

`python_calculator` is the tool for real checkpoints on GSM8K / MATH (`configs/gsm8k.py:
tools`): arithmetic expressions evaluated without running code.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Mapping, Sequence

import numpy as np

from m2po_jax.tasks import arith, tool_calls
from m2po_jax.tasks.base import Tokenizer, check_range

ALPHABET = arith.ALPHABET + "()"
PARSER = "calc"
_EXPRESSION = re.compile(r"(\d{1,9})([+\-*])(\d{1,9})")
_DEMO_STREAM = 3  # the warm-up's draws of which examples call the tool


def calculator(expression: str) -> str:
    """Evaluates an integer expression.

    Args:
      expression: two non-negative integers joined by +, - or *, e.g. "347*86".
    """
    match = _EXPRESSION.fullmatch(expression.strip())
    if match is None:
        raise ValueError(f"expected 'a op b' with integers a, b, got {expression!r}")
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max}


def python_calculator(expression: str) -> str:
    """Evaluates an arithmetic expression, as Python would.

    Numbers, + - * / // % **, parentheses and sqrt, abs, round, min, max; nothing else
    (no names, no attributes), so a model's expression cannot run code.

    Args:
      expression: an arithmetic expression, e.g. "(48 - 12) / 4 * 2.5".
    """
    tree = ast.parse(expression.strip(), mode="eval")

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp | ast.UnaryOp) and type(node.op) in _OPERATORS:
            args = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.operand,)
            args = [value(a) for a in args]
            if isinstance(node.op, ast.Pow) and abs(args[1]) > 100:
                raise ValueError(f"exponent {args[1]} is too large")
            return _OPERATORS[type(node.op)](*args)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCTIONS
            and not node.keywords
        ):
            return _FUNCTIONS[node.func.id](*[value(a) for a in node.args])
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    result = value(tree.body)
    if isinstance(result, float) and result.is_integer() and abs(result) < 2**53:
        result = int(result)
    return str(result)


def parse_calc(text: str) -> tuple[str, list[tool_calls.ToolCall]]:
    """A turn "(expression)" is a calculator call; one that opens "(" but is not that is
    malformed; anything else is an answer."""
    text = text.strip()
    if not text.startswith("("):
        return text, []
    if not text.endswith(")") or text.count("(") != 1 or text.count(")") != 1:
        raise tool_calls.MalformedToolCall(f"expected '(expression)', got {text!r}")
    return "", [tool_calls.ToolCall("calculator", {"expression": text[1:-1]})]


tool_calls.register_parser(PARSER, parse_calc)


class CharFormat:
    """The character tokenizer's chat format: the prompt is BOS and the user's text; an
    answer appended after a turn is each tool message's content and "=" (a content the
    alphabet cannot spell, such as an error, shows as nothing: "=")."""

    parser = PARSER  # the tool-call format the model is shown (agent.parser="auto")

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def prompt_ids(self, messages: Sequence[Mapping], tools: Sequence = ()) -> list[int]:
        del tools  # the format has no tool section: the calculator is the only tool
        if len(messages) != 1 or messages[0].get("role") != "user":
            raise ValueError(
                f"calculator task: expected one user message to open an episode, got {messages!r}"
            )
        return [self.tokenizer.bos_id, *self.tokenizer.encode(messages[0]["content"])]

    def delta_ids(self, messages: Sequence[Mapping]) -> list[int]:
        ids = []
        for message in messages:
            content = str(message.get("content", ""))
            try:
                ids += self.tokenizer.encode(content)
            except ValueError:
                pass  # not spellable in the alphabet: shown as an empty answer
        return ids + self.tokenizer.encode("=")


class CalculatorTask(arith.ArithTask):
    """`ArithTask` over an alphabet with parentheses, whose episodes may call `calculator`.

    Args:
      tool_demos: the share of warm-up examples that are calculator episodes (the rest
        answer directly).
      **kwargs: as `ArithTask` (ops defaults to "*", operands to 2-3 digits).
    """

    def __init__(self, *, tool_demos: float = 0.1, **kwargs):
        if not 0.0 <= tool_demos <= 1.0:
            raise ValueError(f"tool_demos: expected a share in [0, 1], got {tool_demos!r}")
        kwargs.setdefault("ops", "*")
        kwargs.setdefault("min_digits", 2)
        kwargs.setdefault("max_digits", 3)
        kwargs.setdefault("tokenizer", arith.CharTokenizer(ALPHABET))
        super().__init__(**kwargs)
        self.tool_demos = tool_demos

    def chat_format(self) -> CharFormat:
        return CharFormat(self.tokenizer)

    def sft_examples(self, start: int, count: int):
        """(prompt, segments): a direct answer [(answer, True)], or a calculator episode
        [("(a*b)", True), ("answer=", False), (answer, True)]; True = an assistant turn
        (trained, followed by EOS), False = appended by the environment (not trained)."""
        check_range(start, count)
        rng = np.random.default_rng([self.seed, _DEMO_STREAM, start])
        calls = rng.random(count) < self.tool_demos
        out = []
        for (prompt, answer), call in zip(super().sft_examples(start, count), calls, strict=True):
            if call:
                segments = [(f"({prompt[:-1]})", True), (f"{answer}=", False), (answer, True)]
            else:
                segments = [(answer, True)]
            out.append((prompt, segments))
        return out
