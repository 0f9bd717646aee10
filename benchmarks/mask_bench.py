"""Times the M2PO mask: method "sort", method "bisect", a bare jnp.sort, and AReaL's torch rule.

    python benchmarks/mask_bench.py [--sizes 4096,16384,65536,262144,1048576] [--reps 15]

Every JAX function is jitted and timed with block_until_ready after a warm-up; the
torch rule (boolean indexing, one descending sort, suffix means by flip-cumsum, as in
AReaL's actor) runs on the CPU under torch.no_grad, with the better of 1 thread and
torch's default ("thr"). Times are medians in ms; "agree" compares the masks.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from m2po_jax.algorithm.masking import m2po_mask

M2_THRESHOLD = 0.04


@torch.no_grad()
def torch_m2po_mask(old_logp, prox_logp, loss_mask, m2_threshold):
    """AReaL's _apply_m2po_masking, restated (docs/algorithm.md): the reference to beat."""
    m2 = (old_logp - prox_logp) ** 2
    mask_flat = loss_mask.reshape(-1)
    m2_selected = m2.reshape(-1)[mask_flat]
    n = m2_selected.numel()
    if n == 0:
        return loss_mask
    sorted_m2, indices = torch.sort(m2_selected, descending=True)
    suffix_mean = sorted_m2.flip(0).cumsum(0).flip(0) / torch.arange(
        n, 0, -1, dtype=sorted_m2.dtype
    )
    below = torch.where(suffix_mean < m2_threshold)[0]
    num_to_mask = int(below[0]) if len(below) > 0 else n - 1
    keep_sorted = torch.ones(n, dtype=torch.bool)
    keep_sorted[:num_to_mask] = False
    keep_selected = torch.empty_like(keep_sorted)
    keep_selected[indices] = keep_sorted
    out = torch.zeros_like(mask_flat)
    out[mask_flat] = keep_selected
    return out.view_as(loss_mask)


def _median_ms(fn, reps: int) -> float:
    fn()  # warm-up (compiles for jax)
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def _inputs(num_tokens: int, seed: int = 0):
    """[B, 1024] batch (or [T] when small): ~10% padding, heavy-tailed log-ratios, ~0.2% masked."""
    rng = np.random.default_rng(seed)
    shape = (num_tokens // 1024, 1024) if num_tokens >= 1024 else (num_tokens,)
    behav = rng.normal(-1.0, 0.5, shape).astype(np.float32)
    # Heavy-tailed staleness: most tokens barely moved, a few moved a lot.
    prox = behav + (0.13 * rng.standard_t(3, shape)).astype(np.float32)
    loss_mask = rng.random(shape) < 0.9
    return behav, prox, loss_mask


_SORT = jax.jit(lambda b, p, m, t: m2po_mask(b, p, m, t, method="sort"))
_BISECT = jax.jit(lambda b, p, m, t: m2po_mask(b, p, m, t, method="bisect"))
_BARE_SORT = jax.jit(lambda x: jnp.sort(x.reshape(-1)))


def time_one_size(num_tokens: int, reps: int) -> dict:
    behav, prox, loss_mask = _inputs(num_tokens)
    b, p, m = jnp.asarray(behav), jnp.asarray(prox), jnp.asarray(loss_mask)
    tau = jnp.float32(M2_THRESHOLD)
    m2 = jnp.square(b - p)
    tb, tp, tm = torch.from_numpy(behav), torch.from_numpy(prox), torch.from_numpy(loss_mask)
    mask_sort = np.asarray(_SORT(b, p, m, tau))
    mask_bisect = np.asarray(_BISECT(b, p, m, tau))
    mask_torch = torch_m2po_mask(tb, tp, tm, M2_THRESHOLD).numpy()
    row = {
        "tokens": num_tokens,
        "masked": int(loss_mask.sum() - mask_torch.sum()),
        "agree": bool((mask_sort == mask_torch).all() and (mask_bisect == mask_torch).all()),
        "sort": _median_ms(lambda: _SORT(b, p, m, tau).block_until_ready(), reps),
        "bisect": _median_ms(lambda: _BISECT(b, p, m, tau).block_until_ready(), reps),
        "jnp.sort": _median_ms(lambda: _BARE_SORT(m2).block_until_ready(), reps),
    }
    # Torch's intra-op threads spin when the CPU is shared, so it gets the better of
    # 1 thread and its default: the ratios printed are conservative.
    default_threads = torch.get_num_threads()
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        ms = _median_ms(lambda: torch_m2po_mask(tb, tp, tm, M2_THRESHOLD), reps)
        if ms < row.get("torch", np.inf):
            row["torch"], row["torch_threads"] = ms, threads
    torch.set_num_threads(default_threads)
    return row


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_setup() -> list[str]:
    """What the machine and libraries bring to the times: the CPU, the cores this process
    may use, the thread settings in the environment, torch's parallel backend and BLAS,
    and XLA's flags, so a reader can tell the machine's share of a ratio from the method's."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    env = {k: os.environ[k] for k in threads if k in os.environ}
    info = torch.__config__.parallel_info().splitlines()
    backend = next((x.split(":", 1)[1].strip() for x in info if "parallel backend" in x), "?")
    built = torch.__config__.show()
    blas = built.split("BLAS_INFO=", 1)[1].split(",", 1)[0] if "BLAS_INFO=" in built else "?"
    return [
        f"host: {_cpu_model()}, {cores} cores usable of {os.cpu_count()}; "
        f"thread env {env or 'unset'}",
        f"torch {torch.__version__}: {torch.get_num_threads()} intra-op threads, "
        f"{torch.get_num_interop_threads()} inter-op, parallel backend {backend}, BLAS {blas}",
        f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.device_count()} devices), "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,16384,65536,262144,1048576")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    for line in host_setup():
        print(line)
    print(
        "inputs: [tokens / 1024, 1024] float32 (a flat [tokens] below 1024), 10% padding, "
        "log-ratios 0.13 x Student-t(3)"
    )
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__} "
        f"(default {torch.get_num_threads()} threads), tau={M2_THRESHOLD}, median of {args.reps} reps, ms"
    )
    header = (
        f"{'tokens':>9} {'masked':>7} {'agree':>5} {'sort':>8} {'bisect':>8} {'jnp.sort':>9}"
        f" {'torch':>8} {'thr':>3} | {'torch/best':>10} {'sort/jnp.sort':>13} {'torch/sort':>10}"
        f" {'torch/bisect':>12}"
    )
    print(header)
    for num_tokens in sizes:
        r = time_one_size(num_tokens, args.reps)
        best = min(r["sort"], r["bisect"])
        print(
            f"{r['tokens']:>9} {r['masked']:>7} {str(r['agree']):>5} {r['sort']:>8.3f}"
            f" {r['bisect']:>8.3f} {r['jnp.sort']:>9.3f} {r['torch']:>8.3f} {r['torch_threads']:>3} |"
            f" {r['torch'] / best:>10.2f} {r['sort'] / r['jnp.sort']:>13.2f}"
            f" {r['torch'] / r['sort']:>10.2f} {r['torch'] / r['bisect']:>12.2f}"
        )


if __name__ == "__main__":
    main()
