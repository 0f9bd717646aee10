"""What the benchmarks run on, made locally (no hub): a random checkpoint of a real
architecture, a tokenizer that fits its vocabulary, and GSM8K-format problems.

    from benchmarks import fixtures   (or `import fixtures` from this folder)
    path = fixtures.write_checkpoint(tmp / "qwen3-0.6b", "qwen3-0.6b", backend="transformers")
    data = fixtures.write_gsm8k(tmp / "gsm8k.jsonl", 64)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|im_end|>"]


def write_tokenizer(path: Path, numbers: int = 1000) -> Path:
    """A word-level tokenizer.json over the numbers below `numbers`, operators and GSM8K
    words, with special ids in tokenizer_config.json and generation_config.json (two eos ids,
    like Qwen instruct)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = [str(i) for i in range(numbers)] + list("+-*/=$.,:?#()")
    words += "Solve the math problem step by step and end with final numeric answer".split()
    words += "Question Answer Tom has apples buys more gives away how many left total".split()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIALS)
    tok.train_from_iterator([" ".join(words)], trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "pad_token": "<pad>", "bos_token": "<s>"})
    )
    eos = [SPECIALS.index("<|im_end|>"), SPECIALS.index("</s>")]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return path


def write_checkpoint(path: Path, architecture: str, **changes) -> Path:
    """A checkpoint directory of `architecture` (`m2po_jax.models.architectures`) with random
    weights written by transformers (float32 safetensors), plus `write_tokenizer`'s files."""
    import torch
    import transformers

    from m2po_jax.models import architectures

    hf = architectures.hf_config(architecture, **changes)
    config = transformers.AutoConfig.for_model(**hf, bos_token_id=2, eos_token_id=3, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(path), safe_serialization=True)
    del model
    return write_tokenizer(path)


def write_gsm8k(path: Path, count: int, seed: int = 0) -> Path:
    """`count` GSM8K-format records (question, answer ending in '#### n') as JSONL."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for _ in range(count):
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            record = {
                "question": f"Tom has {a} apples . Tom buys {b} more . how many apples total ?",
                "answer": f"{a} + {b} = {a + b} . #### {a + b}",
            }
            fh.write(json.dumps(record) + "\n")
    return path
