"""The chip table the dry run judges fit and speed by: each figure against its published
value, the memory as the device reports it (never the marketing gigabytes: a table over
the real capacity passes a program that does not fit), the device kinds libtpu reports,
and the GPU compiler's target description agreeing with the table."""

import importlib.util

import pytest

from m2po_jax.parallel import chips, gpu_targets

_GIB = 2**30
_MIB = 2**20

# chip: (HBM bytes at most, at least; dense bf16 TFLOP/s; HBM GB/s), from the vendors' pages
# (cloud.google.com/tpu/docs/<chip>, nvidia.com/en-us/data-center/<chip>) and, for the GPUs,
# the total memory the device reports (cudaMemGetInfo / torch's total_memory).
PUBLISHED = {
    "v4": (32 * _GIB, 32 * _GIB, 275, 1200),
    "v5e": (16 * _GIB, 16 * _GIB, 197, 819),
    "v5p": (95 * _GIB, 95 * _GIB, 459, 2765),
    "v6e": (32 * _GIB, 32 * _GIB, 918, 1640),
    "h100": (84_942_979_072, 79 * _GIB, 989, 3350),  # an H100 SXM reports 81,008 MiB
    "h200": (143_156 * _MIB, 139 * _GIB, 989, 4800),  # an H200 reports 143,156 MiB
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_chip_has_its_published_figures(name):
    most, least, tflops, gbps = PUBLISHED[name]
    chip = chips.CHIPS[name]
    assert least <= chip.hbm_bytes <= most, (name, chip.hbm_bytes / _GIB)
    assert chip.peak_flops == tflops * 1e12
    assert chip.hbm_bandwidth == gbps * 1e9
    assert chip.source.startswith("https://")


def test_the_table_has_no_other_chip():
    assert set(chips.CHIPS) == set(PUBLISHED)


def test_a_gpu_target_has_the_memory_of_the_table():
    """The GPU compiler's device description and the fit check read one capacity."""
    for gpu in gpu_targets.GPUS:
        mem = gpu_targets.SPECS[gpu]["mem"]
        assert abs(mem - chips.CHIPS[gpu].hbm_bytes) < 0.01 * mem, gpu
        assert f"{mem}B RAM" in gpu_targets.target_config(gpu)
        assert gpu_targets.SPECS[gpu]["name"] == chips.CHIPS[gpu].device_kind


@pytest.mark.parametrize(
    "topology, kind",
    [("v4:2x2x1", "v4"), ("v5e:4x4", "v5e"), ("v5p:2x2x2", "v5p"), ("v6e:2x4", "v6e")],
)
def test_topology_names_find_their_chip(topology, kind):
    assert chips.for_topology(topology) is chips.CHIPS[kind]
    assert chips.for_topology(topology.upper()) is chips.CHIPS[kind]


def test_device_kinds_find_their_chip_and_others_none():
    for chip in chips.CHIPS.values():
        assert chips.for_device_kind(chip.device_kind) is chip
        assert chips.for_device_kind(chip.device_kind.upper()) is chip
    assert chips.for_device_kind("cpu") is None
    with pytest.raises(ValueError, match="unknown chip 'v9'; expected one of v4, v5e"):
        chips.for_topology("v9:2x2")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="the tpu extra")
@pytest.mark.parametrize("topology", ["v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
def test_the_device_kind_is_what_libtpu_reports(topology):
    """The table's device_kind of each TPU is what the TPU compiler's devices say (a run
    on a real chip finds its row through it)."""
    from m2po_jax.trainer import compile_only

    devices = compile_only.target(topology).devices
    assert chips.for_device_kind(devices[0].device_kind) is chips.for_topology(topology)
