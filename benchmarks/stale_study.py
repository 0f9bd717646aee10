"""Stale-k study in miniature: on-policy GRPO vs stale GRPO vs stale M2PO on the arithmetic task.

Each run starts from the same warm-up (same seed) and trains with the same learning rate;
only the staleness and the M2PO threshold differ. Prints a table of held-out accuracy and
writes an overlay plot.

  python benchmarks/stale_study.py --staleness=16 --lr=3e-4 --steps=150 --out=runs/stale_study
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from absl import logging

from m2po_jax import config as config_lib
from m2po_jax import trainer as trainer_lib
from m2po_jax.configs import arith
from m2po_jax.trainer import metrics as metrics_lib
from m2po_jax.trainer import plots


def run(name: str, preset: str, args, out: Path) -> Path:
    c = arith.get_config(preset)
    c.total_steps = args.steps
    c.actor.optimizer.lr = args.lr
    c.eval.every = max(args.steps // 6, 1)
    c.logging.progress = False
    c.logging.plots = False
    c.checkpoint.every = 0
    if preset != "grpo":
        c.rollout.max_head_offpolicyness = args.staleness
    if preset == "m2po":
        c.actor.m2_threshold = args.tau
    workdir = out / name
    start = time.perf_counter()
    trainer_lib.Trainer(config_lib.from_configdict(c), workdir).run()
    print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    return workdir / "metrics.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--staleness", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--tau", type=float, default=0.04)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", default="runs/stale_study")
    args = parser.parse_args()
    logging.set_verbosity(logging.ERROR)
    out = Path(args.out)
    runs = {
        "GRPO s=0": run("grpo_s0", "grpo", args, out),
        f"GRPO s={args.staleness}": run(f"grpo_s{args.staleness}", "stale_grpo", args, out),
        f"M2PO s={args.staleness}": run(f"m2po_s{args.staleness}", "m2po", args, out),
    }
    plots.plot_comparison(runs, out / "stale_study.png")
    print("\n| run | held-out accuracy by step | best | last | mean masked fraction |")
    print("|---|---|---|---|---|")
    for label, path in runs.items():
        records = metrics_lib.read_metrics(path)
        acc = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
        masked = sum(r["m2po/masked_fraction"] for r in records) / len(records)
        curve = ", ".join(f"{s}: {a:.3f}" for s, a in acc)
        best = max(a for _, a in acc)
        print(f"| {label} | {curve} | {best:.3f} | {acc[-1][1]:.3f} | {masked:.4f} |")
    print(f"\nplot: {out / 'stale_study.png'}")


if __name__ == "__main__":
    main()
