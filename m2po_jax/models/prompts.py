"""Task prompt text -> the token ids the policy sees, and what to do with prompts too long.

    encoder = make_prompt_encoder(tokenizer, chat_template="auto", enable_thinking=None)
    ids = encoder.encode("Question: ...")   # rollouts, evaluation and the SFT warm-up alike

With a chat template each prompt becomes one user message followed by the generation prompt,
tokenized without adding special tokens (the template spells BOS, as transformers'
`apply_chat_template(tokenize=True)` does); without one the raw text follows the BOS id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from m2po_jax.models import chat

# task.chat_template: "auto" = the checkpoint's template when it has one; "on" = require it.
CHAT_TEMPLATE_MODES = ("auto", "on", "off")
# task.long_prompts, for rendered prompts over task.max_prompt_len tokens: "filter" drops the
# example when the task is built (like verl / AReaL's filter_overlong_prompts), "left" keeps its
# last tokens (verl's truncation="left"), "error" refuses to start.
LONG_PROMPT_MODES = ("filter", "left", "error")


class PromptEncoder:
    """Encodes a task prompt as the policy sees it: through the chat template, or BOS + text.

    Args:
      tokenizer: the task tokenizer (`encode` adds no special tokens).
      chat_template: a template source, or None for the raw prompt text.
      template_kwargs: extra template variables (special tokens, `enable_thinking`, ...).
    """

    def __init__(
        self,
        tokenizer,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs or {})
        self.pad_id = tokenizer.pad_id

    def render(self, prompt: str) -> str:
        """The text the model reads: the templated user turn, or `prompt` itself."""
        if self.chat_template is None:
            return prompt
        messages = [{"role": "user", "content": prompt}]
        return chat.render(
            self.chat_template, messages, add_generation_prompt=True, **self.template_kwargs
        )

    def encode(self, prompt: str) -> list[int]:
        if self.chat_template is not None:
            return list(self.tokenizer.encode(self.render(prompt)))
        bos = getattr(self.tokenizer, "bos_id", None)
        return ([bos] if bos is not None else []) + list(self.tokenizer.encode(prompt))

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)


def make_prompt_encoder(
    tokenizer, chat_template: str = "auto", enable_thinking: bool | None = None
) -> PromptEncoder:
    """The encoder for `task.chat_template` / `task.enable_thinking`.

    `enable_thinking` None leaves the template's own default (Qwen3 thinks); True / False is
    passed to the template as its `enable_thinking` variable.
    """
    if chat_template not in CHAT_TEMPLATE_MODES:
        raise ValueError(
            f"task.chat_template={chat_template!r} is not one of {list(CHAT_TEMPLATE_MODES)}"
        )
    source = getattr(tokenizer, "chat_template", None)
    if chat_template == "on" and source is None:
        raise ValueError(
            "task.chat_template='on': the tokenizer has no chat template (no chat_template.jinja "
            "and no chat_template in tokenizer_config.json); use 'auto' or 'off'"
        )
    if chat_template == "off" or source is None:
        return PromptEncoder(tokenizer)
    kwargs: dict[str, Any] = dict(getattr(tokenizer, "special_tokens", None) or {})
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    return PromptEncoder(tokenizer, source, kwargs)


def screen_prompts(
    prompts: Sequence[str],
    where: Sequence[str],
    encode,
    max_len: int,
    mode: str,
) -> tuple[list[int], list[int]]:
    """(token count of each prompt, indices kept) under `mode`; each prompt is encoded once.

    Raises:
      ValueError: mode "error" and a prompt is longer than `max_len` (named by `where`).
    """
    if mode not in LONG_PROMPT_MODES:
        raise ValueError(f"task.long_prompts={mode!r} is not one of {list(LONG_PROMPT_MODES)}")
    lengths = [len(encode(p)) for p in prompts]
    keep = []
    for i, n in enumerate(lengths):
        if n <= max_len or mode == "left":
            keep.append(i)
        elif mode == "error":
            raise ValueError(
                f"{where[i]}: the prompt is {n} tokens, over task.max_prompt_len={max_len} "
                "(task.long_prompts='error'; 'filter' drops such examples, 'left' keeps their "
                "last tokens)"
            )
    return lengths, keep


def count_long(examples: Sequence, encoder: PromptEncoder, max_len: int, known: Mapping) -> int:
    """How many of `examples` have prompts over `max_len` tokens (`known`: uid -> length)."""
    total = 0
    for e in examples:
        n = known.get(e.uid)
        total += (len(encoder.encode(e.prompt)) if n is None else n) > max_len
    return total
