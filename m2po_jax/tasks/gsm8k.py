"""GSM8K-format math word problems (JSONL or Parquet) with a numeric answer checker.

Each JSONL line is a JSON object (each Parquet row a row) with a question and an answer
(keys / columns `question` and `answer` unless configured); the answer ends with
`#### <number>` (the GSM8K convention). The reward extracts the last number of the
completion and compares it numerically with the reference.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence

import numpy as np
from absl import logging

from m2po_jax.models import prompts as prompts_lib
from m2po_jax.tasks.base import Example, RewardFn, Task, Tokenizer, check_range

DEFAULT_PROMPT_TEMPLATE = (
    "Solve the math problem step by step and end with the final numeric answer.\n"
    "Question: {question}\nAnswer:"
)
TOLERANCE = 1e-6

# A sign counts only when it is not a hyphen or minus between two terms ("5-3", "x-3").
# Thousands separators must group by three, so "1,2,3" reads as three numbers.
_NUMBER_RE = re.compile(
    r"(?P<sign>(?<![0-9A-Za-z)])-)?\$?(?P<number>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
)


def extract_last_number(text: str) -> float | None:
    """The last number in `text` ("The answer is $1,234.50." -> 1234.5), or None.

    Commas, "$" and trailing units or "%" are ignored; a leading "-" makes it negative.
    """
    matches = _NUMBER_RE.findall(text)
    if not matches:
        return None
    sign, number = matches[-1]
    value = float(number.replace(",", ""))
    return -value if sign else value


def format_number(value: float) -> str:
    """A canonical string: "72" for integral values, else the shortest float repr."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def numeric_reward(completion: str, answer: str) -> float:
    """1.0 if the last number of `completion` equals the number in `answer` (|diff| <= 1e-6)."""
    predicted = extract_last_number(completion)
    reference = extract_last_number(answer)
    if predicted is None or reference is None:
        return 0.0
    return 1.0 if abs(predicted - reference) <= TOLERANCE else 0.0


def _record(question, answer, where: str, question_key: str, answer_key: str) -> dict:
    """One checked record; `where` ("file:line" or "file row i") names it in errors."""
    for key, value in ((question_key, question), (answer_key, answer)):
        if not isinstance(value, str):
            raise ValueError(f"{where}: missing string field {key!r}")
    if "####" not in answer:
        raise ValueError(f"{where}: answer has no '#### <number>' final answer")
    final = answer.rsplit("####", 1)[1]
    value = extract_last_number(final)
    if value is None:
        raise ValueError(f"{where}: no number after '####' in answer ({final.strip()!r})")
    return {
        "question": question.strip(),
        "solution": answer,
        "answer": format_number(value),
        "where": where,
    }


def _jsonl_rows(path: str, question_key: str, answer_key: str):
    # Bytes in, decoded per line, so a bad byte is reported with its line.
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            where = f"{path}:{line_number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from e
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield record.get(question_key), record.get(answer_key), where


def _parquet_rows(path: str, question_key: str, answer_key: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from e
    for key, field in ((question_key, "task.question_key"), (answer_key, "task.answer_key")):
        if key not in table.column_names:
            raise ValueError(
                f"{path}: no column {key!r} ({field}); the file has columns {table.column_names}"
            )
    questions = table.column(question_key).to_pylist()
    answers = table.column(answer_key).to_pylist()
    for row, (question, answer) in enumerate(zip(questions, answers, strict=True)):
        yield question, answer, f"{path} row {row}"


def load_records(
    path: str | os.PathLike, question_key: str = "question", answer_key: str = "answer"
) -> list[dict]:
    """Records of a GSM8K-format JSONL or Parquet (`.parquet`) file.

    Each record is {"question", "solution", "answer", "where"}; the columns (JSON keys) read
    are `question_key` and `answer_key`.

    Raises:
      FileNotFoundError: the file does not exist.
      ValueError: unreadable file, missing column or field, or an answer without
        `#### <number>`; the message names the file and line or row.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GSM8K data file not found: {path!r}")
    rows = _parquet_rows if path.endswith(".parquet") else _jsonl_rows
    records = [
        _record(*row, question_key, answer_key) for row in rows(path, question_key, answer_key)
    ]
    if not records:
        raise ValueError(f"{path}: no records")
    return records


class GSM8KTask(Task):
    """GSM8K-format problems from local JSONL or Parquet files.

    Training examples cycle through the training records, reshuffled every epoch with
    `np.random.default_rng([seed, epoch])`, so position i is reproducible.

    Args:
      path: training file, JSONL or `.parquet`.
      tokenizer: any object with the `Tokenizer` protocol (e.g. a Hugging Face wrapper).
      eval_path: held-out file; without it the last `num_eval` records of `path`
        are held out.
      num_eval: records held out when `eval_path` is None.
      prompt_template: a format string with a `{question}` field.
      seed: the shuffle seed.
      reward_fn: optional pluggable reward replacing `numeric_reward`.
      question_key, answer_key: the JSON keys / Parquet columns read.
      prompt_encode: prompt text -> the ids the policy sees (`PromptEncoder.encode`); with
        `max_prompt_len`, every prompt is encoded once here and `long_prompts` applied.
      max_prompt_len: the prompt width in tokens.
      long_prompts: one of `prompts.LONG_PROMPT_MODES` ("filter", "left", "error").

    After screening, `prompt_lengths` maps uid -> token count and `prompts_filtered`
    counts the examples dropped per split ({"train": n, "eval": m}).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        tokenizer: Tokenizer,
        *,
        eval_path: str | os.PathLike | None = None,
        num_eval: int = 200,
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
        seed: int = 0,
        reward_fn: str | RewardFn | None = None,
        question_key: str = "question",
        answer_key: str = "answer",
        prompt_encode: Callable[[str], Sequence[int]] | None = None,
        max_prompt_len: int | None = None,
        long_prompts: str = "left",
    ):
        if "{question}" not in prompt_template:
            raise ValueError(
                f"prompt_template: expected a '{{question}}' field, got {prompt_template!r}"
            )
        if not isinstance(num_eval, int) or num_eval < 0:
            raise ValueError(f"num_eval: expected a non-negative int, got {num_eval!r}")
        super().__init__(tokenizer, reward_fn)
        self.prompt_template = prompt_template
        self.seed = seed
        records = load_records(path, question_key, answer_key)
        if eval_path is not None:
            train, held_out = records, load_records(eval_path, question_key, answer_key)
        else:
            if num_eval >= len(records):
                raise ValueError(
                    f"num_eval={num_eval}: {os.fspath(path)!r} has only {len(records)} records; "
                    "hold out fewer or pass eval_path"
                )
            train, held_out = records[: len(records) - num_eval], records[len(records) - num_eval :]
        # uids index the concatenation train + held_out, so they never collide.
        self._train = [self._make(r, uid) for uid, r in enumerate(train)]
        self._solutions = [r["solution"] for r in train]
        self._eval = [self._make(r, len(train) + i) for i, r in enumerate(held_out)]
        self._epoch_order: dict[int, np.ndarray] = {}
        self.prompt_lengths: dict[int, int] = {}
        self.prompts_filtered = {"train": 0, "eval": 0}
        if prompt_encode is not None and max_prompt_len is not None:
            where = {"train": [r["where"] for r in train], "eval": [r["where"] for r in held_out]}
            self._screen(prompt_encode, max_prompt_len, long_prompts, where)

    def _screen(self, encode, max_len: int, mode: str, where: dict[str, list[str]]) -> None:
        """Measures every prompt once and drops (or refuses) the long ones per `mode`."""
        for split in ("train", "eval"):
            examples = self._train if split == "train" else self._eval
            if not examples:
                continue
            prompts = [e.prompt for e in examples]
            lengths, keep = prompts_lib.screen_prompts(prompts, where[split], encode, max_len, mode)
            self.prompt_lengths.update((e.uid, n) for e, n in zip(examples, lengths, strict=True))
            if not keep:
                raise ValueError(
                    f"task.long_prompts='filter': all {len(examples)} {split} prompts are longer "
                    f"than task.max_prompt_len={max_len} tokens (the shortest has "
                    f"{min(lengths)}); raise task.max_prompt_len"
                )
            self.prompts_filtered[split] = len(examples) - len(keep)
            if len(keep) < len(examples):
                logging.warning(
                    "task.long_prompts='filter': dropped %d of %d %s prompts longer than %d tokens",
                    len(examples) - len(keep),
                    len(examples),
                    split,
                    max_len,
                )
            if split == "train":
                self._train = [self._train[i] for i in keep]
                self._solutions = [self._solutions[i] for i in keep]
            else:
                self._eval = [self._eval[i] for i in keep]

    def _make(self, record: dict, uid: int) -> Example:
        prompt = self.prompt_template.format(question=record["question"])
        return Example(prompt=prompt, answer=record["answer"], uid=uid)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._epoch_order:
            if len(self._epoch_order) > 4:
                self._epoch_order.clear()
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch_order[epoch] = rng.permutation(len(self._train))
        return self._epoch_order[epoch]

    def _indices(self, start: int, count: int) -> Sequence[int]:
        n = len(self._train)
        return [int(self._order(pos // n)[pos % n]) for pos in range(start, start + count)]

    def train_examples(self, start: int, count: int) -> list[Example]:
        check_range(start, count)
        return [self._train[i] for i in self._indices(start, count)]

    def eval_examples(self) -> list[Example]:
        return list(self._eval)

    def sft_examples(self, start: int, count: int) -> list[tuple[str, str]]:
        """(prompt, reference solution ending in '#### <number>') in training order."""
        check_range(start, count)
        return [
            (self._train[i].prompt, " " + self._solutions[i]) for i in self._indices(start, count)
        ]

    def verify(self, completion: str, answer: str) -> float:
        return numeric_reward(completion, answer)
