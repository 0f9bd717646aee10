"""The GSM8K config end to end on a local Hugging Face checkpoint, tokenizer and JSONL file."""

import json

import numpy as np
import pytest

from m2po_jax import config as config_lib
from m2po_jax import hf
from m2po_jax import metrics as metrics_lib
from m2po_jax import trainer as trainer_lib
from m2po_jax.configs import gsm8k

WORDS = "what is plus minus the answer apples have has how many".split()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("tiny_llama")
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    tok.train_from_iterator(
        [" ".join(WORDS), " ".join(str(i) for i in range(100)), "? : ."],
        trainers.WordLevelTrainer(special_tokens=specials),
    )
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "pad_token": "<pad>", "bos_token": "<s>"})
    )
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=3,
        bos_token_id=2,
        pad_token_id=0,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)

    rng = np.random.default_rng(0)
    lines = []
    for _ in range(24):
        a, b = (int(x) for x in rng.integers(0, 50, 2))
        lines.append(
            json.dumps(
                {
                    "question": f"what is {a} plus {b} ?",
                    "answer": f"{a} plus {b} is {a + b} . #### {a + b}",
                }
            )
        )
    (path / "train.jsonl").write_text("\n".join(lines) + "\n")
    return path


def small_gsm8k(checkpoint, **changes):
    c = gsm8k.get_config()
    c.model.path = str(checkpoint)
    c.model.dtype = "float32"
    c.model.remat = False
    c.task.train_path = str(checkpoint / "train.jsonl")
    c.task.eval_size = 8
    c.task.max_prompt_len = 32
    c.total_steps = 2
    c.gconfig.n_samples = 2
    c.gconfig.max_new_tokens = 4
    c.actor.reward_norm.group_size = 2
    c.rollout.batch_size = 2
    c.rollout.max_head_offpolicyness = 1
    c.eval.num_examples = 8
    c.eval.batch_size = 8
    c.eval.every = 1
    c.mesh.data = 1
    c.logging.progress = False
    c.logging.plots = False
    for key, value in changes.items():
        c.task[key] = value
    return config_lib.from_configdict(c)


def test_gsm8k_config_trains_from_a_local_checkpoint(checkpoint, tmp_path):
    trainer = trainer_lib.Trainer(small_gsm8k(checkpoint), tmp_path)
    # The policy starts from the checkpoint's weights.
    loaded = hf.load_params(checkpoint, trainer.model_config)
    np.testing.assert_array_equal(
        np.asarray(trainer.state.params["embedding"]), np.asarray(loaded["embedding"])
    )
    result = trainer.run()
    records = metrics_lib.read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1] and result.final_step == 2
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in records)
    assert records[1]["staleness/mean"] == 1.0
    assert np.isfinite(records[1]["loss"])


def test_gsm8k_errors_name_the_missing_file(checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        trainer_lib.Trainer(
            small_gsm8k(checkpoint, train_path=str(tmp_path / "missing.jsonl")), tmp_path
        )
