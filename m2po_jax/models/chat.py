"""Chat templates, rendered exactly as transformers' `apply_chat_template` renders them.

    source = load_chat_template("/models/Qwen2.5-0.5B-Instruct")  # None when it has none
    text = render(source, [{"role": "user", "content": "1+1?"}], add_generation_prompt=True)

The jinja2 environment copies transformers' (sandboxed, `trim_blocks`, `lstrip_blocks`,
`loopcontrols`, `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML), so an
instruct checkpoint sees the prompt format it was tuned on without transformers installed.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

# The named special tokens transformers passes to every template (its `special_tokens_map`).
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
TEMPLATE_FILE = "chat_template.jinja"


def load_chat_template(path: str | os.PathLike, tokenizer_config: Mapping | None = None):
    """The checkpoint's chat template source, or None when it has none.

    `chat_template.jinja` beside the tokenizer wins over `chat_template` in
    tokenizer_config.json, as in transformers; a list of named templates gives "default".
    """
    file = os.path.join(os.fspath(path), TEMPLATE_FILE)
    if os.path.isfile(file):
        with open(file, encoding="utf-8") as fh:
            return fh.read()
    if tokenizer_config is None:
        config_file = os.path.join(os.fspath(path), "tokenizer_config.json")
        if not os.path.isfile(config_file):
            return None
        with open(config_file, encoding="utf-8") as fh:
            tokenizer_config = json.load(fh)
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use"}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        if "default" not in named:
            raise ValueError(
                f"{path}: tokenizer_config.json has chat templates {sorted(named)} but no "
                "'default' one"
            )
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}: chat_template must be a string, got {type(template).__name__}")
    return template or None


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes <, >, & for HTML; templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def compile_template(source: str):
    """The compiled template in an environment like transformers' (cached per source)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # Templates come from checkpoints, so they run sandboxed as transformers runs them.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat template: syntax error on line {e.lineno}: {e.message}") from e


def render(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """The template applied to `messages`; `tools` are JSON schemas of functions
    ({"type": "function", "function": {...}}, `tasks.tools.Tool.schema()`), listed as
    `apply_chat_template(tools=...)` lists them; `kwargs` (special tokens,
    `enable_thinking`, `date_string`, ...) become template variables, as its do."""
    return compile_template(source).render(
        messages=[dict(m) for m in messages],
        tools=None if tools is None else [dict(t) for t in tools],
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )


_PLACEHOLDER = "<M2PO_ASSISTANT_TURN>"


def turn_delta(
    source: str, messages: Sequence[Mapping[str, Any]], *, end_of_turn: str, **kwargs: Any
) -> str:
    """The text to append after an assistant turn's end-of-turn token (whose text is
    `end_of_turn`, e.g. "<|im_end|>", "<|eot_id|>") when `messages` (tool results, a user
    message) follow it: the template's rendering of them and the next assistant header.

    Multi-turn rollouts append it to the sampled tokens instead of rendering the history
    again, so earlier turns stay as sampled even where a template would re-render them
    (Qwen3 drops earlier `<think>` blocks). It is read off the template: a placeholder
    assistant turn after a user turn, rendered alone and followed by `messages` (with the
    generation prompt); the delta is what follows the placeholder's `end_of_turn` in the
    second. `kwargs` are `render`'s (tools, special tokens, ...). ValueError when the
    template renders the user turn differently once messages follow, does not write the
    assistant's content verbatim, or does not end its turn with `end_of_turn`.
    """
    if not end_of_turn:
        raise ValueError("turn_delta: end_of_turn must be the end-of-turn token's text, got ''")
    user = {"role": "user", "content": "PING"}
    assistant = {"role": "assistant", "content": _PLACEHOLDER}
    opening = render(source, [user], add_generation_prompt=False, **kwargs)
    alone = render(source, [user, assistant], add_generation_prompt=False, **kwargs)
    followed = render(source, [user, assistant, *messages], add_generation_prompt=True, **kwargs)
    # The assistant turn itself may render differently when it is not the last message
    # (Qwen3 adds an empty think block to a last one): the model's tokens stand for it.
    if not (alone.startswith(opening) and followed.startswith(opening)):
        raise ValueError(
            "turn_delta: the chat template re-renders earlier turns when messages follow an "
            "assistant turn, so its answer cannot be appended"
        )
    tails = []
    for text in (alone, followed):
        if text.count(_PLACEHOLDER) != 1:
            raise ValueError(
                "turn_delta: the chat template does not render an assistant message's "
                f"content verbatim (placeholder found {text.count(_PLACEHOLDER)} times)"
            )
        tails.append(text.partition(_PLACEHOLDER)[2])
    if not tails[0].startswith(end_of_turn):
        raise ValueError(
            f"turn_delta: the chat template ends an assistant turn with {tails[0][:40]!r}, "
            f"not end_of_turn {end_of_turn!r}"
        )
    if not tails[1].startswith(tails[0]):
        raise ValueError(
            f"turn_delta: the chat template ends an assistant turn with {tails[0]!r} alone but "
            f"{tails[1][: len(tails[0])]!r} when messages follow"
        )
    return tails[1][len(end_of_turn) :]
