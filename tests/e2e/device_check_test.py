"""benchmarks/device_check.py --tiny: every section measures (no errors) and the JSON report
holds finite positive numbers (the GPU-only ones, MFU against a nominal peak and the
device's peak memory, are absent or None on a CPU)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TRAIN_KEYS = (
    "compile_s",
    "step_s_median",
    "step_tflop",
    "tflops_achieved",
    "matmul_tflops_measured",
    "mfu_vs_matmul",
    "tokens_per_s",
)
MEMORY_KEYS = ("plan_train_step_bytes", "xla_step_bytes", "plan_over_xla")
SAMPLER_KEYS = ("call_s_median", "tokens_per_s", "ms_per_decode_step")
RL_KEYS = ("time_to_first_step_s", "last_step_s", "plan_total_bytes", "plan_train_step_bytes")


def _positive(section: str, values: dict, keys) -> None:
    for key in keys:
        value = values[key]
        assert isinstance(value, int | float), (section, key, value)
        assert math.isfinite(value) and value > 0, (section, key, value)


def test_tiny_run_measures_every_section(tmp_path):
    out = tmp_path / "x.json"
    env = dict(os.environ, XLA_FLAGS=os.environ["M2PO_TEST_XLA_FLAGS"])  # one CPU device
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        # One of the tiny preset's three attention paths: the train sections share their
        # code, and the attention paths have their own tests (suite time). The RL sections'
        # random checkpoint is written by m2po_jax, not by transformers in a child process
        # that imports torch (5 s CPU): under "auto" a failing transformers write falls back
        # to m2po_jax silently, so this test never checked it, and loading transformers'
        # checkpoints has its own tests (tests/models/hf_test.py).
        [
            sys.executable,
            str(ROOT / "benchmarks" / "device_check.py"),
            "--tiny",
            "--attention",
            "xla",
            "--checkpoint-writer",
            "jax",
            "--out",
            str(out),
        ],  # fmt: skip
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert list(sections) == ["train/xla", "sampler", "rl_step", "async"]
    for name, entry in sections.items():
        assert entry["status"] == "ok", (name, entry.get("error"))
        assert f"== {name} ==" in proc.stdout
    for name in ("train/xla",):
        result = sections[name]["result"]
        assert result["attention_resolved"] == name.split("/")[1]
        _positive(name, result, TRAIN_KEYS)
        _positive(name, result["memory"], MEMORY_KEYS)
        assert result["nonfinite"] == 0 and math.isfinite(result["loss"])
        assert 0 < result["m2po_masked_fraction"] < 1
    _positive("sampler", sections["sampler"]["result"], SAMPLER_KEYS)
    rl = sections["rl_step"]["result"]
    assert rl["checkpoint_writer"].startswith("m2po_jax.models.hf.save_pretrained"), rl
    _positive("rl_step", rl, RL_KEYS)
    assert rl["steps"] == 2
    for key in ("step_s", "rollout_s", "train_s", "tokens_per_s"):
        _positive("rl_step", dict(enumerate(rl[key])), range(2))
    # One CPU device: the async section says why it cannot split the devices.
    assert "this host has 1" in sections["async"]["result"]["skipped"]
    assert report["meta"]["backend"] == "cpu" and report["total_s"] > 0
