"""The trainer under faults: a damaged checkpoint, a full disk, a kill, a second trainer."""

import builtins
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from trainer_test import read, strip_times, tiny_config

from m2po_jax import trainer as trainer_lib
from m2po_jax.common.errors import WriterError
from m2po_jax.run import tensorboard

REPO = Path(__file__).resolve().parents[2]
DRILL = [sys.executable, str(REPO / "benchmarks" / "fault_drill.py"), "child"]
PRESET = ["--config=configs/arith.py:m2po,tiny", "--config.mesh.data=1"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight")
    trainer = trainer_lib.Trainer(tiny_config(), workdir)
    trainer.run()
    return workdir, jax.tree.map(np.asarray, trainer.state.params)


def test_damaged_latest_checkpoint_falls_back_and_matches_a_straight_run(
    straight, tmp_path, caplog
):
    straight_dir, straight_params = straight
    trainer_lib.Trainer(tiny_config(), tmp_path).run(stop_after=3)  # checkpoints 2 and 3
    state_files = [p for p in (tmp_path / "checkpoints" / "3" / "state").rglob("*") if p.is_file()]
    target = max(state_files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = os.urandom(64)
    target.write_bytes(bytes(data))

    resumed = trainer_lib.Trainer(tiny_config(), tmp_path)
    with caplog.at_level("WARNING"):
        result = resumed.run()
    assert "checkpoints/3 refused" in caplog.text and "falling back to step 2" in caplog.text
    assert result.final_step == 4
    assert strip_times(read(tmp_path)) == strip_times(read(straight_dir))
    leaves = zip(
        jax.tree.leaves(resumed.state.params), jax.tree.leaves(straight_params), strict=True
    )
    for a, b in leaves:
        np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("target", ["tensorboard", "metrics.jsonl"])
def test_a_full_disk_ends_the_run_with_the_checkpoint_intact(tmp_path, monkeypatch, target):
    full = {"on": False}
    real_open = builtins.open
    prefix = str(tmp_path / target)

    class FullDisk:
        """A file on a disk that fills up: writes and flushes fail with ENOSPC."""

        def __init__(self, f, path):
            self._f, self._path = f, path

        def __getattr__(self, name):
            return getattr(self._f, name)

        def write(self, data):
            if full["on"]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._path)
            return self._f.write(data)

        def flush(self):
            if full["on"]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._path)
            return self._f.flush()

    def fake_open(file, *args, **kwargs):
        f = real_open(file, *args, **kwargs)
        path = os.fspath(file) if isinstance(file, str | os.PathLike) else ""
        return FullDisk(f, path) if path.startswith(prefix) else f

    monkeypatch.setattr(builtins, "open", fake_open)
    cfg = tiny_config(**{"logging.tensorboard": True})
    trainer = trainer_lib.Trainer(cfg, tmp_path)
    real_step = trainer.train_step

    def fill_at_step_2(state, batch, rng, ref_params):
        full["on"] = full["on"] or int(state.step) == 2
        return real_step(state, batch, rng, ref_params)

    trainer.train_step = fill_at_step_2
    t0 = time.perf_counter()
    with pytest.raises(WriterError, match=rf"{target}.*: No space left on device \(ENOSPC\)"):
        trainer.run()
    assert time.perf_counter() - t0 < 300  # ends (a hang never would), even on a loaded machine
    monkeypatch.undo()
    assert trainer.checkpointer.all_steps() == [2]
    assert trainer.checkpointer.verify(2) is None


def _child(workdir, *extra, fault=""):
    return subprocess.run(
        [*DRILL, f"--fault={fault}", "--", *PRESET, f"--workdir={workdir}", *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_kill_loses_no_tensorboard_events(tmp_path):
    killed = _child(tmp_path, fault="kill:step:3")
    assert killed.returncode == -9
    # Step 2's row waits for its metrics, fetched after step 3's update is dispatched: the
    # kill as step 3's update starts comes first. The resumed run writes it again.
    assert [r["step"] for r in read(tmp_path)] == [0, 1]
    assert _child(tmp_path).returncode == 0
    rows = read(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    events = tensorboard.read_scalars(tmp_path / "tensorboard")
    assert events["reward/mean"] == {r["step"]: float(np.float32(r["reward/mean"])) for r in rows}


def test_sigterm_exits_143_after_its_checkpoint_and_the_same_command_resumes(tmp_path):
    stopped = _child(tmp_path, fault="signal:2:TERM")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-500:]
    assert "m2po-train: interrupted at step" in stopped.stdout
    resumed = _child(tmp_path)
    assert resumed.returncode == 0 and "m2po-train: finished at step" in resumed.stdout
    assert [r["step"] for r in read(tmp_path)] == [0, 1, 2, 3]
    # The accuracy line lists the evaluations from before the resume too (steps 0 and 1).
    evaluated = [r["step"] for r in read(tmp_path) if "eval/accuracy" in r]
    line = next(x for x in resumed.stdout.splitlines() if "held-out accuracy by step" in x)
    assert [int(part.split(":")[0]) for part in line.split("step: ")[1].split(", ")] == evaluated
    assert evaluated[0] == 0
    # What the mask did, over the steps before the resume too
    mask = next(x for x in resumed.stdout.splitlines() if "the M2PO mask (tau=" in x)
    assert mask.startswith("m2po-train: ") and " of 4 steps; mean m2 before -> after" in mask
    again = _child(tmp_path)
    assert again.returncode == 0, again.stderr[-500:]
    assert "finished at step 4 already; nothing to do" in again.stdout
    assert [r["step"] for r in read(tmp_path)] == [0, 1, 2, 3]


def test_a_second_trainer_is_refused_while_the_first_runs_on(tmp_path):
    cmd = [*DRILL, "--", *PRESET, f"--workdir={tmp_path}", "--config.total_steps=6"]
    first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lock = tmp_path / ".lock"
    while not (lock.exists() and lock.read_text().strip()) and first.poll() is None:
        time.sleep(0.2)
    second = _child(tmp_path, "--config.total_steps=6")
    assert first.poll() is None  # still running
    assert second.returncode == 2
    lines = second.stderr.strip().splitlines()
    assert lines[-1].startswith(f"m2po-train: workdir error: {tmp_path}: in use by another run")
    assert f"(pid {first.pid} on host " in lines[-1] and "Traceback" not in second.stderr
    first.communicate(timeout=300)
    assert first.returncode == 0
    assert [r["step"] for r in read(tmp_path)] == list(range(6))
