"""The measurements of benchmarks/device_check.py, each run in a worker process of its own.

  python benchmarks/device_check_sections.py SECTION ARG SETTINGS_JSON

SECTION is train (ARG: attention implementation), sampler or rl_step (device_check_rl.py);
SETTINGS_JSON is the settings dict device_check.py builds. The worker prints one line
`RESULT_PREFIX + json` with the section's numbers (see the functions below and
device_check.py's docstring).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fixtures, model_bench
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # m2po_jax when not installed

from device_check_common import (  # noqa: E402
    MESH_1,
    device_info,
    model_config,
    peak_memory,
    random_params,
)
from model_bench import jax_matmul_peak, matmul_flops_per_token  # noqa: E402

from m2po_jax import config as config_lib
from m2po_jax.common.types import TrainBatch  # noqa: E402
from m2po_jax.configs import gsm8k  # noqa: E402
from m2po_jax.learner import batching, logprobs, memory, optim
from m2po_jax.learner import train_step as step_lib
from m2po_jax.models import attention as attention_lib
from m2po_jax.models import model_config as model_config_lib
from m2po_jax.parallel import placement as placement_lib
from m2po_jax.rollout import sampling
from m2po_jax.trainer import setup as setup_lib

RESULT_PREFIX = "DEVICE_CHECK_RESULT "
# ----------------------------------------------------------------------------- helpers


def step_flops(mc: model_config_lib.ModelConfig, rows: int, seq: int) -> float:
    """Model FLOPs of one train step (one minibatch, no reference model): the trained
    forward + backward (3 forwards) plus the proximal recompute (1 forward); a forward
    costs 2 N + 4 L H D T per token (PaLM appendix B, full T x T attention), over every
    padded token. Remat recomputation is not counted (MFU, not HFU)."""
    attention = 4.0 * mc.num_layers * mc.num_heads * mc.dim_per_head * seq
    forward = matmul_flops_per_token(mc) + attention
    return rows * seq * 4 * forward


def run_config_for(s: dict, rows: int, prompt_len: int, new_tokens: int):
    """configs/gsm8k.py with this run's shapes and micro-batch cap."""
    c = gsm8k.get_config("qwen2.5-0.5b")
    config_lib.apply_dotted(
        c,
        {
            "rollout.batch_size": rows // c.gconfig.n_samples,
            "task.max_prompt_len": prompt_len,
            "gconfig.max_new_tokens": new_tokens,
            "actor.mb_spec.max_tokens_per_mb": s["max_tokens_per_mb"],
        },
    )
    return config_lib.from_configdict(c)


def train_rows(mc, rows: int, prompt_len: int, seq: int, rng: np.random.Generator, group=1):
    """Random tokens as the sampler lays them out: groups of `group` rows share a
    left-padded prompt (a quarter to all of `prompt_len`), then right-padded completions
    (a sixth to all of the rest)."""
    tokens = rng.integers(0, mc.vocab_size, (rows, seq), dtype=np.int32)
    valid = np.zeros((rows, seq), bool)
    loss_mask = np.zeros((rows, seq), bool)
    new = seq - prompt_len
    for row in range(rows):
        if row % group == 0:
            p = int(rng.integers(max(prompt_len // 4, 1), prompt_len + 1))
        else:
            tokens[row, :prompt_len] = tokens[row - 1, :prompt_len]
        c = int(rng.integers(max(new // 6, 1), new + 1))
        valid[row, prompt_len - p : prompt_len + c] = True
        loss_mask[row, prompt_len : prompt_len + c] = True
    tokens[~valid] = 0
    return tokens, valid, loss_mask


def make_train_batch(params, mc, actor, rows: int, prompt_len: int, seq: int) -> TrainBatch:
    """A TrainBatch whose behaviour log-probs are the model's own plus noise (N(0, 0.05),
    one token in ten N(0, 1): enough for M2PO to mask some) and whose rewards are 0/1,
    half of each group right."""
    rng = np.random.default_rng(0)
    group = actor.reward_norm.group_size
    tokens, valid, loss_mask = train_rows(mc, rows, prompt_len, seq, rng, group)
    # One forward with "xla" attention: the same program in every train worker, so the
    # persistent compilation cache (JAX_COMPILATION_CACHE_DIR) compiles it once.
    own_mc = mc.replace(attention="xla")

    @jax.jit
    def own_logp(params, tokens, valid):
        return logprobs.sequence_logp(params, own_mc, tokens, valid, 1.0, 1024, False)[0]

    own = own_logp(params, tokens, valid)
    scale = np.where(rng.random((rows, seq)) < 0.1, 1.0, 0.05)
    noise = rng.normal(0.0, 1.0, (rows, seq)) * scale
    behav = np.where(loss_mask, np.asarray(own) + noise, 0.0).astype(np.float32)
    rewards = (np.arange(rows) % group < group // 2).astype(np.float32)
    return TrainBatch(
        tokens_BxT=tokens,
        valid_BxT=valid,
        behav_logp_BxT=behav,
        loss_mask_BxT=loss_mask,
        rewards_B=rng.permutation(rewards),
        version_B=np.zeros(rows, np.int32),
        version_BxT=np.zeros(tokens.shape, np.int32),
    )


def timed(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` (which blocks until its result is ready)."""
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return times


# ----------------------------------------------------------------------------- sections


def run_train(s: dict, attention: str) -> dict:
    """Sections 1 and 3: the jitted RL train step with `attention`, its MFU, and device
    memory against the plan and XLA's analysis."""
    rows, seq, prompt_len = s["rows"], s["seq_len"], s["prompt_len"]
    mc = model_config(s, attention)
    cfg = run_config_for(s, rows, prompt_len, seq - prompt_len)
    actor = cfg.actor
    placement = placement_lib.Placement.from_shape(MESH_1, mc)
    tx, schedule = optim.make_optimizer(actor.optimizer, 10)
    start = time.perf_counter()
    params = placement.init_params(jax.random.key(0))
    batch = make_train_batch(params, mc, actor, rows, prompt_len, seq)
    state = step_lib.init_train_state(params, tx)
    del params
    state = jax.device_put(state, placement.state_shardings(state))
    batch = jax.device_put(batch, placement.train_batch_shardings())
    # The trainer's own builder: one trunk pass per prompt, whole groups, the state donated.
    step = setup_lib.build_train_step(cfg, mc, tx, schedule, placement, state)
    rng = jax.random.key(1)
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = step.lower(state, batch, rng, None).compile()
    compile_s = time.perf_counter() - start
    holder = {"state": state}

    def one(i):
        holder["state"], holder["metrics"] = compiled(
            holder["state"], batch, jax.random.fold_in(rng, i), None
        )
        jax.block_until_ready(holder)

    warmup = timed(one, 1)[0]
    times = timed(one, s["steps"])
    metrics = jax.device_get(holder["metrics"])
    n_micro = batching.micro_batch_count(
        rows, seq, actor.mb_spec.n_mbs, actor.mb_spec.max_tokens_per_mb
    )
    used = step_memory(mc, cfg, placement, compiled, rows, seq, n_micro)  # before the matmul
    flops = step_flops(mc, rows, seq)
    median = statistics.median(times)
    device = device_info(s["peak_tflops"])
    size = 512 if s["tiny"] else 8192 if jax.default_backend() != "cpu" else 1024
    matmul = jax_matmul_peak(jnp.dtype(s["dtype"]), size, 10)
    result = {
        "device": device,
        "attention_resolved": memory.attention_kind(mc),
        "params": mc.num_params(),
        "rows": rows,
        "seq_len": seq,
        "micro_batches": n_micro,
        "setup_s": setup_s,
        "compile_s": compile_s,
        "first_step_s": warmup,
        "step_s_median": median,
        "step_s_min": min(times),
        "step_s_all": times,
        "step_tflop": flops / 1e12,
        "tflops_achieved": flops / median / 1e12,
        "matmul_tflops_measured": matmul / 1e12,
        "mfu_vs_matmul": flops / median / matmul,
        "tokens_per_s": rows * seq / median,
        "loss": float(metrics["actor/loss"]),
        "nonfinite": int(metrics["train/nonfinite"]),
        "m2po_masked_fraction": float(metrics["m2po/masked_fraction"]),
    }
    if device["nominal_peak_tflops"]:
        result["mfu"] = flops / median / (device["nominal_peak_tflops"] * 1e12)
    result["memory"] = used
    return result


def step_memory(mc, cfg, placement, compiled, rows: int, seq: int, n_micro: int) -> dict:
    """Section 3: the process's peak device memory (after the steps) next to the memory
    plan's `train_step` (of the path the step plan picks) and XLA's argument + temp +
    output - alias of the compiled step."""
    plan = memory.memory_plan(
        mc,
        placement.mesh,
        batch=rows,
        seq_len=seq,
        micro_batch=rows // n_micro,
        logp_chunk=cfg.actor.logp_chunk_size,
        shared_prompt=setup_lib.step_plan(cfg, placement).loss_prompt,
    )
    xla = compiled.memory_analysis()
    held = (
        xla.argument_size_in_bytes
        + xla.temp_size_in_bytes
        + xla.output_size_in_bytes
        - xla.alias_size_in_bytes
    )
    out = {
        **peak_memory(),
        "plan_train_step_bytes": plan.train_step,
        "xla_step_bytes": held,
        "xla_temp_bytes": xla.temp_size_in_bytes,
        "xla_argument_bytes": xla.argument_size_in_bytes,
        "plan_over_xla": plan.train_step / held,
        "plan": plan.format(),
    }
    if out["peak_bytes"]:
        out["plan_over_peak"] = plan.train_step / out["peak_bytes"]
    return out


def run_sampler(s: dict, _arg: str = "") -> dict:
    """Section 2: `sampling.generate` with no stop token, so every row decodes all tokens."""
    mc = model_config(s, s["sample_attention"])
    rows, width, new = s["sample_rows"], s["sample_prompt_len"], s["sample_new_tokens"]
    params = random_params(mc)
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(1, mc.vocab_size, int(rng.integers(width // 2, width + 1))).tolist()
        for _ in range(rows)
    ]
    tokens, valid = sampling.pad_prompts(prompts, pad_id=0, width=width)
    config = sampling.SamplingConfig(max_new_tokens=new, temperature=1.0)
    key = jax.random.key(2)

    holder = {}

    def one(i):
        out = sampling.generate(params, mc, tokens, valid, jax.random.fold_in(key, i), config)
        holder["steps"] = int(jax.block_until_ready(out).num_steps)

    first = timed(one, 1)[0]
    times = timed(one, s["sample_repeats"])
    median = statistics.median(times)
    return {
        "device": device_info(s["peak_tflops"]),
        "attention_resolved": attention_lib.resolve(
            mc.attention, model_config_lib.as_dtype(mc.dtype), mc.dim_per_head, cached=True
        ),
        "rows": rows,
        "prompt_len": width,
        "new_tokens": new,
        "decoded_steps": holder["steps"],
        "first_call_s": first,
        "call_s_median": median,
        "tokens_per_s": rows * new / median,
        "ms_per_decode_step": 1e3 * median / new,
        **peak_memory(),
    }


def run_rl_step(s: dict, _arg: str = "") -> dict:
    """Section 4, in device_check_rl.py (it imports the trainer, orbax and maybe torch)."""
    import device_check_rl

    return device_check_rl.run_rl_step(s)


def run_async(s: dict, _arg: str = "") -> dict:
    """Section 5, in device_check_rl.py: sync against async rollouts."""
    import device_check_rl

    return device_check_rl.run_async(s)


SECTIONS = {"train": run_train, "sampler": run_sampler, "rl_step": run_rl_step, "async": run_async}


def main(argv: list[str]) -> None:
    section, arg, settings = argv[1], argv[2], json.loads(argv[3])
    result = SECTIONS[section](settings, arg)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv)
