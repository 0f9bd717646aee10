"""Multi-host helpers: one process starts nothing; two processes build one global batch (and
agree on a stop without the runtime's preemption notifier)."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import types

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from m2po_jax.parallel import distributed, sharding


def mesh_of(shape):
    return sharding.make_mesh(shape)


def test_libtpu_on_a_host_without_tpus_is_one_process(monkeypatch):
    """The tpu extra (libtpu, for compile-only runs) on a CPU host: no TPU pod to join,
    so `m2po-train` runs as one process instead of waiting for a coordinator."""
    import importlib.util

    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    fake_jax = types.SimpleNamespace(
        config=types.SimpleNamespace(jax_platforms=""), distributed=jax.distributed
    )
    monkeypatch.setattr(distributed, "jax", fake_jax)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "libtpu" else real(name, *a),
    )
    monkeypatch.setattr(distributed, "_tpu_chips", lambda: 0)
    assert distributed._platform_hint() == "cpu"
    assert distributed.initialize_distributed() is False
    monkeypatch.setattr(distributed, "_tpu_chips", lambda: 4)
    assert distributed._platform_hint() == "tpu"


def test_initialize_distributed_single_process(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    assert distributed.initialize_distributed() is False
    with pytest.raises(ValueError, match="process_id"):
        distributed.initialize_distributed("localhost:1234", num_processes=2)
    assert distributed.process_batch_slice(8) == slice(0, 8)
    assert distributed.process_batch_slice(
        8, mesh_of({"data": 2, "fsdp": 2, "tensor": 2})
    ) == slice(0, 8)
    with pytest.raises(ValueError, match="not divisible by the 4 batch shards"):
        distributed.process_batch_slice(6, mesh_of({"data": 2, "fsdp": 2, "tensor": 2}))
    local = {"x": np.arange(16).reshape(8, 2), "n": np.int32(3)}
    arr = distributed.global_batch_from_local(
        local, mesh_of({"data": 2, "fsdp": 2, "tensor": 2}), global_batch=8
    )
    assert arr["x"].sharding.spec == P(("data", "fsdp"), None)
    np.testing.assert_array_equal(np.asarray(arr["x"]), local["x"])


_WORKER = textwrap.dedent(
    """
    import json, os, signal, sys
    import numpy as np
    import jax
    from jax.experimental import multihost_utils
    from m2po_jax import distributed, sharding
    from m2po_jax.trainer import stopping
    pid, port = int(sys.argv[1]), sys.argv[2]
    # No preemption service, so no notifier: the stop is agreed on by a collective per step.
    jax.config.update("jax_enable_preemption_service", False)
    assert distributed.initialize_distributed(f"localhost:{port}", 2, pid)
    assert distributed.initialize_distributed()  # idempotent
    mesh = sharding.make_mesh({"data": 2, "fsdp": -1})
    rows = distributed.process_batch_slice(8, mesh)
    full = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    batch = distributed.global_batch_from_local({"x": full[rows]}, mesh, global_batch=8)
    total = jax.jit(lambda b: b["x"].sum(), out_shardings=sharding.replicated(mesh))(batch)
    try:
        multihost_utils.reached_preemption_sync_point(0)
        notifier = True
    except RuntimeError:  # "Preemption sync manager has not been initialized"
        notifier = False
    stop, stop_at = stopping.RunStop(), None
    with stop.signals():
        for step in range(6):
            if pid == 1 and step == 2:
                os.kill(os.getpid(), signal.SIGINT)  # process 1 only
            if stop.agreed():
                stop_at = step
                break
    print(json.dumps({"pid": pid, "rows": [rows.start, rows.stop],
                      "shape": list(batch["x"].shape), "total": float(total),
                      "devices": jax.device_count(), "notifier": notifier,
                      "stop_at": stop_at, "stop_signal": stop.signal}))
    distributed.leaving()
    """
)


def test_two_process_global_batch_and_a_stop_without_the_preemption_notifier(tmp_path):
    """Two CPU processes (2 devices each) build one global batch over gloo. Then, with no
    preemption service (so no runtime notifier to tell the other process), a SIGINT to
    process 1 alone stops both at the step it arrived before (`RunStop.agreed`'s
    collective), and both exit with process 1's signal. A process that checked only its
    own request would stop process 1 alone (in a run, process 0 would go on into
    collectives its peer never joins). The stop's whole-run test, on the notifier's path
    and with the resume, is in tests/parallel/parallel_test.py; this one shares the two
    processes above (about a CPU-second more)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": os.environ["M2PO_TEST_XLA_FLAGS"]
        + " --xla_force_host_platform_device_count=2",
    }
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(var, None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(pid), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("two-process run timed out")
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    total = float(np.arange(24).sum())
    assert [r["rows"] for r in results] == [[0, 4], [4, 8]]
    for r in results:
        assert r["devices"] == 4 and r["shape"] == [8, 3] and r["total"] == total
    assert [(r["notifier"], r["stop_at"], r["stop_signal"]) for r in results] == [
        (False, 2, signal.SIGINT)
    ] * 2


@pytest.mark.parametrize("raw", ["abc", "0", "-5"])
def test_a_bad_heartbeat_timeout_is_refused_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(distributed.HEARTBEAT_ENV, raw)
    with pytest.raises(ValueError, match=rf"M2PO_HEARTBEAT_TIMEOUT_S={raw!r}: expected"):
        distributed._heartbeat_from_env()
    monkeypatch.setenv(distributed.HEARTBEAT_ENV, "7")
    assert distributed._heartbeat_from_env() == 7


def test_the_peer_watch_ends_a_process_for_a_lost_peer_and_never_for_one_that_left(
    monkeypatch, capsys
):
    """Against a fake runtime of 3 processes (this one is 1): process 2 disconnected after
    marking its end (`leaving`): not lost. Then process 0 stops beating without that mark:
    this process says so in one line and exits 75."""
    import threading
    import time

    class Client:
        def __init__(self):
            self.live, self.kv = [0, 1], {"m2po/leaving/2": "1"}

        def get_live_nodes(self, ids):
            return [i for i in ids if i in self.live]

        def key_value_try_get(self, key):
            return self.kv[key]  # KeyError: not set, as the runtime's raises

    client = Client()
    state = types.SimpleNamespace(client=client, num_processes=3, process_id=1)
    exits, exited = [], threading.Event()
    monkeypatch.setattr(distributed, "_state", lambda: state)
    monkeypatch.setattr(distributed, "_exiting", threading.Event())
    monkeypatch.setattr(distributed, "_lost", threading.Event())
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)
    monkeypatch.setattr(distributed.os, "_exit", lambda code: exits.append(code) or exited.set())
    try:
        distributed.watch_peers(5, interval_s=0.02)
        time.sleep(0.3)
        assert exits == []  # process 2 left: not lost
        client.live = [1]
        assert exited.wait(5) and exits == [75]
        err = capsys.readouterr().err
        assert err.startswith("m2po-train: lost process 0 of 3 (no heartbeat for 5 s")
        assert err.count("\n") == 1 and "(exit 75)" in err
    finally:
        distributed._exiting.set()  # the watch thread ends at its next look
        for t in threading.enumerate():
            if t.name == "m2po-peer-watch":
                t.join(1)
