"""Synthetic arithmetic ("12+345=" -> "357") with an exact verifier and a char tokenizer.

Small enough that a tiny model learns it on a CPU in minutes, which makes it the
default task for tests and for the stale-k study.

Determinism: training example i comes from block i // BLOCK, drawn with
`np.random.default_rng([seed, stream, block])`, so any position can be regenerated
without replaying the stream. A problem belongs to the eval split iff a hash of
(seed, problem) falls below `eval_fraction`; training draws reject those problems,
so the splits are disjoint by construction.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import numpy as np

from m2po_jax.tasks.base import Example, RewardFn, Task, Tokenizer, check_range

ALPHABET = "0123456789+-*="
OPS = "+-*"
BLOCK = 4096  # examples per independently seeded block
_TRAIN_STREAM, _EVAL_STREAM, _SFT_STREAM = 0, 1, 2
_INTEGER_RE = re.compile(r"-?\d+")


class CharTokenizer:
    """One token per character of a fixed alphabet, plus PAD=0, BOS=1, EOS=2.

    `encode` adds no special tokens. `decode` drops PAD and BOS and ends at the first
    EOS, so the decoded completion is exactly the text the verifier should see.
    """

    pad_id = 0
    bos_id = 1
    eos_id = 2

    def __init__(self, alphabet: str = ALPHABET):
        if not alphabet or len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet: expected distinct characters, got {alphabet!r}")
        self.alphabet = alphabet
        self._offset = 3
        self._char_to_id = {c: i + self._offset for i, c in enumerate(alphabet)}
        self.vocab_size = self._offset + len(alphabet)

    def encode(self, text: str) -> list[int]:
        ids = []
        for pos, char in enumerate(text):
            if char not in self._char_to_id:
                raise ValueError(
                    f"text: character {char!r} at position {pos} of {text!r} is not in the "
                    f"alphabet {self.alphabet!r}"
                )
            ids.append(self._char_to_id[char])
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        chars = []
        for token in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            if token == self.eos_id:
                break
            if token in (self.pad_id, self.bos_id):
                continue
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"ids: token {token} outside [0, {self.vocab_size})")
            chars.append(self.alphabet[token - self._offset])
        return "".join(chars)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a stable, well-mixed uint64 hash (Python's hash() is salted)."""
    x = x.astype(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class ArithTask(Task):
    """Integer arithmetic `a op b` with operands of `min_digits..max_digits` digits.

    Args:
      seed: selects both the train stream and the eval split.
      ops: operators drawn uniformly, a subset of "+-*".
      min_digits, max_digits: each operand first draws its digit count uniformly,
        then a value uniformly among numbers with that many digits (1 digit: 0..9).
      eval_size: number of distinct held-out problems (fewer if the reserved part of
        the problem space is smaller).
      eval_fraction: fraction of the problem space reserved for evaluation.
      format_reward: reward for a well-formed but wrong integer answer (0 = off).
      tokenizer: defaults to `CharTokenizer()`.
      reward_fn: optional pluggable reward replacing `verify`.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        ops: str = "+",
        min_digits: int = 1,
        max_digits: int = 2,
        eval_size: int = 256,
        eval_fraction: float = 0.05,
        format_reward: float = 0.0,
        tokenizer: Tokenizer | None = None,
        reward_fn: str | RewardFn | None = None,
    ):
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed: expected a non-negative int, got {seed!r}")
        if not ops or not set(ops) <= set(OPS) or len(set(ops)) != len(ops):
            raise ValueError(f"ops: expected distinct operators from {OPS!r}, got {ops!r}")
        if not (isinstance(min_digits, int) and isinstance(max_digits, int)) or not (
            1 <= min_digits <= max_digits <= 9
        ):
            raise ValueError(
                "min_digits, max_digits: expected ints with 1 <= min_digits <= max_digits <= 9 "
                f"(int64 products), got {min_digits!r}, {max_digits!r}"
            )
        if not isinstance(eval_size, int) or eval_size < 1:
            raise ValueError(f"eval_size: expected a positive int, got {eval_size!r}")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction: expected a value in (0, 1), got {eval_fraction!r}")
        if not 0.0 <= format_reward < 1.0:
            raise ValueError(f"format_reward: expected a value in [0, 1), got {format_reward!r}")
        super().__init__(tokenizer if tokenizer is not None else CharTokenizer(), reward_fn)
        self.tokenizer.encode("0123456789=" + ops)  # fails early if a symbol is missing
        self.seed = seed
        self.ops = ops
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.eval_size = eval_size
        self.eval_fraction = eval_fraction
        self.format_reward = format_reward
        self._eval = self._make_eval()

    # Problems are int64 arrays (op_index, a, b); `_uid` packs them into one integer.

    def _uid(self, op: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        base = 10**self.max_digits
        return (op.astype(np.int64) * base + a) * base + b

    def _is_eval(self, uid: np.ndarray) -> np.ndarray:
        h = _mix64(_mix64(uid.astype(np.uint64)) ^ np.uint64(self.seed))
        return (h >> np.uint64(11)).astype(np.float64) / float(2**53) < self.eval_fraction

    def _draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, ...]:
        op = rng.integers(0, len(self.ops), n)
        operands = []
        for _ in range(2):
            digits = rng.integers(self.min_digits, self.max_digits + 1, n)
            low = np.where(digits == 1, 0, 10 ** (digits - 1))
            operands.append(rng.integers(low, 10**digits))
        return op, operands[0], operands[1]

    @functools.lru_cache(maxsize=8)  # noqa: B019 (a task lives as long as the run)
    def _block(self, stream: int, block: int) -> np.ndarray:
        """BLOCK training-split problem uids for one (stream, block)."""
        rng = np.random.default_rng([self.seed, stream, block])
        uids = np.zeros((0,), np.int64)
        for _ in range(100):
            uid = self._uid(*self._draw(rng, 2 * BLOCK))
            uids = np.concatenate([uids, uid[~self._is_eval(uid)]])
            if uids.size >= BLOCK:
                return uids[:BLOCK]
        raise ValueError(
            f"eval_fraction={self.eval_fraction} leaves too few training problems in this space"
        )

    def _example(self, uid: int) -> Example:
        base = 10**self.max_digits
        op_index, rest = divmod(uid, base * base)
        a, b = divmod(rest, base)
        op = self.ops[op_index]
        result = a + b if op == "+" else a - b if op == "-" else a * b
        return Example(prompt=f"{a}{op}{b}=", answer=str(result), uid=uid)

    def _stream(self, stream: int, start: int, count: int) -> list[Example]:
        out = []
        for pos in range(start, start + count):
            block, offset = divmod(pos, BLOCK)
            out.append(self._example(int(self._block(stream, block)[offset])))
        return out

    def _make_eval(self) -> list[Example]:
        rng = np.random.default_rng([self.seed, _EVAL_STREAM])
        seen: dict[int, None] = {}  # insertion-ordered set
        # Bounded: a tiny problem space may hold fewer reserved problems than eval_size.
        for _ in range(64):
            uid = self._uid(*self._draw(rng, 8192))
            for u in uid[self._is_eval(uid)].tolist():
                seen.setdefault(u)
            if len(seen) >= self.eval_size:
                break
        if not seen:
            raise ValueError(
                f"eval_fraction={self.eval_fraction} reserves no problem of this space "
                f"(ops={self.ops!r}, digits {self.min_digits}..{self.max_digits}); raise it"
            )
        return [self._example(u) for u in list(seen)[: self.eval_size]]

    def train_examples(self, start: int, count: int) -> list[Example]:
        check_range(start, count)
        return self._stream(_TRAIN_STREAM, start, count)

    def eval_examples(self) -> list[Example]:
        return list(self._eval)

    def sft_examples(self, start: int, count: int) -> list[tuple[str, str]]:
        """(prompt, answer) pairs from the training split, on a stream separate from RL's."""
        check_range(start, count)
        return [(e.prompt, e.answer) for e in self._stream(_SFT_STREAM, start, count)]

    def verify(self, completion: str, answer: str) -> float:
        """1.0 if the stripped completion equals `answer`; `format_reward` for any other
        well-formed integer; else 0.0."""
        text = completion.strip()
        if text == answer:
            return 1.0
        if self.format_reward and _INTEGER_RE.fullmatch(text):
            return self.format_reward
        return 0.0
