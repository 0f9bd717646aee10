"""Compile-only NVIDIA GPU devices: XLA's GPU target configs for a deviceless compile.

jax 0.10.2's CUDA plugin builds devices for a GPU that is not there when given a text-format
`stream_executor.GpuTargetConfigProto` (what XLA's `gpu_specs/*.txtpb` hold) and a topology
"<partitions>x<hosts>x<gpus per host>":

    topologies.get_topology_desc(platform="cuda", target_config=target_config("h100"),
                                 topology="1x1x8")

The plugin's start-up check calls cuInit, which fails without a GPU and leaves the plugin
unregistered ("topology not implemented for cuda"): `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`
must be set before jax initialises its backends (`m2po-train --compile_only` does). It
needs the CUDA plugin (`pip install "jax[cuda12-local]==<jax>" nvidia-cudnn-cu12`: cuDNN
for the attention kernel). The compiled programs report their memory; the plugin has no
cost analysis, and it does not refuse a program over the GPU's memory (the dry run does).
"""

from __future__ import annotations

# H100 SXM 80GB, from openxla/xla xla/backends/gpu/target_config/specs/h100_sxm.txtpb
# (Apache-2.0), without `collective_memory_granularity` (a field newer than the proto in
# jaxlib 0.10.2: "Failed to parse GpuTargetConfigProto") and with cuDNN 9.10.
_H100_SXM = """gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
    feature_extension: ACCELERATED_FEATURES
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  scalar_unit_description {
    rate_infos { key: 4  value { clock_rate_ghz: 1.98 units_per_core: 64 ops_per_clock: 1 } }
    rate_infos { key: 8  value { clock_rate_ghz: 1.98 units_per_core: 64 ops_per_clock: 1 } }
    rate_infos { key: 10 value { clock_rate_ghz: 1.98 units_per_core: 128 ops_per_clock: 2 } }
    rate_infos { key: 11 value { clock_rate_ghz: 1.98 units_per_core: 128 ops_per_clock: 1 } }
    rate_infos { key: 12 value { clock_rate_ghz: 1.98 units_per_core: 64 ops_per_clock: 1 } }
    rate_infos { key: 16 value { clock_rate_ghz: 1.98 units_per_core: 128 ops_per_clock: 2 } }
  }
  matrix_unit_description {
    rate_infos { key: 2  value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 6  value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 10 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 512 } }
    rate_infos { key: 11 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 256 } }
    rate_infos { key: 12 value { clock_rate_ghz: 1.98 units_per_core: 4 ops_per_clock: 32 } }
    rate_infos { key: 16 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 512 } }
    rate_infos { key: 19 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 20 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 23 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 24 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 25 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 28 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 29 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 33 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 35 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 36 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
  }
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0a"
  model_str: "sm_9.0a with 84942979072B RAM, 132 cores, 1980000KHz clock, 2619000KHz mem clock, 52428800B L2$"
  device_address_bits: 64
  pcie_bandwidth: 34359738368
  ecc_enabled: true
  name: "NVIDIA H100 80GB HBM3"
  driver_version: "13.0.0"
  runtime_version: "12.8.0"
  compile_time_toolkit_version: "12.8.0"
  dnn_version: "9.10.0"
  cub_version: "3.1.2"
  device_interconnect_info {
    active_links: 18
  }
}
platform_name: "CUDA"
dnn_version_info {
  major: 9
  minor: 10
  patch: 0
}
device_description_str: "NVIDIA H100 80GB HBM3"
"""

# H200: identical SM90 part; differs in HBM size/bandwidth (upstream h200.txtpb), the
# memory as the device reports it (143,156 MiB; chips.CHIPS["h200"]).
SPECS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", mem=84942979072, bw=3352320000000, memclk=2619000),
    "h200": dict(
        name="NVIDIA H200 141GB HBM3e", mem=143156 * 2**20, bw=4800000000000, memclk=3750000
    ),
}


def target_config(gpu: str, memory_bytes: int | None = None) -> str:
    s = SPECS[gpu]
    mem = memory_bytes or s["mem"]
    cfg = _H100_SXM
    cfg = cfg.replace("NVIDIA H100 80GB HBM3", s["name"])
    cfg = cfg.replace("84942979072", str(mem))
    cfg = cfg.replace("memory_bandwidth: 3352320000000", f"memory_bandwidth: {s['bw']}")
    cfg = cfg.replace("2619000KHz", f"{s['memclk']}KHz")
    return cfg


GPUS = tuple(SPECS)


def cuda_plugin_installed() -> bool:
    """Whether jax's CUDA plugin (the GPU compiler) is installed."""
    import importlib.util

    return any(
        importlib.util.find_spec(name) is not None
        for name in ("jax_cuda12_plugin", "jax_cuda13_plugin")
    )


def devices(gpu: str, per_host: int, hosts: int = 1):
    """Compile-only devices of `hosts` hosts with `per_host` GPUs `gpu` ("h100", "h200")."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="cuda", target_config=target_config(gpu), topology=f"1x{hosts}x{per_host}"
    )
    return topo.devices
