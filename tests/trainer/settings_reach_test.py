"""A setting that is validated must reach the program: for each sampling field, the rollout
the trainer makes with its own setup (`setup.build`, `rollouts.sample_rollout`) changes when
the field does (a field dropped between the config and the sampler would leave it equal)."""

import jax
import numpy as np
import pytest

from m2po_jax import config as config_lib
from m2po_jax.configs import arith
from m2po_jax.rollout import batches as rollout_lib
from m2po_jax.trainer import setup as setup_lib


def _cfg(**changes):
    c = arith.get_config("m2po,tiny")
    c.mesh.data = 1
    config_lib.apply_dotted(c, changes)
    return config_lib.from_configdict(c)


@pytest.fixture(scope="module")
def params():
    run = setup_lib.build(_cfg())
    return setup_lib.initial_params(run, jax.random.key(0))


def _sampled(params, **changes):
    """The rollout the trainer's own setup makes under `changes` (a `SampledRollout`)."""
    cfg = _cfg(**changes)
    run = setup_lib.build(cfg)
    return rollout_lib.sample_rollout(
        params,
        run.model_config,
        run.sampling_config,
        run.task.train_examples(0, 4),
        run.prompts,
        jax.random.key(1),
        n_samples=cfg.gconfig.n_samples,
        version=0,
        max_prompt_len=cfg.task.max_prompt_len,
        placement=run.placement,
        engine=run.engine,
    )


def _rollout(params, **changes):
    b = _sampled(params, **changes).batch
    return np.asarray(b.tokens_BxT), np.asarray(b.behav_logp_BxT)


@pytest.mark.parametrize(
    "field, value",
    [
        ("gconfig.temperature", 0.5),
        ("gconfig.top_k", 2),
        ("gconfig.top_p", 0.3),
        ("gconfig.greedy", True),
        ("gconfig.max_new_tokens", 3),
        ("gconfig.n_samples", 2),
    ],
)
def test_each_sampling_field_changes_the_rollout(params, field, value):
    base_tokens, base_logp = _rollout(params)
    tokens, logp = _rollout(params, **{field: value})
    same = tokens.shape == base_tokens.shape and (
        np.array_equal(tokens, base_tokens) and np.allclose(logp, base_logp)
    )
    assert not same, f"{field}={value} left the rollout as it was"


def _engine_work(params, **changes):
    """(tokens, decode steps) of the continuous engine's rollout under `changes`."""
    sampled = _sampled(
        params, **{"rollout.engine": "continuous", "gconfig.greedy": True, **changes}
    )
    return np.asarray(sampled.batch.tokens_BxT), sampled.generation.decode_steps


@pytest.mark.parametrize(
    "shared, field, value",
    [({}, "rollout.engine_slots", 4), ({"rollout.engine_slots": 8}, "rollout.insert_lanes", 1)],
)
def test_each_engine_field_changes_how_the_engine_works_not_what_it_makes(
    params, shared, field, value
):
    """Slots and insert lanes reach the engine: fewer of them take more decode steps for
    the same rows, and (greedy) the same tokens: why a resume may change them."""
    base_tokens, base_steps = _engine_work(params, **shared)
    tokens, steps = _engine_work(params, **shared, **{field: value})
    np.testing.assert_array_equal(tokens, base_tokens)
    assert steps > base_steps, (field, steps, base_steps)
