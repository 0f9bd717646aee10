"""Test session setup: eight fake CPU devices for the sharding tests, shared fixtures.

The device count is set before jax is imported anywhere, so every test process (xdist
workers included) sees the same count; single-device code runs on device 0.
"""

import json
import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A word-level tokenizer.json with special ids in tokenizer_ and generation_config."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<s>", "</s>", "<eot>"])
    tok.train_from_iterator(["the cat sat on the mat", "a dog ate 12 apples"], trainer)
    path = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "</s>"}, "pad_token": "<pad>", "bos_token": "<s>"})
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    return path
