"""Sections 4 and 5 of benchmarks/device_check.py: full RL steps of the GSM8K trainer,
sync, then sync against async rollouts.

A random checkpoint of the benchmarked architecture (transformers when installed, else
`m2po_jax.models.hf.save_pretrained`), the fixture tokenizer and GSM8K-format data go to a temp
dir; `Trainer(configs/gsm8k.py:qwen2.5-0.5b + overrides).run()` trains on them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fixtures
import jax
from device_check_common import TINY_HF, device_info, hf_config, peak_memory, random_params

from m2po_jax import config as config_lib
from m2po_jax import trainer as trainer_lib
from m2po_jax.configs import gsm8k
from m2po_jax.models import hf, hf_format

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def write_with_transformers(path: Path, s: dict) -> str | None:
    """`fixtures.write_checkpoint` in a child process that sees no GPU (torch's CUDA
    libraries stay out of this JAX process); None on success, else the error's last line."""
    code = (
        "import json, sys; from pathlib import Path; import fixtures; "
        "fixtures.write_checkpoint(Path(sys.argv[1]), sys.argv[2], **json.loads(sys.argv[3]))"
    )
    changes = json.dumps(TINY_HF if s["tiny"] else {})
    path_var = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu", "PYTHONPATH": path_var}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path), s["arch"], changes],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode == 0:
        return None
    return (proc.stderr.strip().splitlines() or [f"status {proc.returncode}"])[-1]


def write_checkpoint(path: Path, s: dict) -> str:
    """A random checkpoint + tokenizer: by transformers when it works, else by m2po_jax."""
    note = "not tried"
    if s["checkpoint_writer"] != "jax":
        note = write_with_transformers(path, s)
        if note is None:
            return "transformers"
        if s["checkpoint_writer"] == "transformers":
            raise RuntimeError(f"fixtures.write_checkpoint failed: {note}")
    hf_cfg = {**hf_config(s), "bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0}
    mc = hf_format.config_from_hf(hf_cfg, dtype="float32", param_dtype="float32")
    params = random_params(mc)
    hf.save_pretrained(params, path, config=mc, hf_config=hf_cfg)
    fixtures.write_tokenizer(path)
    return f"m2po_jax.models.hf.save_pretrained (transformers: {note})"


class TimedTrainer(trainer_lib.Trainer):
    """Notes when each step's update ends; skips the end-of-run checkpoint (not part of a step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_ends: list[float] = []
        real_step = self.train_step

        def timed_step(state, batch, rng, ref_params):
            out = jax.block_until_ready(real_step(state, batch, rng, ref_params))
            self.step_ends.append(time.perf_counter())
            return out

        self.train_step = timed_step

    def save(self, writer=None) -> None:
        pass


def rl_config(s: dict, work: Path):
    """configs/gsm8k.py:qwen2.5-0.5b with this run's shapes, small eval, logging off."""
    c = gsm8k.get_config("qwen2.5-0.5b")
    seq = s["rl_prompt_len"] + s["rl_new_tokens"]
    rows = s["rl_prompts"] * c.gconfig.n_samples
    overrides = {
        "model.path": str(work / "model"),
        "model.dtype": s["dtype"],
        "model.attention": s["rl_attention"],
        "model.remat_policy": s["remat_policy"],
        "task.train_path": str(work / "train.jsonl"),
        "task.eval_path": str(work / "eval.jsonl"),
        "task.max_prompt_len": s["rl_prompt_len"],
        "gconfig.max_new_tokens": s["rl_new_tokens"],
        "rollout.batch_size": s["rl_prompts"],
        "rollout.max_head_offpolicyness": 0,
        "actor.mb_spec.max_tokens_per_mb": max(seq, rows * seq // 2),  # 2 micro-batches
        "total_steps": s["rl_steps"],
        "eval.every": 0,
        "eval.num_examples": s["rl_eval"],
        "eval.batch_size": s["rl_eval"],
        "checkpoint.every": 0,
        "logging.tensorboard": False,
        "logging.progress": False,
        "logging.plots": False,
    }
    config_lib.apply_dotted(c, overrides)
    return config_lib.from_configdict(c)


def run_rl_step(s: dict) -> dict:
    """Section 4: `rl_steps` steps of the GSM8K trainer on a random checkpoint."""
    work = Path(tempfile.mkdtemp(prefix="device_check_rl_"))
    try:
        return _run(s, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(s: dict, work: Path) -> dict:
    start = time.perf_counter()
    writer = write_checkpoint(work / "model", s)
    fixtures.write_gsm8k(work / "train.jsonl", max(64, 4 * s["rl_prompts"] * s["rl_steps"]))
    fixtures.write_gsm8k(work / "eval.jsonl", s["rl_eval"], seed=1)
    written = time.perf_counter()
    cfg = rl_config(s, work)
    trainer = TimedTrainer(cfg, work / "run")
    built = time.perf_counter()
    trainer.run()
    done = time.perf_counter()
    rows = [json.loads(line) for line in open(work / "run" / "metrics.jsonl")]
    step_s = [r["time/rollout_s"] + r["time/train_s"] for r in rows]
    plan = trainer.memory_plan
    return {
        "device": device_info(s["peak_tflops"]),
        "checkpoint_writer": writer,
        "rows": cfg.rollout.batch_size * cfg.gconfig.n_samples,
        "seq_len": cfg.task.max_prompt_len + cfg.gconfig.max_new_tokens,
        "steps": len(rows),
        "checkpoint_write_s": written - start,
        "trainer_init_s": built - written,
        "time_to_first_step_s": trainer.step_ends[0] - written,
        "run_s": done - built,
        "step_s": step_s,
        "rollout_s": [r["time/rollout_s"] for r in rows],
        "train_s": [r["time/train_s"] for r in rows],
        "tokens_per_s": [r["time/tokens_per_s"] for r in rows],
        "last_step_s": step_s[-1],
        "eval_accuracy": rows[-1].get("eval/accuracy"),
        "plan_total_bytes": plan.total,
        "plan_train_step_bytes": plan.train_step,
        "plan": plan.format(),
        **peak_memory(),
    }


def run_async(s: dict) -> dict:
    """Section 5: the RL steps of section 4, sync then async (`rollout.mode`), on the same
    devices: async gives half of them to the rollout worker. k = 2 in both. Needs at
    least 2 devices (a GPU host: its GPUs); reports `skipped` on one."""
    devices = len(jax.local_devices())
    if devices < 2:
        return {
            "device": device_info(s["peak_tflops"]),
            "skipped": f"async rollouts split the devices; this host has {devices}",
        }
    work = Path(tempfile.mkdtemp(prefix="device_check_async_"))
    try:
        write_checkpoint(work / "model", s)
        steps = s["rl_steps"] + 3  # the first two compile
        fixtures.write_gsm8k(work / "train.jsonl", max(64, 4 * s["rl_prompts"] * steps))
        fixtures.write_gsm8k(work / "eval.jsonl", s["rl_eval"], seed=1)
        out = {"device": device_info(s["peak_tflops"]), "devices": devices}
        for mode in ("sync", "async"):
            out[mode] = _timed_run(s, work, mode, steps)
        out["async_over_sync_steps_per_s"] = (
            out["async"]["steps_per_s"] / out["sync"]["steps_per_s"]
        )
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _timed_run(s: dict, work: Path, mode: str, steps: int) -> dict:
    cfg = rl_config(s, work)
    rollout = dataclasses.replace(cfg.rollout, mode=mode, max_head_offpolicyness=2)
    cfg = dataclasses.replace(cfg, rollout=rollout, total_steps=steps)
    trainer = TimedTrainer(cfg, work / f"run_{mode}")
    trainer.run()
    rows = [json.loads(line) for line in open(work / f"run_{mode}" / "metrics.jsonl")]
    ends = trainer.step_ends[2:]
    rate = (len(ends) - 1) / (ends[-1] - ends[0])
    return {
        "steps_per_s": rate,
        "samples_per_s": rate * cfg.rollout.batch_size * cfg.gconfig.n_samples,
        "publish_s": [r.get("time/publish_s") for r in rows],
        "wait_s": [r.get("time/wait_s") for r in rows],
        "train_s": [r["time/train_s"] for r in rows],
        **peak_memory(),
    }
