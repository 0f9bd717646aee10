"""The tool-use demonstration side by side with its baseline: configs/arith.py:calculator (the
policy may call a calculator, multi-turn episodes) against the same task, model, warm-up
length and RL steps without the tool (single-turn answers, no calls in the warm-up).

    python benchmarks/tool_use.py [--steps 60] [--out docs/tool_use.png]

Prints held-out accuracy (greedy) and tool calls per episode at every evaluation of both
runs, and plots them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = {
    "with the calculator": [],
    "without (single-turn)": ["--config.agent.env=", "--config.task.tool_demos=0.0"],
}


def run(name: str, extra: list[str], steps: int, eval_every: int, workdir: Path) -> list[dict]:
    command = [
        sys.executable,
        "-m",
        "m2po_jax.cli.train",
        "--config=configs/arith.py:calculator",
        f"--workdir={workdir}",
        f"--config.total_steps={steps}",
        f"--config.eval.every={eval_every}",
        "--config.logging.progress=False",
        "--config.logging.plots=False",
        *extra,
    ]
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{name}: m2po-train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "step" in r]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval_every", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "docs" / "tool_use.png"))
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    results = {}
    with tempfile.TemporaryDirectory(prefix="m2po_tool_use_") as tmp:
        for i, (name, extra) in enumerate(SIDES.items()):
            workdir = Path(tmp) / str(i)
            results[name] = run(name, extra, args.steps, args.eval_every, workdir)
    print("\nstep | " + " | ".join(f"{n}: accuracy, calls/episode" for n in SIDES))
    evals = {n: [r for r in rows if "eval/accuracy" in r] for n, rows in results.items()}
    for points in zip(*evals.values(), strict=True):
        cells = [
            f"{p['eval/accuracy']:.3f}, {p.get('eval/tool_calls_mean', 0.0):.2f}" for p in points
        ]
        print(f"{points[0]['step']:4d} | " + " | ".join(cells))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, points in evals.items():
        steps = [p["step"] for p in points]
        axes[0].plot(steps, [p["eval/accuracy"] for p in points], marker="o", label=name)
        rows = results[name]
        axes[1].plot(
            [r["step"] for r in rows],
            [r.get("episode/tool_calls_mean", 0.0) for r in rows],
            label=name,
        )
    axes[0].set(xlabel="RL step", ylabel="held-out accuracy (greedy)", ylim=(0, 1))
    axes[1].set(xlabel="RL step", ylabel="tool calls per training episode", ylim=(0, 1.05))
    axes[0].legend()
    fig.suptitle("2-3 digit products: the policy learns to call its calculator")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
