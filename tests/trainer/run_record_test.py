"""The workdir records its config; a resume with another architecture or changed training
settings is refused in one line (unless allowed); run length, logging and paths may change."""

import json

import pytest

from m2po_jax import config as config_lib
from m2po_jax.common.errors import WorkdirError
from m2po_jax.configs import arith
from m2po_jax.models import model_config
from m2po_jax.run import run_record

MODEL = model_config.ModelConfig(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1
)


def _cfg(**changes):
    c = arith.get_config("tiny")
    for key, value in changes.items():
        config_lib.apply_dotted(c, {key: value})
    return config_lib.from_configdict(c)


def test_a_resume_is_checked_against_the_recorded_config(tmp_path):
    first = run_record.describe(_cfg(), MODEL)
    assert run_record.check_and_record(tmp_path, first, resuming=False, allow_change=False) == []
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["config"]["actor.m2_threshold"] == 0.04
    assert saved["params"]["['embedding']"] == [[32, 16], "float32"]
    # The same run, or one that only runs longer and logs elsewhere: resumes.
    longer = run_record.describe(_cfg(total_steps=50, **{"logging.tensorboard": False}), MODEL)
    assert run_record.check_and_record(tmp_path, longer, resuming=True, allow_change=False) == []

    wider = run_record.describe(_cfg(), MODEL.replace(hidden_size=24, intermediate_size=48))
    with pytest.raises(WorkdirError) as err:
        run_record.check_and_record(tmp_path, wider, resuming=True, allow_change=False)
    message = str(err.value)
    assert "\n" not in message and "model differs from this run's at params['embedding']" in message
    assert "float32[32, 16] recorded, float32[32, 24] now" in message

    changed = run_record.describe(_cfg(**{"actor.eps_clip": 0.3}), MODEL)
    with pytest.raises(
        WorkdirError, match=r"actor.eps_clip=0.2 -> 0.3; pass --allow_config_change"
    ):
        run_record.check_and_record(tmp_path, changed, resuming=True, allow_change=False)
    allowed = run_record.check_and_record(tmp_path, changed, resuming=True, allow_change=True)
    assert allowed == ["actor.eps_clip"]
    assert json.loads((tmp_path / "config.json").read_text())["config"]["actor.eps_clip"] == 0.3
    # A new run (no checkpoints) records whatever it is.
    assert run_record.check_and_record(tmp_path, wider, resuming=False, allow_change=False) == []


# What a resume may change, and why (the trainer's MAY_CHANGE must agree, field by field):
# how long, how visibly, where, and how the same math is laid out or scheduled.
RESUMABLE = {
    "total_steps": "train longer",
    "max_nonfinite_steps": "when to give up on non-finite steps",
    "logging.": "what is logged and shown",
    "eval.": "held-out evaluation does not change an update",
    "checkpoint.": "when and what is saved",
    "mesh.": "the layout of the same computation (other devices, a pod)",
    "model.path": "the checkpoint directory moved (shapes are checked separately)",
    "task.train_path": "the data moved",
    "task.eval_path": "the held-out data moved",
    "rollout.worker_timeout_s": "how long to wait for a stuck worker",
    "rollout.reward_workers": "how many completions are scored at once",
    "rollout.reward_timeout_s": "how long one completion's scoring may take",
    "rollout.engine_slots": "the continuous engine's tokens do not depend on the slot",
    "rollout.insert_lanes": "as engine_slots",
    "rollout.chunk_steps": "as engine_slots",
    "rollout.stream_batches": "as engine_slots",
}


def _other(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return [*value, 1]
    return 1  # None


def test_every_field_a_resume_may_change_and_every_other_one_refused(tmp_path):
    first = run_record.describe(_cfg(), MODEL)
    run_record.check_and_record(tmp_path, first, resuming=False, allow_change=False)
    wrong = []
    for key, value in first["config"].items():
        changed = json.loads(json.dumps(first))
        changed["config"][key] = _other(value)
        try:
            run_record.check_and_record(
                tmp_path, changed, resuming=True, allow_change=False, write=False
            )
            accepted = True
        except WorkdirError:
            accepted = False
        if accepted != key.startswith(tuple(RESUMABLE)):
            wrong.append(f"{key}: {'accepted' if accepted else 'refused'}")
    assert not wrong, wrong
    assert len(first["config"]) > 120  # every field of the config was tried
