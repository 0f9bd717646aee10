"""Model benchmark: our Flax LM vs transformers' LlamaForCausalLM, side by side in one run.

  python benchmarks/model_bench.py                      # small f32 config on the CPU
  python benchmarks/model_bench.py --size large --dtype bfloat16   # on a GPU

Measures (compile / warm-up excluded, best round of several):
  (a) train step: forward + backward + AdamW on a token-level log-prob loss;
  (b) sampling: prompts x new tokens at temperature 1 (ours: `sampling.generate`;
      torch: `generate(do_sample=True)` with min_new_tokens = max_new_tokens);
  (c) MFU against a matmul peak measured in the same run.

Each side runs at its best and alone: torch in a worker process (`--torch-worker`) with
`--threads` intra-op threads (default one per core, like XLA:CPU) and OMP_WAIT_POLICY=ACTIVE
(spin-waiting OpenMP threads: torch's fastest setting, 1.1x faster train steps and 1.6x
faster `generate` than PASSIVE on the 2-core CPU). Spinning threads would steal the cores
from JAX, so the two never run at the same time: the run alternates blocks (ours, torch,
ours, torch; `--blocks`), each a few timed rounds, and keeps each side's best round.

FLOP model (PaLM appendix B): a train step costs 6 * N * tokens + 12 * L * H * D * T per
token (attention scores and values over the full T x T matrix, as both implementations
compute it), N = parameters that take part in matmuls (all but the input embedding, which
is a gather, unless tied). A decoded token costs 2 * N + 4 * L * H * D * context.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time

# The torch worker shares the accelerator: JAX must not take 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from m2po_jax.models import hf_format, model_config
from m2po_jax.models import model as model_lib
from m2po_jax.rollout import sampling

SIZES = {
    "small": dict(
        model=dict(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=704,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
        ),
        batch=16,
        seq=128,
    ),
    "large": dict(
        model=dict(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=2816,
            num_layers=8,
            num_heads=16,
            num_kv_heads=4,
        ),
        batch=8,
        seq=512,
    ),
}


@dataclasses.dataclass
class Result:
    name: str
    seconds: float  # per step (train) or per generate call (sampling)
    tokens: int  # tokens per step / generated tokens per call
    flops: float  # per step / per call

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def matmul_flops_per_token(config: model_config.ModelConfig) -> float:
    """2 * N: parameters a token's matmuls use (the input embedding is a gather unless
    tied; of a mixture of experts, the router and the token's experts)."""
    n = config.num_params(active=True)
    if not config.tie_word_embeddings:
        n -= config.vocab_size * config.hidden_size
    return 2.0 * n


def train_flops(config: model_config.ModelConfig, batch: int, seq: int) -> float:
    """6 N per token plus the full T x T attention (forward 4 L H D T, times 3 with backward)."""
    attn = 12.0 * config.num_layers * config.num_heads * config.dim_per_head * seq
    return batch * seq * (3 * matmul_flops_per_token(config) + attn)


def sampling_flops(config: model_config.ModelConfig, batch: int, prompt: int, new: int) -> float:
    """Prefill forward plus one forward per generated token over its actual context."""
    per_head = 4.0 * config.num_layers * config.num_heads * config.dim_per_head
    prefill = batch * prompt * (matmul_flops_per_token(config) + per_head * prompt)
    mean_context = prompt + (new - 1) / 2
    decode = batch * (new - 1) * (matmul_flops_per_token(config) + per_head * mean_context)
    return prefill + decode


def best_of(rounds: list[float]) -> float:
    return min(rounds)


# ----------------------------------------------------------------------------- peak


def jax_matmul_peak(dtype, n: int, repeats: int) -> float:
    """FLOP/s of a jitted n^3 matmul (best of `repeats`)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    matmul = jax.jit(lambda a, b: a @ b)
    matmul(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2.0 * n**3 / min(times)


def torch_matmul_peak(torch, device, dtype, n: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        _sync(torch, device)
        start = time.perf_counter()
        a @ b
        _sync(torch, device)
        times.append(time.perf_counter() - start)
    return 2.0 * n**3 / min(times)


def _sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- ours


def make_jax_train_step(config: model_config.ModelConfig, optimizer):
    def loss_fn(params, tokens_BxT, mask_BxT):
        logits_BxTxV = model_lib.apply(params, config, tokens_BxT)
        logp_BxT = model_lib.token_logp(logits_BxTxV, tokens_BxT)
        return -jnp.sum(logp_BxT * mask_BxT) / jnp.sum(mask_BxT)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, tokens_BxT, mask_BxT):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens_BxT, mask_BxT)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


class JaxTrain:
    def __init__(self, config, tokens_BxT):
        self.config = config
        self.optimizer = optax.adamw(1e-4, weight_decay=0.01)
        self.params = jax.jit(model_lib.init_params, static_argnums=0)(config, jax.random.key(0))
        self.opt_state = self.optimizer.init(self.params)
        self.step = make_jax_train_step(config, self.optimizer)
        self.tokens = jnp.asarray(tokens_BxT)
        # Column 0 has no prediction; every other token counts.
        self.mask = jnp.ones(tokens_BxT.shape, jnp.float32).at[:, 0].set(0.0)

    def run(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            self.params, self.opt_state, loss = self.step(
                self.params, self.opt_state, self.tokens, self.mask
            )
        loss.block_until_ready()
        return (time.perf_counter() - start) / steps


class JaxSample:
    def __init__(self, config, params, prompts_BxP, new_tokens):
        self.config, self.params = config, params
        self.tokens, self.valid = sampling.pad_prompts(prompts_BxP.tolist(), 0)
        self.sampling = sampling.SamplingConfig(max_new_tokens=new_tokens, temperature=1.0)
        self.calls = 0

    def run(self) -> float:
        self.calls += 1
        start = time.perf_counter()
        out = sampling.generate(
            self.params,
            self.config,
            self.tokens,
            self.valid,
            jax.random.key(self.calls),
            self.sampling,
        )
        out.tokens_BxT.block_until_ready()
        elapsed = time.perf_counter() - start
        assert int(out.completion_len_B.sum()) == out.completion_len_B.size * (
            self.sampling.max_new_tokens
        )
        return elapsed


# ----------------------------------------------------------------------------- torch


def hf_model(torch, transformers, config: model_config.ModelConfig, device, seed=0):
    torch.manual_seed(seed)
    hf_config = transformers.LlamaConfig(**hf_format.config_to_hf(config, base={"pad_token_id": 0}))
    model = transformers.LlamaForCausalLM(hf_config).to(device=device, dtype=torch.float32)
    return model


class TorchTrain:
    def __init__(self, torch, transformers, config, tokens_BxT, device, autocast_dtype):
        self.torch, self.device = torch, device
        self.model = hf_model(torch, transformers, config, device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01)
        self.tokens = torch.from_numpy(np.asarray(tokens_BxT, np.int64)).to(device)
        self.autocast_dtype = autocast_dtype

    def step(self):
        torch = self.torch
        with torch.autocast(
            self.device.type,
            dtype=self.autocast_dtype or torch.float32,
            enabled=self.autocast_dtype is not None,
        ):
            # HF's loss: shifted token-level cross-entropy, mean over tokens.
            loss = self.model(input_ids=self.tokens, labels=self.tokens).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def run(self, steps: int) -> float:
        _sync(self.torch, self.device)
        start = time.perf_counter()
        for _ in range(steps):
            loss = self.step()
        loss.item()
        _sync(self.torch, self.device)
        return (time.perf_counter() - start) / steps


class TorchSample:
    def __init__(self, torch, transformers, config, prompts_BxP, new_tokens, device, dtype):
        self.torch, self.device = torch, device
        self.model = hf_model(torch, transformers, config, device).to(dtype).eval()
        tokens, valid = sampling.pad_prompts(prompts_BxP.tolist(), 0)
        self.tokens = torch.from_numpy(tokens.astype(np.int64)).to(device)
        self.valid = torch.from_numpy(valid.astype(np.int64)).to(device)
        self.new_tokens = new_tokens

    def run(self) -> float:
        torch = self.torch
        _sync(torch, self.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(
                input_ids=self.tokens,
                attention_mask=self.valid,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=self.new_tokens,
                min_new_tokens=self.new_tokens,
                pad_token_id=0,
            )
        _sync(torch, self.device)
        elapsed = time.perf_counter() - start
        assert out.shape[1] == self.tokens.shape[1] + self.new_tokens
        return elapsed


# ----------------------------------------------------------------------------- main


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=None, help="override the size's batch")
    parser.add_argument("--seq", type=int, default=None, help="override the size's length")
    parser.add_argument("--train-steps", type=int, default=3, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per side per block")
    parser.add_argument(
        "--blocks", type=int, default=2, help="alternating blocks (ours, torch, ours, ...)"
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--matmul", type=int, default=None, help="n of the n^3 peak matmul (2048 CPU, 8192 GPU)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch intra-op threads (XLA:CPU uses one per core)",
    )
    parser.add_argument(
        "--torch-omp-wait-policy",
        default="ACTIVE",
        help="OMP_WAIT_POLICY of the torch worker (ACTIVE = spin, torch's fastest; PASSIVE)",
    )
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def bench_inputs(args):
    size = SIZES[args.size]
    # bfloat16: bf16 compute on float32 params (mixed precision), as torch autocast does.
    config = model_config.ModelConfig(**size["model"], dtype=args.dtype, param_dtype="float32")
    batch, seq = args.batch or size["batch"], args.seq or size["seq"]
    rng = np.random.default_rng(0)
    tokens_BxT = rng.integers(0, config.vocab_size, (batch, seq), np.int32)
    prompts_BxP = rng.integers(1, config.vocab_size, (args.prompts, args.prompt_len), np.int32)
    if args.matmul is None:
        args.matmul = 2048 if jax.default_backend() == "cpu" else 8192
    return config, batch, seq, tokens_BxT, prompts_BxP


def torch_worker(args) -> None:
    """Warm up, time `--rounds` train and sampling rounds, print one JSON line, exit."""
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config, _, _, tokens_BxT, prompts_BxP = bench_inputs(args)
    autocast = torch.bfloat16 if args.dtype == "bfloat16" else None
    train = TorchTrain(torch, transformers, config, tokens_BxT, device, autocast)
    train.run(2)
    train_times = [train.run(args.train_steps) for _ in range(args.rounds)]
    del train
    torch_dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    sample = TorchSample(
        torch, transformers, config, prompts_BxP, args.new_tokens, device, torch_dtype
    )
    sample.run()
    sample_times = [sample.run() for _ in range(args.rounds)]
    peak = torch_matmul_peak(torch, device, getattr(torch, args.dtype), args.matmul, repeats=5)
    info = dict(
        torch=torch.__version__,
        device=str(device),
        threads=torch.get_num_threads(),
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
    )
    print(json.dumps(dict(train=train_times, sample=sample_times, peak=peak, info=info)))


def run_torch_worker(argv: list[str], args) -> dict:
    """One torch block in a fresh process (so its spinning threads are gone afterwards)."""
    env = dict(os.environ, OMP_WAIT_POLICY=args.torch_omp_wait_policy)
    proc = subprocess.run(
        # --matmul resolved here, so the worker never starts a JAX backend.
        [
            sys.executable,
            os.path.abspath(__file__),
            *argv,
            f"--matmul={args.matmul}",
            "--torch-worker",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"torch worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.torch_worker:
        return torch_worker(args)
    config, batch, seq, tokens_BxT, prompts_BxP = bench_inputs(args)
    jax_dtype = model_config.as_dtype(args.dtype)
    print(
        f"# model_bench: size={args.size} dtype={args.dtype} params={config.num_params():,} "
        f"jax={jax.__version__} backend={jax.default_backend()} devices={jax.devices()} "
        f"torch_threads={None if args.skip_torch else args.threads} "
        f"torch_omp_wait_policy={None if args.skip_torch else args.torch_omp_wait_policy} "
        f"cpus={len(os.sched_getaffinity(0))} load={os.getloadavg()[0]:.1f}",
        flush=True,
    )

    ours_train = JaxTrain(config, tokens_BxT)
    ours_train.run(2)  # compile + warm-up
    # Its own copy: the train step donates (and so deletes) the params it is given.
    sample_params = jax.tree.map(jnp.copy, ours_train.params)
    ours_sample = JaxSample(config, sample_params, prompts_BxP, args.new_tokens)
    ours_sample.run()  # compile + warm-up
    train_times = {"ours": [], "torch": []}
    sample_times = {"ours": [], "torch": []}
    torch_peak, torch_info = None, None
    for _ in range(args.blocks):
        for _ in range(args.rounds):
            train_times["ours"].append(ours_train.run(args.train_steps))
        for _ in range(args.rounds):
            sample_times["ours"].append(ours_sample.run())
        if not args.skip_torch:
            worker = run_torch_worker(argv, args)
            train_times["torch"] += worker["train"]
            sample_times["torch"] += worker["sample"]
            torch_peak = max(torch_peak or 0.0, worker["peak"])
            torch_info = worker["info"]
    if torch_info is not None:
        print(f"# torch worker: {torch_info}", flush=True)
    step_flops = train_flops(config, batch, seq)
    generated = args.prompts * args.new_tokens
    call_flops = sampling_flops(config, args.prompts, args.prompt_len, args.new_tokens)
    peak = jax_matmul_peak(jax_dtype, args.matmul, repeats=5)

    results = {
        "train": {
            who: Result(who, best_of(ts), batch * seq, step_flops)
            for who, ts in train_times.items()
            if ts
        },
        "sample": {
            who: Result(who, best_of(ts), generated, call_flops)
            for who, ts in sample_times.items()
            if ts
        },
    }
    rows = []
    for kind, by_who in results.items():
        for who, r in by_who.items():
            ratio = "-"
            if "torch" in by_who and who == "ours":
                ratio = f"{by_who['torch'].seconds / r.seconds:.2f}x"
            unit = "ms/step" if kind == "train" else "ms/call"
            rows.append(
                (
                    kind,
                    who,
                    f"{r.seconds * 1e3:.1f} {unit}",
                    f"{r.tokens_per_s:,.0f}",
                    ratio,
                    f"{r.flops / r.seconds / 1e9:.1f}",
                    f"{100 * r.flops / r.seconds / peak:.1f}%",
                )
            )
    header = (
        "bench",
        "impl",
        "time (best round)",
        "tokens/s",
        "speed-up vs torch",
        "GFLOP/s",
        "MFU",
    )
    print()
    print(table(rows, header))
    print()
    print(
        f"train: batch {batch} x {seq}, {step_flops / 1e9:.2f} GFLOP/step; "
        f"sample: {args.prompts} prompts x {args.prompt_len} + {args.new_tokens} new tokens, "
        f"{call_flops / 1e9:.2f} GFLOP/call, tokens/s counts generated tokens only."
    )
    print(
        f"peak: jitted {args.matmul}^3 {args.dtype} matmul {peak / 1e9:.1f} GFLOP/s (JAX)"
        + ("" if torch_peak is None else f", {torch_peak / 1e9:.1f} GFLOP/s (torch)")
        + "; MFU is against the JAX peak for both."
    )
    for kind, times in (("train", train_times), ("sample", sample_times)):
        for who, ts in times.items():
            if ts:
                print(
                    f"{kind} {who} rounds (s): "
                    + ", ".join(f"{t:.4f}" for t in ts)
                    + f" (median {statistics.median(ts):.4f})"
                )
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
