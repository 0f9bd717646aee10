"""Verified orbax checkpoints of everything needed to continue a run exactly.

One checkpoint holds the train state (params, optimizer state, step), the reference
params, the PRNG key, the stale-rollout queue and a JSON record (data position, warm-up
progress). Every process calls save/restore (multi-host: orbax coordinates the writes).

Orbax checks no array data on restore (its zarr2/ocdbt files carry no checksum), so
after orbax commits a step, process 0 writes `MANIFEST` into it: the size and CRC-32
of every file. A step is *verified* when its manifest exists and every file matches.
`restore` falls back from a damaged or incomplete step to the newest one that verifies,
moving the bad ones to `workdir/checkpoints_aside` (never deleting them). Rotation
keeps the newest `keep` steps that have a manifest, so it never deletes the newest
good checkpoint before a newer one is committed and hashed. A committed step is never
deleted to be rewritten.

A LoRA run on a Hugging Face checkpoint (`model.path`) saves only what trains: the adapters
of `params` and their optimizer state, with the base's identity in the meta
(`base_identity`: its path and `params_hash`). A resume loads the base from `model.path`
again, refuses it when its hash differs from the one the adapters were trained on, and
puts the restored adapters beside it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils.epath import Path
from flax import traverse_util

from m2po_jax.common.errors import CheckpointError, WriterError, describe_os_error
from m2po_jax.common.types import RolloutBatch
from m2po_jax.models import lora
from m2po_jax.parallel import placement
from m2po_jax.run import paths

MANIFEST = "m2po_manifest.json"
ASIDE_DIR = "checkpoints_aside"
_CHUNK = 1 << 24


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(step_dir: Path) -> list[Path]:
    """Every file under `step_dir` but the manifest, sorted."""
    found = [root / name for root, _, names in step_dir.walk() for name in names]
    return sorted(p for p in found if p.name != MANIFEST and not p.name.startswith(f".{MANIFEST}"))


def write_manifest(step_dir: Path) -> None:
    """Hashes every file of a committed step into `step_dir/MANIFEST` (atomically)."""
    entries = {
        str(p.relative_to(step_dir)): {"size": p.stat().length, "crc32": _crc32(p)}
        for p in _files(step_dir)
    }
    text = json.dumps({"version": 1, "files": entries}, indent=0, sort_keys=True)
    paths.write_atomic(step_dir / MANIFEST, text)


def verify_step_dir(step_dir: Path) -> str | None:
    """None if every file matches the manifest, else what is wrong (one line)."""
    try:
        text = (step_dir / MANIFEST).read_text(encoding="utf-8")
    except FileNotFoundError:
        return f"{MANIFEST} is missing (the save did not finish)"
    except (OSError, UnicodeDecodeError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    try:
        files = json.loads(text)["files"]
        entries = [(name, int(e["size"]), int(e["crc32"])) for name, e in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST} is damaged"
    if not entries:
        return f"{MANIFEST} lists no files"
    for name, size, crc in entries:
        path = step_dir / name
        try:
            if path.stat().length != size:
                return f"{name}: size {path.stat().length} bytes, expected {size} (damaged)"
            if _crc32(path) != crc:
                return f"{name}: checksum mismatch (damaged)"
        except FileNotFoundError:
            return f"{name}: missing"
        except OSError as e:
            return f"{name}: unreadable ({e.strerror})"
    return None


def _fmix32(h):
    """murmur3's 32-bit finalizer: every input bit moves about half the output bits."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


@jax.jit
def _leaf_digest(x):
    """Two 32-bit sums (mod 2**32) of a hash of each element's float32 bits and its flat
    index: integer sums, so the same for any sharding or reduction order."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    index = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(x.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= x.shape[axis]
    first = _fmix32(bits ^ _fmix32(index + jnp.uint32(0x9E3779B9)))
    second = _fmix32(bits + _fmix32(index ^ jnp.uint32(0x7F4A7C15)))
    return jnp.stack([jnp.sum(first, dtype=jnp.uint32), jnp.sum(second, dtype=jnp.uint32)])


def params_hash(params) -> str:
    """sha256 (hex) of every leaf's path, shape and content: each leaf's values as float32
    bits, folded on its devices into a 64-bit digest (`_leaf_digest`), so no tensor is
    copied to the host. The same values give the same hash whatever the mesh; a bfloat16
    and a float32 copy of the same bfloat16 weights hash alike. Every process calls it."""
    flat = traverse_util.flatten_dict(params)
    digests = {path: _leaf_digest(x) for path, x in sorted(flat.items())}
    host = placement.to_host(digests)
    h = hashlib.sha256()
    for path, x in sorted(flat.items()):
        d0, d1 = (int(v) for v in np.asarray(host[path]))
        h.update(f"{'/'.join(map(str, path))}:{tuple(x.shape)}:{d0:08x}{d1:08x}\n".encode())
    return h.hexdigest()


def base_identity(path: str, params) -> dict:
    """What a LoRA checkpoint records of its frozen base: the Hugging Face directory it was
    loaded from and `params_hash` of the base params (the adapters left out)."""
    _, base = lora.split(params)
    if base is None:
        raise ValueError("params: no LoRA adapters, so there is no frozen base to identify")
    return {"path": os.fspath(path), "hash": params_hash(base)}


_DISK_FULL = re.compile(r"No space left on device|os_error_code='28'|ENOSPC")


class _DropOrbaxErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


@contextlib.contextmanager
def _orbax_errors_raised_not_logged() -> Iterator[None]:
    """Orbax logs a failed save's traceback from each of its threads (about 200 lines for a
    full disk) before it raises the same error; the raised one is reported, in one line."""
    drop = _DropOrbaxErrors()
    loggers = [logging.getLogger("absl"), logging.getLogger()]
    for logger in loggers:
        logger.addFilter(drop)
        for handler in logger.handlers:
            handler.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)
            for handler in logger.handlers:
                handler.removeFilter(drop)


def _is_primary() -> bool:
    return jax.process_index() == 0


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(name)


class _Manager(ocp.CheckpointManager):
    """orbax's manager without its own read of the runtime's preemption sync point (at each
    save, with the step as the counter): the trainer reads it once per step with its own
    count (`stopping.RunStop`), and a second reader with other numbers would move the point
    where the processes meet."""

    def reached_preemption(self, step: int) -> bool:
        return False


class Checkpointer:
    """A `CheckpointManager` under `workdir/checkpoints`, keeping the last `keep` verified."""

    def __init__(self, workdir: str | Path, *, keep: int = 2):
        self.workdir = paths.workdir(workdir)
        self.directory = self.workdir / "checkpoints"
        self.keep = keep
        if _is_primary():
            self._check_writable()
        try:
            # Rotation is ours (`_rotate`): orbax's max_to_keep would delete the previous step
            # before the new one is hashed.
            self._manager = _Manager(
                self.directory, options=ocp.CheckpointManagerOptions(create=True)
            )
        except OSError as e:
            raise WriterError(describe_os_error(e, self.directory)) from e

    def _check_writable(self) -> None:
        """Refuses at start, not at the first save after training, a checkpoint directory
        that is a file or cannot be written (read-only, full)."""
        if self.directory.exists() and not self.directory.is_dir():
            raise WriterError(
                f"{self.directory}: exists and is not a directory; move it aside to checkpoint here"
            )
        probe = self.directory / ".m2po_write_probe"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"0" * 4096)
            probe.unlink()
        except OSError as e:
            raise WriterError(describe_os_error(e, self.directory)) from e

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def verify(self, step: int) -> str | None:
        """None if checkpoint `step` verifies, else what is wrong with it."""
        return verify_step_dir(self.step_dir(step))

    def save(
        self,
        step: int,
        *,
        state: Any,
        rng: jax.Array,
        queue: list[RolloutBatch],
        meta: dict,
        ref_params: Any = None,
        warmup_opt_state: Any = None,
        base: dict | None = None,
    ) -> None:
        """Writes checkpoint `step`, hashes it, then rotates; refuses an existing step.

        `warmup_opt_state`: the AdamW state of an unfinished supervised warm-up (a stop
        during it), saved at step 0 with the warm-up's params in `state`.
        `base`: the frozen base's `base_identity` of a LoRA run whose base a resume loads
        again: then only the adapters of `state.params` are saved (`meta["base"]`)."""
        if step in self._manager.all_steps():
            raise CheckpointError(
                f"{self.step_dir(step)}: already exists; a committed checkpoint is not rewritten"
            )
        if base is not None:
            if not lora.has_adapters(state.params):
                raise ValueError("base: given for params without LoRA adapters")
            state = state.replace(params=lora.trainable(state.params))
            meta = {**meta, "base": base}
        items = {
            "state": ocp.args.StandardSave(state),
            "rng": ocp.args.StandardSave({"key": np.asarray(jax.random.key_data(rng))}),
            "meta": ocp.args.JsonSave({**meta, "queue_len": len(queue)}),
        }
        if queue:
            items["queue"] = ocp.args.StandardSave(
                {str(i): b.arrays() for i, b in enumerate(queue)}
            )
        if ref_params is not None:
            items["ref_params"] = ocp.args.StandardSave(ref_params)
        if warmup_opt_state is not None:
            items["warmup_opt_state"] = ocp.args.StandardSave(warmup_opt_state)
        try:
            with _orbax_errors_raised_not_logged():
                self._manager.save(step, args=ocp.args.Composite(**items))
                self._manager.wait_until_finished()
            if _is_primary():
                write_manifest(self.step_dir(step))
        except OSError as e:
            raise WriterError(describe_os_error(e, self.step_dir(step))) from e
        except Exception as e:  # tensorstore reports a full disk as ValueError(RESOURCE_EXHAUSTED)
            if _DISK_FULL.search(str(e)):
                raise WriterError(
                    describe_os_error(
                        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), self.step_dir(step)
                    )
                ) from e
            raise
        _sync(f"m2po_manifest_{step}")
        self._rotate()

    def _rotate(self) -> None:
        """Deletes the steps older than the newest `keep` that have a manifest."""
        steps = self.all_steps()
        hashed = [s for s in steps if (self.step_dir(s) / MANIFEST).is_file()]
        if len(hashed) < self.keep:
            return
        oldest_kept = hashed[-self.keep]
        for s in steps:
            if s < oldest_kept:
                self._manager.delete(s)

    def set_aside(self, step: int, reason: str) -> Path:
        """Moves checkpoint `step` to `workdir/checkpoints_aside` (kept for inspection)."""
        target = self.workdir / ASIDE_DIR / f"{step}-{reason}-{time.strftime('%Y%m%d-%H%M%S')}"
        if _is_primary():
            target.parent.mkdir(parents=True, exist_ok=True)
            self.step_dir(step).rename(target)
        _sync(f"m2po_aside_{step}")
        self._manager.reload()
        return target

    def choose(self, step: int | None = None, *, warn: Callable[[str], None] = print) -> int | None:
        """The step to resume from: `step` if given (it must verify), else the newest that
        verifies; bad or (given `step`) newer checkpoints are set aside. None: no checkpoints.
        """
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise CheckpointError(
                    f"{self.step_dir(step)}: no such checkpoint (restore_step={step}; "
                    f"available: {steps or 'none'})"
                )
            problem = self.verify(step)
            if problem and not self._incomplete(step):
                raise CheckpointError(f"{self.step_dir(step)}: {problem}")
            if problem:  # chosen on purpose, e.g. a step saved before manifests existed
                warn(f"checkpoint {self.step_dir(step)}: {problem}; restoring it unverified")
            for newer in (s for s in steps if s > step):
                target = self.set_aside(newer, "superseded")
                warn(f"checkpoint {self.step_dir(newer)}: moved to {target} (restore_step={step})")
            return step
        problems, damaged = [], False
        for candidate in reversed(steps):
            problem = self.verify(candidate)
            if problem is None:
                return candidate
            problems.append(f"step {candidate}: {problem}")
            incomplete = self._incomplete(candidate)
            damaged = damaged or not incomplete
            target = self.set_aside(candidate, "incomplete" if incomplete else "damaged")
            older = [s for s in steps if s < candidate]
            then = f"falling back to step {older[-1]}" if older else "no older checkpoint"
            warn(
                f"checkpoint {self.step_dir(candidate)} refused: {problem}; moved to {target}; "
                f"{then}"
            )
        if damaged:
            raise CheckpointError(
                f"{self.directory}: no checkpoint verifies ({'; '.join(problems)})"
            )
        # Only saves that stopped before their manifest (unfinished, not damaged): as if
        # none had been started, the run begins again.
        return None

    def _incomplete(self, step: int) -> bool:
        """True if the step's save stopped before writing its manifest."""
        return not (self.step_dir(step) / MANIFEST).exists()

    def meta(self, step: int) -> dict:
        """The JSON record of checkpoint `step` (data position, warm-up steps, ...)."""
        try:
            return self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{self.step_dir(step)}: unreadable record ({e})") from e

    def restore(
        self,
        step: int | None,
        *,
        state_like: Any,
        ref_like: Any = None,
        warmup_like: Any = None,
        base: dict | None = None,
    ) -> dict:
        """Restores a checkpoint into the structure, dtypes and shardings of `state_like`.

        Returns a dict with state, rng, queue (`RolloutBatch` records of numpy arrays,
        oldest first), meta, ref_params, warmup_opt_state (restored like `warmup_like`).

        A checkpoint of adapters alone (saved with `base`) is restored into the adapters of
        `state_like.params`, and the state's params are those adapters with the rest of
        `state_like.params` (the base this run loaded); `base` is that base's
        `base_identity`, which must have the checkpoint's hash. Other checkpoints ignore
        `base`.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"{self.directory}: no checkpoint")
        saved = self.meta(step).get("base")
        frozen = None
        if saved is not None:
            self._check_base(step, saved, base)
            trainable, frozen = lora.split(state_like.params)
            state_like = state_like.replace(params=trainable)
        try:
            restored = self._restore(step, state_like, ref_like, warmup_like)
        except (OSError, ValueError, KeyError, TypeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise CheckpointError(
                f"{self.step_dir(step)}: cannot be restored into this run "
                f"({type(e).__name__}: {first[:300]})"
            ) from e
        if saved is not None:
            state = restored["state"]
            restored["state"] = state.replace(params=lora.merge(state.params, frozen))
        return restored

    def _check_base(self, step: int, saved: dict, base: dict | None) -> None:
        """Refuses (one line) to put a checkpoint's adapters on a base other than theirs."""
        where = self.step_dir(step)
        if base is None:
            raise CheckpointError(
                f"{where}: holds LoRA adapters alone, trained on the base {saved['path']} "
                f"(hash {saved['hash'][:16]}), but this run has no LoRA base to put them "
                "on (model.path with model.lora.rank > 0)"
            )
        if saved["hash"] != base["hash"]:
            raise CheckpointError(
                f"{where}: its LoRA adapters were trained on the base {saved['path']} "
                f"(hash {saved['hash'][:16]}), but this run's base {base['path']} has hash "
                f"{base['hash'][:16]}: a different model; resume with the base the run "
                "started from"
            )

    def _restore(self, step: int, state_like: Any, ref_like: Any, warmup_like: Any) -> dict:
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]
        items = {
            "state": ocp.args.StandardRestore(_abstract(state_like)),
            "rng": ocp.args.StandardRestore(),
        }
        if meta["queue_len"]:
            items["queue"] = ocp.args.StandardRestore()
        if ref_like is not None:
            items["ref_params"] = ocp.args.StandardRestore(_abstract(ref_like))
        if warmup_like is not None:
            items["warmup_opt_state"] = ocp.args.StandardRestore(_abstract(warmup_like))
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        queue = []
        if meta["queue_len"]:
            raw = restored["queue"]
            queue = [
                RolloutBatch.from_arrays(
                    {k: np.asarray(v) for k, v in raw[str(i)].items()}, f"queue item {i}"
                )
                for i in range(meta["queue_len"])
            ]
        key_data = np.asarray(restored["rng"]["key"])
        return {
            "state": restored["state"],
            "rng": jax.random.wrap_key_data(key_data),
            "queue": queue,
            "meta": meta,
            "ref_params": restored["ref_params"] if ref_like is not None else None,
            "warmup_opt_state": restored["warmup_opt_state"] if warmup_like is not None else None,
        }
