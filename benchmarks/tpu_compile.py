"""The real-size presets compiled for their TPU slices on this CPU (libtpu, deviceless).

    python benchmarks/tpu_compile.py            # the TPU table of docs/scale.md: every preset
    python benchmarks/tpu_compile.py qwen3-8b   # one of them
    python benchmarks/tpu_compile.py math:qwen3-4b-base math:qwen3-1.7b-base   # configs/math.py

Each row runs the user's own command, `m2po-train --config=gsm8k:<preset>
--architecture=<preset> --compile_only --topology=<slice> [mesh overrides]`, in its own
process, and reads its report: per-program compile time and memory per chip, whether the
run fits, and the roofline. GPU presets are compiled on the TPU of their memory class
(v5p: 95 GB per chip against an 80 GB GPU). Needs the tpu extra (libtpu). The 8B presets
take about ten minutes each on two cores.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

RUNS = {
    # preset: (slice, extra flags, why); "config:preset" for a config besides gsm8k's
    "qwen3-8b": ("v5e:4x4", [], "the preset's own hardware, a v5e-16"),
    "math:qwen3-4b-base": ("v5e:4x4", [], "the paper's setup on its hardware, a v5e-16"),
    "math:qwen3-1.7b-base": ("v5e:2x4", [], "the paper's setup on its hardware, a v5e-8"),
    "math:qwen3-30b-a3b-base": (
        "v5p:2x2x2",
        [],
        "Qwen3-30B-A3B, fsdp=4 x tensor=2, every expert on every chip, a v5p-8",
    ),
    "qwen2.5-7b": (
        "v5p:2x2x2",
        ["--config.mesh.fsdp=4", "--config.mesh.tensor=2"],
        "8 x 80 GB GPUs -> 8 v5p chips (95 GB), fsdp=4 x tensor=2",
    ),
    "qwen2.5-0.5b": (
        "v5p:2x2x1",
        ["--config.mesh.fsdp=4"],
        "an 80 GB GPU -> 4 v5p chips (95 GB), fsdp=4",
    ),
}


def command(preset: str) -> list[str]:
    topology, extra, _ = RUNS[preset]
    config, _, name = preset.rpartition(":")
    return [
        "m2po-train",
        f"--config={config or 'gsm8k'}:{name}",
        f"--architecture={name.removesuffix('-base')}",
        "--compile_only",
        f"--topology={topology}",
        *extra,
    ]


def run(preset: str) -> dict:
    start = time.perf_counter()
    done = subprocess.run(command(preset), capture_output=True, text=True)
    wall = time.perf_counter() - start
    out = done.stdout + done.stderr
    peak = re.search(r"peak per device: ([\d.]+) GiB in (\w+)", out)
    verdict = re.search(r"^(fits|DOES NOT FIT): ([\d.]+) of ([\d.]+) GiB", out, re.M)
    train = re.search(
        r"train_step\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)", out
    )
    roof = re.search(r"at least (\d+) ms \((\w+)-bound\), MFU at best (\d+)%", out)
    decode = re.search(r"\(([\d.]+)x\) -> at least ([\d.]+) ms", out)
    error = re.search(r"m2po-train: memory error: (.*)", out)
    return dict(
        preset=preset,
        rc=done.returncode,
        wall_s=wall,
        peak=peak.groups() if peak else None,
        verdict=verdict.groups() if verdict else None,
        train=train.groups() if train else None,
        roofline=roof.groups() if roof else None,
        decode=decode.groups() if decode else None,
        error=error.group(1) if error else None,
        output=out,
    )


def main(presets: list[str]) -> None:
    rows = []
    for preset in presets:
        r = run(preset)
        print("\n".join(line for line in r["output"].splitlines() if not _libtpu_noise(line)))
        rows.append(r)
    print("\n| preset | slice | train step: compile s, GiB per chip | peak per chip | fits | "
          "train step bound, MFU at best | decode step: bytes / (weights + KV) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        topology = RUNS[r["preset"]][0]
        train = f"{float(r['train'][0]):.0f} s, {float(r['train'][4]):.2f}" if r["train"] else "-"
        peak = f"{float(r['peak'][0]):.2f} GiB ({r['peak'][1]})" if r["peak"] else "-"
        fits = r["verdict"][0] if r["verdict"] else f"no (exit {r['rc']})"
        roof = f"{r['roofline'][0]} ms, {r['roofline'][2]}%" if r["roofline"] else "-"
        dec = f"{r['decode'][0]}x, {r['decode'][1]} ms" if r["decode"] else "-"
        print(f"| `{r['preset']}` | {topology} | {train} | {peak} | {fits} | {roof} | {dec} |")
    sys.exit(max(r["rc"] for r in rows))


def _libtpu_noise(line: str) -> bool:
    """libtpu's warnings about a host without TPUs (TPU_ACCELERATOR_TYPE, hostnames)."""
    return bool(re.match(r"(WARNING|[IWE]0000|=== Source|learning/|Failed to find host)", line))


if __name__ == "__main__":
    main(sys.argv[1:] or list(RUNS))
