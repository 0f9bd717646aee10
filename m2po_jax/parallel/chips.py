"""Accelerator chips: memory, peak bfloat16 compute and memory bandwidth, with their sources.

The compile-only dry run (`m2po_jax.trainer.compile_only`) checks a run's memory per chip
against `hbm_bytes` and turns XLA's cost analysis into a roofline with `peak_flops` and
`hbm_bandwidth`. Figures are the vendors' published per-chip numbers (dense bfloat16,
no sparsity); HBM sizes are what the devices report (GiB), never the marketing figure: the
dry run passes a program whose peak is under `hbm_bytes`.

    chip = chips.for_topology("v5e:4x4")   # or chips.for_device_kind("TPU v5 lite")
    chip.hbm_bytes, chip.peak_flops, chip.hbm_bandwidth
"""

from __future__ import annotations

import dataclasses

_GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip's published figures."""

    name: str  # the topology prefix jax takes ("v5e") or a GPU's name ("h100")
    device_kind: str  # what `device.device_kind` reports
    hbm_gib: float
    peak_tflops: float  # dense bfloat16
    hbm_gbps: float  # HBM bandwidth, GB/s (10^9 bytes)
    source: str

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_gib * _GIB)

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def hbm_bandwidth(self) -> float:
        return self.hbm_gbps * 1e9


CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip("v4", "TPU v4", 32, 275, 1200, "https://cloud.google.com/tpu/docs/v4"),
        Chip("v5e", "TPU v5 lite", 16, 197, 819, "https://cloud.google.com/tpu/docs/v5e"),
        Chip("v5p", "TPU v5", 95, 459, 2765, "https://cloud.google.com/tpu/docs/v5p"),
        Chip("v6e", "TPU v6 lite", 32, 918, 1640, "https://cloud.google.com/tpu/docs/v6e"),
        Chip(
            "h100",
            "NVIDIA H100 80GB HBM3",
            79.1,  # what the device reports: 84,942,979,072 bytes
            989,
            3350,
            "https://www.nvidia.com/en-us/data-center/h100/ (SXM)",
        ),
        Chip(
            "h200",
            "NVIDIA H200 141GB HBM3e",
            139.8,  # what the device reports: 143,156 MiB (the "141 GB" is 10^9 bytes, less
            # the driver's reservation); 141 GiB would pass a program that does not fit
            989,
            4800,
            "https://www.nvidia.com/en-us/data-center/h200/",
        ),
    )
}


def for_topology(topology: str) -> Chip:
    """The chip of a topology name as jax takes it ("v5e:4x4" -> v5e)."""
    name = topology.split(":", 1)[0].lower()
    if name not in CHIPS:
        raise ValueError(
            f"topology {topology!r}: unknown chip {name!r}; expected one of {', '.join(CHIPS)}"
        )
    return CHIPS[name]


def for_device_kind(device_kind: str) -> Chip | None:
    """The chip whose `device_kind` is `device_kind`, or None (a CPU, an unlisted chip)."""
    for chip in CHIPS.values():
        if chip.device_kind.lower() == device_kind.lower():
            return chip
    return None
