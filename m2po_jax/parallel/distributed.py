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

import atexit
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
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


# A process that another one lost exits with this (EX_TEMPFAIL: run the command again).
LOST_PEER_EXIT = 75
HEARTBEAT_ENV = "M2PO_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_S = 100  # jax's default


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    heartbeat_timeout_s: int | None = None,
) -> bool:
    """Start multi-host JAX once; call before anything touches a device.

    Arguments default to JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID. With none of them set, a TPU pod (or a SLURM / Open MPI job)
    lets jax detect the cluster itself, and anywhere else this is one process and
    nothing is started. On CPU the collectives run over gloo.

    A process that dies (a kill, out of memory, its host gone) is noticed by the others
    after `heartbeat_timeout_s` (default M2PO_HEARTBEAT_TIMEOUT_S, else 100 s): each says
    which process is gone in one line and exits with `LOST_PEER_EXIT` (75), instead of
    waiting in a collective (`watch_peers`).

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
    if heartbeat_timeout_s is None:
        heartbeat_timeout_s = _heartbeat_from_env()
    # A lost process is not fatal to the others in the runtime (which would abort them with
    # SIGABRT): `watch_peers` notices it and ends them with a line of ours.
    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
    )
    global _heartbeat_s
    _heartbeat_s = heartbeat_timeout_s
    watch_peers(heartbeat_timeout_s)
    return True


_heartbeat_s = DEFAULT_HEARTBEAT_S


def heartbeat_timeout_s() -> int:
    """The heartbeat timeout the runtime was started with (how soon a lost peer shows)."""
    return _heartbeat_s


def _heartbeat_from_env() -> int:
    raw = os.environ.get(HEARTBEAT_ENV, "")
    if not raw:
        return DEFAULT_HEARTBEAT_S
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{HEARTBEAT_ENV}={raw!r}: expected a whole number of seconds >= 1")
    return value


# ---- lost peers ---------------------------------------------------------------------------

_LEAVING_KEY = "m2po/leaving/"
_lost_peer_note: Callable[[], str] | None = None
_lost = threading.Event()
_exiting = threading.Event()


def set_lost_peer_note(note: Callable[[], str] | None) -> None:
    """`note()` ends the line printed when a peer is lost (say, where the last checkpoint is)."""
    global _lost_peer_note
    _lost_peer_note = note


def leaving() -> None:
    """Marks this process's end as intended (the run finished or stopped), so that the
    others do not report it as lost once it disconnects. Call once the last collective is
    done."""
    client = _state().client
    if client is not None and jax.process_count() > 1:
        try:
            client.key_value_set(f"{_LEAVING_KEY}{_state().process_id}", "1")
        except Exception:  # noqa: BLE001 (already marked)
            pass


def wait_if_peer_lost(timeout_s: float) -> None:
    """After a failed collective: waits up to `timeout_s` for the peer watch to find a lost
    process (it then exits this one with its line); returns if none is found."""
    if _state().client is not None:
        _lost.wait(timeout_s)


def _state():
    from jax._src import distributed

    return distributed.global_state


def watch_peers(heartbeat_timeout_s: int, interval_s: float = 1.0) -> None:
    """Starts the thread that ends this process, in one line, when another one is gone.

    The runtime's heartbeats say which processes live; a process that disconnected after
    `leaving()` is not lost. Process 0 (which serves the runtime) waits for the others
    before it exits, lost peer or not, so that they end with their own line too."""
    state = _state()
    count, me = state.num_processes, state.process_id
    if state.client is None or count < 2:
        return
    ids = list(range(count))

    def gone(missing: list[int], why: str) -> None:
        if _exiting.is_set():
            return  # this process is ending anyway (its own error or its finish)
        note = _lost_peer_note() if _lost_peer_note is not None else ""
        names = ", ".join(str(i) for i in missing)
        print(
            f"m2po-train: lost process {names} of {count} ({why}); process {me} stops too "
            f"(exit {LOST_PEER_EXIT}){'; ' + note if note else ''}; run the same command on "
            "every host to resume",
            file=sys.stderr,
            flush=True,
        )
        _lost.set()
        if me == 0:
            _wait_for_others(ids, 10.0)
        os._exit(LOST_PEER_EXIT)

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if _exiting.is_set():
                return
            try:
                live = state.client.get_live_nodes(ids)
            except Exception:  # noqa: BLE001 (the runtime's server, process 0, is gone)
                gone([0], "the coordinator stopped answering")
                return
            missing = [i for i in ids if i not in live and not _left(state.client, i)]
            if missing:
                gone(
                    missing,
                    f"no heartbeat for {heartbeat_timeout_s} s: an error, a kill, out of "
                    "memory or its host gone; see its log",
                )
                return

    threading.Thread(target=watch, name="m2po-peer-watch", daemon=True).start()

    def at_exit() -> None:
        _exiting.set()
        if me == 0:
            # The runtime's server stays up until the others have disconnected.
            _wait_for_others(ids, 60.0)

    # Registered after jax's own shutdown hook, so it runs first.
    atexit.register(at_exit)


def _left(client, process: int) -> bool:
    try:
        client.key_value_try_get(f"{_LEAVING_KEY}{process}")
        return True
    except Exception:  # noqa: BLE001 (not marked)
        return False


def _wait_for_others(ids: list[int], timeout_s: float) -> None:
    client = _state().client
    deadline = time.monotonic() + timeout_s
    while client is not None and time.monotonic() < deadline:
        try:
            if set(client.get_live_nodes(ids)) <= {0}:
                return
        except Exception:  # noqa: BLE001
            return
        time.sleep(0.1)


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
