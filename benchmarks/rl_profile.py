"""Where an RL step's time goes: ours' trainer on e2e_bench's fixture, traced by XLA.

    python benchmarks/rl_profile.py                                  # short, static sampler
    python benchmarks/rl_profile.py --setting long --engine continuous --slots 32
    python benchmarks/rl_profile.py --steps 4 --warmup 3 --keep /tmp/prof   # keep the trace

Runs `m2po_jax.trainer.Trainer` exactly as `benchmarks/e2e_bench.py` does (same checkpoint,
prompts, config; the update waited for inside the step so that its time is its own), traces
`--steps` steps after `--warmup` with `jax.profiler`, and splits the traced steps' wall time
into parts:

  prefill, decode    the rollout programs' ops: inside a decode `while_loop` (the static
                     sampler's, or the continuous engine's with its refills), or not
  scoring            the reward on the host (`rollout.rewards`)
  forward, backward  the train step's model ops (XLA keeps JAX's op names: `jvp(...)` is
                     the forward, `transpose(jvp(...))` the backward)
  optimizer          the train step's `optimizer` scope (clipping norm, AdamW)
  loss, mask, other  the rest of the train step (M2PO mask, advantages, log-probs, loss)
  host, idle         what is left of the wall time: Python, data, dispatch, waiting

FLOPs are counted, not modelled: every `dot` of every compiled program (the optimized HLO,
dumped by XLA while the run compiles) times the number of times the profile saw the op that
contains it run, so loops, length blocks, rematerialisation and unused branches count as
they ran. MFU is those FLOPs per second over a 2048^3 float32 matmul measured in the same
process (this machine's peak as jit sees it). Ops are timed as the thunk executor reports
them (summed over threads: parts of one program that run at once both count).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

PARTS = (
    "prefill",
    "decode",
    "scoring",
    "forward",
    "backward",
    "optimizer",
    "loss, mask, other",
    "host, idle",
)
CONTROL = ("while", "conditional", "call")  # thunks that only run other thunks


# ----------------------------------------------------------------------------- the HLO


_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = \w+\[([\d,]*)\]")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


class Module:
    """One optimized HLO module: each instruction's op name and the dot FLOPs it runs."""

    def __init__(self, text: str):
        self.computations: dict[str, list[tuple[str, str, str]]] = {}
        shapes: dict[str, list[int]] = {}
        current = None
        for line in text.splitlines():
            match = _COMPUTATION.match(line)
            if match:
                current = self.computations.setdefault(match.group(1), [])
                continue
            match = _SHAPE.match(line)
            if match and current is not None:
                shapes[match.group(1)] = _dims(match.group(2))
                current.append((match.group(1), line, ""))
        self.shapes = shapes
        self.lines = {name: line for comp in self.computations.values() for name, line, _ in comp}
        self._flops: dict[str, float] = {}

    def op_name(self, instruction: str) -> str:
        match = re.search(r'op_name="([^"]*)"', self.lines.get(instruction, ""))
        return match.group(1) if match else ""

    def flops(self, instruction: str) -> float:
        """Dot FLOPs of one run of `instruction` (a fusion: of the computation it calls;
        control flow: 0, its body's thunks are counted as they run)."""
        if instruction in self._flops:
            return self._flops[instruction]
        line = self.lines.get(instruction, "")
        match = _INSTRUCTION.match(line)
        total = 0.0
        if match:
            _, _, out, op, rest = match.groups()
            if op == "dot":
                operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
                lhs = self.shapes.get(operands[0], [])
                contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
                k = 1
                for d in _dims(contracting.group(1)) if contracting else []:
                    k *= lhs[d]
                n = 1
                for d in _dims(out):
                    n *= d
                total = 2.0 * n * k
            elif op in ("fusion", "custom-call"):
                called = re.search(r"calls=%([\w.\-]+)", rest)
                if called:
                    total = sum(
                        self.flops(name) for name, _, _ in self.computations[called.group(1)]
                    )
        self._flops[instruction] = total
        return total


def load_modules(dump: Path) -> dict[int, tuple[str, Module]]:
    """program id -> (module name, Module), from XLA's `--xla_dump_to` directory."""
    modules = {}
    for path in dump.glob("module_*.cpu_after_optimizations.txt"):
        match = re.match(r"module_(\d+)\.(.+)\.cpu_after_optimizations\.txt$", path.name)
        modules[int(match.group(1))] = (match.group(2), Module(path.read_text()))
    return modules


# ----------------------------------------------------------------------------- the trace


def thunk_events(trace_dir: Path):
    """(program id, module name, op, start ns, duration ns) of every XLA op in the trace."""
    from jax.profiler import ProfileData

    (path,) = glob.glob(str(trace_dir / "**" / "*.xplane.pb"), recursive=True)
    data = ProfileData.from_file(path)
    for plane in data.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_module" in stats and "program_id" in stats:
                    yield (
                        int(stats["program_id"]),
                        stats["hlo_module"],
                        event.name,
                        event.start_ns,
                        event.duration_ns,
                    )


def classify(module: Module, op: str, is_train: bool) -> str:
    name = module.op_name(op)
    if is_train:
        if "/optimizer/" in name:
            return "optimizer"
        if "transpose(" in name:
            return "backward"
        if "jvp(" in name or "CausalLM" in name:
            return "forward"
        return "loss, mask, other"
    # the static sampler's decode loop and the continuous engine's (`_run`: decode steps and
    # the refills inside them); prefills, the engine's start and finish outside any loop
    return "decode" if "while/body" in name else "prefill"


# ----------------------------------------------------------------------------- the run


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    matmul = jax.jit(lambda a, b: a @ b)
    matmul(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def profile(args, work: Path) -> dict:
    import e2e_bench
    import jax

    from m2po_jax.rollout import rewards as rewards_lib
    from m2po_jax.run import metrics as metrics_lib

    fix = e2e_bench.make_fixtures(work, args.setting)
    fix["slots"] = args.slots
    fix["compile_cache"] = str(work / "cache")  # empty: every program compiles (and dumps)
    trace_dir = work / "trace"
    window = {}
    scoring = []
    write = metrics_lib.MetricsWriter.write
    first, last = args.warmup, args.warmup + args.steps

    def traced_write(self, step, record):
        # Rows are written as each step ends (ours waits for its update in the bench).
        if step == first - 1:
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0  # Python's calls traced slow the step down ~1.6x
            jax.profiler.start_trace(str(trace_dir), profiler_options=options)
            window["start"] = time.perf_counter()
        if step == last - 1 and "start" in window:
            window["stop"] = time.perf_counter()
            jax.profiler.stop_trace()
        return write(self, step, record)

    score = rewards_lib.RewardScorer.__call__

    def timed_score(self, examples, texts):
        t0 = time.perf_counter()
        try:
            return score(self, examples, texts)
        finally:
            scoring.append((t0, time.perf_counter()))

    metrics_lib.MetricsWriter.write = traced_write
    rewards_lib.RewardScorer.__call__ = timed_score
    # Then as many steps untraced (the trace slows a step down: its time is the one
    # reported), and the last step (it evaluates).
    run = e2e_bench.run_ours(fix, last + args.steps + 1, str(work / "run"), engine=args.engine)
    untraced = run["step_s"][last - 1 : last - 1 + args.steps]
    peak = matmul_peak()

    start, stop = window["start"], window["stop"]
    wall = stop - start
    scored = sum(min(b, stop) - max(a, start) for a, b in scoring if b > start and a < stop)
    modules = load_modules(work / "hlo")
    seconds = collections.Counter()
    flops = collections.Counter()
    train_ids = {
        pid
        for pid, (_, module) in modules.items()
        if any("transpose(" in module.op_name(op) for op in module.lines)
    }
    unknown = collections.Counter()
    for pid, name, op, _, duration in thunk_events(trace_dir):
        if op.startswith(CONTROL) or op.startswith("end:"):
            continue
        if pid not in modules:
            unknown[name] += duration
            continue
        _, module = modules[pid]
        part = classify(module, op, pid in train_ids)
        seconds[part] += duration / 1e9
        flops[part] += module.flops(op)
    seconds["scoring"] = scored
    busy = sum(seconds.values())
    seconds["host, idle"] = max(wall - busy, 0.0)
    steps = args.steps
    return dict(
        setting=args.setting,
        engine=args.engine,
        steps=steps,
        step_s=statistics.median(untraced),
        traced_step_s=wall / steps,
        peak=peak,
        seconds={p: seconds[p] / steps for p in PARTS},
        flops={p: flops[p] / steps for p in PARTS},
        overlap_s=max(busy - wall, 0.0) / steps,
        untraced_ms={k: v / 1e6 / steps for k, v in unknown.items()},
        gen_tokens=statistics.mean(run["gen_tokens"]),
    )


def report(result: dict) -> str:
    step, traced, peak = result["step_s"], result["traced_step_s"], result["peak"]
    lines = [
        f"# rl_profile: setting={result['setting']} engine={result['engine']}: "
        f"{step:.3f} s/step untraced (median of {result['steps']}), {traced:.3f} s/step "
        f"traced ({traced / step:.2f}x: the profiler's cost per op), "
        f"{result['gen_tokens']:.0f} generated tokens/step; "
        f"matmul peak {peak / 1e9:.1f} GFLOP/s (2048^3 float32, jit)",
        "",
        "| part | ms / traced step | share | GFLOP / step | GFLOP/s (traced) | MFU (traced) |",
        "|---|---|---|---|---|---|",
    ]
    total_flops = 0.0
    for part in PARTS:
        s, f = result["seconds"][part], result["flops"][part]
        total_flops += f
        rate = f"{f / s / 1e9:.1f}" if f and s else "-"
        mfu = f"{100 * f / s / peak:.1f}%" if f and s else "-"
        gflop = f"{f / 1e9:.2f}" if f else "-"
        share = f"{100 * s / traced:.1f}%"
        lines.append(f"| {part} | {1e3 * s:.1f} | {share} | {gflop} | {rate} | {mfu} |")
    lines.append(
        f"| **whole step, untraced** | {1e3 * step:.1f} | | {total_flops / 1e9:.2f} | "
        f"{total_flops / step / 1e9:.1f} | **{100 * total_flops / step / peak:.1f}%** |"
    )
    if result["overlap_s"] > 0:
        lines.append(
            f"\nops that ran at once: {1e3 * result['overlap_s']:.1f} ms/traced step counted twice"
        )
    if result["untraced_ms"]:
        lines.append(f"ops of programs compiled before the dump: {result['untraced_ms']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=("short", "long"), default="short")
    parser.add_argument("--engine", choices=("static", "continuous"), default="static")
    parser.add_argument("--slots", type=int, default=32, help="the continuous engine's slots")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the trace")
    parser.add_argument("--steps", type=int, default=4, help="steps traced")
    parser.add_argument("--keep", help="a directory to keep the trace and HLO dump in")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    if args.warmup < 2 or args.steps < 1:
        parser.error("--warmup must be >= 2 (compiles) and --steps >= 1")
    work = Path(args.keep or tempfile.mkdtemp(prefix="rl_profile_"))
    work.mkdir(parents=True, exist_ok=True)
    # XLA writes every optimized program as it compiles it: the FLOPs are counted there.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={work / 'hlo'} --xla_dump_hlo_as_text"
    )
    result = profile(args, work)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
