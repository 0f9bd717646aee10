"""A whole RL step, ours against Hugging Face TRL's `GRPOTrainer` and Google's Tunix
`GRPOLearner`, on this machine.

    pip install -e ".[bench]"          # adds trl (with torch 2.13.0+cpu and transformers)
    # Tunix in a venv of its own (it would downgrade this venv's transformers):
    python3 -m venv /work/venvs/tunix
    /work/venvs/tunix/bin/pip install google-tunix==0.1.7 "jax==0.10.2"
    python benchmarks/e2e_bench.py                    # both settings, 8 steps per side x 2
    python benchmarks/e2e_bench.py --settings short --steps 6 --rounds 1
    python benchmarks/e2e_bench.py --settings short --steps 5 --rounds 1 --sides ours,tunix
    python benchmarks/e2e_bench.py --settings short --sides ours,ours-unshared,tunix
    python benchmarks/e2e_bench.py --settings short --sides ours,tunix --no_prompt_sharing
    python benchmarks/e2e_bench.py --settings long --engines static,continuous --slots 32

All sides get the same local checkpoint (a random 3.2M-parameter Llama: vocab 512, hidden
256, 4 layers, 4 query / 2 key-value heads, MLP 704, float32), the same GSM8K-format prompts
and verifier, 16 prompts x 8 samples per step, on-policy, one optimizer update per step at
lr 1e-5, sampling temperature 1, no reference model. Settings:

  short   prompts of ~36 tokens, 32 new tokens
  long    prompts of ~128 tokens, 256 new tokens; the checkpoint's end-of-sequence logit is
          raised so that most completions stop early (mean ~40 tokens), as a trained model's do

Each side runs alone in its own process, the sides alternating (in `--sides` order, then
reversed); each drops its first two steps (compilation, warm-up) and the last (ours
evaluates there). Printed per side: seconds per step (median), generated tokens per step
and per second (the tokens actually sampled, the stopping EOS included), the rollout /
train split, the time from building the trainer (checkpoint load included, imports not) to
the end of its first step (ours: its first run with an empty persistent compilation cache,
then the best later run, which finds its programs in the cache as a restarted `m2po-train`
does), and one speed-up column per peer side (the peer's s / step over the row's).
Ours runs `m2po_jax.trainer.Trainer` as `m2po-train` does (M2PO on, tau 0.04; the greedy
evaluation it runs before step 0 is timed and left out of the time to first step), once per
rollout engine of `--engines` (`rollout.engine`; the continuous one with `--slots` decode
slots, `rollout.engine_slots`).

Flags:
  --sides ours,trl,tunix   which sides run (default all three); `ours-unshared` adds ours
                           with prompt sharing off beside the default one
  --no_prompt_sharing      our train step runs every row's whole sequence, prompt included
                           (as TRL and Tunix do), instead of each group's prompt once:
                           `m2po_jax.learner.logprobs.shares_prompts` answers no in our
                           child, and the run fails unless every step's "train/shared_prompt"
                           reads 0. Rows are labelled `ours-unshared`.
  --tunix_python PATH      the Python of the Tunix venv (default /work/venvs/tunix/bin/python)

Tunix (0.1.7, jax 0.10.2) runs in a child of its venv's Python that imports only the
standard library, Tunix and its venv's packages (transformers for the tokenizer; no torch,
no m2po_jax: the GSM8K prompt template and verifier are read from m2po_jax/tasks/gsm8k.py's
source, `_gsm8k_scorer`). Its `Llama3` gets a `ModelConfig` built from the checkpoint's
config.json and the safetensors weights; Tunix's attention ignores `rope_theta` (always
1e6) and has no llama3 rope scaling, so the bench supplies transformers' frequencies
(`_tunix_llama3`; logits then match to ~1e-6, 2.5e-2 without). `GRPOLearner` with the
vanilla rollout engine, `num_generations` 8, `num_iterations` 1, beta 0 and no reference
model, the 16 prompts one mini-batch (one update of the 128 rows per step; AdamW lr 1e-5,
weight decay 0.01, clipped at norm 1, as ours), actor and sampler sharing their weights on
one CPU mesh; sampling at temperature 1 over the full vocabulary, stopping on EOS, seed
`step` at step `step`, KV cache of prompt + new tokens. Its rollout time is
`_generate_and_compute_advantage` (generation, rewards, advantages), its train time the
actor update, waited for. Tunix cuts each completion before its EOS (so the EOS is not in
its loss; the token counts add it back) and trains every row at the full prompt +
`max_new_tokens` width; its train step compiles twice (steps 0 and 1, both dropped).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

ROWS, SAMPLES = 16, 8
EOS_ID = 3  # "</s>" in fixtures.SPECIALS
SETTINGS = {
    "short": dict(filler=0, max_new_tokens=32, eos_stop=None),
    # ~92 filler tokens bring the prompt to ~128; p(stop) per token ~ 1/40
    "long": dict(filler=23, max_new_tokens=256, eos_stop=0.025),
}
ARCH = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=False,
    max_position_embeddings=16384,
)


# ----------------------------------------------------------------------------- fixtures


def _questions(count: int, filler: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        story = " ".join(f"Tom gives away {rng.randint(2, 9)} ." for _ in range(filler))
        question = f"Tom has {a} apples . {story} Tom buys {b} more . how many apples total ?"
        records.append({"question": " ".join(question.split()), "answer": f"#### {a + b}"})
    return records


def _raise_eos(path: Path, stop_prob: float) -> None:
    """Gives every position a steady end-of-sequence probability of about `stop_prob`.

    The layers' output projections (attention `o_proj`, MLP `down_proj`) are zeroed, so the
    residual stream is the current token's embedding and the next-token distribution
    depends on that token only: the completion lengths then follow the same distribution
    whatever the context and whichever implementation samples (a random model's own
    streams otherwise drift far from the calibration). Every layer still runs in full, so
    the work per token is unchanged. A constant component along one hidden unit is added
    to every token embedding; the output row of EOS reads that unit, with its weight
    calibrated on random tokens.
    """
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb[:, 0] = 0.2
        head[EOS_ID] = 0.0
        tokens = torch.randint(
            5, ARCH["vocab_size"], (16, 64), generator=torch.Generator().manual_seed(0)
        )
        lo, hi = 0.0, 10.0
        for _ in range(30):
            head[EOS_ID, 0] = (lo + hi) / 2
            probs = model(tokens).logits.softmax(-1)[..., EOS_ID].mean().item()
            lo, hi = (
                (head[EOS_ID, 0].item(), hi) if probs < stop_prob else (lo, head[EOS_ID, 0].item())
            )
    model.save_pretrained(str(path), safe_serialization=True)


def make_fixtures(root: Path, setting: str) -> dict:
    import fixtures

    spec = SETTINGS[setting]
    ckpt = root / f"llama-3.2m-{setting}"
    fixtures.write_checkpoint(ckpt, "llama-3.1-8b", **ARCH)
    fixtures.write_tokenizer(ckpt, numbers=450)
    # one end-of-sequence id, so that both trainers stop on the same token
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}))
    if spec["eos_stop"]:
        _raise_eos(ckpt, spec["eos_stop"])
    data = root / f"gsm8k-{setting}.jsonl"
    with open(data, "w") as fh:
        for record in _questions(4096, spec["filler"]):
            fh.write(json.dumps(record) + "\n")
    return {"checkpoint": str(ckpt), "data": str(data), **spec}


# ----------------------------------------------------------------------------- sides


def run_ours(
    fix: dict, steps: int, workdir: str, engine: str = "static", share_prompts: bool = True
) -> dict:
    """`share_prompts=False`: the train step runs every row's whole sequence, prompt
    included, as the other sides do (`logprobs.shares_prompts` answers no, so the step plan
    takes the unshared path; each record's "train/shared_prompt" must then read 0)."""
    import jax

    from m2po_jax import trainer as trainer_lib
    from m2po_jax.config import apply_dotted, from_configdict
    from m2po_jax.configs import gsm8k
    from m2po_jax.learner import logprobs
    from m2po_jax.models.prompts import make_prompt_encoder
    from m2po_jax.models.tokenizer import load_tokenizer
    from m2po_jax.run import metrics as metrics_lib
    from m2po_jax.tasks.gsm8k import DEFAULT_PROMPT_TEMPLATE
    from m2po_jax.trainer import compile_cache

    encode = make_prompt_encoder(load_tokenizer(fix["checkpoint"]), chat_template="off").encode

    with open(fix["data"]) as fh:
        first = json.loads(fh.readline())["question"]
    prompt_len = len(encode(DEFAULT_PROMPT_TEMPLATE.format(question=first)))
    config = gsm8k.get_config()
    apply_dotted(
        config,
        {
            "total_steps": steps,
            "model.path": fix["checkpoint"],
            "model.dtype": "float32",
            "model.param_dtype": "float32",
            "task.train_path": fix["data"],
            "task.eval_size": 16,
            "task.max_prompt_len": prompt_len,
            "task.chat_template": "off",
            "gconfig.n_samples": SAMPLES,
            "gconfig.max_new_tokens": fix["max_new_tokens"],
            "rollout.batch_size": ROWS,
            "rollout.max_head_offpolicyness": 0,
            "actor.ppo_n_minibatches": 1,
            "actor.optimizer.lr": 1e-5,
            "sft.max_steps": 0,
            "eval.every": 0,
            "eval.num_examples": 16,
            "eval.batch_size": 16,
            "checkpoint.every": 0,
            "logging.tensorboard": False,
            "logging.progress": False,
            "logging.plots": False,
            "rollout.engine": engine,
            "rollout.engine_slots": fix["slots"] if engine == "continuous" else 0,
        },
    )
    cfg = from_configdict(config)
    compile_cache.enable(fix["compile_cache"])  # as m2po-train does
    stamps, rows, eval_s = [], [], []
    write = metrics_lib.MetricsWriter.write

    def timed_write(self, step, record):
        stamps.append(time.perf_counter())
        rows.append(dict(record))
        return write(self, step, record)

    evaluate = trainer_lib.Trainer.evaluate

    def timed_evaluate(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return evaluate(self, *args, **kwargs)
        finally:
            eval_s.append(time.perf_counter() - t)

    metrics_lib.MetricsWriter.write = timed_write
    trainer_lib.Trainer.evaluate = timed_evaluate
    if not share_prompts:
        logprobs.shares_prompts = lambda rows, shared: False
    t0 = time.perf_counter()
    trainer = trainer_lib.Trainer(cfg, workdir)
    jitted = trainer.train_step

    def synced_step(*args):
        # The trainer dispatches the update and fetches its metrics a step late; waiting
        # here puts the update's device time in "time/train_s" instead of in the next
        # rollout's wait. The next rollout needs these params anyway: the wait costs nothing.
        return jax.block_until_ready(jitted(*args))

    trainer.train_step = synced_step
    trainer.run()
    shared = sorted({int(r["train/shared_prompt"]) for r in rows if "train/shared_prompt" in r})
    if shared != [int(share_prompts)]:
        raise RuntimeError(f"train/shared_prompt {shared} in a run with {share_prompts=}")
    step_s = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {
        "first_step_s": stamps[0] - t0 - (eval_s[0] if eval_s else 0.0),
        "step_s": step_s,  # step_s[i] is step i + 1
        "rollout_s": [r["time/rollout_s"] for r in rows[1:]],
        "train_s": [r["time/train_s"] for r in rows[1:]],
        "gen_tokens": [r["rollout/completion_len_mean"] * ROWS * SAMPLES for r in rows[1:]],
        "prompt_len": prompt_len,
        "shared_prompt": shared[0],
    }


def run_trl(fix: dict, steps: int, workdir: str) -> dict:
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from m2po_jax.tasks.gsm8k import DEFAULT_PROMPT_TEMPLATE
    from m2po_jax.tasks.verifiers import numeric_reward

    torch.set_num_threads(os.cpu_count() or 1)
    with open(fix["data"]) as fh:
        records = [json.loads(line) for line in fh][: steps * ROWS]
    dataset = Dataset.from_list(
        [
            {
                "prompt": DEFAULT_PROMPT_TEMPLATE.format(question=r["question"]),
                "answer": r["answer"],
            }
            for r in records
        ]
    )

    def reward(prompts, completions, answer, **kwargs):
        return [
            numeric_reward(c, a.split("####")[-1].strip())
            for c, a in zip(completions, answer, strict=True)
        ]

    stamps, gen_s, lengths = [], [], []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    args = GRPOConfig(
        output_dir=workdir,
        per_device_train_batch_size=ROWS * SAMPLES,
        num_generations=SAMPLES,
        max_completion_length=fix["max_new_tokens"],
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        beta=0.0,
        num_iterations=1,
        gradient_accumulation_steps=1,
        max_steps=steps,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=0,
    )
    t0 = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(fix["checkpoint"])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        fix["checkpoint"], dtype=torch.float32
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **k):
        t = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            gen_s.append(time.perf_counter() - t)

    trainer._generate_and_score_completions = timed_generate
    trainer.train()
    step_s = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {
        "first_step_s": stamps[0] - t0,
        "step_s": step_s,
        "rollout_s": gen_s[1:],
        "train_s": [s - g for s, g in zip(step_s, gen_s[1:], strict=False)],
        "gen_tokens": [n * ROWS * SAMPLES for n in lengths[1:]],
    }


def _gsm8k_scorer() -> tuple[str, object]:
    """(`DEFAULT_PROMPT_TEMPLATE`, `numeric_reward`) of `m2po_jax/tasks/gsm8k.py`, read from
    its source without importing the package (the Tunix venv does not have it): the module's
    definitions run with the package import and the task class left out (the scorer needs
    `re` only)."""
    path = HERE.parent / "m2po_jax" / "tasks" / "gsm8k.py"
    tree = ast.parse(path.read_text(), str(path))
    tree.body = [
        node
        for node in tree.body
        if not isinstance(node, ast.ClassDef)
        and not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("m2po_jax"))
    ]
    scope: dict = {"__name__": "gsm8k_scorer"}
    exec(compile(tree, str(path), "exec"), scope)  # noqa: S102 - this repository's own file
    return scope["DEFAULT_PROMPT_TEMPLATE"], scope["numeric_reward"]


def _rope_inv_freq(hf: dict) -> list[float]:
    """The rotary inverse frequencies transformers' Llama uses for a config.json (`default`
    or `llama3` rope type), one per pair of head dimensions."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    inv = [1.0 / theta ** (i / dim) for i in range(0, dim, 2)]
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return inv
    if kind != "llama3":
        raise ValueError(f"rope type {kind!r}: only default and llama3 are reproduced")
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def _tunix_llama3(checkpoint: str, mesh):
    """Tunix's Llama3 with the checkpoint's safetensors weights (float32).

    Tunix 0.1.7 builds no `ModelConfig` from a config.json: it is built here field by field.
    Its attention calls `apply_rope` without the config's `rope_theta` (the function's
    default, 1e6, always applies) and has no llama3 frequency scaling; the module's
    `apply_rope` is replaced by one with transformers' frequencies for this config.json
    (`_rope_inv_freq`), so that the logits match the checkpoint's (max |diff| ~1e-6).
    """
    import jax.numpy as jnp
    from tunix.models.llama3 import model as llama3
    from tunix.models.llama3 import params as llama3_params

    hf = json.loads((Path(checkpoint) / "config.json").read_text())
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    config = llama3.ModelConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=head_dim,
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(rope.get("rope_theta", hf.get("rope_theta", 10000))),
        norm_eps=hf["rms_norm_eps"],
        weight_tying=bool(hf.get("tie_word_embeddings", False)),
    )
    inv_freq = jnp.asarray(_rope_inv_freq(hf), jnp.float32)

    def apply_rope(inputs, positions, head_dim, rope_theta=None):
        angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, L, H/2]
        sin, cos = jnp.sin(angles)[..., None, :], jnp.cos(angles)[..., None, :]
        first, second = jnp.split(inputs, 2, axis=-1)
        out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
        return out.astype(inputs.dtype)

    llama3.apply_rope = apply_rope
    model = llama3_params.create_model_from_safe_tensors(
        checkpoint, config, mesh=mesh, dtype=jnp.float32
    )
    return model, hf


def run_tunix(fix: dict, steps: int, workdir: str) -> dict:
    """Tunix's `GRPOLearner` (vanilla rollout engine) on the same work as the other sides.

    Runs in the Tunix venv (`--tunix_python`): imports the standard library, Tunix and what
    its venv holds (transformers for the tokenizer), never m2po_jax. GRPO with
    `num_generations` 8, `num_iterations` 1 (on-policy: no old-policy pass), beta 0 (no
    reference model), epsilon 0.2; the batch of 16 prompts is one mini-batch (one AdamW
    update of the 128 rows per step, clipped at global norm 1, weight decay 0.01, as ours);
    actor and rollout share one mesh, so the sampler reads the trained weights (no sync).
    The sampler runs at temperature 1 with top-p 1 and no top-k (the full distribution),
    stops on EOS_ID, and gets seed `step` for step `step` (Tunix's `RolloutConfig.seed` is
    one seed for every step otherwise). Its KV cache is the prompt plus `max_new_tokens`.
    """
    import dataclasses

    import jax
    import numpy as np
    import optax
    import transformers
    from flax import nnx
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    template, numeric_reward = _gsm8k_scorer()
    with open(fix["data"]) as fh:
        records = [json.loads(line) for line in fh][: steps * ROWS]
    prompts = [template.format(question=r["question"]) for r in records]
    batches = [
        {
            "prompts": np.array(prompts[i : i + ROWS]),
            "answer": np.array([r["answer"] for r in records[i : i + ROWS]]),
        }
        for i in range(0, len(records), ROWS)
    ]

    def reward(prompts, completions, answer, **kwargs):
        return [
            numeric_reward(c, a.split("####")[-1].strip())
            for c, a in zip(completions, answer, strict=True)
        ]

    t0 = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(fix["checkpoint"])
    # The sampler puts BOS before each prompt's `encode` (as ours does: the same ids); all
    # prompts are this long, so none is padded.
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    prompt_len = max(len(bos + tokenizer.encode(p)) for p in prompts)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model, _ = _tunix_llama3(fix["checkpoint"], mesh)
    max_new = fix["max_new_tokens"]
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=max_new,
        max_prompt_length=prompt_len,
        kv_cache_size=prompt_len + max_new,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        eos_tokens=[EOS_ID],
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(1e-5, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01),
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=model,
        reference=None,
        tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in rl_cluster_lib.Role},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optimizer,
                eval_every_n_steps=10**9,
                max_steps=steps,
                checkpoint_root_directory=None,
                metrics_logging_options=None,
            ),
            rollout_config=rollout_config,
        ),
    )
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(
            num_generations=SAMPLES, num_iterations=1, beta=0.0, epsilon=0.2
        ),
        reward_fns=reward,
    )
    stamps, gen_s, train_s, gen_tokens = [], [], [], []

    rollout = cluster.rollout
    sample = rollout.generate

    def seeded_sample(prompts, config, **kwargs):
        # One generate call of the step's 128 rows per step: its index is the step's.
        out = sample(prompts, dataclasses.replace(config, seed=len(gen_tokens)), **kwargs)
        # Tunix returns each completion up to its first EOS (left out): the EOS is one
        # more generated token, as ours counts it.
        gen_tokens.append(sum(len(t) + (len(t) < max_new) for t in out.tokens))
        return out

    rollout.generate = seeded_sample
    prepare = learner._generate_and_compute_advantage

    def timed_prepare(*a, **k):
        t = time.perf_counter()
        try:
            return prepare(*a, **k)
        finally:
            gen_s.append(time.perf_counter() - t)

    learner._generate_and_compute_advantage = timed_prepare
    update = cluster.update_actor

    def synced_update(*a, **k):
        # The update is dispatched asynchronously; the next rollout reads these weights,
        # so waiting here costs nothing and puts the update's time in its step.
        t = time.perf_counter()
        update(*a, **k)
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
        stamps.append(time.perf_counter())
        train_s.append(stamps[-1] - t)

    cluster.update_actor = synced_update
    learner.train(batches)
    if len(gen_tokens) != steps or len(stamps) != steps:
        raise RuntimeError(f"tunix: {len(gen_tokens)} rollouts, {len(stamps)} updates, {steps=}")
    step_s = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {
        "first_step_s": stamps[0] - t0,
        "step_s": step_s,
        "rollout_s": gen_s[1:],
        "train_s": train_s[1:],
        "gen_tokens": gen_tokens[1:],
        "prompt_len": prompt_len,
    }


# ----------------------------------------------------------------------------- driver


PEERS = {"trl": "TRL GRPOTrainer", "tunix": "Tunix GRPOLearner"}


def _ours_side(engine: str, share_prompts: bool) -> str:
    """Our side's child name: ours[-continuous][-unshared]."""
    return (
        "ours"
        + ("" if engine == "static" else f"-{engine}")
        + ("" if share_prompts else "-unshared")
    )


def _side_label(side: str, slots: int) -> str:
    if side in PEERS:
        return PEERS[side]
    label = "m2po-jax"
    if "-continuous" in side:
        label += f", continuous ({slots} slots)"
    if side.endswith("-unshared"):
        label += ", prompts unshared"
    return label


def _child(side: str, fix: dict, steps: int, python: str = sys.executable) -> dict:
    with tempfile.TemporaryDirectory() as wd:
        cmd = [python, __file__, "--child", side, "--fixture", json.dumps(fix)]
        cmd += ["--steps", str(steps), "--workdir", wd]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{side} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(runs: list[dict]) -> dict:
    # Drop each run's first two steps; `step_s` starts at step 1 and the last step is left
    # out (ours evaluates after it).
    pick = lambda key: [x for r in runs for x in r[key][1:-1]]  # noqa: E731
    step = statistics.median(pick("step_s"))
    return {
        "step_s": step,
        "gen_tokens": statistics.median(pick("gen_tokens")),
        "tokens_per_s": statistics.median(pick("gen_tokens")) / step,
        "rollout_s": statistics.median(pick("rollout_s")),
        "train_s": statistics.median(pick("train_s")),
        "first_step_s": runs[0]["first_step_s"],  # ours: with an empty compilation cache
        "first_step_warm_s": min(r["first_step_s"] for r in runs[1:]) if len(runs) > 1 else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default="short,long")
    parser.add_argument("--steps", type=int, default=8, help="steps per run (>= 5)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side, alternating")
    parser.add_argument(
        "--sides",
        default="ours,trl,tunix",
        help="comma-separated: ours (one row per --engines entry), ours-unshared (ours with "
        "--no_prompt_sharing, beside ours), trl, tunix",
    )
    parser.add_argument(
        "--engines",
        default="static",
        help="our side's rollout engines, each a row: static, continuous or both",
    )
    parser.add_argument("--slots", type=int, default=32, help="the continuous engine's slots")
    parser.add_argument(
        "--no_prompt_sharing",
        action="store_true",
        help="our train step runs every row's whole sequence instead of each group's prompt "
        "once (rows labelled ours-unshared)",
    )
    parser.add_argument(
        "--tunix_python",
        default="/work/venvs/tunix/bin/python",
        help="the Python of a venv with google-tunix==0.1.7 (runs the tunix side)",
    )
    parser.add_argument(
        "--child",
        choices=[_ours_side(e, s) for e in ("static", "continuous") for s in (True, False)]
        + list(PEERS),
    )
    parser.add_argument("--fixture")
    parser.add_argument("--workdir")
    args = parser.parse_args()
    if args.child:
        fix = json.loads(args.fixture)
        if args.child == "trl":
            result = run_trl(fix, args.steps, args.workdir)
        elif args.child == "tunix":
            result = run_tunix(fix, args.steps, args.workdir)
        else:
            engine = "continuous" if "-continuous" in args.child else "static"
            share = not args.child.endswith("-unshared")
            result = run_ours(fix, args.steps, args.workdir, engine, share)
        print(json.dumps(result))
        return
    if args.steps < 5:
        parser.error("--steps must be >= 5 (two warm-up steps and the last are dropped)")
    asked = args.sides.split(",")
    unknown = set(asked) - {"ours", "ours-unshared", *PEERS}
    if unknown:
        parser.error(
            f"--sides: unknown {sorted(unknown)}; expected ours, ours-unshared, trl, tunix"
        )
    sides: list[str] = []
    for name in asked:
        if name in PEERS:
            new = [name]
        else:
            share = name == "ours" and not args.no_prompt_sharing
            new = [_ours_side(e, share) for e in args.engines.split(",")]
        sides += [side for side in new if side not in sides]
    peers = [side for side in sides if side in PEERS]
    if "tunix" in peers and not Path(args.tunix_python).exists():
        parser.error(f"--tunix_python {args.tunix_python} does not exist (see the module doc)")
    python = {"tunix": args.tunix_python}
    print(
        f"# e2e_bench: {ROWS} prompts x {SAMPLES} samples per step, {args.steps} steps per run, "
        f"{args.rounds} runs per side, {os.cpu_count()} CPUs, sides {','.join(sides)}"
    )
    header = (
        "| setting | side | s / step | gen tokens / step | gen tokens / s | rollout s | train s "
        "| first step s (cold / warm) |"
        + "".join(f" speed-up vs {PEERS[p].split()[0]} |" for p in peers)
    )
    lines = [header, "|---" * (8 + len(peers)) + "|"]
    with tempfile.TemporaryDirectory() as root:
        for setting in args.settings.split(","):
            fix = make_fixtures(Path(root), setting)
            fix["compile_cache"] = str(Path(root) / f"xla-cache-{setting}")
            fix["slots"] = args.slots
            runs = {side: [] for side in sides}
            for i in range(args.rounds):
                for side in sides if i % 2 == 0 else sides[::-1]:
                    run = _child(side, fix, args.steps, python.get(side, sys.executable))
                    runs[side].append(run)
                    print(
                        f"  {setting} {side} run {i}: s / step "
                        f"{[round(x, 2) for x in run['step_s']]}, gen tokens / step "
                        f"{[round(x) for x in run['gen_tokens']]}",
                        flush=True,
                    )
            summaries = {side: _summary(runs[side]) for side in sides}
            for side in sides:
                s = summaries[side]
                first = f"{s['first_step_s']:.1f}"
                if side.startswith("ours") and s["first_step_warm_s"] is not None:
                    first += f" / {s['first_step_warm_s']:.1f}"
                speedups = "".join(f" {summaries[p]['step_s'] / s['step_s']:.2f}x |" for p in peers)
                lines.append(
                    f"| {setting} | {_side_label(side, args.slots)} | {s['step_s']:.2f} | "
                    f"{s['gen_tokens']:.0f} | {s['tokens_per_s']:.0f} | {s['rollout_s']:.2f} | "
                    f"{s['train_s']:.2f} | {first} |{speedups}"
                )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
