#!/usr/bin/env python3
"""Deviceless (ahead-of-time) compilation of a jitted JAX program for a named
NVIDIA GPU (H100 SXM 80GB or H200 141GB) on a machine with NO GPU.

Tested with jax==jaxlib==jax-cuda12-plugin==jax-cuda12-pjrt==0.10.2, Python 3.11,
CPU-only host (no libcuda, no GPU).

    python gpu_compile.py --gpu h100 --devices 8
    python gpu_compile.py --gpu h200 --devices 1

How it works: the CUDA PJRT plugin's PJRT_TopologyDescription_Create
(xla/pjrt/c/pjrt_c_api_gpu_internal.cc, PJRT_GpuDeviceTopology_Create) accepts
two options: `target_config` (a *text-format* stream_executor.GpuTargetConfigProto)
and `topology` ("<partitions>x<hosts-per-partition>x<devices-per-host>").
jax.experimental.topologies.get_topology_desc(platform="cuda", **kwargs)
forwards kwargs verbatim to it.
"""

import argparse
import os
import re

# Must be set before jax initialises the CUDA plugin: its CUDA version check
# calls cuInit(), which fails without a GPU/driver, and then the plugin (and its
# topology factory) are not registered -> "topology not implemented for cuda".
# Either of these two env vars avoids that check.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# GpuTargetConfigProto for H100 SXM 80GB, adapted from openxla/xla
# xla/backends/gpu/target_config/specs/h100_sxm.txtpb (Apache-2.0):
#  * `collective_memory_granularity` removed (field unknown to the proto in
#    jaxlib 0.10.2 -> "Failed to parse GpuTargetConfigProto")
#  * dnn_version_info set to 9.10.0 (upstream h100_sxm has 8.9.4; it did not
#    change the result in our tests).
from m2po_jax.parallel.gpu_targets import SPECS, target_config  # noqa: E402


def gpu_devices(
    gpu: str = "h100", num_devices: int = 8, num_hosts: int = 1, memory_bytes: int | None = None
):
    """Compile-only devices for `num_hosts` hosts x `num_devices` GPUs each."""
    topo = topologies.get_topology_desc(
        platform="cuda",
        target_config=target_config(gpu, memory_bytes),
        topology=f"1x{num_hosts}x{num_devices}",
    )
    return topo.devices


def summarize(name, compiled, hbm_bytes):
    ma = compiled.memory_analysis()
    total = (
        ma.argument_size_in_bytes
        + ma.output_size_in_bytes
        - ma.alias_size_in_bytes
        + ma.temp_size_in_bytes
    )
    txt = compiled.as_text()
    ccs = sorted(set(re.findall(r'custom_call_target="([^"]+)"', txt)))
    print(f"== {name}")
    print(
        f"   per-device: args {ma.argument_size_in_bytes / 2**20:.2f} MiB, "
        f"out {ma.output_size_in_bytes / 2**20:.2f} MiB, "
        f"alias {ma.alias_size_in_bytes / 2**20:.2f} MiB, "
        f"temp {ma.temp_size_in_bytes / 2**20:.2f} MiB, "
        f"total {total / 2**30:.3f} GiB of {hbm_bytes / 2**30:.1f} GiB HBM"
        f" -> {'fits' if total <= hbm_bytes else 'DOES NOT FIT'}"
    )
    print(f"   raw: {ma}")
    # Not implemented for the GPU plugin's compile-only executables in 0.10.2
    # (PJRT returns "UNIMPLEMENTED: GetCostAnalysis is not supported."; JAX
    # turns that into None).
    print(f"   cost_analysis: {compiled.cost_analysis()}")
    print(f"   custom calls: {ccs}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", choices=sorted(SPECS), default="h100")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument(
        "--memory-bytes",
        type=int,
        default=None,
        help="override device_memory_size in the target config",
    )
    args = ap.parse_args()

    devs = gpu_devices(args.gpu, 8 if args.devices > 1 else 1, memory_bytes=args.memory_bytes)
    hbm = args.memory_bytes or SPECS[args.gpu]["mem"]
    print(
        f"jax {jax.__version__}; host backend: {jax.default_backend()}; "
        f"target: {len(devs)} x {devs[0].device_kind}"
    )

    for n in sorted({1, args.devices}):
        mesh = Mesh(np.array(devs[:n]), ("x",))
        # 1) matmul, rows sharded over the mesh
        a = jax.ShapeDtypeStruct(
            (8192, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, P("x", None))
        )
        b = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
        c = jax.jit(lambda a, b: a @ b).lower(a, b).compile()
        summarize(f"matmul 8192^2 bf16, {n} device(s)", c, hbm)

        # 2) cuDNN flash attention (fwd, and fwd+bwd), heads sharded over the mesh
        spec = P(None, None, "x", None) if n > 1 else P()
        q = jax.ShapeDtypeStruct(
            (2, 1024, 8, 128), jnp.bfloat16, sharding=NamedSharding(mesh, spec)
        )
        attn = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation="cudnn", is_causal=True
        )
        c = jax.jit(attn).lower(q, q, q).compile()
        summarize(f"cudnn attention fwd [2,1024,8,128] bf16, {n} device(s)", c, hbm)
        loss = lambda q, k, v, attn=attn: attn(q, k, v).astype(jnp.float32).sum()
        c = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile()
        summarize(f"cudnn attention fwd+bwd, {n} device(s)", c, hbm)


if __name__ == "__main__":
    main()
