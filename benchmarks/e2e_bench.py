"""A whole RL step, ours against Hugging Face TRL's `GRPOTrainer`, on this machine.

    pip install -e ".[bench]"          # adds trl (with torch 2.13.0+cpu and transformers)
    python benchmarks/e2e_bench.py                    # both settings, 8 steps per side x 2
    python benchmarks/e2e_bench.py --settings short --steps 6 --rounds 1
    python benchmarks/e2e_bench.py --settings long --engines static,continuous --slots 32

Both sides get the same local checkpoint (a random 3.2M-parameter Llama: vocab 512, hidden
256, 4 layers, 4 query / 2 key-value heads, MLP 704, float32), the same GSM8K-format prompts
and verifier, 16 prompts x 8 samples per step, on-policy, one optimizer update per step at
lr 1e-5, sampling temperature 1, no reference model. Settings:

  short   prompts of ~36 tokens, 32 new tokens
  long    prompts of ~128 tokens, 256 new tokens; the checkpoint's end-of-sequence logit is
          raised so that most completions stop early (mean ~40 tokens), as a trained model's do

Each side runs alone in its own process, the two alternating; each drops its first two steps
(compilation, warm-up) and the last (ours evaluates there). Printed per side: seconds per
step (median), generated tokens per second, the rollout / train split and the time from
building the trainer (checkpoint load included, imports not) to the end of its first step
(ours: its first run with an empty persistent compilation cache, then the best later run,
which finds its programs in the cache as a restarted `m2po-train` does).
Ours runs `m2po_jax.trainer.Trainer` as `m2po-train` does (M2PO on, tau 0.04; the greedy
evaluation it runs before step 0 is timed and left out of the time to first step), once per
rollout engine of `--engines` (`rollout.engine`; the continuous one with `--slots` decode
slots, `rollout.engine_slots`).
"""

from __future__ import annotations

import argparse
import json
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


def run_ours(fix: dict, steps: int, workdir: str, engine: str = "static") -> dict:
    import jax

    from m2po_jax import trainer as trainer_lib
    from m2po_jax.config import apply_dotted, from_configdict
    from m2po_jax.configs import gsm8k
    from m2po_jax.models.prompts import make_prompt_encoder
    from m2po_jax.models.tokenizer import load_tokenizer
    from m2po_jax.tasks.gsm8k import DEFAULT_PROMPT_TEMPLATE
    from m2po_jax.trainer import compile_cache
    from m2po_jax.trainer import metrics as metrics_lib

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
    step_s = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {
        "first_step_s": stamps[0] - t0 - (eval_s[0] if eval_s else 0.0),
        "step_s": step_s,  # step_s[i] is step i + 1
        "rollout_s": [r["time/rollout_s"] for r in rows[1:]],
        "train_s": [r["time/train_s"] for r in rows[1:]],
        "gen_tokens": [r["rollout/completion_len_mean"] * ROWS * SAMPLES for r in rows[1:]],
        "prompt_len": prompt_len,
    }


def run_trl(fix: dict, steps: int, workdir: str) -> dict:
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from m2po_jax.tasks.gsm8k import DEFAULT_PROMPT_TEMPLATE, numeric_reward

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


# ----------------------------------------------------------------------------- driver


def _child(side: str, fix: dict, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as wd:
        cmd = [sys.executable, __file__, "--child", side, "--fixture", json.dumps(fix)]
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
        "--engines",
        default="static",
        help="our side's rollout engines, each a row: static, continuous or both",
    )
    parser.add_argument("--slots", type=int, default=32, help="the continuous engine's slots")
    parser.add_argument("--child", choices=("ours", "ours-continuous", "trl"))
    parser.add_argument("--fixture")
    parser.add_argument("--workdir")
    args = parser.parse_args()
    if args.child:
        fix = json.loads(args.fixture)
        if args.child == "trl":
            print(json.dumps(run_trl(fix, args.steps, args.workdir)))
        else:
            engine = "continuous" if args.child == "ours-continuous" else "static"
            print(json.dumps(run_ours(fix, args.steps, args.workdir, engine)))
        return
    if args.steps < 5:
        parser.error("--steps must be >= 5 (two warm-up steps and the last are dropped)")
    print(
        f"# e2e_bench: {ROWS} prompts x {SAMPLES} samples per step, {args.steps} steps per run, "
        f"{args.rounds} runs per side, {os.cpu_count()} CPUs"
    )
    header = (
        "| setting | side | s / step | gen tokens / s | rollout s | train s | first step s "
        "(cold / warm) | speed-up |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as root:
        for setting in args.settings.split(","):
            fix = make_fixtures(Path(root), setting)
            fix["compile_cache"] = str(Path(root) / f"xla-cache-{setting}")
            fix["slots"] = args.slots
            ours_sides = ["ours" if e == "static" else f"ours-{e}" for e in args.engines.split(",")]
            runs = {side: [] for side in (*ours_sides, "trl")}
            for i in range(args.rounds):
                order = (*ours_sides, "trl") if i % 2 == 0 else ("trl", *ours_sides[::-1])
                for side in order:
                    runs[side].append(_child(side, fix, args.steps))
                    print(
                        f"  {setting} {side} run {i}: steps {runs[side][-1]['step_s']}", flush=True
                    )
            trl = _summary(runs["trl"])
            named = [
                (
                    "m2po-jax" if side == "ours" else f"m2po-jax, {side[5:]} ({args.slots} slots)",
                    _summary(runs[side]),
                )
                for side in ours_sides
            ]
            for side, s in (*named, ("TRL GRPOTrainer", trl)):
                speedup = trl["step_s"] / s["step_s"]
                first = f"{s['first_step_s']:.1f}"
                if side.startswith("m2po-jax") and s["first_step_warm_s"] is not None:
                    first += f" / {s['first_step_warm_s']:.1f}"
                lines.append(
                    f"| {setting} | {side} | {s['step_s']:.2f} | {s['tokens_per_s']:.0f} | "
                    f"{s['rollout_s']:.2f} | {s['train_s']:.2f} | {first} | {speedup:.2f}x |"
                )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
