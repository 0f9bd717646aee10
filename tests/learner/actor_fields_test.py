"""Every actor field reaches the compiled train step: changing it changes the lowered
program (a field validated, then dropped on its way to the step, would leave it equal).

The program is lowered, not compiled or run: its StableHLO text, without source locations,
is the fingerprint (as `benchmarks/step_fingerprint.py`)."""

import functools
import importlib.util
from pathlib import Path

import pytest

from m2po_jax import config as config_lib
from m2po_jax.configs import arith
from m2po_jax.models.model_config import ModelConfig

_SPEC = importlib.util.spec_from_file_location(
    "step_fingerprint", Path(__file__).resolve().parents[2] / "benchmarks" / "step_fingerprint.py"
)
_FINGERPRINT = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_FINGERPRINT)  # its lowering, with this test's model and batch

MODEL = ModelConfig(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1
)
ROWS, SEQ = 16, 9  # two groups of gconfig.n_samples = 8: group and batch levels differ


def _actor(changes: dict):
    c = arith.get_config("m2po")
    config_lib.apply_dotted(c, {f"actor.{k}": v for k, v in changes.items()})
    return config_lib.from_configdict(c).actor


@functools.cache  # the shared settings' program is lowered once
def _lowered(changes: tuple) -> str:
    return _FINGERPRINT.lowered_step(MODEL, _actor(dict(changes)), ROWS, SEQ)


def _program(changes: dict) -> str:
    return _lowered(tuple(sorted(changes.items())))


# (settings both programs share, the field, its other value)
FIELDS = [
    ({}, "m2_threshold", 0.1),
    ({}, "m2po_method", "bisect"),
    ({"ppo_n_minibatches": 2}, "m2po_second_moment", "current_behav"),
    ({}, "m2po_stop_rule", "le"),
    ({}, "m2po_candidates", "harmful"),
    ({}, "m2po_scope", "row"),
    ({}, "eps_clip", 0.3),
    ({}, "eps_clip_higher", 0.28),
    ({}, "c_clip", 3.0),
    ({}, "use_decoupled_loss", False),
    ({"use_decoupled_loss": False}, "recompute_logprob", False),
    ({"ppo_n_minibatches": 2, "m2_threshold": None}, "prox_logp_method", "loglinear"),
    ({}, "loss_denominator", "valid"),
    ({}, "rejection_sampling.upper", 3.0),
    ({}, "rejection_sampling.level", "sequence"),
    ({}, "rollout_correction.is_level", "geometric"),
    ({}, "rollout_correction.is_threshold", 2.0),
    ({}, "importance_sampling_level", "sequence"),
    ({"use_decoupled_loss": False}, "use_sapo_loss", True),
    ({"use_decoupled_loss": False, "use_sapo_loss": True}, "sapo_tau_pos", 0.5),
    ({"use_decoupled_loss": False, "use_sapo_loss": True}, "sapo_tau_neg", 2.0),
    ({}, "ppo_n_minibatches", 2),
    ({}, "mb_spec.n_mbs", 2),
    ({}, "logp_chunk_size", 3),
    ({}, "reward_scaling", 2.0),
    ({}, "reward_bias", 0.5),
    ({}, "reward_clip", 1.0),
    ({}, "reward_norm.mean_level", "batch"),
    ({}, "reward_norm.std_level", "batch"),
    ({}, "adv_norm", True),
    ({}, "kl_ctl", 0.1),
    ({"kl_ctl": 0.1}, "kl_estimator", "k3"),
    ({}, "optimizer.lr", 2e-3),
    ({}, "optimizer.weight_decay", 0.5),
    ({}, "optimizer.beta1", 0.5),
    ({}, "optimizer.beta2", 0.5),
    ({}, "optimizer.eps", 1e-3),
    ({}, "optimizer.gradient_clipping", 0.5),
    ({}, "optimizer.lr_scheduler_type", "cosine"),
    ({"optimizer.lr_scheduler_type": "cosine"}, "optimizer.warmup_steps_proportion", 0.5),
]


@pytest.mark.parametrize("shared, field, value", FIELDS, ids=[f[1] for f in FIELDS])
def test_each_actor_field_changes_the_train_step(shared, field, value):
    assert _program(shared) != _program({**shared, field: value}), f"{field}={value!r}"
