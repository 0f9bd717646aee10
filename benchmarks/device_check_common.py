"""What the device check's workers share (benchmarks/device_check_sections.py and
device_check_rl.py): the benchmarked architecture's config, random params, the device's
kind and nominal peak, its peak memory.
"""

from __future__ import annotations

import jax

from m2po_jax.models import architectures, hf_format
from m2po_jax.models import model_config as model_config_lib
from m2po_jax.parallel import placement as placement_lib

# Dense bf16 tensor-core peaks in TFLOP/s (NVIDIA data sheets list twice these "with
# sparsity"): H100/H200 SXM 989.4 (1,979 sparse), H200 NVL 835 (1,671 sparse), H100 PCIe 756
# (1,513 sparse), A100 312. Matched against `device_kind`, most specific first.
NOMINAL_BF16_TFLOPS = (
    ("H200 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200", 989.4),
    ("H100", 989.4),
    ("A100", 312.0),
)
# --tiny shrinks the architecture to this (config.json names); the vocabulary still holds
# the fixture tokenizer's ~1,050 words.
TINY_HF = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=2048,
)
MESH_1 = {"data": 1, "fsdp": 1, "tensor": 1}


def hf_config(s: dict) -> dict:
    """config.json of the benchmarked architecture (shrunk under --tiny)."""
    return architectures.hf_config(s["arch"], **(TINY_HF if s["tiny"] else {}))


def model_config(s: dict, attention: str) -> model_config_lib.ModelConfig:
    """`architectures.model_config(arch, dtype, "float32", remat=True, attention=...)`."""
    mc = hf_format.config_from_hf(hf_config(s), dtype=s["dtype"], param_dtype="float32")
    return mc.replace(remat=True, remat_policy=s["remat_policy"], attention=attention)


def random_params(mc: model_config_lib.ModelConfig):
    """Random params on device 0, initialised under one jit (eager flax init is slow)."""
    return placement_lib.Placement.from_shape(MESH_1, mc).init_params(jax.random.key(0))


def device_info(peak_override: float | None) -> dict:
    """Backend, device kind and the peak the MFU is taken against (None: unknown)."""
    device = jax.local_devices()[0]
    peak = peak_override
    source = "--peak-tflops" if peak_override else None
    if peak is None and device.platform == "gpu":
        for name, tflops in NOMINAL_BF16_TFLOPS:
            if name in device.device_kind:
                peak, source = tflops, f"NVIDIA data sheet, dense bf16 ({name})"
                break
    return {
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "jax_version": jax.__version__,
        "nominal_peak_tflops": peak,
        "peak_source": source,
    }


def peak_memory() -> dict:
    """Device 0's peak and limit from `memory_stats()` (None where unreported: CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return {"peak_bytes": stats.get("peak_bytes_in_use"), "limit_bytes": stats.get("bytes_limit")}
