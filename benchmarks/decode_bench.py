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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="race,long_tail")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default="static,continuous,paged")
    args = parser.parse_args(argv)
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
