"""Device check: one short run that measures what a GPU session needs to know.

  bash benchmarks/device_check.sh                      # H200: Qwen2.5-0.5B shapes, bf16, < 8 min
  bash benchmarks/device_check.sh --arch qwen2.5-1.5b  # the 1.5B shapes instead
  python benchmarks/device_check.py --tiny --out tmp/x.json   # CPU smoke run (~1-2 min)

Each section runs in a worker process of its own (benchmarks/device_check_sections.py):
an out-of-memory error or a crashing kernel costs that section only, and each train
section's peak memory is its own. Sections run in priority order (the first attention path,
the sampler, the RL step, then the other attention paths) under a global budget
(`--budget-s`): once it is spent the remaining sections are reported as skipped. Each
result is printed as soon as it is measured, and the JSON report (`--out`) is rewritten
after every section, so a run cut short keeps what it measured.

What the numbers mean:
  train/<attention>  the real jitted RL train step (`train_step.make_train_step`, state
      donated and fed back) on random Qwen2.5 params: `--rows` rows of `--seq-len` tokens
      (left-padded prompts of up to `--prompt-len`, right-padded completions), behaviour
      log-probs = the model's own + noise, 0/1 rewards in groups of 8, actor settings of
      configs/gsm8k.py, micro-batches of at most `--max-tokens-per-mb` tokens, remat.
      step_s_median: seconds per step (after a warm-up step); compile_s: lower + compile.
      mfu = model FLOPs / step time / nominal peak. Model FLOPs per step = rows x seq x
      (8 N + 16 L H D seq): the trained forward + backward (6 N + 12 L H D T per token) and
      the proximal recompute forward (2 N + 4 L H D T), N = parameters used in matmuls,
      attention over the full T x T (PaLM appendix B); remat and the rematerialised output
      head are not counted, and flash kernels that skip the masked half do less work than
      counted. Nominal peak: NVIDIA's dense bf16 figure for the device (H200 SXM: 989.4
      TFLOP/s, half the data sheet's 1,979 "with sparsity"; H200 NVL 835), or
      `--peak-tflops`. mfu_vs_matmul: against an 8192^3 matmul in the compute dtype
      measured in the same process (1024^3 on a CPU, 512^3 with --tiny; the only peak
      there).
      memory (section 3): peak_bytes = `memory_stats()["peak_bytes_in_use"]` of the worker
      after the steps (None on CPU), plan_train_step_bytes = `memory.memory_plan(...)
      .train_step` for the same shapes, xla_step_bytes = XLA's argument + temp + output -
      alias of the compiled step.
  sampler  `sampling.generate`: `--sample-rows` prompts of `--sample-prompt-len` tokens,
      `--sample-new-tokens` new tokens, no stop token (every row decodes every step).
      tokens_per_s = rows x new tokens / seconds per call; ms_per_decode_step = seconds per
      call / new tokens (the prefill, one forward over the prompts, included).
  rl_step  `trainer.Trainer(configs/gsm8k.py:qwen2.5-0.5b).run()` for `--rl-steps` steps on
      a random checkpoint written to a temp dir (transformers when installed, else
      `hf.save_pretrained`) with GSM8K-format data: `--rl-prompts` prompts x 8 samples,
      `--rl-prompt-len` + `--rl-new-tokens` tokens, no staleness, 8 eval problems.
      step_s: rollout + train seconds of each step (metrics.jsonl; the first includes the
      compiles); time_to_first_step_s: from the checkpoint on disk to the end of step 0
      (trainer init, eval compile and run, rollout, train); the trainer's memory plan.
  async  the rl_step run sync, then async (`rollout.mode=async`, half the devices roll
      out, k = 2 in both), `--rl-steps` + 3 steps each: updates/s after two warm-up steps,
      async / sync, and the weight publication seconds per step. Skipped with one device.

Exit status 0 when every section measured, 1 otherwise (the report is written either way).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "device_check_sections.py"
RESULT_PREFIX = "DEVICE_CHECK_RESULT "  # = device_check_sections.RESULT_PREFIX (no jax here)
GiB = 2**30

# Defaults per mode: (GPU, --tiny).
DEFAULTS = {
    "arch": ("qwen2.5-0.5b", "qwen2.5-0.5b"),
    "dtype": ("bfloat16", "float32"),
    "attention": ("cudnn,xla,chunked,dot_product", "xla,dot_product,chunked"),
    "rows": (8, 8),
    "seq_len": (1024, 64),
    "prompt_len": (256, 16),
    "max_tokens_per_mb": (4096, 256),
    "steps": (5, 2),
    "sample_rows": (64, 8),
    "sample_prompt_len": (256, 16),
    "sample_new_tokens": (256, 16),
    "sample_repeats": (3, 2),
    "rl_prompts": (8, 2),
    "rl_prompt_len": (256, 96),
    "rl_new_tokens": (256, 16),
    "rl_steps": (2, 2),
    "rl_eval": (8, 2),
    "min_section_s": (30.0, 5.0),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes, float32, CPU attention")
    p.add_argument("--out", default="device_check.json", help="JSON report path")
    p.add_argument("--budget-s", type=float, default=420.0, help="global time budget")
    p.add_argument("--section-timeout-s", type=float, default=240.0, help="cap per section")
    p.add_argument("--sections", default="train,sampler,rl_step,async", help="which to run")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the MFU peak")
    p.add_argument("--remat-policy", default="nothing_saveable")
    p.add_argument("--sample-attention", default="auto")
    p.add_argument("--rl-attention", default="auto")
    p.add_argument("--checkpoint-writer", default="auto", choices=("auto", "transformers", "jax"))
    for name, (gpu, _) in DEFAULTS.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(gpu), default=None)
    args = p.parse_args(argv)
    for name, (gpu, tiny) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else gpu)
    return args


def plan_sections(args) -> list[tuple[str, str, str]]:
    """(name, worker section, worker arg) in priority order."""
    wanted = set(args.sections.split(","))
    paths = [a for a in args.attention.split(",") if a]
    train = [(f"train/{a}", "train", a) for a in paths] if "train" in wanted else []
    rest = [(n, n, "") for n in ("sampler", "rl_step", "async") if n in wanted]
    return train[:1] + rest + train[1:]


def run_worker(section: str, arg: str, settings: dict, timeout: float) -> dict:
    """One section in a fresh process; its result dict, or raises with the output's tail."""
    cmd = [sys.executable, str(WORKER), section, arg, json.dumps(settings)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        tail = _tail(_text(err.stdout) + "\n" + _text(err.stderr))
        raise TimeoutError(f"timed out after {timeout:.0f} s; output tail:\n{tail}") from None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    how = f"status {proc.returncode}"
    if proc.returncode < 0:
        how = f"signal {-proc.returncode}" + (
            " (out of host memory?)" if proc.returncode == -9 else ""
        )
    raise RuntimeError(
        f"worker ended with {how} and no result; output tail:\n" + _tail(proc.stdout + proc.stderr)
    )


def _text(output) -> str:
    """Captured output as str (a timeout hands it over as bytes, or None)."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.splitlines()[-lines:])


# ----------------------------------------------------------------------------- report


def _gib(x) -> str:
    if x is None:
        return "n/a"
    return f"{x / GiB:.2f} GiB" if x >= GiB else f"{x / 2**20:.1f} MiB"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def summarize(name: str, r: dict) -> list[str]:
    """The report lines of one measured section."""
    if name.startswith("train/"):
        m = r["memory"]
        return [
            f"  {r['params'] / 1e6:.4g}M params, {r['rows']} x {r['seq_len']} tokens, "
            f"{r['micro_batches']} micro-batches, attention {r['attention_resolved']}",
            f"  step {r['step_s_median'] * 1e3:.1f} ms (min {r['step_s_min'] * 1e3:.1f}), "
            f"setup {r['setup_s']:.1f} s, compile {r['compile_s']:.1f} s, "
            f"first step {r['first_step_s']:.2f} s",
            f"  {r['step_tflop']:.4g} TFLOP/step -> {r['tflops_achieved']:.4g} TFLOP/s, "
            f"MFU {_pct(r.get('mfu'))} of {r['device']['nominal_peak_tflops'] or 'n/a'} "
            f"TFLOP/s, {_pct(r['mfu_vs_matmul'])} of the measured matmul "
            f"({r['matmul_tflops_measured']:.4g} TFLOP/s), {r['tokens_per_s']:.0f} tokens/s",
            f"  loss {r['loss']:.4f}, nonfinite {r['nonfinite']}, "
            f"M2PO masked {_pct(r['m2po_masked_fraction'])}",
            f"  memory: peak {_gib(m['peak_bytes'])}, plan train_step "
            f"{_gib(m['plan_train_step_bytes'])}, XLA step {_gib(m['xla_step_bytes'])} "
            f"(temp {_gib(m['xla_temp_bytes'])}); plan/XLA {m['plan_over_xla']:.2f}, "
            f"plan/peak {m.get('plan_over_peak', float('nan')):.2f}",
        ]
    if name == "sampler":
        return [
            f"  {r['rows']} rows x ({r['prompt_len']} prompt + {r['new_tokens']} new) tokens, "
            f"attention {r['attention_resolved']}, "
            f"{r['decoded_steps']} decoded steps: {r['tokens_per_s']:.0f} tokens/s, "
            f"{r['ms_per_decode_step']:.2f} ms/step (first call {r['first_call_s']:.1f} s)",
        ]
    if name == "async":
        if "skipped" in r:
            return [f"  skipped: {r['skipped']}"]
        a, b = r["sync"], r["async"]
        return [
            f"  {r['devices']} devices (async: half roll out): sync {a['steps_per_s']:.2f} "
            f"steps/s, async {b['steps_per_s']:.2f} steps/s "
            f"({r['async_over_sync_steps_per_s']:.2f}x); publish s "
            + ", ".join(f"{x:.3f}" for x in b["publish_s"] if x is not None)
        ]
    return [
        f"  {r['rows']} rows x {r['seq_len']} tokens, checkpoint by {r['checkpoint_writer']} "
        f"in {r['checkpoint_write_s']:.1f} s, trainer init {r['trainer_init_s']:.1f} s",
        f"  time to first step {r['time_to_first_step_s']:.1f} s; step s "
        + ", ".join(f"{x:.2f}" for x in r["step_s"])
        + " (rollout "
        + ", ".join(f"{x:.2f}" for x in r["rollout_s"])
        + "; train "
        + ", ".join(f"{x:.2f}" for x in r["train_s"])
        + ")",
        "  tokens/s "
        + ", ".join(f"{x:.0f}" for x in r["tokens_per_s"])
        + f"; peak {_gib(r['peak_bytes'])} vs plan total {_gib(r['plan_total_bytes'])} "
        f"(train_step {_gib(r['plan_train_step_bytes'])})",
    ]


def _lines(name: str, result: dict) -> list[str]:
    """`summarize`, or the raw numbers if a value does not fit its format."""
    try:
        return summarize(name, result)
    except (KeyError, TypeError, ValueError) as err:
        return [f"  (report format failed: {err!r})", "  " + json.dumps(result, default=str)]


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)


def print_memory_table(report: dict) -> None:
    """Section 3 at a glance: every train path's peak next to the plan and XLA."""
    print("\n== memory vs plan (train step) ==", flush=True)
    for name, sec in report["sections"].items():
        if name.startswith("train/") and sec["status"] == "ok":
            m = sec["result"]["memory"]
            print(
                f"  {name:<20} peak {_gib(m['peak_bytes']):>11}  plan "
                f"{_gib(m['plan_train_step_bytes']):>11}  XLA {_gib(m['xla_step_bytes']):>11}",
                flush=True,
            )


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    start = time.perf_counter()
    deadline = start + args.budget_s
    settings = vars(args)
    report = {"settings": settings, "meta": {}, "sections": {}}
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")  # set by device_check.sh
    out = Path(args.out)
    failed = False
    for name, section, arg in plan_sections(args):
        left = deadline - time.perf_counter()
        print(f"\n== {name} ==", flush=True)
        if left < args.min_section_s:
            report["sections"][name] = {"status": "skipped", "reason": "time budget spent"}
            print(f"  skipped: {left:.0f} s of the budget left", flush=True)
            failed = True
            continue
        t0 = time.perf_counter()
        try:
            result = run_worker(section, arg, settings, min(left, args.section_timeout_s))
            entry = {"status": "ok", "seconds": time.perf_counter() - t0, "result": result}
            if not report["meta"]:
                report["meta"] = {**result.get("device", {}), "compilation_cache": cache}
            lines = _lines(name, result)
        except Exception as err:  # noqa: BLE001 - every failure is reported, then the next
            entry = {"status": "error", "seconds": time.perf_counter() - t0, "error": str(err)}
            lines = ["  ERROR " + str(err).replace("\n", "\n  ")]
            failed = True
        report["sections"][name] = entry
        report["total_s"] = time.perf_counter() - start
        write_report(out, report)
        print("\n".join(lines) + f"\n  ({entry['seconds']:.1f} s)", flush=True)
    print_memory_table(report)
    report["total_s"] = time.perf_counter() - start
    write_report(out, report)
    meta = report["meta"]
    print(
        f"\n{meta.get('device_kind', '?')} ({meta.get('backend', '?')}, jax "
        f"{meta.get('jax_version', '?')}): {report['total_s']:.0f} s, report in {out}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
