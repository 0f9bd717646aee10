"""The train step alone: today's fast paths against the reference step, same process.

    python benchmarks/step_bench.py                       # the e2e_bench short batch
    python benchmarks/step_bench.py --prompt 128 --new 192 --mean_len 40  # e2e long

The model is e2e_bench's 3.2M Llama (vocab 512, hidden 256, 4 layers, float32); the batch
is 16 prompts x 8 samples, prompt columns shared within each group as the sampler writes
them, completions of random lengths (uniform in [new / 4, new], or geometric with mean
`--mean_len` and one row at `new`), M2PO on (tau 0.04), one minibatch. Paths, each jitted
once and timed alternately over `--repeats` calls (median, after a warm-up call):

  reference   a separate proximal pass, every row's whole sequence through the trunk
  fused       prox from the loss's own pass (gradient stopped), rows' full sequences
  fast        fused, each prompt once through the trunk, rows in four blocks by length
              (what the trainer runs)

Prints seconds per step and the ratio to the reference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from m2po_jax import config as config_lib
from m2po_jax.common.types import PromptGroups, TrainBatch  # noqa: E402
from m2po_jax.configs import arith  # noqa: E402
from m2po_jax.learner import logprobs, optim
from m2po_jax.learner import train_step as step_lib
from m2po_jax.models import model as model_lib
from m2po_jax.models import model_config

MODEL = model_config.ModelConfig(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=704,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
)


def make_batch(params, groups, group, prompt, new, mean_len=0, seed=0):
    rng = np.random.default_rng(seed)
    rows = groups * group
    tokens = rng.integers(3, MODEL.vocab_size, (rows, prompt + new)).astype(np.int32)
    valid = np.ones_like(tokens, bool)
    for g in range(groups):
        tokens[g * group : (g + 1) * group, :prompt] = tokens[g * group, :prompt]
        valid[g * group : (g + 1) * group, : g % 4] = False
    if mean_len:  # a sampler's lengths: stops with probability 1 / mean_len per token
        lengths = np.minimum(rng.geometric(1 / mean_len, rows), new)
        lengths[0] = new
    else:
        lengths = rng.integers(new // 4, new + 1, rows)
    for r, n in enumerate(lengths):
        valid[r, prompt + n :] = False
    tokens[~valid] = 0
    loss_mask = valid.copy()
    loss_mask[:, :prompt] = False
    prox, _ = logprobs.sequence_logp(params, MODEL, tokens, valid)
    behav = np.asarray(prox) * loss_mask
    behav += rng.normal(0, 0.3, behav.shape).astype(np.float32) * loss_mask
    return TrainBatch(
        tokens_BxT=jnp.asarray(tokens),
        valid_BxT=jnp.asarray(valid),
        behav_logp_BxT=jnp.asarray(behav),
        loss_mask_BxT=jnp.asarray(loss_mask),
        rewards_B=jnp.asarray(rng.integers(0, 2, rows), jnp.float32),
        version_B=jnp.zeros(rows, jnp.int32),
        version_BxT=jnp.zeros(tokens.shape, jnp.int32),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=37)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--mean_len", type=int, default=0, help="geometric completion lengths (0: uniform)"
    )
    args = parser.parse_args()
    c = arith.get_config("m2po").to_dict()
    c["actor"]["m2_threshold"] = 0.04
    c["actor"]["ppo_n_minibatches"] = 1
    c["actor"]["logp_chunk_size"] = 4096
    actor = config_lib.from_configdict(c).actor
    tx, schedule = optim.make_optimizer(actor.optimizer, 100)
    params = model_lib.init_params(MODEL, jax.random.key(0))
    batch = make_batch(params, args.groups, args.group, args.prompt, args.new, args.mean_len)
    paths = {
        "reference": dict(fuse_prox=False),
        "fused": dict(),
        "fast": dict(groups=PromptGroups(args.prompt, args.group)),
    }
    steps, states = {}, {}
    for name, kwargs in paths.items():
        steps[name] = step_lib.make_train_step(MODEL, actor, tx, schedule, **kwargs)
        state = step_lib.init_train_state(jax.tree.map(jnp.copy, params), tx)
        states[name], _ = steps[name](state, batch, jax.random.key(0), None)  # compile
        jax.block_until_ready(states[name])
    times = {name: [] for name in paths}
    for i in range(args.repeats):
        for name in paths:
            t = time.perf_counter()
            states[name], metrics = steps[name](states[name], batch, jax.random.key(i), None)
            jax.block_until_ready((states[name], metrics))
            times[name].append(time.perf_counter() - t)
    rows, cols = batch.tokens_BxT.shape
    print(f"# step_bench: {rows} rows x {cols} columns ({args.prompt} prompt), {jax.devices()[0]}")
    print("| path | s / step | vs reference |")
    print("|---|---|---|")
    base = statistics.median(times["reference"])
    for name in paths:
        t = statistics.median(times[name])
        print(f"| {name} | {t:.3f} | {base / t:.2f}x |")


if __name__ == "__main__":
    main()
