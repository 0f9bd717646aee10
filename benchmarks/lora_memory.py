"""Per-chip memory of the real-size presets with LoRA against full fine-tuning.

    python benchmarks/lora_memory.py                          # qwen2.5-7b and qwen3-8b
    python benchmarks/lora_memory.py --presets qwen3-8b --ranks 16,64

For each preset on its hardware (the slices of `benchmarks/tpu_compile.py`), the trainer's
own memory plan (`setup.memory_plan`, what `m2po-train` checks before it compiles, on the
preset's mesh over the slice's devices: libtpu's deviceless topology, nothing allocated),
full fine-tuning against LoRA on every projection at each rank (and QLoRA's int8 / nf4 bases
at the first rank): params, optimizer moments,
gradients, activations, and the total per chip, with the adapters' size (what an async run
publishes per step). `--compile` also runs the compile-only check (`m2po-train
--compile_only`, XLA's memory analysis of every program for the slice) per row: about ten
minutes per 8B row on two cores.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import tpu_compile  # noqa: E402

GIB = 2**30


def plan_row(preset: str, rank: int, targets: str, base: str = "float") -> dict:
    from m2po_jax import config as config_lib
    from m2po_jax.configs import gsm8k
    from m2po_jax.parallel import placement as placement_lib
    from m2po_jax.parallel import sharding
    from m2po_jax.trainer import compile_only
    from m2po_jax.trainer import setup as setup_lib

    topology, extra, _ = tpu_compile.RUNS[preset]
    c = gsm8k.get_config(preset)
    changes = {"model.lora.rank": rank, "model.lora.targets": targets, "model.lora.base": base}
    for flag in extra:  # --config.mesh.fsdp=4
        key, value = flag.removeprefix("--config.").split("=")
        changes[key] = int(value)
    config_lib.apply_dotted(c, changes)
    cfg = config_lib.from_configdict(c)
    model_config, _, _ = compile_only.model_for(cfg, preset)
    tgt = compile_only.target(topology)
    shape = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
    mesh = sharding.make_mesh(shape, list(tgt.devices))
    plan, _ = setup_lib.memory_plan(cfg, model_config, placement_lib.Placement(mesh, model_config))
    return dict(
        preset=preset,
        slice=topology,
        mesh=" x ".join(f"{k}={v}" for k, v in mesh.shape.items() if v > 1),
        lora=(f"r={rank}" + ("" if base == "float" else f", {base} base")) if rank else "full",
        adapters_mb=model_config.lora_params() * 4 / 1e6,
        plan=plan,
        hbm=tgt.hbm_bytes,
    )


def compile_row(preset: str, rank: int) -> str:
    cmd = [*tpu_compile.command(preset), f"--config.model.lora.rank={rank}"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    peak = [line for line in out.stdout.splitlines() if "peak" in line.lower()]
    return peak[-1].strip() if peak else f"exit {out.returncode}: {out.stderr.strip()[-200:]}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="qwen2.5-7b,qwen3-8b")
    parser.add_argument("--ranks", default="16,64")
    parser.add_argument("--targets", default="q,k,v,o,gate,up,down")
    parser.add_argument("--qlora", default="int8,nf4", help="quantised bases at the first rank")
    parser.add_argument("--compile", action="store_true", help="also run --compile_only")
    args = parser.parse_args(argv)
    print(
        "| preset | slice, mesh | LoRA | adapters (float32) | params | optimizer | gradients "
        "| activations + head | total per chip | of HBM |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for preset in args.presets.split(","):
        ranks = [int(r) for r in args.ranks.split(",")]
        rows = [(0, "float")] + [(r, "float") for r in ranks]
        rows += [(ranks[0], b) for b in args.qlora.split(",") if b]
        for rank, base in rows:
            row = plan_row(preset, rank, args.targets, base)
            p = row["plan"]
            adapters = f"{row['adapters_mb']:.1f} MB" if rank else "-"
            print(
                f"| `{preset}` | {row['slice']}, {row['mesh']} | {row['lora']} | {adapters} | "
                f"{p.params / GIB:.2f} GiB | {p.optimizer / GIB:.2f} GiB | "
                f"{p.gradients / GIB:.2f} GiB | {(p.activations + p.logits) / GIB:.2f} GiB | "
                f"**{p.total / GIB:.2f} GiB** | {p.total / row['hbm']:.0%} |"
            )
            if args.compile:
                print(f"|  | compile-only: {compile_row(preset, rank)} | | | | | | | | |")


if __name__ == "__main__":
    main()
