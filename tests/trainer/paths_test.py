"""The workdir path layer: local paths and object stores (a `gs://` store held in memory)."""

import importlib.util
import json

import fsspec
import pytest
from etils.epath import backend as epath_backend
from fsspec.implementations.memory import MemoryFileSystem

from m2po_jax.common.errors import WorkdirError
from m2po_jax.run import checkpoint as ckpt_lib
from m2po_jax.run import metrics as metrics_lib
from m2po_jax.run import paths, plots, run_record, tensorboard
from m2po_jax.run import workdir as workdir_lib

_PROTOCOLS = ("gs", "gcs")
fsspec_registry = importlib.import_module("fsspec.registry")  # the module, not its mapping


def _reset_backends():
    type(epath_backend.fsspec_backend)._get_filesystem.cache_clear()


@pytest.fixture
def fake_gs(monkeypatch):
    """`gs://` served by fsspec's in-memory filesystem: epath's fsspec backend, no network."""
    saved = {name: fsspec_registry._registry.get(name) for name in _PROTOCOLS}
    for name in _PROTOCOLS:
        fsspec.register_implementation(name, MemoryFileSystem, clobber=True)
    _reset_backends()
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]
    # A fake store needs no Google client, and has no hierarchical namespace to ask about.
    monkeypatch.setattr(paths, "_MODULES", {})
    try:  # orbax's private helper (orbax-checkpoint 0.12); absent elsewhere, nothing to patch
        from orbax.checkpoint._src.path import gcs_utils
    except ImportError:
        gcs_utils = None
    if gcs_utils is not None and hasattr(gcs_utils, "is_hierarchical_namespace_enabled"):
        monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
    try:
        yield MemoryFileSystem()
    finally:
        for name, cls in saved.items():
            if cls is None:
                fsspec_registry._registry.pop(name, None)
            else:
                fsspec_registry._registry[name] = cls
        _reset_backends()
        MemoryFileSystem.store.clear()


def test_a_workdir_url_that_cannot_be_written_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(WorkdirError, match=r"^ftp://host/run: a workdir on ftp:// is not supp"):
        paths.workdir("ftp://host/run")
    if importlib.util.find_spec("gcsfs") is None:
        _reset_backends()
        with pytest.raises(WorkdirError, match=r"no filesystem backend for gs:// .*gcsfs"):
            paths.workdir("gs://bucket/run")
    assert list(tmp_path.iterdir()) == []  # no local "gs:" or "ftp:" folder
    local = paths.workdir("runs/a")
    assert paths.is_local(local) and str(local) == str(tmp_path / "runs" / "a")


def test_every_workdir_writer_works_on_an_object_store(fake_gs):
    root = paths.workdir("gs://bucket/run")
    assert not paths.is_local(root) and str(root) == "gs://bucket/run"
    with workdir_lib.hold(root):  # no locks on object stores: held with a warning
        with metrics_lib.MetricsWriter(root) as writer:
            for step in range(4):
                writer.write(step, {"reward/mean": step / 4, "m2po/m2_before": 0.01 * step})
            writer.flush()
            assert fake_gs.cat("gs://bucket/run/metrics.jsonl").count(b"\n") == 4
        # A resume at step 2 drops steps 2 and 3, from the file and from TensorBoard.
        with metrics_lib.MetricsWriter(root, resume_step=2) as writer:
            writer.write(2, {"reward/mean": 9.0})
    records = metrics_lib.read_metrics(root / metrics_lib.METRICS_FILE)
    assert [(r["step"], r["reward/mean"]) for r in records] == [(0, 0.0), (1, 0.25), (2, 9.0)]
    scalars = tensorboard.read_scalars(root / metrics_lib.TENSORBOARD_DIR)
    assert scalars["reward/mean"] == {0: 0.0, 1: 0.25, 2: 9.0}

    written = plots.plot_metrics(root / metrics_lib.METRICS_FILE, root / "plots")
    assert written and all(fake_gs.cat(p)[:4] == b"\x89PNG" for p in written)

    record = {"config": {"seed": 0}, "params": {"['w']": [[2, 2], "float32"]}}
    run_record.check_and_record(root, record, resuming=False, allow_change=False)
    assert json.loads(fake_gs.cat("gs://bucket/run/config.json")) == record
    changed = {**record, "config": {"seed": 1}}
    with pytest.raises(WorkdirError, match=r"seed=0 -> 1"):
        run_record.check_and_record(root, changed, resuming=True, allow_change=False)


def test_checkpoints_verify_and_fall_back_on_an_object_store(fake_gs):
    """Orbax's own array writes go through tensorstore's GCS driver (not this fake store);
    what is ours runs here: the manifest, verification, set-aside, the start-up probe."""
    run = "gs://bucket/run/checkpoints"
    for step in (3, 5, 7):  # committed as orbax commits on GCS: a commit_success.txt
        fake_gs.pipe({f"{run}/{step}/state/a": b"x" * 100, f"{run}/{step}/commit_success.txt": b""})
    for step in (3, 5):
        ckpt_lib.write_manifest(paths.workdir(f"{run}/{step}"))
    entries = json.loads(fake_gs.cat(f"{run}/3/m2po_manifest.json"))["files"]
    assert (
        sorted(entries) == ["commit_success.txt", "state/a"] and entries["state/a"]["size"] == 100
    )
    fake_gs.pipe(f"{run}/5/state/a", b"x" * 99 + b"z")  # step 5 damaged, step 7 unfinished
    ckpt = ckpt_lib.Checkpointer("gs://bucket/run")
    assert ckpt.all_steps() == [3, 5, 7]
    warnings = []
    assert ckpt.choose(warn=warnings.append) == 3
    assert "7 refused: m2po_manifest.json is missing" in warnings[0]
    assert "5 refused: state/a: checksum mismatch" in warnings[1]
    aside = sorted(p for p in fake_gs.store if "checkpoints_aside" in p)
    assert [p.split("/")[5].split("-")[:2] for p in aside] == [["5", "damaged"]] * 3 + [
        ["7", "incomplete"]
    ] * 2
    assert ckpt.verify(3) is None and ckpt.all_steps() == [3]
