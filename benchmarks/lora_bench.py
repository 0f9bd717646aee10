"""LoRA against full fine-tuning on one model, same process: the train step and sampling.

    python benchmarks/lora_bench.py                      # rank 16 on every projection
    python benchmarks/lora_bench.py --rank 64 --targets q,v

The model is model_bench's `--size` (default: e2e_bench's 3.2M-parameter Llama, float32);
the batch is step_bench's (16 prompts x 8 samples, 37-token prompts, 32 new tokens, M2PO
on, one minibatch), the train step the trainer's (`train_step.make_train_step`). Sides,
each jitted once and timed alternately (median of `--repeats` after a warm-up):

  train step     full fine-tuning | LoRA (adapters differentiated, AdamW on them alone)
  sampling       the static sampler (16 x 8 rows, 32 new tokens) with the base | with the
                 adapters unmerged (x W + s (x A) B per projection, what the trainer's
                 rollouts run) | with the adapters merged into a copy (`lora.merged`:
                 one matmul per projection; the merge itself timed apart)

Also printed: the optimizer state's bytes on each side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import step_bench  # noqa: E402

from m2po_jax import config as config_lib  # noqa: E402
from m2po_jax.common.types import PromptGroups  # noqa: E402
from m2po_jax.configs import arith  # noqa: E402
from m2po_jax.learner import optim  # noqa: E402
from m2po_jax.learner import train_step as step_lib  # noqa: E402
from m2po_jax.models import lora  # noqa: E402
from m2po_jax.models import model as model_lib  # noqa: E402
from m2po_jax.rollout import sampling  # noqa: E402


def timed(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="q,k,v,o,gate,up,down")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    base_config = step_bench.MODEL
    config = base_config.replace(lora_rank=args.rank, lora_targets=args.targets)
    c = arith.get_config("m2po").to_dict()
    c["actor"]["ppo_n_minibatches"] = 1
    actor = config_lib.from_configdict(c).actor
    tx, schedule = optim.make_optimizer(actor.optimizer, 100)
    base = model_lib.init_params(base_config, jax.random.key(0))
    # Adapters as after some training (B nonzero), so that no side computes zeros.
    adapted = model_lib.add_adapters(base, config, jax.random.key(1))
    adapted = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.01 if str(p[-1]).endswith("_lora_b']") else x, adapted
    )
    batch = step_bench.make_batch(base, 16, 8, 37, 32)
    groups = PromptGroups(37, 8)
    sides = {"full": (base_config, base), f"LoRA r={args.rank}": (config, adapted)}
    steps, states, opt_bytes = {}, {}, {}
    for name, (cfg, params) in sides.items():
        steps[name] = step_lib.make_train_step(cfg, actor, tx, schedule, groups=groups)
        states[name] = step_lib.init_train_state(jax.tree.map(jnp.copy, params), tx)
        opt_bytes[name] = sum(x.nbytes for x in jax.tree.leaves(states[name].opt_state))

    def run_step(name):
        states[name], metrics = steps[name](states[name], batch, jax.random.key(0), None)
        return states[name], metrics

    train = {name: [] for name in sides}
    for name in sides:  # compile
        jax.block_until_ready(run_step(name))
    for _ in range(args.repeats):
        for name in sides:
            start = time.perf_counter()
            jax.block_until_ready(run_step(name))
            train[name].append(time.perf_counter() - start)

    settings = sampling.SamplingConfig(max_new_tokens=32)
    tokens, valid = batch.tokens_BxT[::8, :37], batch.valid_BxT[::8, :37]
    merge = jax.jit(lambda p: lora.merged(p, config)[0])
    merged = merge(adapted)
    samplers = {
        "base": (base_config, base),
        "adapters unmerged": (config, adapted),
        "adapters merged": (base_config, merged),
    }
    sample = {name: [] for name in samplers}

    def gen(cfg, params):
        return sampling.generate(params, cfg, tokens, valid, jax.random.key(0), settings, 8)

    for cfg, params in samplers.values():
        jax.block_until_ready(gen(cfg, params))
    for _ in range(args.repeats):
        for name, (cfg, params) in samplers.items():
            start = time.perf_counter()
            jax.block_until_ready(gen(cfg, params))
            sample[name].append(time.perf_counter() - start)
    merge_s = timed(lambda: merge(adapted), args.repeats)

    print(f"# lora_bench: {config.lora_params():,} adapter params ({args.targets}), base "
          f"{base_config.num_params():,}, {jax.devices()[0].platform}")  # fmt: skip
    print("| bench | side | s | vs full / base | optimizer state |")
    print("|---|---|---|---|---|")
    full = statistics.median(train["full"])
    for name in sides:
        t = statistics.median(train[name])
        print(
            f"| train step | {name} | {t:.3f} | {full / t:.2f}x | {opt_bytes[name] / 1e6:.2f} MB |"
        )
    plain = statistics.median(sample["base"])
    for name in samplers:
        t = statistics.median(sample[name])
        print(f"| sampling | {name} | {t:.3f} | {plain / t:.2f}x | |")
    print(f"| merge | `lora.merged` (once per published version) | {merge_s:.4f} | | |")


if __name__ == "__main__":
    main()
