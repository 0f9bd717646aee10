"""A decode step against its floor, for the three rollout engines, at the races' shapes.

    python benchmarks/decode_bench.py                        # both cases, 3 rounds
    python benchmarks/decode_bench.py --cases race --rounds 5

The floor of a decode step is the larger of its FLOPs at the matmul peak and its bytes at
the memory bandwidth, both measured in the same process: a 2048^3 float32 matmul
(`model_bench.jax_matmul_peak`) and a jitted read of a 512 MiB array (and a copy of it:
the faster counts). FLOPs are the generated tokens' matmuls (2 x the params in matmuls)
plus their attention over the columns each token actually has (4 L H D per column); bytes
are the weights once per step plus the live keys and values (each token's context, K x D
per column and layer, keys and values). The paged engine's floor counts what it is built to
read: each group's prompt keys and values once per step (its rows' queries share one read)
rather than once per row, over the steps its longest row decodes, plus each row's own
columns; `paged floor` prints that floor, and the ratio against it. Idle rows and cache columns beyond a row's
context count as waste, not as work: the static sampler's finished rows, the engine's
empty slots and attention over columns no row has filled all show in the ratio.

A step's time is the engine's whole `generate` call (the path the trainer runs: prefill,
decode loop, sampling, bookkeeping) less the same call with `max_new_tokens=1` (the
prefill and the first token), over the decode steps the call ran. Cases (the model is
e2e_bench's 3.2M-parameter Llama, float32, made context-free as rollout_bench does, so
that completion lengths do not depend on the prompts):

  race        e2e_bench short: 16 prompts x 8 samples, 36-token prompts, 32 new tokens,
              no stop token (every row runs to 32); the engine gets a slot per row
  long_tail   rollout_bench long_tail: 64 prompts x 4 samples, prompts <= 32 tokens,
              lengths ~ geometric (mean ~40, cap 512), 32 slots; the static sampler
              decodes batches of 8 prompts

The paged engine gets the continuous engine's slots and its default pool (every prompt
and every slot's whole completion: no preemption).

Prints per case and engine: ms per decode step, the floor (and whether FLOPs or bytes set
it), the ratio, and the step's GFLOP/s.

    python benchmarks/decode_bench.py --precisions           # cheaper rollouts, two tables
    python benchmarks/decode_bench.py --precisions --targets cpu,v5e:1x1,h100:1

`--precisions` measures the rollout precisions (`rollout.weight_dtype` x `rollout.kv_dtype`,
`PRECISIONS`) instead: (1) on this CPU, the paged engine's ms per decode step on the race
case, side by side in one run against float32's; (2) the bytes one decode step moves, from
the compiler, for a real architecture (`--architecture`, default qwen3-1.7b; `--rows` rows
each reading a `--context`-column KV cache): XLA's cost analysis on each `--targets` entry
(`cpu` = this host, a TPU topology such as `v5e:1x1` through libtpu, `h100:1` through jax's
CUDA plugin, skipped with a note when it is not installed), and on a TPU the HBM bytes read
from the compiled HLO (`hlo_traffic.hbm_bytes`); each against float32 weights and KV. On a TPU or GPU target the HLO's HBM bytes
(`hlo_traffic.hbm_bytes`: operands and results of the compiled program's top-level ops,
VMEM excluded) are printed too; the CUDA plugin's compile-only gives no cost analysis, so
there they are the only figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import model_bench  # noqa: E402
import rollout_bench  # noqa: E402

from m2po_jax.rollout import engines as engine_lib  # noqa: E402
from m2po_jax.rollout import sampling  # noqa: E402

CONFIG = rollout_bench.CONFIG


@dataclasses.dataclass(frozen=True)
class Case:
    prompts: int
    n_samples: int
    prompt_len: int
    max_new: int
    slots: int
    stop: bool
    fixed_prompt_len: bool  # every prompt exactly prompt_len tokens


CASES = {
    "race": Case(16, 8, 36, 32, 128, stop=False, fixed_prompt_len=True),
    "long_tail": Case(64, 4, 32, 512, 32, stop=True, fixed_prompt_len=False),
}


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s of the faster of a jitted read (sum) and copy (x + 1) of `mib` MiB."""
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    read, copy = jax.jit(jnp.sum), jax.jit(lambda x: x + 1.0)
    best = 0.0
    for fn, moved in ((read, x.nbytes), (copy, 2 * x.nbytes)):
        jax.block_until_ready(fn(x))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - start)
        best = max(best, moved / min(times))
    return best


def case_prompts(case: Case) -> tuple[np.ndarray, np.ndarray]:
    if not case.fixed_prompt_len:
        return rollout_bench.prompts(case.prompts, case.prompt_len)
    rng = np.random.default_rng(0)
    ids = [list(rng.integers(5, CONFIG.vocab_size, case.prompt_len)) for _ in range(case.prompts)]
    return sampling.pad_prompts(ids, 0, case.prompt_len)


def engines(case: Case, max_new: int, names: list[str]) -> list[engine_lib.RolloutEngine]:
    stops = (rollout_bench.EOS_ID,) if case.stop else ()
    settings = sampling.SamplingConfig(max_new_tokens=max_new, stop_token_ids=stops)
    built = {
        "static": lambda: engine_lib.StaticEngine(CONFIG, settings),
        "continuous": lambda: engine_lib.ContinuousEngine(CONFIG, settings, slots=case.slots),
        "paged": lambda: engine_lib.PagedEngine(CONFIG, settings, slots=case.slots),
    }
    return [built[name]() for name in names]


def run(engine, params, tokens, valid, case: Case, key) -> dict:
    """One pass over every prompt (static: batches of slots // n_samples prompts):
    rollout_bench's `run_side`, the path both benchmarks time."""
    return rollout_bench.run_side(
        engine, params, tokens, valid, case.n_samples, case.slots // case.n_samples, key
    )


def floor_work(case: Case, valid: np.ndarray, lengths: np.ndarray) -> tuple[float, float, float]:
    """(FLOPs, bytes, shared-prompt bytes) of the decode loop's real work: tokens 2.. of
    each row, each over its own context, and the live keys and values it reads: every
    row's whole context, or (shared) each group's prompt once per step of its longest row
    plus every row's own columns."""
    c = CONFIG
    prompt_len = valid.sum(1)
    per_column_flops = 4.0 * c.num_layers * c.num_heads * c.dim_per_head
    per_column_bytes = 2.0 * c.num_layers * c.num_kv_heads * c.dim_per_head * 4
    flops = bytes_ = shared = 0.0
    for p, group in zip(prompt_len, lengths.reshape(-1, case.n_samples), strict=True):
        for n in group:
            # Decode step t (1 .. n - 1) feeds token t - 1 at context p + t.
            contexts = p + np.arange(1, n)
            flops += (n - 1) * model_bench.matmul_flops_per_token(c)
            flops += per_column_flops * contexts.sum()
            bytes_ += per_column_bytes * contexts.sum()
            shared += per_column_bytes * np.arange(1, n).sum()
        shared += per_column_bytes * p * max(int(group.max()) - 1, 0)
    return flops, bytes_, shared


# (label, rollout.weight_dtype, rollout.kv_dtype): float32 first, the baseline.
PRECISIONS = (
    ("float32", "", ""),
    ("bf16 weights", "bfloat16", ""),
    ("int8 weights", "int8", ""),
    ("fp8 weights", "float8_e4m3fn", ""),
    ("bf16 KV", "", "bfloat16"),
    ("fp8 KV", "", "float8_e4m3fn"),
    ("int8 weights + bf16 KV", "int8", "bfloat16"),
    ("fp8 weights + fp8 KV", "float8_e4m3fn", "float8_e4m3fn"),
)


def rollout_config(config, weight_dtype: str, kv_dtype: str):
    """The model config a rollout engine runs under these settings (as
    `setup.rollout_model_config` makes it)."""
    from m2po_jax.models import quant

    config = config.replace(kv_dtype=kv_dtype)
    if weight_dtype in quant.WEIGHT_QUANTS[1:]:
        return config.replace(weight_quant=weight_dtype)
    return config.replace(param_dtype=weight_dtype) if weight_dtype else config


def cpu_precisions(rounds: int) -> None:
    """The paged engine's ms per decode step on the race case under each precision, the
    weights converted as the trainer's publish converts them (`quant.convert_weights`)."""
    from m2po_jax.models import quant

    case = CASES["race"]
    params = rollout_bench.context_free_params(1 / 40)
    tokens, valid = case_prompts(case)
    stops = (rollout_bench.EOS_ID,) if case.stop else ()
    sides = []
    for label, weight_dtype, kv_dtype in PRECISIONS:
        config = rollout_config(CONFIG, weight_dtype, kv_dtype)
        engines_ = [
            engine_lib.PagedEngine(
                config, sampling.SamplingConfig(max_new_tokens=n, stop_token_ids=stops),
                slots=case.slots,
            )
            for n in (case.max_new, 1)
        ]  # fmt: skip
        sides.append((label, engines_, quant.convert_weights(params, weight_dtype)))
    best: dict = {}
    for r in range(-1, rounds):  # round -1 compiles; the sides alternate within a round
        for label, (full, first), weights in sides:
            key = jax.random.key(max(r, 0))
            res = run(full, weights, tokens, valid, case, key)
            pre = run(first, weights, tokens, valid, case, key)
            if r >= 0:
                step_s = (res["seconds"] - pre["seconds"]) / res["decode_steps"]
                best[label] = min(best.get(label, step_s), step_s)
    print("\n| precision (paged engine, race, this CPU) | ms / decode step | vs float32 |")
    print("|---|---|---|")
    for label, *_ in PRECISIONS:
        print(f"| {label} | {best[label] * 1e3:.2f} | {best[label] / best['float32']:.2f}x |")


def decode_step_bytes(architecture: str, targets: list[str], rows: int, context: int) -> None:
    """Bytes one decode step moves (XLA's cost analysis; on a TPU also the HLO's HBM bytes)
    per precision and target, against float32 weights and KV."""
    from m2po_jax.models import architectures
    from m2po_jax.models import model as model_lib
    from m2po_jax.parallel import gpu_targets
    from m2po_jax.trainer import compile_only, hlo_traffic

    print(
        f"\n# one decode step of {architecture}: {rows} rows x {context} cached columns, "
        "compute bfloat16 (float32 on cpu); GB per step, x = against float32 weights and KV"
    )
    tpu = [t for t in targets if t != "cpu"]  # the HLO's HBM bytes (hlo_traffic)
    found: dict = {}
    for t in targets:
        if t.startswith("h100") and not gpu_targets.cuda_plugin_installed():
            print(f"<!-- {t}: jax's CUDA plugin is not installed; column left empty -->")
            continue
        devices = compile_only.target("" if t == "cpu" else t).devices
        dtype = "float32" if t == "cpu" else "bfloat16"
        base = architectures.model_config(architecture, dtype=dtype, param_dtype="float32")
        one = jax.sharding.SingleDeviceSharding(devices[0])
        for label, weight_dtype, kv_dtype in PRECISIONS:
            config = rollout_config(base, weight_dtype, kv_dtype)
            params = jax.eval_shape(lambda c=config: model_lib.init_params(c, jax.random.key(0)))
            cache = jax.eval_shape(lambda c=config: model_lib.init_cache(c, rows, context))

            def step(params, cache, token_Bx1, config=config):
                pos = jnp.full(token_Bx1.shape, context - 1, jnp.int32)
                return model_lib.apply(params, config, token_Bx1, pos, None, cache,
                                       context - 1, last_only=True)  # fmt: skip

            placed = jax.tree.map(
                lambda x, one=one: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                (params, cache, jax.ShapeDtypeStruct((rows, 1), jnp.int32)),
            )
            compiled = (
                jax.jit(step, donate_argnums=1).lower(*placed).compile()
            )  # in place, as the engines
            cost = compiled.cost_analysis()  # none from the CUDA plugin's compile-only
            cost = cost[0] if isinstance(cost, list) else cost
            if cost:
                found[(t, label)] = float(cost.get("bytes accessed", 0.0))
            if t in tpu:
                found[(t + " hbm", label)] = hlo_traffic.hbm_bytes(compiled.as_text())
    columns = [c for c in [*targets, *(t + " hbm" for t in tpu)] if (c, "float32") in found]
    print("| precision | " + " | ".join(_column_name(c) for c in columns) + " |")
    print("|---" * (1 + len(columns)) + "|")
    for label, *_ in PRECISIONS:
        cells = []
        for col in columns:
            if (col, label) not in found:
                cells.append("-")
                continue
            gb, ratio = found[(col, label)] / 1e9, found[(col, label)] / found[(col, "float32")]
            cells.append(f"{gb:.2f} ({ratio:.2f}x)")
        print(f"| {label} | " + " | ".join(cells) + " |")


def _column_name(column: str) -> str:
    target, _, hbm = column.partition(" ")
    return f"{target} HBM (HLO)" if hbm else f"{target} cost analysis"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="race,long_tail")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default="static,continuous,paged")
    parser.add_argument("--precisions", action="store_true", help="the rollout precisions")
    parser.add_argument("--targets", default="cpu,v5e:1x1,h100:1")
    parser.add_argument("--architecture", default="qwen3-1.7b")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args(argv)
    if args.precisions:
        cpu_precisions(args.rounds)
        decode_step_bytes(args.architecture, args.targets.split(","), args.rows, args.context)
        return
    names = args.engines.split(",")
    if not set(names) <= {"static", "continuous", "paged"}:
        parser.error(f"--engines: static, continuous or paged, got {args.engines!r}")
    peak = model_bench.jax_matmul_peak(jnp.float32, 2048, 5)
    bandwidth = memory_bandwidth()
    weight_bytes = CONFIG.num_params() * 4
    print(
        f"# decode_bench: matmul peak {peak / 1e9:.1f} GFLOP/s, memory {bandwidth / 1e9:.1f} GB/s, "
        f"weights {weight_bytes / 1e6:.1f} MB, {jax.devices()[0].platform}"
    )
    print(
        "| case | engine | ms / decode step | floor ms (bound) | over floor | "
        "paged floor ms | over paged floor | GFLOP/s |"
    )
    print("|---" * 8 + "|")
    for name in args.cases.split(","):
        if name not in CASES:
            parser.error(f"--cases: unknown case {name!r} ({', '.join(CASES)})")
        case = CASES[name]
        params = rollout_bench.context_free_params(1 / 40)  # no stop token in "race"
        tokens, valid = case_prompts(case)
        full, first = engines(case, case.max_new, names), engines(case, 1, names)
        best = {}
        for r in range(-1, args.rounds):  # round -1 compiles
            for engine, prefill in zip(full, first, strict=True):
                key = jax.random.key(max(r, 0))
                res = run(engine, params, tokens, valid, case, key)
                pre = run(prefill, params, tokens, valid, case, key)
                if r < 0:
                    continue
                step_s = (res["seconds"] - pre["seconds"]) / res["decode_steps"]
                if engine.name not in best or step_s < best[engine.name][0]:
                    best[engine.name] = (step_s, res)
        for engine_name, (step_s, res) in best.items():
            flops, kv_bytes, shared_bytes = floor_work(case, valid, res["lengths"])
            steps = res["decode_steps"]
            flop_s, byte_s = flops / peak / steps, (kv_bytes / steps + weight_bytes) / bandwidth
            floor = max(flop_s, byte_s)
            bound = "FLOPs" if flop_s >= byte_s else "bytes"
            shared_floor = max(flop_s, (shared_bytes / steps + weight_bytes) / bandwidth)
            print(
                f"| {name} | {engine_name} | {step_s * 1e3:.2f} | {floor * 1e3:.2f} ({bound}) | "
                f"**{step_s / floor:.2f}x** | {shared_floor * 1e3:.2f} | "
                f"{step_s / shared_floor:.2f}x | {flops / steps / step_s / 1e9:.1f} |"
            )


if __name__ == "__main__":
    main()
