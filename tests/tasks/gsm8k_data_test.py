"""GSM8K data: Parquet and JSONL with configurable columns, unreadable files, long prompts."""

import json

import pytest
from byte_tokenizer import ByteTokenizer

from m2po_jax.models.prompts import PromptEncoder, count_long
from m2po_jax.tasks import Example, GSM8KTask


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _records(n):
    return [
        {"question": f"Tom has {i} apples and buys 2. How many?", "answer": f"#### {i + 2}"}
        for i in range(n)
    ]


def test_gsm8k_parquet_with_custom_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = _records(5)
    table = pa.table(
        {
            "problem": [r["question"] for r in records],
            "solution": [r["answer"] for r in records],
            "level": [1, 2, 3, 4, 5],
        }
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    task = GSM8KTask(
        path, ByteTokenizer(), num_eval=2, question_key="problem", answer_key="solution"
    )
    assert [e.answer for e in task.eval_examples()] == ["5", "6"]
    assert task.eval_examples()[0].prompt.endswith(
        "Tom has 3 apples and buys 2. How many?\nAnswer:"
    )
    assert sorted(e.answer for e in task.train_examples(0, 3)) == ["2", "3", "4"]
    # The same keys apply to JSONL.
    jsonl = _write_jsonl(
        tmp_path / "t.jsonl", [{"problem": r["question"], "solution": r["answer"]} for r in records]
    )
    same = GSM8KTask(
        jsonl, ByteTokenizer(), num_eval=2, question_key="problem", answer_key="solution"
    )
    assert same.eval_examples() == task.eval_examples()
    with pytest.raises(ValueError, match=r"t.jsonl:1: no key 'question' \(task.question_key\)"):
        GSM8KTask(jsonl, ByteTokenizer(), num_eval=2)
    with pytest.raises(
        ValueError,
        match=r"train.parquet row 0: no key 'question' \(task.question_key\); the record has keys "
        r"\['level', 'problem', 'solution'\]",
    ):
        GSM8KTask(path, ByteTokenizer(), num_eval=2)
    with pytest.raises(
        ValueError, match=r"train.parquet row 0: no key 'answer' \(task.answer_key\)"
    ):
        GSM8KTask(path, ByteTokenizer(), num_eval=2, question_key="problem")
    pq.write_table(pa.table({"question": ["q", None], "answer": ["#### 1", "#### 2"]}), path)
    with pytest.raises(
        ValueError, match=r"train.parquet row 1: 'question' \(task.question_key\) is null"
    ):
        GSM8KTask(path, ByteTokenizer(), num_eval=0)


def test_gsm8k_unreadable_files_are_named(tmp_path):
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ValueError, match=r"corrupt.parquet: not a readable Parquet file"):
        GSM8KTask(corrupt, ByteTokenizer(), num_eval=0)
    latin = tmp_path / "latin.jsonl"
    good = json.dumps(_records(1)[0]).encode()
    latin.write_bytes(
        good + b"\n" + '{"question": "caf\u00e9", "answer": "#### 1"}\n'.encode("latin-1")
    )
    with pytest.raises(ValueError, match=r"latin.jsonl:2: not UTF-8 text"):
        GSM8KTask(latin, ByteTokenizer(), num_eval=0)


def _long_records(words=(1, 2, 3, 4, 5, 6, 1)):
    """Questions of the given numbers of words; prompt length grows with the words."""
    return [
        {"question": " ".join(["word"] * n), "answer": f"#### {i}"} for i, n in enumerate(words)
    ]


def test_gsm8k_long_prompts_filter_error_and_left(tmp_path):
    tok = ByteTokenizer()
    path = _write_jsonl(tmp_path / "train.jsonl", _long_records())
    encode = lambda text: [tok.bos_id, *tok.encode(text)]
    prompts = [e.prompt for e in GSM8KTask(path, tok, num_eval=0)._train]
    lengths = [len(encode(p)) for p in prompts]
    limit = lengths[3]  # the 5- and 6-word questions (lines 5 and 6) are too long
    kwargs = dict(num_eval=1, prompt_encode=encode, max_prompt_len=limit)

    task = GSM8KTask(path, tok, long_prompts="filter", **kwargs)
    assert task.prompts_filtered == {"train": 2, "eval": 0}
    assert sorted(e.answer for e in task.train_examples(0, 4)) == ["0", "1", "2", "3"]
    assert [e.answer for e in task.eval_examples()] == ["6"]
    assert sorted(p for p, _ in task.sft_examples(0, 4)) == sorted(prompts[:4])
    # A held-out set is filtered like the training set, and counted apart.
    mixed = _write_jsonl(tmp_path / "mixed.jsonl", _long_records((1, 5, 2, 6)))
    task = GSM8KTask(path, tok, eval_path=mixed, **{**kwargs, "long_prompts": "filter"})
    assert task.prompts_filtered == {"train": 2, "eval": 2}
    assert [e.answer for e in task.eval_examples()] == ["0", "2"]
    long_eval = _write_jsonl(tmp_path / "eval.jsonl", _long_records((5, 6)))
    with pytest.raises(ValueError, match=r"all 2 eval prompts are longer"):
        GSM8KTask(path, tok, eval_path=long_eval, **{**kwargs, "long_prompts": "filter"})
    with pytest.raises(ValueError, match=r"all 6 train prompts.*max_prompt_len=3 tokens.*shortest"):
        GSM8KTask(path, tok, long_prompts="filter", **{**kwargs, "max_prompt_len": 3})

    message = rf"train.jsonl:5: the prompt is {lengths[4]} tokens, over task.max_prompt_len={limit}"
    with pytest.raises(ValueError, match=message):
        GSM8KTask(path, tok, long_prompts="error", **kwargs)
    assert GSM8KTask(path, tok, long_prompts="error", **{**kwargs, "max_prompt_len": 999})

    left = GSM8KTask(path, tok, long_prompts="left", **kwargs)
    assert left.prompts_filtered == {"train": 0, "eval": 0}
    assert [left.prompt_lengths[uid] for uid in range(7)] == lengths
    with pytest.raises(ValueError, match="long_prompts='drop' is not one of"):
        GSM8KTask(path, tok, long_prompts="drop", **kwargs)


def test_the_warm_up_pairs_each_prompt_with_its_own_solution_after_a_filter(tmp_path):
    """A long problem dropped from the middle of the file drops its solution too: every
    warm-up (prompt, target) pair is one source row's question and its own answer."""
    tok = ByteTokenizer()
    rows = [{"question": f"q{i} " + "word " * (12 if i in (1, 4) else 1), "answer": f"#### {i}"}
            for i in range(7)]  # fmt: skip
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    encode = lambda text: [tok.bos_id, *tok.encode(text)]
    lengths = [len(encode(e.prompt)) for e in GSM8KTask(path, tok, num_eval=0)._train]
    limit = max(n for i, n in enumerate(lengths) if i not in (1, 4))  # rows 1 and 4 are longer
    task = GSM8KTask(
        path, tok, num_eval=0, long_prompts="filter", prompt_encode=encode, max_prompt_len=limit
    )
    assert task.prompts_filtered["train"] == 2
    pairs = task.sft_examples(0, 10)
    source = {r["question"].strip(): r["answer"] for r in rows}
    for prompt, target in pairs:
        question = prompt.split("Question: ")[1].split("\nAnswer:")[0]
        assert target.strip() == source[question], (prompt, target)
    answers = {e.prompt: e.answer for e in task.train_examples(0, 10)}
    assert {answers[p] for p, _ in pairs} == {"0", "2", "3", "5", "6"}


def test_count_long_uses_known_lengths_and_encodes_the_rest():
    tok = ByteTokenizer()
    encoder = PromptEncoder(tok)
    examples = [Example("abc", "1", 0), Example("abcdef", "2", 1), Example("abcdefgh", "3", 2)]
    # Raw prompts get BOS: 4, 7 and 9 tokens; uid 0 is "known" to be long.
    assert count_long(examples, encoder, 6, {}) == 2
    assert count_long(examples, encoder, 6, {0: 50}) == 3
    assert count_long(examples, encoder, 9, {}) == 0
