"""GSM8K-format JSONL math word problems with a numeric answer checker.

Each line is a JSON object with `question` and `answer`; the answer ends with
`#### <number>` (the GSM8K convention). The reward extracts the last number of the
completion and compares it numerically with the reference.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

import numpy as np

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


def load_jsonl(path: str | os.PathLike) -> list[dict]:
    """Records of a GSM8K-format file, each {"question", "solution", "answer", "line"}.

    Raises:
      FileNotFoundError: the file does not exist.
      ValueError: a line is not a JSON object, lacks `question` / `answer`, or the
        answer has no `#### <number>`; the message names the file and line.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GSM8K data file not found: {path!r}")
    records = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            for field in ("question", "answer"):
                if not isinstance(record.get(field), str):
                    raise ValueError(f"{where}: missing string field {field!r}")
            solution = record["answer"]
            if "####" not in solution:
                raise ValueError(f"{where}: answer has no '#### <number>' final answer")
            final = solution.rsplit("####", 1)[1]
            value = extract_last_number(final)
            if value is None:
                raise ValueError(f"{where}: no number after '####' in answer ({final.strip()!r})")
            records.append(
                {
                    "question": record["question"].strip(),
                    "solution": solution,
                    "answer": format_number(value),
                    "line": line_number,
                }
            )
    if not records:
        raise ValueError(f"{path}: no records")
    return records


class GSM8KTask(Task):
    """GSM8K-format problems from local JSONL files.

    Training examples cycle through the training records, reshuffled every epoch with
    `np.random.default_rng([seed, epoch])`, so position i is reproducible.

    Args:
      path: training JSONL file.
      tokenizer: any object with the `Tokenizer` protocol (e.g. a Hugging Face wrapper).
      eval_path: held-out JSONL file; without it the last `num_eval` records of `path`
        are held out.
      num_eval: records held out when `eval_path` is None.
      prompt_template: a format string with a `{question}` field.
      seed: the shuffle seed.
      reward_fn: optional pluggable reward replacing `numeric_reward`.
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
        records = load_jsonl(path)
        if eval_path is not None:
            train, held_out = records, load_jsonl(eval_path)
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
