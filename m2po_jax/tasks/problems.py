"""Problems with reference answers from local files: the data side of `gsm8k` and `math`.

A file is JSONL (one JSON object per line; a UTF-8 BOM is read), Parquet (`.parquet`), or a
local Hugging Face `datasets` directory (`Dataset.save_to_disk`: its Arrow files are read
with pyarrow; `datasets` itself is not needed). Each record gives

- the problem, under `question_key` (GSM8K: `question`; MATH: `problem`);
- the reference, under `answer_key`: kept as the user wrote it after `extract_reference`
  (the last `\\boxed{...}`, else the text after `####`, else the whole string); an integer
  or float is taken as its string;
- optionally a full solution, under `solution_key`: the supervised warm-up's target, and
  where the reference is taken from when a record has no `answer_key`.

Every reference is checked by the task's verifier when the file is read: one it cannot
read is refused naming the file and line, never scored as another number.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from absl import logging

from m2po_jax.models import prompts as prompts_lib
from m2po_jax.tasks.base import Example, RewardFn, Task, Tokenizer, check_range

if TYPE_CHECKING:
    from m2po_jax.tasks.verifiers import Verifier

# The field a prompt template names the problem by ("{problem}" or "{question}").
FIELDS = ("problem", "question")


def prompt_template_text(template: str, where: str = "task.prompt_template") -> str:
    """A template string with a `{problem}` (or `{question}`) field; a path to a file
    holding one is read. Raises ValueError naming `where` otherwise."""
    if template and "{" not in template and os.path.isfile(template):
        try:
            with open(template, encoding="utf-8-sig") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{where}: cannot read the template file {template!r} ({e})") from e
    if not any(f"{{{field}}}" in template for field in FIELDS):
        raise ValueError(
            f"{where}: expected a '{{problem}}' (or '{{question}}') field or a file holding "
            f"such a template, got {template[:80]!r}"
        )
    try:
        template.format(problem="", question="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"{where}: {template[:80]!r} is not a format string with only {{problem}} "
            f"({type(e).__name__}: {e}; write a literal brace as {{{{ or }}}})"
        ) from e
    return template


# ----------------------------------------------------------------------------- reading files


def _jsonl_rows(path: str) -> Iterator[tuple[dict, str]]:
    # Bytes in, decoded per line, so a bad byte is reported with its line.
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            where = f"{path}:{line_number}"
            if line_number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # the UTF-8 BOM some editors write
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
            yield record, where


def _table_rows(table, path: str) -> Iterator[tuple[dict, str]]:
    for row, record in enumerate(table.to_pylist()):
        yield record, f"{path} row {row}"


def _parquet_rows(path: str) -> Iterator[tuple[dict, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from e
    return _table_rows(table, path)


def _dataset_rows(path: str) -> Iterator[tuple[dict, str]]:
    """A `datasets.Dataset.save_to_disk` directory: its Arrow files, in order."""
    import pyarrow as pa

    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        with open(os.path.join(path, "dataset_dict.json")) as f:
            splits = json.load(f).get("splits", [])
        raise ValueError(
            f"{path}: a DatasetDict with splits {splits}; name one split's directory, e.g. "
            f"{os.path.join(path, splits[0] if splits else 'train')}"
        )
    state_file = os.path.join(path, "state.json")
    if not os.path.isfile(state_file):
        raise ValueError(
            f"{path}: a directory that is not a saved Hugging Face dataset (no state.json); "
            "expected a JSONL or .parquet file or a `save_to_disk` directory"
        )
    with open(state_file) as f:
        files = [entry["filename"] for entry in json.load(f).get("_data_files", [])]
    if not files:
        raise ValueError(f"{state_file}: lists no data files")
    tables = []
    for name in files:
        file = os.path.join(path, name)
        try:
            with pa.memory_map(file) as source:
                tables.append(pa.ipc.open_stream(source).read_all())
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{file}: not a readable Arrow file ({e})") from e
    return _table_rows(pa.concat_tables(tables), path)


def read_rows(path: str | os.PathLike) -> Iterator[tuple[dict, str]]:
    """(record, where) of each record of a JSONL / Parquet file or a saved dataset."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return _dataset_rows(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path!r}")
    return _parquet_rows(path) if path.endswith(".parquet") else _jsonl_rows(path)


def _text(value, key: str, field: str, record: dict, where: str) -> str:
    if key not in record:
        raise ValueError(f"{where}: no key {key!r} ({field}); the record has keys {sorted(record)}")
    if value is None:
        raise ValueError(f"{where}: {key!r} ({field}) is null; expected a string or a number")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(
            f"{where}: {key!r} ({field}) is a {type(value).__name__}; expected a string or a number"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: {key!r} ({field}) is {value}; expected a finite number")
    return value if isinstance(value, str) else str(value)


def load_problems(
    path: str | os.PathLike,
    verifier: Verifier,
    *,
    question_key: str = "question",
    answer_key: str = "answer",
    solution_key: str = "",
) -> list[dict]:
    """Records {"question", "answer", "solution", "where"} of a problem file, every reference
    checked by `verifier`.

    Raises:
      FileNotFoundError: no such file or directory.
      ValueError: an unreadable file, a record without the problem or the reference, or a
        reference the verifier cannot read; the message names the file and line or row.
    """
    from m2po_jax.tasks.verifiers import extract_reference  # (verifiers imports gsm8k)

    records = []
    for record, where in read_rows(path):
        question = _text(record.get(question_key), question_key, "task.question_key", record, where)
        solution = None
        if solution_key:
            solution = record.get(solution_key)
            if solution is not None:
                solution = _text(solution, solution_key, "task.solution_key", record, where)
        if answer_key in record:
            raw = _text(record[answer_key], answer_key, "task.answer_key", record, where)
        elif solution is not None:
            raw = solution  # the reference is the solution's final answer
        else:
            fields = f"{answer_key!r} (task.answer_key)"
            if solution_key:
                fields += f" or {solution_key!r} (task.solution_key)"
            raise ValueError(f"{where}: no key {fields}; the record has keys {sorted(record)}")
        reference = extract_reference(raw)
        try:
            verifier.check_reference(reference)
        except ValueError as e:
            raise ValueError(f"{where}: reference {reference[:80]!r}: {e}") from None
        records.append(
            {
                "question": question.strip(),
                "answer": reference,
                "solution": solution if solution is not None else raw,
                "where": where,
            }
        )
    if not records:
        raise ValueError(f"{os.fspath(path)}: no records")
    return records


# ----------------------------------------------------------------------------- the task


class ProblemTask(Task):
    """Problems with reference answers from local files, scored by a verifier.

    Training examples cycle through the training records, reshuffled every epoch with
    `np.random.default_rng([seed, epoch])`, so position i is reproducible.

    Args:
      path: the training file (JSONL, `.parquet`, or a `save_to_disk` directory).
      tokenizer: any object with the `Tokenizer` protocol.
      eval_path: the held-out file; without it (and without `eval_sets`) the last
        `num_eval` training records are held out.
      num_eval: records held out when neither `eval_path` nor `eval_sets` is given.
      eval_sets: {name: path} of held-out sets (`eval.sets`), read like `path`; given,
        they are what `eval_sets()` returns.
      prompt_template: a string with a `{problem}` (or `{question}`) field, or a file
        holding one; the task's default when empty.
      verifier: "math" or "numeric" (`verifiers.VERIFIERS`), or a `Verifier`.
      seed: the shuffle seed.
      reward_fn: a reward `(completion, reference) -> float` replacing the verifier
        (it receives the reference as the user wrote it).
      question_key, answer_key, solution_key: the keys / columns read (`load_problems`);
        "" for the task's defaults (`default_question_key`, `default_solution_key`).
      prompt_encode: prompt text -> the ids the policy sees (`PromptEncoder.encode`); with
        `max_prompt_len`, every prompt is encoded once here and `long_prompts` applied.
      max_prompt_len: the prompt width in tokens.
      long_prompts: one of `prompts.LONG_PROMPT_MODES` ("filter", "left", "error").
    """

    default_template = "{problem}"
    default_verifier = "math"
    default_question_key = "question"
    default_solution_key = ""

    def __init__(
        self,
        path: str | os.PathLike,
        tokenizer: Tokenizer,
        *,
        eval_path: str | os.PathLike | None = None,
        num_eval: int = 200,
        eval_sets: Mapping[str, str | os.PathLike] | None = None,
        prompt_template: str = "",
        verifier: str | Verifier = "",
        seed: int = 0,
        reward_fn: str | RewardFn | None = None,
        question_key: str = "",
        answer_key: str = "answer",
        solution_key: str = "",
        prompt_encode: Callable[[str], Sequence[int]] | None = None,
        max_prompt_len: int | None = None,
        long_prompts: str = "left",
    ):
        if not isinstance(num_eval, int) or num_eval < 0:
            raise ValueError(f"num_eval: expected a non-negative int, got {num_eval!r}")
        from m2po_jax.tasks import verifiers as verifiers_lib  # (verifiers imports gsm8k)

        self.prompt_template = prompt_template_text(prompt_template or self.default_template)
        self.verifier = (
            verifier
            if isinstance(verifier, verifiers_lib.Verifier)
            else verifiers_lib.make_verifier(verifier or self.default_verifier)
        )
        super().__init__(tokenizer, reward_fn)
        self.seed = seed
        keys = dict(
            question_key=question_key or self.default_question_key,
            answer_key=answer_key,
            solution_key=solution_key or self.default_solution_key,
        )
        records = load_problems(path, self.verifier, **keys)
        if eval_path is not None:
            train, held_out = records, load_problems(eval_path, self.verifier, **keys)
        elif eval_sets:  # the named sets are the held-out data: train on every record
            train, held_out = records, []
        else:
            if num_eval >= len(records):
                raise ValueError(
                    f"num_eval={num_eval}: {os.fspath(path)!r} has only {len(records)} records; "
                    "hold out fewer or pass eval_path"
                )
            train, held_out = records[: len(records) - num_eval], records[len(records) - num_eval :]
        # uids index the concatenation train + held-out + each named set: never colliding.
        self._train = [self._make(r, uid) for uid, r in enumerate(train)]
        self._solutions = [r["solution"] for r in train]
        uid = len(train)
        self._eval = [self._make(r, uid + i) for i, r in enumerate(held_out)]
        uid += len(held_out)
        self._sets: dict[str, list[Example]] = {}
        where = {"train": [r["where"] for r in train], "eval": [r["where"] for r in held_out]}
        for name, set_path in (eval_sets or {}).items():
            rows = load_problems(set_path, self.verifier, **keys)
            self._sets[name] = [self._make(r, uid + i) for i, r in enumerate(rows)]
            where[name] = [r["where"] for r in rows]
            uid += len(rows)
        self._epoch_order: dict[int, np.ndarray] = {}
        self.prompt_lengths: dict[int, int] = {}
        self.prompts_filtered = {split: 0 for split in where}
        if prompt_encode is not None and max_prompt_len is not None:
            self._screen(prompt_encode, max_prompt_len, long_prompts, where)

    @property
    def verifier_name(self) -> str:
        return f"{self.verifier.name} verifier"

    @property
    def scorer(self) -> RewardFn:
        return self._reward_fn if self._reward_fn is not None else self.verifier

    def _split(self, split: str) -> list[Example]:
        return {"train": self._train, "eval": self._eval}.get(split, self._sets.get(split))

    def _screen(self, encode, max_len: int, mode: str, where: dict[str, list[str]]) -> None:
        """Measures every prompt once and drops (or refuses) the long ones per `mode`."""
        for split in where:
            examples = self._split(split)
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
            kept = [examples[i] for i in keep]
            if split == "train":
                self._train = kept
                self._solutions = [self._solutions[i] for i in keep]
            elif split == "eval":
                self._eval = kept
            else:
                self._sets[split] = kept

    def _make(self, record: dict, uid: int) -> Example:
        text = record["question"]
        prompt = self.prompt_template.format(problem=text, question=text)
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

    def eval_sets(self) -> dict[str, list[Example]]:
        """The named held-out sets (`eval_sets`), or {"held_out": the held-out split}."""
        return {k: list(v) for k, v in self._sets.items()} or {"held_out": self.eval_examples()}

    def sft_examples(self, start: int, count: int) -> list[tuple[str, str]]:
        """(prompt, the record's solution, or its answer field) in training order."""
        check_range(start, count)
        return [
            (self._train[i].prompt, " " + self._solutions[i]) for i in self._indices(start, count)
        ]

    def verify(self, completion: str, answer: str) -> float:
        return self.verifier(completion, answer)


def parse_eval_sets(text: str) -> dict[str, str]:
    """`eval.sets` ("name=path,name=path") as {name: path}; "" is {}."""
    sets: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not eq or not name or not path:
            raise ValueError(f"eval.sets: expected name=path[,name=path...], got {item!r}")
        if not all(c.isalnum() or c in "_-." for c in name):
            raise ValueError(
                f"eval.sets: set name {name!r} may hold letters, digits, '_', '-' and '.' only "
                "(it names the metrics eval/<name>/...)"
            )
        if name in sets:
            raise ValueError(f"eval.sets: {name!r} named twice")
        sets[name] = path
    return sets
