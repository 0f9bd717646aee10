"""Routing replay's record side: every engine records, for each generated token, the
experts a teacher-forced forward of the same params picks at that position, and -1 at
prompt, appended and padding columns (`SamplingConfig.record_experts`)."""

import dataclasses

import jax
import numpy as np
import pytest
import tiny_moe

from m2po_jax.models import model as model_lib
from m2po_jax.rollout import engines as engine_lib
from m2po_jax.rollout import sampling

CONFIG = tiny_moe.config(top_k=2)
PAD = 63
N = 2
_rng = np.random.default_rng(0)
PROMPTS = [list(_rng.integers(1, 60, size=int(_rng.integers(1, 7)))) for _ in range(4)]
TOKENS, VALID = sampling.pad_prompts(PROMPTS, PAD)
WIDTH = TOKENS.shape[1]
SETTINGS = sampling.SamplingConfig(
    max_new_tokens=10, temperature=1.0, pad_id=PAD, stop_token_ids=(5, 6, 7), record_experts=True
)


@pytest.fixture(scope="module")
def params():
    return tiny_moe.params(CONFIG)


@jax.jit
def _experts(params, tokens, valid):
    return model_lib.apply(params, CONFIG, tokens, valid_BxT=valid, return_routing=True)[1][1]


def teacher_forced_experts(params, out) -> np.ndarray:
    """The experts [B, T, L, K] a full forward over the rollouts' tokens runs."""
    return np.asarray(_experts(params, out.tokens_BxT, out.valid_BxT))


def assert_recorded(params, out, fed_BxT):
    """Recorded exactly at `fed_BxT` (generated tokens some pass fed), equal there to the
    teacher-forced forward's experts (as sets: the order within K is the forward's too)."""
    recorded = np.asarray(out.experts_BxTxLxK)
    assert recorded.dtype == np.int16
    assert recorded.shape == out.tokens_BxT.shape + (CONFIG.num_layers, 2)
    at = recorded[..., 0, 0] >= 0
    np.testing.assert_array_equal(at, fed_BxT)
    assert (recorded[~at] == -1).all()
    np.testing.assert_array_equal(recorded[at], teacher_forced_experts(params, out)[at])


def _fed_except_last(out) -> np.ndarray:
    """Generated tokens but each row's last one (no step fed it)."""
    sampled = np.asarray(out.completion_mask_BxT)
    last = np.cumsum(sampled[:, ::-1], axis=1)[:, ::-1] == 1
    return sampled & ~last


def test_static_engine_records_each_fed_token(params):
    out = sampling.generate(params, CONFIG, TOKENS, VALID, jax.random.key(1), SETTINGS, N)
    recorded = np.asarray(out.experts_BxTxLxK)
    fed = recorded[..., 0, 0] >= 0
    # Each generated token but the row's last is fed by a decode step; the last too when
    # another row kept the loop running (the stop token is fed once more).
    sampled = np.asarray(out.completion_mask_BxT)
    assert (fed <= sampled).all() and (fed >= _fed_except_last(out)).all()
    assert_recorded(params, out, fed)


def test_continuous_engine_records_each_fed_token(params):
    engine = engine_lib.ContinuousEngine(CONFIG, SETTINGS, slots=3, insert_lanes=1)
    out = engine.generate(params, TOKENS, VALID, jax.random.key(2), n_samples=N).out
    # A slot stops decoding its sequence at its end: the last token is never fed.
    assert_recorded(params, out, _fed_except_last(out))
    streamed = list(engine.stream(params, [(TOKENS, VALID, jax.random.key(2))] * 2, n_samples=N))
    for unit in streamed:
        np.testing.assert_array_equal(unit.out.experts_BxTxLxK, out.experts_BxTxLxK)


def test_paged_engine_records_each_fed_token_when_preempted(params):
    """With 17 pages (the prompts take 10, a completion 6) sequences are preempted and
    resumed: their recomputed tokens' experts come from the resume's prefill, and still
    equal the teacher-forced forward's (the decode steps' otherwise)."""
    engine = engine_lib.PagedEngine(CONFIG, SETTINGS, slots=4, page_size=2, pages=17)
    got = engine.generate(params, TOKENS, VALID, jax.random.key(2), n_samples=N)
    assert got.preemptions > 0
    assert_recorded(params, jax.device_get(got.out), _fed_except_last(got.out))


def test_multi_turn_records_sampled_tokens_and_not_appended_ones(params):
    """Episodes on the paged engine: a turn's last sampled token is fed by the append's
    prefill (recorded from it); the appended tokens are never recorded."""
    settings = dataclasses.replace(SETTINGS, max_new_tokens=24, stop_token_ids=(5, 6, 7, 8, 9))
    engine = engine_lib.PagedEngine(CONFIG, settings, slots=4, page_size=2)
    appended = {}

    def on_turns(turns):
        answers = []
        for turn in turns:
            go = appended.get(turn.row, 0) < 1 and not turn.cut and turn.room >= 3
            appended[turn.row] = appended.get(turn.row, 0) + go
            answers.append([40, 41, 42] if go else None)
        return answers

    got = engine.episodes(
        params, TOKENS, VALID, jax.random.key(3), on_turns, n_samples=N, max_append=8
    )
    out = jax.device_get(got.out)
    assert sum(appended.values()) >= 3
    assert_recorded(params, out, _fed_except_last(out))
