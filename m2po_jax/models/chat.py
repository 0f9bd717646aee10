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
    **kwargs: Any,
) -> str:
    """The template applied to `messages`; `kwargs` (special tokens, `enable_thinking`,
    `date_string`, ...) become template variables, as `apply_chat_template`'s do."""
    return compile_template(source).render(
        messages=[dict(m) for m in messages],
        tools=None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
