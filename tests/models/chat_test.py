"""Chat templates render as transformers renders them; prompts encode with exactly one BOS."""

import datetime
import json
from pathlib import Path

import pytest

from m2po_jax.models import chat, prompts, tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
PROMPT = "Solve it.\nQuestion: what is 12 plus 30 ?\nAnswer:"
LLAMA_BOS, LLAMA_EOT = "<|begin_of_text|>", "<|eot_id|>"
SPECIALS = [
    "<unk>",
    LLAMA_BOS,
    "<|end_of_text|>",
    LLAMA_EOT,
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
]


def write_checkpoint(path: Path, template: str | None, *, in_file: bool = False) -> Path:
    """tokenizer.json (adds BOS like Llama 3's post-processor) and tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    words = "solve it question what is 12 plus 30 ? answer : . system user assistant".split()
    vocab = {w: i for i, w in enumerate(SPECIALS + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    bos_id = vocab[LLAMA_BOS]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{LLAMA_BOS} $A", special_tokens=[(LLAMA_BOS, bos_id)]
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": LLAMA_BOS,
        "eos_token": LLAMA_EOT,
        "pad_token": "<|end_of_text|>",
    }
    if template is not None and not in_file:
        config["chat_template"] = template
    elif template is not None:
        (path / chat.TEMPLATE_FILE).write_text(template)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def hf_tokenizer(path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class FixedDatetime(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2031, 3, 5, 12, 0, 0)


@pytest.mark.parametrize(
    "name, enable_thinking, marker",
    [
        ("qwen2.5-instruct", None, "You are Qwen, created by Alibaba Cloud."),
        ("qwen3", True, "<|im_start|>assistant\n"),
        ("qwen3", False, "<think>\n\n</think>\n\n"),
        ("llama-3.2-instruct", None, "Today Date: 05 Mar 2031"),
    ],
)
def test_real_templates_render_like_transformers(
    name, enable_thinking, marker, tmp_path, monkeypatch
):
    from transformers.utils import chat_template_utils

    # Llama 3.2 prints today's date through strftime_now: pin it in both renderers.
    monkeypatch.setattr(chat_template_utils, "datetime", FixedDatetime)
    monkeypatch.setattr(chat.datetime, "datetime", FixedDatetime)
    template = (TEMPLATES / f"{name}.jinja").read_text()
    path = write_checkpoint(tmp_path / name, template)
    encoder = prompts.make_prompt_encoder(
        tokenizer.load_tokenizer(path), "auto", enable_thinking=enable_thinking
    )
    hf = hf_tokenizer(path)
    messages = [{"role": "user", "content": PROMPT}]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert encoder.render(PROMPT) == expected
    assert marker in expected
    if name == "qwen3" and enable_thinking:
        assert expected.endswith("<|im_start|>assistant\n")  # no empty think block
    expected_ids = hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False, **kwargs
    )
    assert encoder.encode(PROMPT) == list(expected_ids)


def test_llama_date_string_is_passed_through(tmp_path):
    template = (TEMPLATES / "llama-3.2-instruct.jinja").read_text()
    path = write_checkpoint(tmp_path, template)
    tok = tokenizer.load_tokenizer(path)
    encoder = prompts.PromptEncoder(
        tok, tok.chat_template, {**tok.special_tokens, "date_string": "26 Jul 2024"}
    )
    expected = hf_tokenizer(path).apply_chat_template(
        [{"role": "user", "content": PROMPT}],
        tokenize=False,
        add_generation_prompt=True,
        date_string="26 Jul 2024",
    )
    assert encoder.render(PROMPT) == expected
    assert expected.startswith(LLAMA_BOS + "<|start_header_id|>system")


def test_chat_template_modes_and_single_bos(tmp_path):
    template = (TEMPLATES / "llama-3.2-instruct.jinja").read_text()
    with_template = tokenizer.load_tokenizer(write_checkpoint(tmp_path / "a", template))
    without = tokenizer.load_tokenizer(write_checkpoint(tmp_path / "b", None))
    bos = with_template.bos_id
    raw_ids = with_template.encode(PROMPT)

    templated = prompts.make_prompt_encoder(with_template, "auto").encode(PROMPT)
    assert templated[0] == bos and templated.count(bos) == 1  # the template spells BOS once
    assert prompts.make_prompt_encoder(with_template, "on").encode(PROMPT) == templated
    off = prompts.make_prompt_encoder(with_template, "off")
    assert off.render(PROMPT) == PROMPT and off.encode(PROMPT) == [bos, *raw_ids]
    auto_without = prompts.make_prompt_encoder(without, "auto")
    assert auto_without.chat_template is None and auto_without.encode(PROMPT) == [bos, *raw_ids]
    with pytest.raises(ValueError, match="chat_template='on'.*no chat template"):
        prompts.make_prompt_encoder(without, "on")
    with pytest.raises(ValueError, match="not one of"):
        prompts.make_prompt_encoder(without, "yes")


def test_template_file_beside_the_tokenizer_wins(tmp_path):
    path = write_checkpoint(tmp_path, "{{ 'from file: ' + messages[0]['content'] }}", in_file=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'from config' }}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    encoder = prompts.make_prompt_encoder(tokenizer.load_tokenizer(path), "auto")
    assert encoder.render("hi") == "from file: hi"
    assert (
        hf_tokenizer(path).apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        == "from file: hi"
    )


def test_named_templates_and_template_errors(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert chat.load_chat_template(tmp_path, {"chat_template": named}) == "D"
    with pytest.raises(ValueError, match="no 'default'"):
        chat.load_chat_template(tmp_path, {"chat_template": named[:1]})
    assert chat.load_chat_template(tmp_path / "missing") is None
    with pytest.raises(ValueError, match="syntax error on line 1"):
        chat.render("{% if %}", [])
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="only user turns"):
        chat.render("{{ raise_exception('only user turns') }}", [])
    # tojson does not HTML-escape, as in transformers.
    assert chat.render("{{ messages[0] | tojson }}", [{"role": "user", "content": "<a&b>"}]) == (
        '{"role": "user", "content": "<a&b>"}'
    )


def test_block_whitespace_and_loop_controls_match_transformers(tmp_path):
    # Real templates mostly use "{%-"; this one relies on trim_blocks, lstrip_blocks and break.
    template = (
        "{% for m in messages %}\n"
        "    {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "  <{{ m.role }}>\n{{ m.content }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}\n  [assistant]\n{% endif %}"
    )
    path = write_checkpoint(tmp_path, template)
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    expected = hf_tokenizer(path).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert chat.render(template, messages, add_generation_prompt=True) == expected
    assert "b" not in expected and "\n" in expected


# ---------------------------------------------------------------- tools and turn deltas


def _lookup(city: str, days: int = 1) -> str:
    """Looks up the weather.

    Args:
        city: The city.
        days: How many days ahead.
    """
    return "sunny"


TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Looks up the weather.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city."},
                "days": {"type": "integer", "description": "How many days ahead."},
            },
            "required": ["city"],
        },
    },
}
DATE = {"date_string": "26 Jul 2024"}  # Llama 3.2 prints a date; the others ignore it


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "llama-3.2-instruct"])
def test_render_lists_tools_as_transformers(name, tmp_path):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    path = write_checkpoint(tmp_path, template)
    specials = tokenizer.load_tokenizer(path).special_tokens
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    ours = chat.render(template, messages, tools=[TOOL_SCHEMA], **specials, **DATE)
    expected = hf_tokenizer(path).apply_chat_template(
        messages, tools=[TOOL_SCHEMA], tokenize=False, add_generation_prompt=True, **DATE
    )
    assert ours == expected
    assert '"name": "lookup"' in ours and ours != chat.render(
        template, messages, **specials, **DATE
    )


# (template, its end-of-turn token, what the template writes after a last turn's token,
# a first assistant turn calling the tool, the final assistant turn)
TURNS = {
    "qwen2.5-instruct": (
        "<|im_end|>",
        "\n",
        'Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"city": "Oslo"}}\n</tool_call>',
        "It is sunny in Oslo.",
    ),
    "llama-3.2-instruct": (
        "<|eot_id|>",
        "",
        '{"name": "lookup", "parameters": {"city": "Oslo"}}',
        "It is sunny in Oslo.",
    ),
    # Qwen3 renders a conversation's last assistant turn with a think block (an empty one
    # when it has none): the final turn carries one, as a thinking model writes it.
    "qwen3": (
        "<|im_end|>",
        "\n",
        'Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"city": "Oslo"}}\n</tool_call>',
        "<think>\n\n</think>\n\nIt is sunny in Oslo.",
    ),
}


@pytest.mark.parametrize("name", list(TURNS))
def test_turn_delta_continues_a_conversation_as_transformers_renders_it(name, tmp_path):
    end_of_turn, after_last, first, final = TURNS[name]
    template = (TEMPLATES / f"{name}.jinja").read_text()
    path = write_checkpoint(tmp_path, template)
    kwargs = {**tokenizer.load_tokenizer(path).special_tokens, **DATE, "tools": [TOOL_SCHEMA]}
    user = {"role": "user", "content": PROMPT}
    answer = {"role": "tool", "name": "lookup", "content": "sunny"}
    delta = chat.turn_delta(template, [answer], end_of_turn=end_of_turn, **kwargs)
    ours = (
        chat.render(template, [user], add_generation_prompt=True, **kwargs)
        + first
        + end_of_turn
        + delta
        + final
        + end_of_turn
    )
    hf = hf_tokenizer(path)
    conversation = [
        user,
        {"role": "assistant", "content": first},
        answer,
        {"role": "assistant", "content": final},
    ]
    expected = hf.apply_chat_template(conversation, tools=[TOOL_SCHEMA], tokenize=False, **DATE)
    assert ours + after_last == expected
    assert delta.count("sunny") == 1 and not delta.startswith(end_of_turn)
    expected_ids = hf.apply_chat_template(
        conversation, tools=[TOOL_SCHEMA], tokenize=True, return_dict=False, **DATE
    )
    assert hf.encode(ours + after_last, add_special_tokens=False) == list(expected_ids)
    # A user message after the turn continues it the same way.
    follow = {"role": "user", "content": "And tomorrow?"}
    delta = chat.turn_delta(template, [follow], end_of_turn=end_of_turn, **kwargs)
    full = chat.render(template, [user, conversation[1], follow], **kwargs)
    assert full.endswith(end_of_turn + delta)


def test_turn_delta_keeps_qwen3_reasoning_that_a_re_render_changes(tmp_path):
    template = (TEMPLATES / "qwen3.jinja").read_text()
    hf = hf_tokenizer(write_checkpoint(tmp_path, template))
    user = {"role": "user", "content": PROMPT}
    thought = "<think>reasoning</think>\n\nIt is 42."
    for follow in (
        {"role": "user", "content": "Are you sure?"},  # a re-render drops the think block
        {"role": "tool", "name": "lookup", "content": "sunny"},  # ... or rewrites it
    ):
        delta = chat.turn_delta(template, [follow], end_of_turn="<|im_end|>")
        ours = chat.render(template, [user]) + thought + "<|im_end|>" + delta
        rendered = hf.apply_chat_template(
            [user, {"role": "assistant", "content": thought}, follow],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert thought in ours and ours.endswith("<|im_start|>assistant\n")
        assert thought not in rendered  # what the model wrote is not what a re-render shows
        if follow["role"] == "user":
            assert "reasoning" not in rendered
            rewritten = ""
        else:
            rewritten = "<think>\nreasoning\n</think>\n\n"
            assert rewritten in rendered
        # Apart from the think block, the two are the same text.
        assert ours.replace("<think>reasoning</think>\n\n", rewritten) == rendered


def test_turn_delta_refuses_templates_it_cannot_continue():
    turn = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
    prompt = "{% if add_generation_prompt %}<assistant>{% endif %}"
    tool = [{"role": "tool", "content": "42"}]
    assert chat.turn_delta(turn + prompt, tool, end_of_turn="</s>") == "<tool>42</s><assistant>"
    with pytest.raises(
        ValueError, match=r"ends an assistant turn with '</s>', not end_of_turn '<eot>'"
    ):
        chat.turn_delta(turn + prompt, tool, end_of_turn="<eot>")
    counted = "[{{ messages | length }}]" + turn + prompt  # a header that changes per message
    with pytest.raises(ValueError, match="re-renders earlier turns"):
        chat.turn_delta(counted, tool, end_of_turn="</s>")
    hidden = "{% for m in messages %}<{{ m.role }}>{% if m.role != 'assistant' %}{{ m.content }}"
    hidden += "{% endif %}</s>{% endfor %}" + prompt
    with pytest.raises(ValueError, match="does not render an assistant message's content verbatim"):
        chat.turn_delta(hidden, tool, end_of_turn="</s>")
    closing = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% if loop.last or m.role != 'assistant' %}</s>{% else %}</x>{% endif %}{% endfor %}"
        + prompt
    )
    with pytest.raises(ValueError, match="'</s>' alone but '</x>' when messages follow"):
        chat.turn_delta(closing, tool, end_of_turn="</s>")
