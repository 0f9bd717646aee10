"""The config a workdir was trained with, recorded at the start of every run, checked on resume.

`<workdir>/config.json` holds the resolved config and the model's parameter shapes. A run
that resumes from the workdir's checkpoints is refused, in one line, when its model's
parameters differ in shape or dtype from the recorded ones (before orbax would fail on
them), or when a setting that changes training differs, unless the user allows it
(`m2po-train --allow_config_change`). Settings that only say how long, where or how
visibly to run may change freely (`MAY_CHANGE`).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax

from m2po_jax import config as config_lib
from m2po_jax.common.errors import ConfigError, WorkdirError
from m2po_jax.configs import default
from m2po_jax.models import model as model_lib
from m2po_jax.models import model_config as model_config_lib
from m2po_jax.run import paths

CONFIG_FILE = "config.json"
# Prefixes of fields a resumed run may change without being asked.
MAY_CHANGE = (
    "total_steps", "logging.", "eval.", "checkpoint.", "mesh.", "model.path",
    "task.train_path", "task.eval_path", "max_nonfinite_steps",
    "rollout.worker_timeout_s", "rollout.reward_workers", "rollout.reward_timeout_s",
    # the continuous engine's tokens depend on the sequence, not on its slot
    "rollout.engine_slots", "rollout.insert_lanes", "rollout.chunk_steps",
    "rollout.stream_batches",
)  # fmt: skip


def _flat(tree, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def describe(cfg, model_config: model_config_lib.ModelConfig) -> dict:
    """What `config.json` records: the flat config and every parameter's shape and dtype."""
    shapes = jax.eval_shape(lambda: model_lib.init_params(model_config, jax.random.key(0)))
    params = {
        jax.tree_util.keystr(path): [list(x.shape), str(x.dtype)]
        for path, x in jax.tree_util.tree_flatten_with_path(shapes)[0]
    }
    record = {"config": _flat(dataclasses.asdict(cfg)), "params": params}
    return json.loads(json.dumps(record))  # as it reads back: tuples as lists


def check_and_record(
    workdir: str | os.PathLike,
    record: dict,
    *,
    resuming: bool,
    allow_change: bool,
    write: bool = True,
) -> list[str]:
    """Refuses a resume whose model or training settings differ from the recorded ones;
    writes `record` (atomically). Returns the changed settings that were allowed."""
    path = paths.as_path(workdir) / CONFIG_FILE
    allowed = []
    if resuming and path.exists():
        try:
            before = json.loads(path.read_text())
            old_params, old_config = before["params"], before["config"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WorkdirError(f"{path}: unreadable ({e}); move it aside to resume anyway") from e
        for name in sorted(set(old_params) | set(record["params"])):
            was, now = old_params.get(name), record["params"].get(name)
            if was != now:
                raise WorkdirError(
                    f"{path}: the checkpoints' model differs from this run's at params{name}: "
                    f"{_shape(was)} recorded, {_shape(now)} now; use a new workdir for another "
                    f"architecture"
                )
        changed = [
            k
            for k in sorted(set(old_config) | set(record["config"]))
            if old_config.get(k) != record["config"].get(k) and not k.startswith(MAY_CHANGE)
        ]
        listing = ", ".join(
            f"{k}={old_config.get(k)!r} -> {record['config'].get(k)!r}" for k in changed
        )
        if changed and not allow_change:
            raise WorkdirError(
                f"{path}: this run changes settings the checkpoints were trained with: {listing}; "
                f"pass --allow_config_change to resume with them, or use a new workdir"
            )
        allowed = changed
    if write:
        paths.write_atomic(path, json.dumps(record, indent=1, sort_keys=True))
    return allowed


def _shape(entry) -> str:
    return "absent" if entry is None else f"{entry[1]}{entry[0]}"


def read_record(workdir: str | os.PathLike) -> dict:
    """The workdir's `config.json`; WorkdirError (one line) if it is missing or unreadable."""
    path = paths.as_path(workdir) / CONFIG_FILE
    if not path.exists():
        raise WorkdirError(f"{path}: missing; {workdir} is not a workdir m2po-train has run in")
    try:
        record = json.loads(path.read_text())
        record["config"], record["params"]  # noqa: B018 (both must be there)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WorkdirError(f"{path}: unreadable ({type(e).__name__}: {e})") from e
    return record


def recorded_config(record: dict, where: str):
    """The run's `Config` from a record: the built-in defaults, then every recorded setting
    (settings added since the record was written keep their defaults)."""
    config = default.get_config()
    try:
        config_lib.apply_dotted(config, record["config"])
    except ConfigError as e:
        raise WorkdirError(f"{where}: {e} (written by another version?)") from e
    return config_lib.from_configdict(config)
