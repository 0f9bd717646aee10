"""Prompt screening at task.max_prompt_len (`prompts.screen_prompts`, `count_long`)."""

import types

import pytest

from m2po_jax.models import prompts as prompts_lib


def _encode(text):
    return text.split()  # one token per word


PROMPTS = ["a b c", "a b c d", "a b c d e", "a"]  # 3, 4, 5 and 1 tokens
WHERE = [f"train.jsonl:{i + 1}" for i in range(len(PROMPTS))]


def test_filter_keeps_a_prompt_of_exactly_the_limit_and_drops_longer_ones():
    lengths, keep = prompts_lib.screen_prompts(PROMPTS, WHERE, _encode, 4, "filter")
    assert lengths == [3, 4, 5, 1]
    assert keep == [0, 1, 3]  # 4 tokens at max_prompt_len=4 stay; 5 go


def test_left_keeps_every_long_prompt():
    lengths, keep = prompts_lib.screen_prompts(PROMPTS, WHERE, _encode, 4, "left")
    assert (lengths, keep) == ([3, 4, 5, 1], [0, 1, 2, 3])


def test_error_names_the_first_long_prompt():
    with pytest.raises(ValueError, match=r"train.jsonl:3: the prompt is 5 tokens, over .*=4"):
        prompts_lib.screen_prompts(PROMPTS, WHERE, _encode, 4, "error")
    assert prompts_lib.screen_prompts(PROMPTS, WHERE, _encode, 5, "error")[1] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="long_prompts='drop' is not one of"):
        prompts_lib.screen_prompts(PROMPTS, WHERE, _encode, 4, "drop")


def test_count_long_counts_prompts_over_the_limit_only():
    encoder = types.SimpleNamespace(encode=_encode)
    examples = [types.SimpleNamespace(uid=i, prompt=p) for i, p in enumerate(PROMPTS)]
    assert prompts_lib.count_long(examples, encoder, 4, {}) == 1
    assert prompts_lib.count_long(examples, encoder, 3, {}) == 2
    # Known lengths are used as given (the task's cache), the others encoded.
    assert prompts_lib.count_long(examples, encoder, 4, {0: 9}) == 2
