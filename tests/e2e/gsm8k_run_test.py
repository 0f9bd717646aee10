"""The GSM8K config end to end on a local Hugging Face checkpoint, tokenizer and JSONL file."""

import json

import jax
import numpy as np
import pytest

from m2po_jax import config as config_lib
from m2po_jax import trainer as trainer_lib
from m2po_jax.configs import gsm8k
from m2po_jax.models import hf
from m2po_jax.models import prompts as prompts_lib
from m2po_jax.models import tokenizer as tokenizer_lib
from m2po_jax.run import metrics as metrics_lib
from m2po_jax.tasks import gsm8k as gsm8k_task
from m2po_jax.tasks import verifiers
from m2po_jax.trainer import sft

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
    return config_lib.from_configdict(small_gsm8k_dict(checkpoint, **changes))


def small_gsm8k_dict(checkpoint, **changes):
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
    c.rollout.batch_size = 2
    c.rollout.max_head_offpolicyness = 1
    c.eval.num_examples = 8
    c.eval.batch_size = 8
    c.eval.every = 1
    c.mesh.data = 1
    c.logging.progress = False
    c.logging.plots = False
    c.eval.reward = changes.pop("eval_reward", "train")
    for key, value in changes.items():
        c.task[key] = value
    return c


def completion_length_reward(completion: str, answer: str) -> float:
    """A training reward that differs between samples of one prompt (the tiny random policy
    never solves a problem: with the task's verifier every advantage would be 0)."""
    return len(completion) / 10.0


def _greedy_by_torch(checkpoint, prompts, tokenizer, new_tokens, eos_id=3):
    """Greedy completions (decoded, without the stop token) by the transformers model."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint).eval()
    texts = []
    for prompt in prompts:
        ids = torch.tensor([prompts_lib.PromptEncoder(tokenizer).encode(prompt)])
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                do_sample=False, eos_token_id=eos_id, pad_token_id=0,
            )  # fmt: skip
        completion = out[0, ids.shape[1] :].tolist()
        completion = completion[: completion.index(eos_id)] if eos_id in completion else completion
        texts.append(tokenizer.decode(completion))
    return texts


def test_gsm8k_config_trains_from_a_local_checkpoint(checkpoint, tmp_path):
    # The held-out split (the last task.eval_size records) gets answers that the initial
    # policy's greedy completions, decoded by transformers, get right for some examples.
    lines = (checkpoint / "train.jsonl").read_text().splitlines()
    examples = [json.loads(line) for line in lines]
    eval_records = examples[-8:]
    tokenizer = tokenizer_lib.load_tokenizer(checkpoint)
    prompts = [
        gsm8k_task.DEFAULT_PROMPT_TEMPLATE.format(question=r["question"]) for r in eval_records
    ]
    texts = _greedy_by_torch(checkpoint, prompts, tokenizer, new_tokens=4)
    right = 0
    for i, (record, text) in enumerate(zip(eval_records, texts, strict=True)):
        number = verifiers.extract_last_number(text)
        if number is not None and i % 2 == 0:
            record["answer"] = f"#### {gsm8k_task.format_number(number)}"
            right += 1
        else:
            record["answer"] = "#### 123456"  # no completion of 4 tokens says it
    assert right >= 2, texts
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in examples))

    reward_fn = f"{__name__}:completion_length_reward"
    # eval.reward="verifier": held-out accuracy by the GSM8K verifier, not this reward.
    cfg = small_gsm8k(checkpoint, train_path=str(data), reward_fn=reward_fn, eval_reward="verifier")
    trainer = trainer_lib.Trainer(cfg, tmp_path / "run")
    # The policy starts from the checkpoint's weights.
    loaded = hf.load_params(checkpoint, trainer.model_config)
    np.testing.assert_array_equal(
        np.asarray(trainer.state.params["embedding"]), np.asarray(loaded["embedding"])
    )
    result = trainer.run()
    records = metrics_lib.read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1] and result.final_step == 2
    # Step 0 evaluates the initial policy: the fraction transformers' greedy decoding gets.
    assert records[0]["eval/accuracy"] == right / 8
    assert result.scored_by == "numeric verifier"
    assert result.eval_accuracy == [(s, r["eval/accuracy"]) for s, r in enumerate(records)]
    assert records[1]["staleness/mean"] == 1.0
    for r in records:
        assert r["reward/std"] > 0 and r["train/adv_abs_mean"] > 0
        assert np.isfinite(r["loss"]) and r["loss"] != 0.0 and r["grad_norm"] > 0
    # Two AdamW updates at lr 1e-6 (constant): each moves a param by about lr at most.
    lr = cfg.actor.optimizer.lr
    assert records[1]["train/lr"] == pytest.approx(lr)
    moved = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(trainer.state.params), jax.tree.leaves(loaded), strict=True)
    )
    assert 0.9 * lr < moved < 2.2 * lr


def test_a_study_on_the_gsm8k_config_runs_its_cells_from_the_checkpoint(checkpoint, tmp_path):
    from m2po_jax.cli import study

    base = small_gsm8k_dict(checkpoint, reward_fn=f"{__name__}:completion_length_reward")
    cells = study.grid([0, 1], ["grpo", "m2po"], [1e-6], [0])
    ran = study.run_study(base.to_dict(), cells, tmp_path, steps=2)
    assert [c.name for c in ran] == ["k0_grpo_lr1e-06_seed0", "k1_m2po_lr1e-06_seed0"]
    assert not (tmp_path / "warmup").exists()  # the config has no warm-up: the checkpoint
    for c in ran:
        workdir = tmp_path / "cells" / c.name
        recorded = json.loads((workdir / "config.json").read_text())["config"]
        assert recorded["model.path"] == str(checkpoint) and recorded["actor.optimizer.lr"] == 1e-6
        rows = metrics_lib.read_metrics(workdir / "metrics.jsonl")
        assert [r["step"] for r in rows] == [0, 1] and rows[1]["staleness/max"] == c.staleness
        assert all(r["reward/std"] > 0 and r["grad_norm"] > 0 for r in rows)
        done = json.loads((workdir / study.DONE).read_text())
        assert done["final"] == rows[-1]["eval/accuracy"]
    table = (tmp_path / "study.md").read_text()
    assert "| 1 | m2po | 1e-06 | 1 |" in table and "| 0 | grpo | 1e-06 | 1 |" in table


def test_gsm8k_errors_name_the_missing_file(checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        trainer_lib.Trainer(
            small_gsm8k(checkpoint, train_path=str(tmp_path / "missing.jsonl")), tmp_path
        )


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }} : {{ m.content }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


@pytest.fixture(scope="module")
def chat_checkpoint(checkpoint, tmp_path_factory):
    """The tiny checkpoint with a chat template file and two stop ids in generation_config."""
    import shutil

    path = tmp_path_factory.mktemp("tiny_chat") / "ckpt"
    shutil.copytree(checkpoint, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 0]}))
    return path


def test_chat_template_reaches_rollouts_eval_and_warmup_with_one_bos(chat_checkpoint, tmp_path):
    import transformers

    from m2po_jax.rollout import batches as rollout_lib

    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(chat_checkpoint))
    hf.chat_template = TEMPLATE
    trainer = trainer_lib.Trainer(small_gsm8k(chat_checkpoint), tmp_path)
    assert trainer.sampling_config.stop_token_ids == (3, 0)  # every generation_config eos id
    example = trainer.task.train_examples(0, 1)[0]
    messages = [{"role": "user", "content": example.prompt}]
    expected = list(hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    assert expected[0] == 2 and expected.count(2) == 1  # "<s>" once, from the template
    width = trainer.cfg.task.max_prompt_len
    ids, valid = rollout_lib.encode_prompts([example.prompt], trainer.prompts, width)
    assert ids[0][valid[0]].tolist() == expected
    tokens, valid, target = sft.sft_batch(trainer.setup, 0, 1)
    prompt_part = tokens[0][valid[0] & ~target[0]].tolist()
    assert prompt_part == expected  # the warm-up sees the rollout's prompt tokens
    assert trainer.task.prompt_lengths[example.uid] == len(expected)

    raw = trainer_lib.Trainer(small_gsm8k(chat_checkpoint, chat_template="off"), tmp_path / "raw")
    ids, valid = rollout_lib.encode_prompts([example.prompt], raw.prompts, width)
    assert ids[0][valid[0]].tolist() == [2, *raw.tokenizer.encode(example.prompt)]


@pytest.fixture(scope="module")
def mixed_lengths(checkpoint, tmp_path_factory):
    """Train JSONL whose odd lines have questions 20 words longer."""
    lines = []
    for i in range(16):
        extra = " how many apples" * 7 if i % 2 else ""
        question = f"what is {i} plus {i}{extra} ?"
        lines.append(json.dumps({"question": question, "answer": f"#### {2 * i}"}))
    path = tmp_path_factory.mktemp("mixed") / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_long_prompt_metrics(checkpoint, mixed_lengths, tmp_path):
    cfg = small_gsm8k(checkpoint, train_path=str(mixed_lengths), max_prompt_len=32)
    left_cfg = small_gsm8k(
        checkpoint, train_path=str(mixed_lengths), max_prompt_len=32, long_prompts="left"
    )
    left = trainer_lib.Trainer(left_cfg, tmp_path / "left")
    width = cfg.task.max_prompt_len
    long = [len(left.prompts.encode(e.prompt)) > width for e in left.task.train_examples(0, 6)]
    assert 0 < sum(long) < 6
    left.run()
    records = metrics_lib.read_metrics(tmp_path / "left" / "metrics.jsonl")
    # The queue holds one batch (positions 0-1); steps 0 and 1 generate positions 2-3 and 4-5.
    assert [r["rollout/prompts_truncated"] for r in records] == [sum(long[2:4]), sum(long[4:6])]
    assert left.task.prompts_filtered == {"train": 0, "eval": 0}

    filtered = trainer_lib.Trainer(cfg, tmp_path / "filter")  # the gsm8k config's "filter"
    assert cfg.task.long_prompts == "filter"
    kept = filtered.task.train_examples(0, 16)
    assert all(len(filtered.prompts.encode(e.prompt)) <= width for e in kept)
    dropped = filtered.task.prompts_filtered
    assert dropped["train"] + dropped["eval"] == 8  # every long (odd) line
    filtered.run(stop_after=1)
    records = metrics_lib.read_metrics(tmp_path / "filter" / "metrics.jsonl")
    assert records[0]["data/prompts_filtered"] == dropped["train"]
    assert records[0]["data/eval_prompts_filtered"] == dropped["eval"]
    assert records[0]["rollout/prompts_truncated"] == 0


RECEIVED = []


def reference_is_half(completion: str, answer: str) -> float:
    """A reward that records the reference it gets, and is 1 exactly for the raw '\\frac{1}{2}'."""
    RECEIVED.append(answer)
    return float(answer == "\\frac{1}{2}")


def test_a_math_run_scores_raw_references_and_evaluates_two_sets_avg_at_4(checkpoint, tmp_path):
    def write(name, records):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return str(path)

    answers = ["\\frac{1}{2}" if i % 2 else str(i + i) for i in range(8)]
    train = write("train.jsonl", [
        {"problem": f"what is {i} plus {i} ?", "solution": "it is \\boxed{" + a + "}"}
        for i, a in enumerate(answers)
    ])  # fmt: skip
    half = write("half.jsonl", [{"problem": "what is 1 plus 1 ?", "answer": "\\frac{1}{2}"}] * 3)
    three = write("three.jsonl", [{"problem": "how many ?", "answer": 3}] * 2)
    c = small_gsm8k_dict(checkpoint, reward_fn=f"{__name__}:reference_is_half")
    c.task.name, c.task.train_path, c.task.prompt_template = "math", train, "{problem}"
    c.total_steps = 1
    c.eval.sets = f"half={half},three={three}"
    c.eval.n_samples, c.eval.temperature = 4, 1.0
    RECEIVED.clear()
    trainer = trainer_lib.Trainer(config_lib.from_configdict(c), tmp_path / "run")
    result = trainer.run()
    assert "\\frac{1}{2}" in RECEIVED and "3" in RECEIVED and "0" in RECEIVED  # as written
    row = metrics_lib.read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    # Evaluation scores with the training reward: every completion of "half" is right.
    assert (row["eval/half/avg@4"], row["eval/half/pass@4"]) == (1.0, 1.0)
    assert (row["eval/three/avg@4"], row["eval/three/pass@4"]) == (0.0, 0.0)
    assert row["eval/accuracy"] == 0.5 and row["eval/pass@4"] == 0.5
    assert row["reward/timeouts"] == 0
    assert result.scored_by == f"{__name__}:reference_is_half"
