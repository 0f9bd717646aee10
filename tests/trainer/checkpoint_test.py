"""Verified checkpoints: checksums, fallback, rotation, a kill at every point of a save."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax.common.errors import CheckpointError, WorkdirError, WriterError
from m2po_jax.run import checkpoint as ckpt_lib
from m2po_jax.run import workdir as workdir_lib


def _state(value):
    return {"w": jnp.full((64, 64), value, jnp.float32), "step": jnp.int32(value)}


def _save(ckpt, step):
    ckpt.save(
        step,
        state=_state(step),
        rng=jax.random.key(step),
        queue=[],
        meta={"data_position": step, "sft_steps": 0},
    )


def _restored_step(ckpt, step):
    return int(ckpt.restore(step, state_like=_state(0))["state"]["step"])


def _largest_array_file(step_dir):
    files = [p for p in (Path(step_dir) / "state").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def _damage(path, offset=None, flip_bit=False):
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    if flip_bit:
        data[offset] ^= 0x01
    else:
        data[offset : offset + 64] = os.urandom(64)
    path.write_bytes(bytes(data))


@pytest.fixture
def two_steps(tmp_path):
    ckpt = ckpt_lib.Checkpointer(tmp_path, keep=2)
    _save(ckpt, 2)
    _save(ckpt, 4)
    return ckpt


def test_saves_are_hashed_and_verify(two_steps):
    assert two_steps.all_steps() == [2, 4]
    for step in (2, 4):
        assert (two_steps.step_dir(step) / ckpt_lib.MANIFEST).is_file()
        assert two_steps.verify(step) is None
    assert _restored_step(two_steps, 4) == 4


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda d: _damage(_largest_array_file(d)), "checksum mismatch"),
        (lambda d: _damage(_largest_array_file(d), flip_bit=True), "checksum mismatch"),
        (lambda d: _damage(d / "meta" / "metadata", offset=0), "meta/metadata"),
        (lambda d: __import__("shutil").rmtree(d / "state"), "state/"),
        (lambda d: (d / ckpt_lib.MANIFEST).unlink(), "missing (the save did not finish)"),
        (lambda d: (d / ckpt_lib.MANIFEST).write_bytes(b"\xff\xfe garbage"), "unreadable"),
    ],
    ids=["64_random_bytes", "one_bit", "metadata", "no_state", "no_manifest", "bad_manifest"],
)
def test_damaged_latest_falls_back_to_the_previous_step(two_steps, damage, problem):
    damage(two_steps.step_dir(4))
    assert problem in two_steps.verify(4)
    messages = []
    step = two_steps.choose(warn=messages.append)
    assert step == 2 and _restored_step(two_steps, 2) == 2
    assert len(messages) == 1
    assert "checkpoints/4 refused" in messages[0] and "falling back to step 2" in messages[0]
    # The damaged step is moved aside (kept, not deleted), so step 4 can be written again.
    assert two_steps.all_steps() == [2]
    aside = list((two_steps.workdir / ckpt_lib.ASIDE_DIR).iterdir())
    kind = "incomplete" if "did not finish" in problem else "damaged"
    assert [p.name.split("-")[:2] for p in aside] == [["4", kind]]
    _save(two_steps, 4)
    assert two_steps.verify(4) is None


def test_no_verified_checkpoint_stops_with_every_problem_named(two_steps):
    _damage(_largest_array_file(two_steps.step_dir(4)))
    (two_steps.step_dir(2) / ckpt_lib.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint verifies \(step 4: .*; step 2: "):
        two_steps.choose(warn=lambda m: None)


def test_an_unfinished_first_save_starts_the_run_again(tmp_path):
    ckpt = ckpt_lib.Checkpointer(tmp_path, keep=2)
    _save(ckpt, 2)
    (ckpt.step_dir(2) / ckpt_lib.MANIFEST).unlink()  # killed before the manifest
    messages = []
    assert ckpt.choose(warn=messages.append) is None
    assert "no older checkpoint" in messages[0] and ckpt.all_steps() == []
    # Chosen on purpose, an unhashed step (e.g. from before manifests) restores unverified.
    _save(ckpt, 2)
    (ckpt.step_dir(2) / ckpt_lib.MANIFEST).unlink()
    assert ckpt.choose(2, warn=messages.append) == 2 and "unverified" in messages[-1]


def test_restore_step_picks_an_older_checkpoint_and_sets_newer_aside(two_steps):
    with pytest.raises(CheckpointError, match=r"checkpoints/3: no such checkpoint.*\[2, 4\]"):
        two_steps.choose(3)
    messages = []
    assert two_steps.choose(2, warn=messages.append) == 2
    assert two_steps.all_steps() == [2] and "restore_step=2" in messages[0]
    _damage(_largest_array_file(two_steps.step_dir(2)))
    with pytest.raises(CheckpointError, match="checkpoints/2: .*checksum mismatch"):
        two_steps.choose(2)


def test_a_committed_step_is_never_rewritten(two_steps):
    with pytest.raises(CheckpointError, match="already exists"):
        _save(two_steps, 4)
    assert two_steps.verify(4) is None and _restored_step(two_steps, 4) == 4


class Killed(BaseException):
    """Stands for a SIGKILL: nothing after it runs."""


def _kill(*args, **kwargs):
    raise Killed


@pytest.mark.parametrize(
    "point",
    ["orbax_write", "before_manifest", "manifest_write", "before_rotation", "rotation_delete"],
)
def test_a_kill_at_every_point_of_a_save_leaves_a_restorable_checkpoint(tmp_path, point):
    ckpt = ckpt_lib.Checkpointer(tmp_path, keep=1)
    _save(ckpt, 2)
    mp = pytest.MonkeyPatch()
    if point == "orbax_write":
        mp.setattr(ckpt._manager, "wait_until_finished", _kill)
    elif point == "before_manifest":
        mp.setattr(ckpt_lib, "write_manifest", _kill)
    elif point == "manifest_write":
        mp.setattr(ckpt_lib.os, "replace", _kill)  # the manifest's tmp file is written
    elif point == "before_rotation":
        mp.setattr(ckpt, "_rotate", _kill)
    else:
        mp.setattr(ckpt._manager, "delete", _kill)
    with pytest.raises(Killed):
        _save(ckpt, 4)
    mp.undo()
    rerun = ckpt_lib.Checkpointer(tmp_path, keep=1)
    step = rerun.choose(warn=lambda m: None)
    # Until step 4 is hashed, step 2 stays; after, step 4 is the one to resume from.
    assert step == (4 if point in ("before_rotation", "rotation_delete") else 2)
    assert _restored_step(rerun, step) == step


def test_rotation_keeps_the_newest_hashed_steps(tmp_path):
    ckpt = ckpt_lib.Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        _save(ckpt, step)
    assert ckpt.all_steps() == [2, 3]
    np.testing.assert_array_equal(
        np.asarray(ckpt.restore(3, state_like=_state(0))["state"]["w"]), np.full((64, 64), 3.0)
    )


def test_workdir_lock_refuses_a_second_holder_naming_pid_and_host(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from m2po_jax import workdir\n"
            f"workdir.acquire({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WorkdirError, match=rf"in use by another run \(pid {holder.pid} on"):
            workdir_lib.acquire(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    # The kernel released the dead holder's lock: the workdir is free again.
    with workdir_lib.hold(tmp_path):
        with workdir_lib.hold(tmp_path):  # nested holds in one process
            pass
        assert (tmp_path / workdir_lib.LOCK_FILE).read_text().startswith(f"{os.getpid()} ")


def test_a_file_where_checkpoints_go_is_refused_at_start(tmp_path):
    (tmp_path / "checkpoints").write_text("not a directory")
    with pytest.raises(WriterError, match=r"checkpoints: exists and is not a directory"):
        ckpt_lib.Checkpointer(tmp_path)


@pytest.fixture
def small_disk(tmp_path):
    """A real 256 KiB tmpfs (needs root, as on the CI machine; skipped elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                          capture_output=True)  # fmt: skip
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_real_full_disk_is_one_line_and_keeps_the_last_checkpoint(small_disk, capfd):
    ckpt = ckpt_lib.Checkpointer(small_disk, keep=2)
    _save(ckpt, 1)  # 16 KiB of weights: fits
    capfd.readouterr()
    noise = jax.random.normal(jax.random.key(0), (256, 256))  # 256 KiB that do not compress
    big = {"w": noise, "step": jnp.int32(2)}
    with pytest.raises(WriterError, match=r"checkpoints/2: No space left on device \(ENOSPC\)"):
        ckpt.save(2, state=big, rng=jax.random.key(2), queue=[], meta={})
    out, err = capfd.readouterr()
    assert len((out + err).strip().splitlines()) <= 3, (out + err)[:3000]
    assert ckpt.verify(1) is None and _restored_step(ckpt, 1) == 1
