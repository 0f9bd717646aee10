"""Orbax checkpoints of everything needed to continue a run exactly.

One checkpoint holds the train state (params, optimizer state, step), the reference
params, the PRNG key, the stale-rollout queue and a JSON record (data position, warm-up
progress). Every process calls save/restore (multi-host: orbax coordinates the writes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
    """A `CheckpointManager` under `workdir/checkpoints`, keeping the last `keep`."""

    def __init__(self, workdir: str | Path, *, keep: int = 2):
        directory = Path(workdir).absolute() / "checkpoints"
        self.directory = directory
        self._manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(
        self,
        step: int,
        *,
        state: Any,
        rng: jax.Array,
        queue: list[dict],
        meta: dict,
        ref_params: Any = None,
    ) -> None:
        """Writes checkpoint `step` (replacing one of the same step) and waits for it."""
        if step in self._manager.all_steps():
            self._manager.delete(step)
        items = {
            "state": ocp.args.StandardSave(state),
            "rng": ocp.args.StandardSave({"key": np.asarray(jax.random.key_data(rng))}),
            "meta": ocp.args.JsonSave({**meta, "queue_len": len(queue)}),
        }
        if queue:
            items["queue"] = ocp.args.StandardSave({str(i): b for i, b in enumerate(queue)})
        if ref_params is not None:
            items["ref_params"] = ocp.args.StandardSave(ref_params)
        self._manager.save(step, args=ocp.args.Composite(**items))
        self._manager.wait_until_finished()

    def restore(self, step: int | None, *, state_like: Any, ref_like: Any = None) -> dict:
        """Restores a checkpoint into the structure, dtypes and shardings of `state_like`.

        Returns a dict with state, rng, queue (list of numpy dicts), meta, ref_params.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
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
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        queue = []
        if meta["queue_len"]:
            raw = restored["queue"]
            queue = [
                {k: np.asarray(v) for k, v in raw[str(i)].items()} for i in range(meta["queue_len"])
            ]
        key_data = np.asarray(restored["rng"]["key"])
        return {
            "state": restored["state"],
            "rng": jax.random.wrap_key_data(key_data),
            "queue": queue,
            "meta": meta,
            "ref_params": restored["ref_params"] if ref_like is not None else None,
        }

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
