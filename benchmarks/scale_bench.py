"""Real-size models on this machine: what fits, checked by running and by compiling.

  python benchmarks/scale_bench.py --part a    # Qwen3-0.6B-shaped checkpoint, 3 RL steps
  python benchmarks/scale_bench.py --part b    # 7B and 8B steps, compile only, 8 devices
  python benchmarks/scale_bench.py --part c    # the same at vocabularies 32k and 152k
  python benchmarks/scale_bench.py --plans     # memory plan of every configs/gsm8k.py preset

(a) A checkpoint with Qwen3-0.6B's shapes (vocabulary 151,936, tied embeddings; random
    weights written by transformers) runs three RL steps of configs/gsm8k.py on the CPU:
    2 prompts x 2 samples, 128-token prompts, 64 new tokens, float32. Prints the trainer
    process's peak RSS and the seconds per step (rollout + train, from metrics.jsonl).
(b) Compile only, with abstract shapes and nothing allocated: the train steps of the
    `qwen2.5-7b` and `qwen3-8b` presets on 8 fake CPU devices (fsdp=8, one row per device
    per micro-batch) and of `qwen2.5-0.5b` on one, built by the trainer's own builder (`setup.build_train_step`), next
    to the plain step (every row's whole sequence). Prints XLA's memory per device, the
    memory plan of the path that runs, and the seconds to trace and compile. Targets: the
    trainer's step at most 1.1x the plain step's memory and 40 GiB, compiled in 60 s.
(c) The compile of (b) at vocabularies 32,000 and 152,064: XLA's temp memory must differ by
    less than 15% (the output head works in chunks, so it no longer scales with rows x T).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2**30


def _gsm8k_actor(preset: str):
    from m2po_jax import config as config_lib
    from m2po_jax.configs import gsm8k

    return config_lib.from_configdict(gsm8k.get_config(preset))


def part_a(steps: int = 3) -> dict:
    """Three RL steps of a Qwen3-0.6B-shaped checkpoint, in a child process (its peak RSS)."""
    import fixtures

    work = Path(tempfile.mkdtemp(prefix="scale_a_"))
    t0 = time.perf_counter()
    fixtures.write_checkpoint(work / "qwen3-0.6b", "qwen3-0.6b")
    fixtures.write_gsm8k(work / "train.jsonl", 64)
    written = time.perf_counter() - t0
    args = [
        sys.executable,
        "-m",
        "m2po_jax.cli.train",
        "--config=configs/gsm8k.py",
        f"--workdir={work / 'run'}",
        f"--config.model.path={work / 'qwen3-0.6b'}",
        f"--config.task.train_path={work / 'train.jsonl'}",
        "--config.task.eval_size=4",
        "--config.model.dtype=float32",
        "--config.rollout.batch_size=2",
        "--config.gconfig.n_samples=2",
        "--config.task.max_prompt_len=128",
        "--config.gconfig.max_new_tokens=64",
        "--config.rollout.max_head_offpolicyness=0",
        f"--config.total_steps={steps}",
        "--config.eval.every=0",
        "--config.eval.num_examples=2",
        "--config.eval.batch_size=2",
        "--config.checkpoint.every=0",
        "--config.logging.tensorboard=False",
        "--config.logging.progress=False",
        "--config.logging.plots=False",
        "--config.mesh.data=1",
    ]
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    t0 = time.perf_counter()
    proc = subprocess.run(
        args, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"part (a) run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    rows = [json.loads(line) for line in open(work / "run" / "metrics.jsonl")]
    per_step = [r["time/rollout_s"] + r["time/train_s"] for r in rows]
    return {
        "checkpoint_write_s": written,
        "wall_s": wall,
        "peak_rss_gib": peak_rss / GiB,
        "step_s": per_step,
        "train_s": [r["time/train_s"] for r in rows],
        "rollout_s": [r["time/rollout_s"] for r in rows],
    }


ARCH = {"qwen2.5-0.5b": "qwen2.5-0.5b", "qwen2.5-7b": "qwen2.5-7b", "qwen3-8b": "qwen3-8b"}


def _on_devices(preset: str, devices: int):
    """The preset's run on `devices` fake devices: fsdp over all of them with the same rows
    per device per micro-batch (the qwen3-8b preset is for 16 chips)."""
    from m2po_jax import config as config_lib
    from m2po_jax.configs import gsm8k

    c = gsm8k.get_config(preset)
    size = c.mesh.data * c.mesh.fsdp * c.mesh.tensor
    if size != devices:
        c.actor.mb_spec.max_tokens_per_mb = c.actor.mb_spec.max_tokens_per_mb * devices // size
        c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, devices, 1
    return config_lib.from_configdict(c)


def compile_preset(
    preset: str, share_prompts: bool = True, vocab_size: int | None = None, devices: int = 8
) -> dict:
    """XLA's memory analysis and compile time of a preset's train step, built by the
    trainer's own builder (`setup.build_train_step`) from abstract shapes."""
    from m2po_jax.learner import batching, memory
    from m2po_jax.models import architectures
    from m2po_jax.parallel import placement as placement_lib
    from m2po_jax.trainer import setup as setup_lib

    cfg = _on_devices(preset, devices)
    changes = {} if vocab_size is None else {"vocab_size": vocab_size}
    m = cfg.model
    model_config = architectures.model_config(
        ARCH[preset],
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        remat=m.remat,
        scan_layers=m.scan_layers,
        **changes,
    )
    mesh_shape = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
    placement = placement_lib.Placement.from_shape(mesh_shape, model_config)
    rows = cfg.rollout.batch_size * cfg.gconfig.n_samples
    seq_len = cfg.task.max_prompt_len + cfg.gconfig.max_new_tokens
    a = cfg.actor
    rows_mb = rows // a.ppo_n_minibatches
    n_micro = batching.micro_batch_count(
        rows_mb, seq_len, a.mb_spec.n_mbs, a.mb_spec.max_tokens_per_mb
    )
    xla = setup_lib.compiled_step_memory(cfg, model_config, placement, share_prompts=share_prompts)
    step_plan = setup_lib.step_plan(cfg, placement)
    shared = step_plan.loss_prompt if share_prompts else None
    plan = memory.memory_plan(
        model_config,
        placement.mesh,
        batch=rows_mb,
        seq_len=seq_len,
        micro_batch=rows_mb // n_micro,
        logp_chunk=a.logp_chunk_size,
        shared_prompt=shared,
    )
    return {
        "preset": preset,
        "step": "trainer" if share_prompts else "plain",
        "mesh": mesh_shape,
        "vocab_size": model_config.vocab_size,
        "rows": rows,
        "seq_len": seq_len,
        "micro_batches_per_minibatch": n_micro,
        "shared_prompt": shared is not None,
        "length_blocks": shared.length_blocks if shared else 1,
        "lower_s": xla.lower_s,
        "compile_s": xla.compile_s,
        "xla_argument_gib": xla.analysis.argument_size_in_bytes / GiB,
        "xla_temp_gib": xla.analysis.temp_size_in_bytes / GiB,
        "xla_total_gib": xla.held_bytes / GiB,
        "plan_train_step_gib": plan.train_step / GiB,
        "plan": plan.format(),
    }


def presets_plans() -> str:
    """The memory plan of every configs/gsm8k.py preset, as the trainer would print it."""
    import jax

    from m2po_jax.learner import batching, memory
    from m2po_jax.models import architectures
    from m2po_jax.parallel import placement as placement_lib
    from m2po_jax.parallel import sharding
    from m2po_jax.trainer import setup as setup_lib

    out = []
    for preset in ARCH:  # the real-size presets (not the CPU one)
        cfg = _gsm8k_actor(preset)
        m = cfg.model
        model_config = architectures.model_config(
            ARCH[preset],
            dtype=m.dtype,
            param_dtype=m.param_dtype,
            remat=m.remat,
            scan_layers=m.scan_layers,
        )
        shape = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
        size = shape["data"] * shape["fsdp"] * shape["tensor"]
        # The plan needs a mesh of the preset's shape; CPU devices stand in for the chips.
        devices = jax.devices()
        if len(devices) < size:
            raise RuntimeError(f"--plans needs {size} devices: set XLA_FLAGS device count")
        mesh = sharding.make_mesh(shape, devices[:size])
        rows = cfg.rollout.batch_size * cfg.gconfig.n_samples
        seq_len = cfg.task.max_prompt_len + cfg.gconfig.max_new_tokens
        a = cfg.actor
        rows_mb = rows // a.ppo_n_minibatches
        n = batching.micro_batch_count(
            rows_mb, seq_len, a.mb_spec.n_mbs, a.mb_spec.max_tokens_per_mb
        )
        placement = placement_lib.Placement(mesh, model_config)
        plan = memory.memory_plan(
            model_config,
            mesh,
            batch=rows_mb,
            seq_len=seq_len,
            micro_batch=rows_mb // n,
            kv_cache_batch=rows,
            kv_cache_len=seq_len,
            logp_chunk=a.logp_chunk_size,
            shared_prompt=setup_lib.step_plan(cfg, placement).loss_prompt,
        )
        out.append(f"{preset}: {rows} rows x {seq_len} tokens, {n} micro-batches/minibatch")
        out.append(plan.format())
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("a", "b", "c"), action="append", default=[])
    parser.add_argument("--plans", action="store_true")
    args = parser.parse_args()
    if not args.part and not args.plans:
        args.part = ["a", "b", "c"]
    if args.plans:
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=16"
        print(presets_plans(), flush=True)
    if "a" in args.part:
        result = part_a()
        print("(a) Qwen3-0.6B-shaped checkpoint, 3 RL steps on this CPU:", flush=True)
        print(json.dumps(result, indent=1), flush=True)
    if "b" in args.part:
        print("(b) train steps of the real-size presets on at most 8 fake devices, compile only:")
        for preset in ("qwen2.5-0.5b", "qwen2.5-7b", "qwen3-8b"):
            devices = 1 if preset == "qwen2.5-0.5b" else 8  # its preset is for one GPU
            trainer = compile_preset(preset, devices=devices)
            plain = compile_preset(preset, share_prompts=False, devices=devices)
            for r in (trainer, plain):
                print(json.dumps({k: v for k, v in r.items() if k != "plan"}), flush=True)
            print(
                f"  {preset}: trainer's step {trainer['xla_total_gib']:.2f} GiB per device "
                f"(plan {trainer['plan_train_step_gib']:.2f}), compile "
                f"{trainer['lower_s'] + trainer['compile_s']:.0f} s; plain step "
                f"{plain['xla_total_gib']:.2f} GiB, compile "
                f"{plain['lower_s'] + plain['compile_s']:.0f} s; memory ratio "
                f"{trainer['xla_total_gib'] / plain['xla_total_gib']:.3f}",
                flush=True,
            )
    if "c" in args.part:
        small = compile_preset("qwen2.5-7b", vocab_size=32000)
        large = compile_preset("qwen2.5-7b", vocab_size=152064)
        ratio = large["xla_temp_gib"] / small["xla_temp_gib"]
        print("(c) temp memory per device at vocab 32,000 vs 152,064:", flush=True)
        print(f"  {small['xla_temp_gib']:.2f} GiB vs {large['xla_temp_gib']:.2f} GiB: x{ratio:.3f}")


if __name__ == "__main__":
    main()
