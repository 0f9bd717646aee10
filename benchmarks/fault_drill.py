"""Fault drill: kills, signals, corruptions, a full disk and a second trainer on the tiny preset.

  python benchmarks/fault_drill.py            # every case, then the table (a few minutes)
  python benchmarks/fault_drill.py --cases=kill_step_3,corrupt_bytes

Each case runs `m2po-train` in child processes, injects its fault, reruns to the end, and
compares `metrics.jsonl` and the TensorBoard scalars with an uninterrupted run: a row that
is missing or differs is lost. The last line reads `N faults, 0 lost` when nothing was.

`child` mode (used by the cases and tests) runs `m2po-train` with a fault armed:
  python benchmarks/fault_drill.py child --fault=kill:step:3 -- --workdir=... [flags]
Faults: kill:step:N (SIGKILL as step N's update starts), kill:save:N:{orbax,manifest,rotate}
(SIGKILL inside the save of step N), signal:N:{TERM,INT,TERM2} (TERM2: twice),
warmup:N:TERM (SIGTERM in supervised warm-up step N), stall:N (the async rollout worker hangs
on batch N), full:N:{tensorboard,metrics,checkpoint}
(ENOSPC on those writes from step N on).

The `Np_*` cases run N processes of one run (`JAX_NUM_PROCESSES`, one CPU device each, gloo),
the fault in one or more of them, and compare rows and final params with an uninterrupted
N-process run:

  python benchmarks/fault_drill.py --cases=multi     # every multi-process case
"""

from __future__ import annotations

import argparse
import builtins
import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
PRESET = ["--config=configs/arith.py:m2po,tiny", "--config.mesh.data=1"]
CACHE = Path(tempfile.gettempdir()) / "m2po_fault_drill_jax_cache"


def _die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(fault: str, workdir: Path) -> None:
    """Patches the trainer in this process so that `fault` happens."""
    from m2po_jax import trainer as trainer_lib
    from m2po_jax.run import checkpoint as ckpt_lib

    kind, *args = fault.split(":")

    def at_step(n, action):
        """`action` runs as step n's update starts (its rollout done, its row not written)."""

        class Faulty(trainer_lib.Trainer):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                real_step = self.train_step

                def step_fn(state, batch, rng, ref_params):
                    if int(state.step) == n:
                        print(f"fault_drill: fault at {time.time()}", file=sys.stderr, flush=True)
                        action()
                    return real_step(state, batch, rng, ref_params)

                self.train_step = step_fn

        trainer_lib.Trainer = Faulty  # what `m2po-train` builds

    if kind == "kill" and args[0] == "step":
        at_step(int(args[1]), _die)
    elif kind == "kill":
        step, point = int(args[1]), args[2]
        save = ckpt_lib.Checkpointer.save

        def patched_save(self, s, **kwargs):
            if s == step and point == "orbax":
                # Dies while orbax's writer threads have the step's files half written.
                self._manager.wait_until_finished = lambda: (time.sleep(0.05), _die())
            elif s == step and point == "manifest":
                ckpt_lib.os.replace = _die
            elif s == step and point == "rotate":
                self._manager.delete = _die
            return save(self, s, **kwargs)

        ckpt_lib.Checkpointer.save = patched_save
    elif kind == "signal":
        sig = {"TERM": [signal.SIGTERM], "INT": [signal.SIGINT]}.get(args[1], [signal.SIGTERM] * 2)
        at_step(int(args[0]), lambda: [os.kill(os.getpid(), s) for s in sig])
    elif kind == "warmup":
        from m2po_jax.trainer import sft

        real_batch, calls = sft.sft_batch, []

        def batch(run, start, count):
            calls.append(start)
            if len(calls) == int(args[0]):
                print(f"fault_drill: fault at {time.time()}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), _SIGNALS[args[1]])
            return real_batch(run, start, count)

        sft.sft_batch = batch
    elif kind == "stall":  # the async rollout worker hangs making batch N
        from m2po_jax.trainer import async_rollouts

        real_generate = async_rollouts.AsyncRollouts.generate

        def generate(self, index, version, params):
            if index == int(args[0]):
                print(f"fault_drill: fault at {time.time()}", file=sys.stderr, flush=True)
                time.sleep(3600)
            return real_generate(self, index, version, params)

        async_rollouts.AsyncRollouts.generate = generate
    elif kind == "full":
        _arm_full_disk(int(args[0]), args[1], workdir, at_step)
    else:
        raise SystemExit(f"fault_drill: unknown fault {fault!r}")


def _arm_full_disk(step: int, target: str, workdir: Path, at_step) -> None:
    """From step `step`, writes to `target` fail with ENOSPC, as on a full disk."""
    from m2po_jax.run import checkpoint as ckpt_lib

    full = {"on": False}
    real_open = builtins.open
    prefix = str(workdir / ("tensorboard" if target == "tensorboard" else "metrics.jsonl"))

    def no_space(path):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    class File:
        def __init__(self, f, path):
            self._f, self._path = f, path

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

        def write(self, data):
            if full["on"]:
                raise no_space(self._path)
            return self._f.write(data)

        def flush(self):
            if full["on"]:
                raise no_space(self._path)
            return self._f.flush()

    def fake_open(file, *args, **kwargs):
        f = real_open(file, *args, **kwargs)
        path = os.path.abspath(os.fspath(file)) if isinstance(file, str | os.PathLike) else ""
        return File(f, path) if path.startswith(prefix) else f

    if target == "checkpoint":
        real_manifest = ckpt_lib.write_manifest

        def manifest(step_dir):
            if full["on"]:
                raise no_space(step_dir / ckpt_lib.MANIFEST)
            return real_manifest(step_dir)

        ckpt_lib.write_manifest = manifest
    else:
        builtins.open = fake_open
    at_step(step, lambda: full.update(on=True))


def child(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="fault_drill.py child")
    parser.add_argument("--fault", default="")
    args, rest = parser.parse_known_args(argv)
    rest = [a for a in rest if a != "--"]
    workdir = next(Path(a.split("=", 1)[1]) for a in rest if a.startswith("--workdir="))
    if args.fault:
        _arm(args.fault, workdir.absolute())
    from m2po_jax.cli import train as main

    sys.argv = ["m2po-train", *rest]
    main.run()


# ---- the drill ---------------------------------------------------------------------------


def _train(workdir: Path, *extra: str, fault: str = "", wait: bool = True):
    cmd = [sys.executable, __file__, "child", f"--fault={fault}", "--"]
    cmd += [*PRESET, f"--workdir={workdir}", *extra]
    # Children share a compilation cache: the runs differ in their faults, not their programs.
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(CACHE))
    env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    if not wait:
        return proc
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def _rows(workdir: Path) -> dict[int, dict]:
    from m2po_jax.run import metrics as metrics_lib

    path = workdir / "metrics.jsonl"
    if not path.exists():
        return {}
    return {
        r["step"]: {k: v for k, v in r.items() if not k.startswith("time/")}
        for r in metrics_lib.read_metrics(path)
    }


def _lost(workdir: Path, reference: Path) -> int:
    """Reference rows missing or different in metrics.jsonl or in the TensorBoard scalars."""
    from m2po_jax.run import tensorboard

    want, got = _rows(reference), _rows(workdir)
    events = tensorboard.read_scalars(workdir / "tensorboard")
    lost = 0
    for step, row in want.items():
        tb_ok = events.get("reward/mean", {}).get(step) == _f32(row["reward/mean"])
        lost += got.get(step) != row or not tb_ok
    return lost + len(set(got) - set(want))


def _f32(x):
    import numpy as np

    return float(np.float32(x))


def _corrupt(workdir: Path, how: str) -> None:
    step_dir = max((workdir / "checkpoints").iterdir(), key=lambda p: int(p.name))
    if how == "metadata":
        (step_dir / "meta" / "metadata").write_bytes(os.urandom(64))
        return
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    if how == "bit":
        data[len(data) // 2] ^= 1
    else:
        data[len(data) // 2 : len(data) // 2 + 64] = os.urandom(64)
    target.write_bytes(bytes(data))


_SIGNALS = {"TERM": signal.SIGTERM, "INT": signal.SIGINT}


def _fault_time(err: str) -> float:
    marks = [x for x in err.splitlines() if x.startswith("fault_drill: fault at ")]
    return float(marks[0].rsplit(" ", 1)[1]) if marks else float("nan")


def _one_line_error(rc: int, err: str, needle: str) -> bool:
    lines = [x for x in err.splitlines() if x.startswith("m2po-train:")]
    return rc == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err


def _case(name: str, workdir: Path, reference: Path) -> str:
    """Runs case `name`; returns its outcome (the rows lost are counted after)."""
    kill = name.startswith("kill")
    faults = {
        "kill_step_1": "kill:step:1",
        "kill_step_3": "kill:step:3",
        "kill_in_orbax_write": "kill:save:2:orbax",
        "kill_before_manifest": "kill:save:2:manifest",
        "kill_in_final_rotation": "kill:save:4:rotate",
        "kill_in_final_write": "kill:save:4:orbax",
        "sigterm": "signal:2:TERM",
        "sigint": "signal:1:INT",
        "double_sigterm": "signal:3:TERM2",
        "full_disk_tensorboard": "full:3:tensorboard",
        "full_disk_metrics": "full:2:metrics",
        "full_disk_checkpoint": "full:3:checkpoint",
    }
    extra = ("--config.checkpoint.keep=1",) if "final" in name else ()
    if name in faults:
        rc, out, err = _train(workdir, *extra, fault=faults[name])
        took = time.time() - _fault_time(err)
        if kill and rc != -signal.SIGKILL:
            return f"FAILED: exit {rc}, expected a SIGKILL"
        if name.startswith("full"):
            if not _one_line_error(rc, err, "No space left on device"):
                return f"FAILED: exit {rc}: {err.strip()[-300:]}"
            outcome = f"one-line error {took:.1f}s after the fault, exit 2; resumed"
        elif name == "double_sigterm":
            if rc != 128 + signal.SIGTERM or "signal 15 again: exiting now" not in err:
                return f"FAILED: exit {rc}, expected exit 143 at the second SIGTERM"
            outcome = "second SIGTERM ended it at once (exit 143, one line); resumed"
        elif kill:
            outcome = "resumed"
        elif rc != 128 + _SIGNALS[faults[name].split(":")[-1]] or "interrupted at step" not in out:
            return f"FAILED: exit {rc}, expected a clean stop: {err.strip()[-300:]}"
        else:
            outcome = "stopped with a checkpoint; resumed"
    elif name.startswith("corrupt"):
        rc, _, err = _train(workdir)
        _corrupt(workdir, name.split("_")[1])
        rc, _, err = _train(workdir)
        if rc != 0 or "falling back to step 2" not in err:
            return f"FAILED: exit {rc}, no fallback message: {err.strip()[-300:]}"
        return "refused, fell back to step 2"
    elif name == "second_trainer":
        first = _train(workdir, "--config.total_steps=6", wait=False)
        lock = workdir / ".lock"
        while not (lock.exists() and lock.read_text().strip()) and first.poll() is None:
            time.sleep(0.2)
        rc, _, err = _train(workdir, "--config.total_steps=6")
        refused = _one_line_error(rc, err, f"in use by another run (pid {first.pid} on")
        running = first.poll() is None
        first.communicate(timeout=300)
        if not refused or first.returncode != 0:
            return f"FAILED: second exit {rc}, first exit {first.returncode}: {err[-300:]}"
        return "refused in one line" + ("" if running else " (first had finished)")
    else:
        raise SystemExit(f"fault_drill: unknown case {name!r}")
    rc, _, err = _train(workdir, *extra)
    return outcome if rc == 0 else f"FAILED: rerun exit {rc}: {err.strip()[-300:]}"


CASES = [
    "kill_step_1",
    "kill_step_3",
    "kill_in_orbax_write",
    "kill_before_manifest",
    "kill_in_final_write",
    "kill_in_final_rotation",
    "sigterm",
    "sigint",
    "double_sigterm",
    "corrupt_bytes",
    "corrupt_bit",
    "corrupt_metadata",
    "full_disk_tensorboard",
    "full_disk_metrics",
    "full_disk_checkpoint",
    "second_trainer",
]


# ---- several processes -------------------------------------------------------------------

MULTI = [
    "--config=configs/arith.py:m2po,tiny",
    "--config.rollout.batch_size=8",
    "--config.task.format_reward=0.5",
    "--config.logging.tensorboard=False",
    # Steps of a fraction of a second: a stop is agreed about a second after its signal
    # (the runtime's notifier polls once a second), so the run is long enough to see it.
    "--config.total_steps=10",
]
HEARTBEAT_S = 10
# Async: each process rolls out on 2 of its 4 CPU devices and trains on the other 2.
ASYNC = ("--config.rollout.mode=async", "--config.rollout.worker_timeout_s=20")
MULTI_CASES = {
    # name: (processes, {process: fault}[, extra flags, devices per process]); async runs
    # are timing-dependent (which batch is how stale), so they are compared by prompts
    # (none lost or repeated), not by rows and params.
    "2p_sigterm_p0": (2, {0: "signal:2:TERM"}),
    "2p_sigterm_p1": (2, {1: "signal:2:TERM"}),
    "2p_sigint_p1": (2, {1: "signal:1:INT"}),
    "2p_sigterm_both_apart": (2, {0: "signal:1:TERM", 1: "signal:3:TERM"}),
    "2p_sigterm_warmup_p1": (2, {1: "warmup:2:TERM"}),
    "2p_double_sigterm_p1": (2, {1: "signal:2:TERM2"}),
    "2p_sigkill_p1": (2, {1: "kill:step:2"}),
    "2p_sigkill_p0": (2, {0: "kill:step:2"}),
    "4p_sigterm_p0": (4, {0: "signal:2:TERM"}),
    "4p_sigterm_p1": (4, {1: "signal:2:TERM"}),
    "4p_sigterm_p2": (4, {2: "signal:2:TERM"}),
    "4p_sigterm_p3": (4, {3: "signal:2:TERM"}),
    "4p_sigterm_all_apart": (4, {0: "signal:1:TERM", 1: "signal:2:TERM", 2: "signal:3:TERM"}),
    "4p_sigkill_p2": (4, {2: "kill:step:2"}),
    "2p_async_sigterm_p1": (2, {1: "signal:3:TERM"}, ASYNC, 4),
    "2p_async_stalled_worker_p1": (2, {1: "stall:4"}, ASYNC, 4),
}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_processes(
    workdir: Path,
    n: int,
    faults: dict[int, str] | None = None,
    *extra: str,
    xla_flags: str = "",
    heartbeat_s: int = HEARTBEAT_S,
    devices: int = 1,
):
    """One run as `n` processes (`devices` CPU devices each); returns [(exit code, stdout, stderr,
    seconds from the first fault to this process's end)] by process."""
    faults = faults or {}
    port = _free_port()
    procs = []
    for pid in range(n):
        cmd = [sys.executable, __file__, "child", f"--fault={faults.get(pid, '')}", "--"]
        cmd += [*MULTI, f"--workdir={workdir}", *extra]
        env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES=str(n),
            JAX_PROCESS_ID=str(pid),
            M2PO_HEARTBEAT_TIMEOUT_S=str(heartbeat_s),
            XLA_FLAGS=f"{xla_flags} --xla_force_host_platform_device_count={devices}".strip(),
            JAX_COMPILATION_CACHE_DIR=str(CACHE),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        )
        procs.append(
            subprocess.Popen(
                cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
        )
    ended = {}
    deadline = time.time() + 600
    while len(ended) < n and time.time() < deadline:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.time()
        time.sleep(0.1)
    results = []
    for i, p in enumerate(procs):
        if p.poll() is None:  # a hang: what this drill exists to catch
            p.kill()
            ended[i] = float("inf")
        out, err = p.communicate()
        results.append([p.returncode, out, err, ended[i]])
    times = [t for t in (_fault_time(r[2]) for r in results) if t == t]
    first_fault = min(times, default=float("nan"))
    for r in results:
        r[3] = r[3] - first_fault
    return [tuple(r) for r in results]


def final_params(workdir: Path):
    """The newest checkpoint's step and params, as numpy arrays (leaves in tree order)."""
    import jax
    import orbax.checkpoint as ocp

    directory = workdir / "checkpoints"
    step = max(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.metadata(directory / str(step) / "state").item_metadata
        target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), tree)
        state = checkpointer.restore(directory / str(step) / "state", target)
    return step, [np.asarray(x) for x in jax.tree.leaves(state["params"])]


def _interrupted_step(out: str) -> int | None:
    for line in out.splitlines():
        if line.startswith("m2po-train: interrupted at step "):
            return int(line.split("at step ")[1].split(";")[0])
    return None


def _spec(name: str):
    n, faults, *rest = MULTI_CASES[name]
    extra = tuple(rest[0]) if rest else ()
    devices = rest[1] if len(rest) > 1 else 1
    return n, faults, extra, devices


def _multi_case(name: str, workdir: Path) -> tuple[str, float]:
    """Runs multi-process case `name`; returns its outcome and the seconds from the fault to
    the last process's end."""
    n, faults, extra, devices = _spec(name)
    results = train_processes(workdir, n, faults, *extra, devices=devices)
    took = max(r[3] for r in results)
    codes = [r[0] for r in results]
    if any(t == float("inf") for _, _, _, t in results):
        return f"FAILED: a process hung (exits {codes})", took
    killed = [p for p, f in faults.items() if f.startswith(("kill", "stall"))]
    double = [p for p, f in faults.items() if f.endswith("TERM2")]
    if killed or double:
        dead = killed or double
        stalled = any(faults[p].startswith("stall") for p in dead)
        want_dead = (
            2 if stalled else -signal.SIGKILL if killed else 128 + signal.SIGTERM
        )  # a stalled worker: the one-line worker error
        others = [p for p in range(n) if p not in dead]
        bad = [p for p in dead if codes[p] != want_dead]
        # Others: our line and exit 75, or (the coordinator gone) the runtime's abort.
        ends = {}
        for p in others:
            err = results[p][2]
            if codes[p] == 75 and f"m2po-train: lost process {dead[0]} of {n}" in err:
                ends[p] = "lost-peer line, exit 75"
            elif codes[p] == -signal.SIGABRT and "Terminating process because the JAX" in err:
                ends[p] = "runtime abort (exit 134)"
            else:
                bad.append(p)
        if bad:
            tails = "; ".join(f"p{p} exit {codes[p]}: {results[p][2].strip()[-300:]}" for p in bad)
            return f"FAILED: {tails}", took
        kinds = sorted(set(ends.values()))
        what = (
            "worker stalled (one-line error, exit 2)"
            if stalled
            else "SIGKILL"
            if killed
            else "second SIGTERM (exit 143, one line)"
        )
        outcome = f"p{dead[0]} {what}; others: {', '.join(kinds)}"
    else:
        signum = signal.SIGINT if any(f.endswith("INT") for f in faults.values()) else 15
        steps = {_interrupted_step(r[1]) for r in results}
        if set(codes) != {128 + signum} or len(steps) != 1 or None in steps:
            tails = "; ".join(
                f"p{i} exit {r[0]}: {r[2].strip()[-200:]}" for i, r in enumerate(results)
            )
            return f"FAILED: {tails}", took
        outcome = f"all {n} stopped after step {steps.pop()}, exit {128 + signum}"
    rerun = train_processes(workdir, n, None, *extra, devices=devices)
    if any(r[0] != 0 for r in rerun):
        return f"FAILED: rerun exits {[r[0] for r in rerun]}: {rerun[0][2][-300:]}", took
    return outcome + "; resumed", took


def _prompts_once(workdir: Path) -> bool:
    """An async run's rows: every step once, and each batch's prompts the next ones."""
    rows = _rows(workdir)
    return sorted(rows) == list(range(len(rows))) and all(
        r["data/first_prompt"] == r["data/prompts"] * s for s, r in rows.items()
    )


def multi_drill(cases: list[str], root: Path) -> list[tuple[str, str, int, float]]:
    rows = []
    references = {}
    for name in cases:
        n, _, extra, devices = _spec(name)
        is_async = "--config.rollout.mode=async" in extra
        if not is_async and n not in references:
            references[n] = root / f"reference_{n}p"
            codes = [r[0] for r in train_processes(references[n], n)]
            if codes != [0] * n:
                raise SystemExit(f"fault_drill: the {n}-process reference run failed: {codes}")
        workdir = root / name
        outcome, took = _multi_case(name, workdir)
        if "FAILED" in outcome:
            lost = 0
        elif is_async:
            lost = 0 if _prompts_once(workdir) else 1
            outcome += "; every prompt once" if not lost else "; PROMPTS LOST OR REPEATED"
        else:
            lost = _lost_rows(workdir, references[n])
            ref_step, ref_params = final_params(references[n])
            step, params = final_params(workdir)
            same = step == ref_step and all(
                np.array_equal(a, b) for a, b in zip(params, ref_params, strict=True)
            )
            outcome += "; params equal" if same else "; PARAMS DIFFER"
            lost += 0 if same else 1
        rows.append((name, outcome, lost, took))
        print(f"  {name}: {outcome}; {lost} rows lost; ended {took:.1f}s after the fault")
    return rows


def _lost_rows(workdir: Path, reference: Path) -> int:
    want, got = _rows(reference), _rows(workdir)
    return sum(got.get(s) != r for s, r in want.items()) + len(set(got) - set(want))


def drill(cases: list[str]) -> int:
    root = Path(tempfile.mkdtemp(prefix="fault_drill_"))
    multi = [c for c in cases if c in MULTI_CASES]
    cases = [c for c in cases if c not in MULTI_CASES]
    reference = root / "reference"
    rows = []
    if cases:
        rc, _, err = _train(reference)
        if rc != 0:
            raise SystemExit(f"fault_drill: the reference run failed: {err[-2000:]}")
    reference6 = root / "reference6"
    if "second_trainer" in cases:
        _train(reference6, "--config.total_steps=6")
    for name in cases:
        workdir = root / name
        t0 = time.perf_counter()
        outcome = _case(name, workdir, reference)
        lost = _lost(workdir, reference6 if name == "second_trainer" else reference)
        rows.append((name, outcome, lost, time.perf_counter() - t0))
        print(f"  {name}: {outcome}; {lost} rows lost ({rows[-1][3]:.0f}s)", flush=True)
    multi_rows = multi_drill(multi, root) if multi else []
    print()
    print("| case | outcome | rows lost |")
    print("|---|---|---|")
    for name, outcome, lost, _ in rows:
        print(f"| {name} | {outcome} | {lost} |")
    if multi_rows:
        print()
        print(f"| case ({HEARTBEAT_S} s heartbeat) | outcome | last process ended | rows lost |")
        print("|---|---|---|---|")
        for name, outcome, lost, took in multi_rows:
            print(f"| {name} | {outcome} | {took:.1f} s after the fault | {lost} |")
    rows += multi_rows
    total = sum(r[2] for r in rows) + sum("FAILED" in r[1] for r in rows)
    print(f"\n{len(rows)} faults, {total} lost")
    shutil.rmtree(root, ignore_errors=True)
    return 1 if total else 0


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES + list(MULTI_CASES)))
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    if cases == ["multi"]:
        cases = list(MULTI_CASES)
    sys.exit(drill(cases))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
