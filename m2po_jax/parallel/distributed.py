"""Multi-host JAX: start `jax.distributed`, and build global batches from per-process rows.

Every process runs the same program. `initialize_distributed()` starts the cluster from
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (or lets a TPU pod, SLURM or
Open MPI job describe itself); each process then produces only the rows
`process_batch_slice(global_batch, mesh)` of a batch and `global_batch_from_local` makes the
global, batch-sharded arrays::

    initialize_distributed()
    mesh = sharding.make_mesh({"data": -1})
    rows = process_batch_slice(global_batch, mesh)
    batch = global_batch_from_local(host_batch_for(rows), mesh, global_batch)
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from m2po_jax.parallel import sharding


def _tpu_chips() -> int:
    """TPU chips on this host's PCI bus (as jax counts them), without starting a backend.

    libtpu alone says nothing: the tpu extra installs it on any host, a CPU one included,
    to compile for TPU slices (`m2po-train --compile_only --topology=...`)."""
    try:
        from jax._src import hardware_utils

        return int(hardware_utils.num_available_tpu_chips_and_device_id()[0])
    except Exception:  # a jax without it: look for the accelerator device files
        import glob

        return len(glob.glob("/dev/accel*")) + len(glob.glob("/dev/vfio/[0-9]*"))


def _platform_hint() -> str | None:
    """The platform jax will pick, guessed without starting a backend."""
    platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip().lower()
    if importlib.util.find_spec("libtpu") and _tpu_chips() > 0:
        return "tpu"
    if any(
        importlib.util.find_spec(m)
        for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")
    ):
        return "gpu"
    return "cpu"


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
) -> bool:
    """Start multi-host JAX once; call before anything touches a device.

    Arguments default to JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID. With none of them set, a TPU pod (or a SLURM / Open MPI job)
    lets jax detect the cluster itself, and anywhere else this is one process and
    nothing is started. On CPU the collectives run over gloo.

    Returns:
      True if jax.distributed is running (started now or earlier).
    """
    if jax.distributed.is_initialized():
        return True
    env = os.environ
    coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    platform = _platform_hint()
    configured = coordinator_address is not None or num_processes is not None
    auto_cluster = platform == "tpu" or "SLURM_JOB_ID" in env or "OMPI_COMM_WORLD_SIZE" in env
    if not configured and not auto_cluster:
        return False
    if configured and (coordinator_address is None or num_processes is None or process_id is None):
        raise ValueError(
            "initialize_distributed: coordinator_address, num_processes and process_id are all "
            f"needed, got {coordinator_address!r}, {num_processes!r}, {process_id!r} "
            "(arguments or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID)"
        )
    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
    )
    return True


def process_batch_slice(global_batch: int, mesh: Mesh | None = None) -> slice:
    """The rows of a global batch that this process feeds to `global_batch_from_local`.

    With a mesh, read from where `sharding.batch_sharding(mesh)` puts this process's devices;
    without one, process i takes block i of `process_count` equal blocks.
    """
    if global_batch < 1:
        raise ValueError(f"global_batch: must be positive, got {global_batch}")
    if mesh is None:
        count = jax.process_count()
        if global_batch % count:
            raise ValueError(
                f"global_batch {global_batch} is not divisible by the process count {count}"
            )
        per = global_batch // count
        return slice(jax.process_index() * per, (jax.process_index() + 1) * per)
    shards = sharding.batch_shards(mesh)
    if global_batch % shards:
        raise ValueError(
            f"global_batch {global_batch} is not divisible by the {shards} batch shards of the mesh"
        )
    rows = (
        sharding.batch_sharding(mesh, 1).addressable_devices_indices_map((global_batch,)).values()
    )
    starts = sorted({r[0].indices(global_batch)[:2] for r in rows})
    start, stop = starts[0][0], starts[-1][1]
    if sum(b - a for a, b in starts) != stop - start:
        raise ValueError(
            f"this process's rows {starts} are not contiguous in mesh {dict(mesh.shape)}"
        )
    return slice(start, stop)


def global_batch_from_local(local_tree: Any, mesh: Mesh, global_batch: int | None = None) -> Any:
    """Global batch-sharded arrays from each process's rows (`process_batch_slice`).

    Args:
      local_tree: pytree of host arrays [b_local, ...] (e.g. a `TrainBatch`).
      mesh: the device mesh; dim 0 goes over ("data", "fsdp").
      global_batch: rows over all processes (default: inferred by jax).
    """

    def one(local):
        local = np.asarray(local)
        if local.ndim == 0:
            return jax.make_array_from_process_local_data(sharding.replicated(mesh), local)
        shape = None if global_batch is None else (global_batch, *local.shape[1:])
        spec = sharding.batch_sharding(mesh, local.ndim)
        return jax.make_array_from_process_local_data(spec, local, shape)

    return jax.tree.map(one, local_tree)
