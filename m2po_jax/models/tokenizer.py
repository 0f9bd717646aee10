"""Hugging Face tokenizers from a local checkpoint directory, with the ids an RL loop needs.

    tok = load_tokenizer("/models/Qwen2.5-0.5B-Instruct", model_config)
    ids = tok.encode("12+34=")
    tok.eos_ids, tok.pad_id, tok.bos_id

Reads `tokenizer.json` through the `tokenizers` library (no transformers, no network) and the
special ids from `tokenizer_config.json`, `generation_config.json` and `config.json` beside it,
plus the chat template (`chat_template.jinja` or tokenizer_config.json's `chat_template`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from m2po_jax.common.checks import read_json
from m2po_jax.models import chat
from m2po_jax.models.model_config import ModelConfig

PathLike = str | os.PathLike


def _token_content(token: Any) -> str | None:
    if isinstance(token, Mapping):  # {"content": "<|im_end|>", ...}
        token = token.get("content")
    return token if isinstance(token, str) else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the ids an RL loop needs.

    `eos_ids` gathers every end-of-sequence id named in tokenizer_config.json,
    generation_config.json and config.json (chat models stop on more than one);
    `eos_id` is the first of them. `chat_template` is the checkpoint's template source (or
    None) and `special_tokens` the named special tokens' strings it is rendered with.
    """

    def __init__(
        self,
        tokenizer,
        eos_ids: tuple[int, ...],
        pad_id: int | None,
        bos_id: int | None,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.eos_ids = eos_ids
        self.eos_id = eos_ids[0] if eos_ids else None
        self.pad_id = pad_id if pad_id is not None else self.eos_id
        self.bos_id = bos_id
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens (BOS) only when asked, as chat templates
        already spell them out."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, eos_ids={self.eos_ids}, pad_id={self.pad_id})"


def load_tokenizer(path: PathLike, model_config: ModelConfig | None = None) -> HFTokenizer:
    """Loads `path/tokenizer.json` and the special ids from the json files beside it.

    Args:
      path: checkpoint or tokenizer directory.
      model_config: when given, the tokenizer's ids must fit its `vocab_size`.
    """
    from tokenizers import Tokenizer  # imported here: only this function needs it

    path = os.fspath(path)
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(
            f"{file}: not found; load_tokenizer needs a fast-tokenizer tokenizer.json "
            "(sentencepiece-only tokenizer.model is not supported)"
        )
    tokenizer = Tokenizer.from_file(file)
    tok_cfg = read_json(os.path.join(path, "tokenizer_config.json")) or {}
    gen_cfg = read_json(os.path.join(path, "generation_config.json")) or {}
    model_cfg = read_json(os.path.join(path, "config.json")) or {}

    def special(key: str) -> int | None:
        content = _token_content(tok_cfg.get(key))
        return None if content is None else tokenizer.token_to_id(content)

    eos_ids: list[int] = []
    for candidate in (
        _as_ids(special("eos_token")),
        _as_ids(gen_cfg.get("eos_token_id")),
        _as_ids(model_cfg.get("eos_token_id")),
    ):
        eos_ids += [i for i in candidate if i not in eos_ids]
    pad_id = special("pad_token")
    if pad_id is None:
        pad_id = gen_cfg.get("pad_token_id", model_cfg.get("pad_token_id"))
    bos_id = special("bos_token")
    if bos_id is None:
        bos_id = gen_cfg.get("bos_token_id", model_cfg.get("bos_token_id"))
    # What transformers' special_tokens_map gives templates: tokenizer_config.json's named tokens.
    named = {key: _token_content(tok_cfg.get(key)) for key in chat.SPECIAL_TOKEN_KEYS}
    wrapped = HFTokenizer(
        tokenizer,
        tuple(eos_ids),
        pad_id,
        bos_id,
        chat_template=chat.load_chat_template(path, tok_cfg),
        special_tokens={k: v for k, v in named.items() if v is not None},
    )
    if model_config is not None and wrapped.vocab_size > model_config.vocab_size:
        raise ValueError(
            f"tokenizer: vocabulary size {wrapped.vocab_size} (max id + 1) exceeds "
            f"model_config.vocab_size {model_config.vocab_size}"
        )
    return wrapped
