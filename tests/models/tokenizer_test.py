"""Tokenizers from a local directory: special ids from the json files, vocabulary checks."""

import pytest

from m2po_jax.models import tokenizer
from m2po_jax.models.model_config import ModelConfig


def test_tokenizer(tokenizer_dir):
    tok = tokenizer.load_tokenizer(tokenizer_dir)
    assert tok.vocab_size == 5 + 10  # 5 specials + 10 distinct words
    assert (tok.eos_id, tok.eos_ids, tok.pad_id, tok.bos_id) == (3, (3, 4), 0, 2)
    ids = tok.encode("the cat ate 12 apples")
    assert len(ids) == 5 and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == "the cat ate 12 apples"
    assert tok.decode([*ids, tok.eos_id]) == "the cat ate 12 apples"  # specials skipped
    assert tok.encode("zebra") == [tok.token_to_id("<unk>")]


def test_tokenizer_vocab_checks(tokenizer_dir, tmp_path):
    small = ModelConfig(
        vocab_size=8,
        hidden_size=16,
        intermediate_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
    )
    with pytest.raises(ValueError, match=r"vocabulary size 15.*vocab_size 8"):
        tokenizer.load_tokenizer(tokenizer_dir, small)
    assert tokenizer.load_tokenizer(tokenizer_dir, small.replace(vocab_size=15)).vocab_size == 15
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        tokenizer.load_tokenizer(tmp_path)


def test_eos_ids_keep_every_generation_config_stop_id(tokenizer_dir, tmp_path):
    """Qwen2.5-Instruct: tokenizer eos <|im_end|>, generation_config [<|im_end|>, <|endoftext|>]."""
    import json
    import shutil

    path = tmp_path / "qwen_like"
    shutil.copytree(tokenizer_dir, path)
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<eot>", "pad_token": "</s>", "bos_token": None})
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 3]}))
    (path / "config.json").write_text(json.dumps({"eos_token_id": 3, "bos_token_id": 3}))
    tok = tokenizer.load_tokenizer(path)
    assert tok.eos_ids == (4, 3) and tok.eos_id == 4
    assert tok.special_tokens == {"eos_token": "<eot>", "pad_token": "</s>"}
    assert tok.chat_template is None
    assert tokenizer.load_tokenizer(tokenizer_dir).special_tokens["bos_token"] == "<s>"
