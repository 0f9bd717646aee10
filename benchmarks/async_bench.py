"""Sync against async rollouts through the trainer, on the same 8 devices, in one run.

    python benchmarks/async_bench.py                # both cases, the table in docs/benchmarks.md
    python benchmarks/async_bench.py --steps 40 --cases b --timeline docs/async_timeline.png

8 fake CPU devices (`--xla_force_host_platform_device_count=8`): sync runs rollouts and
training in turns on all 8; async gives 4 to the rollout worker and 4 to the learner. The
run is the built-in default (arithmetic, the 2-layer model, 64 prompts x 8 samples,
staleness k = 4, M2PO) without its warm-up. Cases:

  a   the built-in task (its reward: a string comparison, microseconds)
  b   the same task, each completion's reward taking 20 ms of wall time (a stand-in for a
      verifier or a code sandbox: `time.sleep`, no CPU), scored by `rollout.reward_workers`
      threads in both modes (the same rewards, in the same order), for each count in
      `--reward_workers`: 512 completions take 10.2 s / workers to score, so the count
      sets how the host's scoring compares with the devices' work

Each (case, mode) is one `Trainer.run`; the train step is wrapped to time every update
(waited for, so its time is the update's). After `--warmup` steps (the compiles, and the
k + 1 batches an async worker makes ahead while the learner compiles), it
reports updates per second, samples (completions) per second, and the learner's idle
fraction: the share of the window its devices spent neither training nor publishing
weights. Prints a table with async's ratio to sync.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

from m2po_jax import config as config_lib  # noqa: E402
from m2po_jax import trainer as trainer_lib  # noqa: E402
from m2po_jax.configs import default  # noqa: E402
from m2po_jax.run import metrics as metrics_lib  # noqa: E402
from m2po_jax.run import plots  # noqa: E402

REWARD_S = 0.020


def config(mode: str, steps: int, reward_workers: int):
    c = default.get_config()
    c.total_steps = steps
    c.sft.max_steps = 0
    c.rollout.mode = mode
    c.rollout.reward_workers = reward_workers
    c.eval.every = 0
    c.eval.num_examples = c.eval.batch_size = 32
    c.checkpoint.every = 0
    c.logging.tensorboard = False
    c.logging.progress = False
    c.logging.plots = False
    return config_lib.from_configdict(c)


def measure(mode: str, case: str, steps: int, warmup: int, reward_workers: int, timeline):
    cfg = config(mode, steps, reward_workers)
    with tempfile.TemporaryDirectory() as workdir:
        trainer = trainer_lib.Trainer(cfg, workdir)
        if case == "b":
            scorer = trainer.setup.rewards  # what the sync step and the worker score with
            base = scorer.fn

            def slow_reward(completion, answer):
                time.sleep(REWARD_S)
                return base(completion, answer)

            scorer.fn = slow_reward
        real = trainer.train_step
        calls: list[tuple[float, float]] = []

        def timed(state, batch, rng, ref):
            t0 = time.perf_counter()
            out = jax.block_until_ready(real(state, batch, rng, ref))
            calls.append((t0, time.perf_counter()))
            return out

        trainer.train_step = timed
        trainer.run()
        records = metrics_lib.read_metrics(Path(workdir) / metrics_lib.METRICS_FILE)
    if timeline:  # the steady state: from the first timed update on
        t = trainer.async_rollouts.timeline
        window = (calls[warmup][0] - t.origin, calls[-1][1] - t.origin)
        plots.plot_timeline(t.spans(), timeline, window=window)
    window = calls[warmup:]
    # From the start of the first timed update to the start of the last: n - 1 steps.
    span = window[-1][0] - window[0][0]
    n = len(window) - 1
    busy = sum(e - s for s, e in window[:-1])
    busy += sum(r.get("time/publish_s", 0.0) for r in records[warmup : warmup + n])
    samples = cfg.rollout.batch_size * cfg.gconfig.n_samples
    return {
        "steps_per_s": n / span,
        "samples_per_s": n * samples / span,
        "learner_idle": 1.0 - busy / span,
        "publish_ms": 1e3 * sum(r.get("time/publish_s", 0.0) for r in records[warmup:]) / n,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--cases", default="ab")
    p.add_argument("--reward_workers", default="16,32,64", help="comma-separated counts")
    p.add_argument("--timeline", default="", help="PNG of case b's async run after warm-up")
    args = p.parse_args(argv)
    print(f"jax {jax.__version__}, {len(jax.devices())} devices, {os.cpu_count()} cores")
    header = (
        "| case | reward workers | mode | updates/s | samples/s | learner idle | publish ms/step |"
    )
    rows = [header, "|---|---|---|---|---|---|---|"]
    counts = [int(x) for x in args.reward_workers.split(",")]
    runs = [(case, w) for case in args.cases for w in (counts if case == "b" else [1])]
    for case, workers in runs:
        got = {}
        for mode in ("sync", "async"):
            plot = args.timeline if (case, workers, mode) == ("b", counts[-1], "async") else ""
            got[mode] = r = measure(mode, case, args.steps, args.warmup, workers, plot)
            rows.append(
                f"| {case} | {workers} | {mode} | {r['steps_per_s']:.2f} | "
                f"{r['samples_per_s']:.0f} | {r['learner_idle']:.2f} | {r['publish_ms']:.1f} |"
            )
            print(rows[-1], flush=True)
        ratio = got["async"]["samples_per_s"] / got["sync"]["samples_per_s"]
        rows.append(f"| {case} | {workers} | async / sync | | **{ratio:.2f}x** | | |")
        print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
