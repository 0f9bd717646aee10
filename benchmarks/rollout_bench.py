"""Rollout engines side by side: the static sampler, the continuous-batching engine and the
paged engine.

    python benchmarks/rollout_bench.py                     # both cases, 2 rounds
    python benchmarks/rollout_bench.py --cases long_tail --rounds 1

Same model, prompts, sampling settings and slot count on both sides: the static sampler
(`rollout.engine=static`, what `sampling.generate` does) decodes the prompts in batches of
`--slots` rows, each batch until its longest completion ends; the continuous engine
(`rollout.engine=continuous`) runs every sequence through `--slots` decode slots and
refills a slot as soon as its sequence stops; the paged engine (`rollout.engine=paged`) runs
them through the same slots over a pool of KV pages, each group's prompt stored once. All are
the trainer's code path (`m2po_jax.rollout.engines`), temperature 1.

KV memory: the continuous engine holds `--slots` rows of (prompt width + max new) columns
and every prompt's prefix (prompt width columns); the paged engine's pool is
`--paged-kv` times that many bytes on the long tail (0.5: half; pages of 16 tokens) and
its default (every prompt and every slot's whole completion) on same-length completions,
where it goes against the static sampler. Both figures are printed in bytes.

The model is e2e_bench's random 3.2M-parameter Llama (vocab 512, hidden 256, 4 layers,
4 / 2 heads, MLP 704, float32) made context-free as e2e_bench does: the layers' output
projections are zeroed, so the next token depends on the current one only (every layer
still runs: the work per token is unchanged), and the end-of-sequence logit is raised so
that a sequence stops with probability ~1/40 per token. Cases:

  long_tail   completion lengths ~ geometric, mean ~40, cap 512 (`--max-new`)
  to_cap      no stop token: every sequence runs to the cap (`--cap-new`)

Printed per case and side: generated tokens per second (best of `--rounds`, after a
warm-up run that compiles), decode steps, and the share of decode work (slots x steps)
spent on finished or empty rows, the paged engine's preemptions; then the continuous /
static, paged / continuous and paged / static ratios.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from m2po_jax.models import model as model_lib  # noqa: E402
from m2po_jax.models import model_config as model_config_lib  # noqa: E402
from m2po_jax.rollout import engines as engine_lib  # noqa: E402
from m2po_jax.rollout import sampling  # noqa: E402

EOS_ID = 3
CONFIG = model_config_lib.ModelConfig(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=704,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    max_position_embeddings=16384,
)


def context_free_params(stop_prob: float, seed: int = 0):
    """Random params whose next token depends on the current token only, with an
    end-of-sequence probability of about `stop_prob` (e2e_bench's `_raise_eos`)."""
    params = model_lib.init_params(CONFIG, jax.random.key(seed))
    for name, layer in params.items():
        if name.startswith("layers_"):
            layer["attn"]["o_kernel"] = jnp.zeros_like(layer["attn"]["o_kernel"])
            layer["mlp"]["down_kernel"] = jnp.zeros_like(layer["mlp"]["down_kernel"])
    params["embedding"] = params["embedding"].at[:, 0].set(0.2)
    head = params["lm_head"].at[:, EOS_ID].set(0.0)
    tokens = jax.random.randint(jax.random.key(1), (16, 64), 5, CONFIG.vocab_size)
    forward = jax.jit(lambda p: model_lib.apply(p, CONFIG, tokens))
    lo, hi = 0.0, 50.0
    for _ in range(30):
        mid = (lo + hi) / 2
        params["lm_head"] = head.at[0, EOS_ID].set(mid)
        prob = float(jax.nn.softmax(forward(params), -1)[..., EOS_ID].mean())
        lo, hi = (mid, hi) if prob < stop_prob else (lo, mid)
    return params


def prompts(count: int, width: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = [
        list(rng.integers(5, CONFIG.vocab_size, int(rng.integers(width // 2, width + 1))))
        for _ in range(count)
    ]
    return sampling.pad_prompts(ids, 0, width)


def run_side(engine, params, tokens, valid, n_samples: int, batch_prompts: int, key) -> dict:
    """One pass over every prompt: the static side in batches, the continuous in one call."""
    start = time.perf_counter()
    step = batch_prompts if engine.name == "static" else tokens.shape[0]
    generated, decode, slot_steps, live, preemptions = 0, 0, 0, 0, 0
    lengths = []
    for first in range(0, tokens.shape[0], step):
        g = engine.generate(
            params,
            tokens[first : first + step],
            valid[first : first + step],
            jax.random.fold_in(key, first),
            n_samples=n_samples,
        )
        length = np.asarray(jax.device_get(g.out.completion_len_B))
        lengths.append(length)
        preemptions += getattr(g, "preemptions", 0)
        generated += int(length.sum())
        decode, slot_steps, live = (
            decode + g.decode_steps,
            slot_steps + g.slot_steps,
            live + g.live_steps,
        )
    seconds = time.perf_counter() - start
    lengths = np.concatenate(lengths)
    return dict(
        seconds=seconds,
        tokens_per_s=generated / seconds,
        generated=generated,
        decode_steps=decode,
        idle=1.0 - live / max(slot_steps, 1),
        mean_len=float(lengths.mean()),
        max_len=int(lengths.max()),
        lengths=lengths,
        preemptions=preemptions,
    )


def kv_bytes(columns: int) -> int:
    """Bytes of `columns` cache columns (keys and values of every layer)."""
    itemsize = jnp.dtype(model_config_lib.as_dtype(CONFIG.dtype)).itemsize
    return 2 * CONFIG.num_layers * columns * CONFIG.num_kv_heads * CONFIG.dim_per_head * itemsize


def continuous_kv_columns(slots: int, prompts: int, width: int, max_new: int) -> int:
    """The continuous engine's cache columns: its slots' rows and every prompt's prefix."""
    return slots * (width + max_new) + prompts * width


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="long_tail,to_cap")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n-samples", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new", type=int, default=512)
    parser.add_argument("--cap-new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--insert-lanes", type=int, default=0)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--paged-kv", type=float, default=0.5,
                        help="long_tail: the paged pool's bytes over the continuous cache's")  # fmt: skip
    args = parser.parse_args(argv)
    if args.slots % args.n_samples:
        parser.error("--slots must be a multiple of --n-samples (the static side's batches)")
    params = context_free_params(1 / 40)
    tokens, valid = prompts(args.prompts, args.prompt_len)
    batch_prompts = args.slots // args.n_samples
    print(
        f"{args.prompts} prompts x {args.n_samples} samples, {args.slots} slots "
        f"(static: batches of {batch_prompts} prompts), prompts <= {args.prompt_len} tokens, "
        f"{jax.device_count()} device(s) [{jax.devices()[0].platform}]"
    )
    header = (
        "| case | engine | gen tokens/s | decode steps | idle share | mean / max len | s | "
        "KV MB | preemptions |"
    )
    print(header + "\n" + "|---" * 9 + "|")
    for case in args.cases.split(","):
        if case == "long_tail":
            settings = sampling.SamplingConfig(
                max_new_tokens=args.max_new, stop_token_ids=(EOS_ID,)
            )
        elif case == "to_cap":
            settings = sampling.SamplingConfig(max_new_tokens=args.cap_new)
        else:
            parser.error(f"--cases: unknown case {case!r} (long_tail, to_cap)")
        new = settings.max_new_tokens
        columns = continuous_kv_columns(args.slots, args.prompts, args.prompt_len, new)
        kv = {
            "static": kv_bytes(args.slots * (args.prompt_len + new)),
            "continuous": kv_bytes(columns),
        }
        fraction = args.paged_kv if case == "long_tail" else 0.0
        pages = int(fraction * columns) // args.page_size  # 0: the engine's default
        paged = engine_lib.PagedEngine(
            CONFIG, settings, slots=args.slots, pages=pages, page_size=args.page_size,
            insert_lanes=args.insert_lanes,
        )  # fmt: skip
        size = paged.sizes(args.prompts, args.prompt_len, args.n_samples)
        kv["paged"] = kv_bytes(size["pages"] * args.page_size)
        engines = [
            engine_lib.StaticEngine(CONFIG, settings),
            engine_lib.ContinuousEngine(
                CONFIG, settings, slots=args.slots, insert_lanes=args.insert_lanes
            ),
            paged,
        ]
        best = {}
        for engine in engines:  # warm-up: compiles every program
            run_side(
                engine, params, tokens, valid, args.n_samples, batch_prompts, jax.random.key(9)
            )
        for r in range(args.rounds):
            for engine in engines:
                res = run_side(
                    engine,
                    params,
                    tokens,
                    valid,
                    args.n_samples,
                    batch_prompts,
                    jax.random.key(r),
                )
                if engine.name not in best or res["seconds"] < best[engine.name]["seconds"]:
                    best[engine.name] = res
        for name, res in best.items():
            print(
                f"| {case} | {name} | {res['tokens_per_s']:,.0f} | {res['decode_steps']} | "
                f"{res['idle']:.2f} | {res['mean_len']:.1f} / {res['max_len']} | "
                f"{res['seconds']:.2f} | {kv[name] / 1e6:.2f} | {res['preemptions']} |"
            )
        rate = {name: res["tokens_per_s"] for name, res in best.items()}
        for a, b in (("continuous", "static"), ("paged", "continuous"), ("paged", "static")):
            print(f"| {case} | {a} / {b} | **{rate[a] / rate[b]:.2f}x** | | | | | | |")


if __name__ == "__main__":
    main()
