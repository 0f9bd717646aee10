"""Tests for m2po_jax.tasks: generation, tokenizer, verifiers, GSM8K parsing, registry."""

import json
import sys

import pytest
from byte_tokenizer import ByteTokenizer

from m2po_jax.common.errors import RewardError
from m2po_jax.tasks import (
    ArithTask,
    CharTokenizer,
    Example,
    GSM8KTask,
    Task,
    Tokenizer,
    extract_last_number,
    make_task,
    numeric_reward,
    reward_fn_from_name,
)
from m2po_jax.tasks.arith import BLOCK


def _python_value(prompt: str) -> int:
    """Independent reference: evaluate "a op b=" with Python arithmetic."""
    assert prompt.endswith("=")
    for op in "+*":
        if op in prompt:
            a, b = prompt[:-1].split(op)
            return int(a) + int(b) if op == "+" else int(a) * int(b)
    a, b = prompt[:-1].split("-")
    return int(a) - int(b)


# ---------------------------------------------------------------- char tokenizer


def test_char_tokenizer_ids_and_round_trip():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 17)
    # "0" is id 3, digits in order, then "+", "-", "*", "=".
    assert tok.encode("12+3=") == [4, 5, 13, 6, 16]
    assert tok.encode("-*") == [14, 15]
    for text in ["", "0123456789", "99*99=9801", "5-17=-12"]:
        assert tok.decode(tok.encode(text)) == text
    assert isinstance(tok, Tokenizer)


def test_char_tokenizer_decode_skips_specials_and_stops_at_eos():
    tok = CharTokenizer()
    assert tok.decode([1, 4, 5, 2, 7, 8]) == "12"
    assert tok.decode([0, 0, 1, 6, 0]) == "3"
    with pytest.raises(ValueError, match="outside"):
        tok.decode([3, 40])


def test_char_tokenizer_rejects_unknown_character():
    with pytest.raises(ValueError, match=r"'a' at position 2"):
        CharTokenizer().encode("12a")


# ---------------------------------------------------------------- arith generation


def test_arith_same_seed_and_position_give_same_examples():
    a, b = ArithTask(seed=3), ArithTask(seed=3)
    assert a.train_examples(1000, 40) == b.train_examples(1000, 40)
    # Position i does not depend on how the range was requested (across a block edge).
    long = a.train_examples(BLOCK - 20, 60)
    assert b.train_examples(BLOCK - 5, 10) == long[15:25]
    assert a.train_examples(BLOCK + 7, 1)[0] == long[27]


def test_arith_positions_and_seeds_differ():
    task = ArithTask(seed=0)
    first, second = task.train_examples(0, 50), task.train_examples(50, 50)
    assert [e.prompt for e in first] != [e.prompt for e in second]
    other_seed = ArithTask(seed=1).train_examples(0, 50)
    assert [e.prompt for e in first] != [e.prompt for e in other_seed]
    assert len({e.prompt for e in task.train_examples(0, 1000)}) > 500


def test_arith_answers_and_digit_ranges():
    task = ArithTask(seed=0, ops="+-*", min_digits=2, max_digits=3)
    examples = task.train_examples(0, 300)
    seen_ops = set()
    for e in examples:
        assert e.answer == str(_python_value(e.prompt))
        body = e.prompt[:-1]
        op = next(c for c in "+-*" if c in body)
        seen_ops.add(op)
        for operand in body.split(op):
            assert 10 <= int(operand) <= 999 and operand == str(int(operand))
        CharTokenizer().encode(e.prompt + e.answer)  # every character is in the alphabet
    assert seen_ops == {"+", "-", "*"}
    # Default: 1-2 digit addition.
    for e in ArithTask().train_examples(0, 200):
        a, b = e.prompt[:-1].split("+")
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99


def test_arith_eval_is_disjoint_from_first_100k_train_problems():
    task = ArithTask(seed=0)
    eval_set = task.eval_examples()
    assert len(eval_set) == 256
    eval_prompts = {e.prompt for e in eval_set}
    assert len(eval_prompts) == 256  # distinct problems
    train_prompts = {e.prompt for e in task.train_examples(0, 100_000)}
    assert not eval_prompts & train_prompts
    sft_prompts = {p for p, _ in task.sft_examples(0, 5000)}
    assert not eval_prompts & sft_prompts
    assert eval_set == ArithTask(seed=0).eval_examples()
    for e in eval_set:
        assert e.answer == str(_python_value(e.prompt))


def test_arith_tiny_space_still_has_disjoint_eval():
    task = ArithTask(seed=0, max_digits=1, eval_fraction=0.1)
    eval_prompts = {e.prompt for e in task.eval_examples()}
    assert 0 < len(eval_prompts) < 100
    assert not eval_prompts & {e.prompt for e in task.train_examples(0, 5000)}


def test_arith_sft_examples_are_prompt_answer_pairs():
    task = ArithTask(seed=0)
    pairs = task.sft_examples(10, 20)
    assert pairs == task.sft_examples(10, 20)
    for prompt, target in pairs:
        assert target == str(_python_value(prompt))


def test_arith_verifier_hand_examples():
    task = ArithTask()
    example = Example(prompt="12+345=", answer="357", uid=0)
    assert task.reward(example, "357") == 1.0
    assert task.reward(example, " 357\n") == 1.0
    assert task.reward(example, "358") == 0.0
    assert task.reward(example, "357+1") == 0.0
    assert task.reward(example, "3570") == 0.0
    assert task.reward(example, "") == 0.0
    tok = task.tokenizer
    # The decoded completion ends at EOS, so tokens after it do not count.
    assert task.reward(example, tok.decode(tok.encode("357") + [tok.eos_id] + tok.encode("9"))) == 1
    partial = ArithTask(format_reward=0.1)
    assert partial.reward(example, "358") == 0.1
    assert partial.reward(example, "-12") == 0.1
    assert partial.reward(example, "3+5") == 0.0
    assert partial.reward(example, "") == 0.0


def test_arith_bad_arguments():
    with pytest.raises(ValueError, match="ops"):
        ArithTask(ops="/")
    with pytest.raises(ValueError, match="min_digits"):
        ArithTask(min_digits=3, max_digits=2)
    with pytest.raises(ValueError, match="eval_fraction"):
        ArithTask(eval_fraction=0.0)
    with pytest.raises(ValueError, match="start"):
        ArithTask().train_examples(-1, 3)
    with pytest.raises(ValueError, match="count"):
        ArithTask().train_examples(0, 2.5)
    with pytest.raises(TypeError, match="tokenizer"):
        ArithTask(tokenizer=object())


# ---------------------------------------------------------------- numeric answers


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is $1,234.50.", 1234.5),
        ("-3 apples", -3.0),
        ("no number", None),
        ("so 5-3 = 2", 2.0),
        ("we get 12 then 7.", 7.0),
        ("1,2,3", 3.0),
        ("It costs -$4,000 in total", -4000.0),
        ("$-3", -3.0),
        ("about 45% of them", 45.0),
        ("x = 0.25", 0.25),
        ("#### 1,000,000", 1_000_000.0),
    ],
)
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


def test_numeric_reward():
    assert numeric_reward("The answer is $1,234.50.", "1234.5") == 1.0
    assert numeric_reward("so -3 apples", "-3") == 1.0
    assert numeric_reward("72.0000001", "72") == 1.0  # within 1e-6
    assert numeric_reward("72.001", "72") == 0.0
    assert numeric_reward("no number", "0") == 0.0
    assert numeric_reward("", "5") == 0.0
    assert numeric_reward("Janet makes 9 + 9 = 18", "She earns 9 + 9 = 18.\n#### 18") == 1.0
    assert numeric_reward("so 17", "She earns 9 + 9 = 18.\n#### 18") == 0.0
    assert numeric_reward("it is 1,002", "#### 1,002") == 1.0


@pytest.mark.parametrize("answer", ["x #### \\frac{1}{2}", "#### 1/3", "#### 2, 3", ""])
def test_numeric_reward_refuses_a_reference_it_cannot_read(answer):
    """As the trainer's GSM8K reward does: reading the last digits of `\\frac{1}{2}` would
    score "The answer is 2" right."""
    with pytest.raises(ValueError, match="plain number|empty reference"):
        numeric_reward("The answer is 2", answer)


# ---------------------------------------------------------------- GSM8K files


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _records(n):
    return [
        {
            "question": f"Tom has {i} apples and buys 2. How many?",
            "answer": f"{i}+2={i + 2}\n#### {i + 2:,}",
        }
        for i in range(n)
    ]


def test_gsm8k_holds_out_last_records_and_builds_prompts(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", _records(10) + [_records(1001)[1000]])
    task = GSM8KTask(path, ByteTokenizer(), num_eval=3)
    eval_set = task.eval_examples()
    assert [e.answer for e in eval_set] == ["10", "11", "1,002"]  # kept as written
    assert eval_set[0].prompt.endswith("Question: Tom has 8 apples and buys 2. How many?\nAnswer:")
    train = task.train_examples(0, 8)
    assert sorted(e.answer for e in train) == [str(i + 2) for i in range(8)]
    assert {e.uid for e in train}.isdisjoint({e.uid for e in eval_set})
    assert task.reward(eval_set[2], "He has 1,002 apples.") == 1.0
    assert task.reward(eval_set[2], "He has 1,003 apples.") == 0.0
    custom = GSM8KTask(path, ByteTokenizer(), num_eval=1, prompt_template="Q: {question} A:")
    assert custom.eval_examples()[0].prompt == "Q: Tom has 1000 apples and buys 2. How many? A:"


def test_gsm8k_cycles_with_deterministic_per_epoch_shuffle(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", _records(12))
    eval_path = _write_jsonl(tmp_path / "test.jsonl", _records(2))
    task = GSM8KTask(path, ByteTokenizer(), eval_path=eval_path, seed=5)
    epochs = [task.train_examples(12 * k, 12) for k in range(3)]
    for epoch in epochs:
        assert sorted(e.uid for e in epoch) == list(range(12))  # each epoch a permutation
    assert [e.uid for e in epochs[0]] != [e.uid for e in epochs[1]]
    again = GSM8KTask(path, ByteTokenizer(), eval_path=eval_path, seed=5)
    assert again.train_examples(7, 20) == epochs[0][7:] + epochs[1] + epochs[2][:3]
    assert [e.uid for e in task.eval_examples()] == [12, 13]
    prompt, target = task.sft_examples(0, 1)[0]
    assert prompt == epochs[0][0].prompt and "####" in target


def test_gsm8k_file_errors(tmp_path):
    tok = ByteTokenizer()
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        GSM8KTask(tmp_path / "missing.jsonl", tok)
    good = json.dumps(_records(1)[0])
    cases = {
        "bad_json": (f"{good}\n\n{{not json\n", r"bad_json.jsonl:3: not valid JSON"),
        "no_field": (f'{good}\n{{"question": "q"}}\n', r"no_field.jsonl:2: no key 'answer'"),
        "no_number": ('{"question": "q", "answer": "#### none"}\n', r":1: reference 'none': "),
        "not_object": ("[1, 2]\n", r":1: expected a JSON object"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(content)
        with pytest.raises(ValueError, match=message):
            GSM8KTask(path, tok, num_eval=0)
    path = _write_jsonl(tmp_path / "small.jsonl", _records(3))
    with pytest.raises(ValueError, match="num_eval=3"):
        GSM8KTask(path, tok, num_eval=3)
    with pytest.raises(ValueError, match="prompt_template"):
        GSM8KTask(path, tok, num_eval=1, prompt_template="no field")


# ---------------------------------------------------------------- pluggable rewards


def test_reward_fn_from_name_imports_and_is_used(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def half(completion, answer):\n    return 0.5\nNOT_CALLABLE = 3\n"
        "class Scorer:\n    @staticmethod\n    def score(completion, answer):\n        return 0.25\n"
    )
    (tmp_path / "broken_rewards.py").write_text("import not_a_real_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert reward_fn_from_name("m2po_jax.tasks.gsm8k:numeric_reward") is numeric_reward
    assert reward_fn_from_name("my_rewards:Scorer.score")("", "") == 0.25
    example = Example("1+1=", "2", 0)
    assert ArithTask(reward_fn="my_rewards:half").reward(example, "2") == 0.5
    assert ArithTask(reward_fn=lambda c, a: float(c == a)).reward(example, "2") == 1.0
    with pytest.raises(ValueError, match="module 'no_such_module_xyz' not found"):
        reward_fn_from_name("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        reward_fn_from_name("my_rewards:missing")
    with pytest.raises(TypeError, match="callable"):
        reward_fn_from_name("my_rewards:NOT_CALLABLE")
    for malformed in ["my_rewards.half", "my_rewards:", ":half", "a:b:c"]:
        with pytest.raises(ValueError, match="package.module:function"):
            reward_fn_from_name(malformed)
    # A missing dependency inside an existing module keeps its own name.
    with pytest.raises(ModuleNotFoundError, match="not_a_real_dependency_xyz"):
        reward_fn_from_name("broken_rewards:f")
    with pytest.raises(RewardError, match="returned 'yes'; expected a finite number"):
        ArithTask(reward_fn=lambda c, a: "yes").reward(example, "2")
    sys.modules.pop("my_rewards", None)
    sys.modules.pop("broken_rewards", None)


def test_make_task_registry(tmp_path):
    assert isinstance(make_task("arith", seed=1), ArithTask)
    path = _write_jsonl(tmp_path / "t.jsonl", _records(4))
    assert isinstance(
        make_task("gsm8k", path=path, tokenizer=ByteTokenizer(), num_eval=1), GSM8KTask
    )
    with pytest.raises(ValueError, match="unknown 'maths'.*arith.*gsm8k.*math"):
        make_task("maths")
    with pytest.raises(TypeError, match="make_task\\('arith'.*digits"):
        make_task("arith", digits=3)


def test_the_attributes_the_trainer_reads_are_declared_on_every_task():
    """`Task` declares what the trainer reads besides the methods: a task that screens no
    prompts has them empty, GSM8K fills them (tests/tasks/gsm8k_data_test.py)."""
    task = make_task("arith", seed=0)
    assert task.prompt_lengths == {} and task.prompts_filtered is None
    assert {"prompt_lengths", "prompts_filtered"} <= set(Task.__annotations__)


def test_a_bad_arith_setting_is_named_as_in_the_config():
    """`--config.task.ops=7` names `task.ops`, the field the user wrote, not the library's
    `ops` argument."""
    from m2po_jax import config as config_lib
    from m2po_jax.configs import arith
    from m2po_jax.trainer import setup as setup_lib

    c = arith.get_config("tiny")
    c.task.ops = "7"
    with pytest.raises(ValueError, match=r"^task\.ops: expected distinct operators"):
        setup_lib.build_task(config_lib.from_configdict(c))
