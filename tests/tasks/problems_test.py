"""Problems as math-RL users have them: MATH / plain / GSM8K files, references kept as
written, refused where the verifier cannot read them, rewards that fail in one line, scoring
timeouts, and tasks of the user's by name."""

import json
import math
import sys
import time

import pytest
from byte_tokenizer import ByteTokenizer

from m2po_jax.common.errors import RewardError
from m2po_jax.rollout import rewards as rewards_lib
from m2po_jax.rollout.rewards import RewardScorer
from m2po_jax.tasks import (
    Example,
    GSM8KTask,
    MathTask,
    Task,
    make_task,
    parse_eval_sets,
    prompt_template_text,
    task_class,
)
from m2po_jax.tasks.verifiers import MathVerifier


def _jsonl(path, records, bom=False):
    text = "".join(json.dumps(r) + "\n" for r in records)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return path


MATH_RECORDS = [
    {"problem": "Compute 1/2 of 1.", "solution": "Half of one is $\\boxed{\\frac{1}{2}}$."},
    {"problem": "Simplify sqrt(18).", "solution": "We get $\\boxed{3\\sqrt{2}}$."},
    {"problem": "Solve x^2 < 1.", "answer": "(-1, 1)", "solution": "ignored \\boxed{0}"},
    {"problem": "Point?", "solution": "It is \\boxed{(2, 3)}."},
    {"problem": "How many?", "answer": 42},
    {"problem": "Half?", "answer": 0.5},
    {"problem": "Which day?", "solution": "\\boxed{\\text{Monday}}"},
]


def test_math_files_keep_the_reference_as_written_and_math_verify_scores_it(tmp_path):
    path = _jsonl(tmp_path / "math.jsonl", MATH_RECORDS, bom=True)  # a BOM is read
    task = MathTask(path, ByteTokenizer(), num_eval=0)
    got = {e.prompt.split("\n")[0]: e.answer for e in task.train_examples(0, len(MATH_RECORDS))}
    assert got == {
        "Compute 1/2 of 1.": "\\frac{1}{2}",
        "Simplify sqrt(18).": "3\\sqrt{2}",
        "Solve x^2 < 1.": "(-1, 1)",  # the answer field wins over the solution's box
        "Point?": "(2, 3)",
        "How many?": "42",
        "Half?": "0.5",
        "Which day?": "\\text{Monday}",
    }
    example = next(e for e in task.train_examples(0, 7) if e.answer == "\\frac{1}{2}")
    assert example.prompt.endswith("put your final answer within \\boxed{}.")
    assert task.reward(example, "so the answer is \\boxed{0.5}") == 1.0
    assert task.reward(example, "The answer is 2") == 0.0  # the old number-mangling case
    assert task.reward(example, "\\boxed{\\frac{2}{4}}") == 1.0
    point = next(e for e in task.train_examples(0, 7) if e.answer == "(2, 3)")
    assert task.reward(point, "\\boxed{(3, 2)}") == 0.0
    assert task.reward_name == "math verifier"
    # The warm-up's target is the solution, or the answer field without one.
    pairs = dict(task.sft_examples(0, 7))
    assert pairs[example.prompt] == " Half of one is $\\boxed{\\frac{1}{2}}$."


def test_gsm8k_refuses_what_its_numeric_verifier_would_mangle(tmp_path):
    tok = ByteTokenizer()
    ok = _jsonl(tmp_path / "ok.jsonl", [{"question": "q", "answer": a} for a in
                                        ("#### 1,002", "16", 7, "x #### -3")])  # fmt: skip
    task = GSM8KTask(ok, tok, num_eval=0)
    assert sorted(e.answer for e in task.train_examples(0, 4)) == ["-3", "1,002", "16", "7"]
    for bad in ("1/3", "\\frac{1}{2}", "1e3", "x^2+1", "(2, 3)"):
        path = _jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "#### 1"},
                                               {"question": "q", "answer": f"#### {bad}"}])  # fmt: skip
        with pytest.raises(ValueError, match=r"bad.jsonl:2: reference .*task.verifier='math'"):
            GSM8KTask(path, tok, num_eval=0)
    # The same file is fine for the math task.
    assert MathTask(path, tok, num_eval=0, question_key="question").train_examples(0, 1)


def test_data_messages_name_the_key_the_field_and_the_keys_present(tmp_path):
    tok = ByteTokenizer()
    path = _jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "answer": "1"}])
    with pytest.raises(ValueError) as e:
        MathTask(path, tok, num_eval=0)
    assert str(e.value) == (
        f"{path}:1: no key 'problem' (task.question_key); the record has keys ['answer', 'prompt']"
    )
    assert MathTask(path, tok, num_eval=0, question_key="prompt").train_examples(0, 1)
    path = _jsonl(tmp_path / "u.jsonl", [{"problem": "p", "final": "1"}])
    with pytest.raises(ValueError, match=r"u.jsonl:1: no key 'answer' \(task.answer_key\) or "
                                         r"'solution' \(task.solution_key\); the record has"):  # fmt: skip
        MathTask(path, tok, num_eval=0)
    path = _jsonl(tmp_path / "v.jsonl", [{"problem": "p", "answer": ["1"]}])
    with pytest.raises(ValueError, match=r"'answer' \(task.answer_key\) is a list; expected"):
        MathTask(path, tok, num_eval=0)


def test_parquet_and_a_saved_dataset_directory(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"problem": ["a", "b"], "answer": ["\\frac{1}{2}", "3"], "level": [1, 2]})
    pq.write_table(table, tmp_path / "t.parquet")
    task = MathTask(tmp_path / "t.parquet", ByteTokenizer(), num_eval=1)
    assert [e.answer for e in task.eval_examples()] == ["3"]
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict(
        {"problem": ["p1", "p2", "p3"], "solution": ["\\boxed{1}", "\\boxed{x^2}", "\\boxed{7}"]}
    ).save_to_disk(str(saved))
    task = MathTask(saved, ByteTokenizer(), num_eval=1)
    assert [e.answer for e in task.eval_examples()] == ["7"]
    assert sorted(e.answer for e in task.train_examples(0, 2)) == ["1", "x^2"]
    both = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"problem": ["p"]})}).save_to_disk(
        str(both)
    )
    with pytest.raises(ValueError, match=r"a DatasetDict with splits \['train'\]; name one"):
        MathTask(both, ByteTokenizer(), num_eval=0)


def test_prompt_templates_from_a_string_or_a_file_and_eval_set_names(tmp_path):
    assert prompt_template_text("Q: {question}") == "Q: {question}"
    file = tmp_path / "t.txt"
    file.write_text("Problem: {problem}\nBox it: \\boxed{{}}")
    path = _jsonl(tmp_path / "m.jsonl", [{"problem": "1+1", "answer": "2"}] * 2)
    task = MathTask(path, ByteTokenizer(), num_eval=1, prompt_template=str(file))
    assert task.eval_examples()[0].prompt == "Problem: 1+1\nBox it: \\boxed{}"
    with pytest.raises(ValueError, match=r"task.prompt_template: expected a '\{problem\}'"):
        prompt_template_text("no field")
    with pytest.raises(ValueError, match=r"not a format string with only \{problem\}"):
        prompt_template_text("{problem} \\boxed{}")
    assert parse_eval_sets("a=/x.jsonl, b-2=/y") == {"a": "/x.jsonl", "b-2": "/y"}
    for bad, message in (("a", "expected name=path"), ("a/b=x", "letters, digits"),
                         ("a=x,a=y", "'a' named twice")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_eval_sets(bad)


SEEN = []


def raw_reference_reward(completion, answer):
    SEEN.append(answer)
    return 1.0


def test_a_reward_fn_gets_the_raw_reference_and_failures_stop_in_one_line(tmp_path):
    path = _jsonl(tmp_path / "m.jsonl", MATH_RECORDS[:1] * 2)
    task = MathTask(path, ByteTokenizer(), num_eval=0, reward_fn=f"{__name__}:raw_reference_reward")
    SEEN.clear()
    assert task.reward(task.train_examples(0, 1)[0], "anything") == 1.0
    assert SEEN == ["\\frac{1}{2}"]
    assert task.reward_name == f"{__name__}:raw_reference_reward"
    example = Example("p", "\\frac{1}{2}", 17)
    long = "x" * 300

    def raises(c, a):
        raise KeyError("boom")

    for fn, reason in ((raises, "raised KeyError: 'boom'"), (lambda c, a: None, "returned None"),
                       (lambda c, a: math.nan, "returned nan"), (lambda c, a: True, "returned True")):  # fmt: skip
        task = MathTask(path, ByteTokenizer(), num_eval=0, reward_fn=fn)
        with pytest.raises(RewardError) as e:
            task.reward(example, long)
        text = str(e.value)
        assert reason in text and "(problem 17, completion: 'xxx" in text and "\n" not in text
        assert text.endswith("x' ...)") and text.count("x") >= 200 and len(text) < 420
    # The scorer reports the same, for a whole batch.
    scorer = RewardScorer(task, workers=2, timeout_s=5.0)
    with pytest.raises(RewardError, match=r"returned True; expected a finite number \(problem 17"):
        scorer([example], ["c"])


class SlowVerifier(MathVerifier):
    """math-verify, but a completion saying "slow" takes 30 s (adversarial input)."""

    def __call__(self, completion, reference):
        if "slow" in completion:
            time.sleep(30)
        return super().__call__(completion, reference)


def slow_reward(completion, answer):
    if "slow" in completion:
        time.sleep(3)
    return 1.0


def test_scoring_times_out_per_completion_scores_zero_and_counts(tmp_path):
    path = _jsonl(tmp_path / "m.jsonl", MATH_RECORDS[:2])
    task = MathTask(path, ByteTokenizer(), num_eval=0, verifier=SlowVerifier())
    examples = task.train_examples(0, 2)
    half = next(e for e in examples if e.answer == "\\frac{1}{2}")
    scorer = RewardScorer(task, workers=2, timeout_s=1.0)
    assert scorer.in_processes  # math-verify may hang: worker processes with an alarm
    pool = scorer._start()  # warm workers: the deadlines count from here
    t0 = time.perf_counter()
    rewards = scorer([half] * 3, ["\\boxed{0.5}", "slow \\boxed{0.5}", "\\boxed{3}"])
    took = time.perf_counter() - t0
    # The worker's alarm stopped the slow completion at 1 s: its worker was not replaced
    # (that takes the 5 s grace past the alarm, then a new pool).
    assert scorer._pool is pool and took < 1.0 + rewards_lib._GRACE_S
    scorer.close()
    assert rewards == [1.0, 0.0, 0.0] and scorer.take_timeouts() == 1
    assert scorer.take_timeouts() == 0
    # A user's function runs on threads; past its timeout it scores 0 and is counted.
    task = MathTask(path, ByteTokenizer(), num_eval=0, reward_fn=slow_reward)
    scorer = RewardScorer(task, workers=2, timeout_s=0.5)
    assert not scorer.in_processes
    assert scorer([half] * 2, ["fast", "slow"]) == [1.0, 0.0] and scorer.take_timeouts() == 1
    # A hung one does not hold its thread's place: with one thread, the completions after
    # it run (each with its own 0.5 s from its start) instead of timing out unscored.
    scorer = RewardScorer(task, workers=1, timeout_s=0.5)
    t0 = time.perf_counter()
    assert scorer([half] * 3, ["slow", "fast", "fast"]) == [0.0, 1.0, 1.0]
    assert scorer.take_timeouts() == 1 and time.perf_counter() - t0 < 2.5


def test_a_task_of_the_users_by_name(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(
        "from m2po_jax.tasks import Example, Task\n"
        "class Reverse(Task):\n"
        "    def train_examples(self, start, count):\n"
        "        return [Example(f'reverse {i}', str(i)[::-1], i) for i in range(start, start + count)]\n"
        "    def eval_examples(self):\n"
        "        return [Example('reverse 12', '21', -1)]\n"
        "    def verify(self, completion, answer):\n"
        "        return float(completion.strip() == answer)\n"
        "NOT_A_TASK = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cls = task_class("my_tasks:Reverse")
    assert issubclass(cls, Task)
    task = make_task("my_tasks:Reverse", tokenizer=ByteTokenizer())
    assert task.train_examples(10, 2)[1].answer == "11" and task.eval_sets() == {
        "held_out": [Example("reverse 12", "21", -1)]
    }
    assert task.reward_name == "Reverse.verify"
    with pytest.raises(TypeError, match="expected a subclass of m2po_jax.tasks.Task"):
        task_class("my_tasks:NOT_A_TASK")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        task_class("my_tasks:Nope")
    with pytest.raises(ValueError, match="module 'no_such_tasks' not found"):
        task_class("no_such_tasks:T")
    with pytest.raises(ValueError, match=r"unknown 'nope'; expected one of \['arith', "
                       r"'calculator', 'gsm8k', 'math'\] or 'package.module:TaskClass'"):  # fmt: skip
        task_class("nope")
    sys.modules.pop("my_tasks", None)
