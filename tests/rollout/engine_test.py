"""Tests for m2po_jax.rollout.engines: the continuous-batching engine against the static
sampler (`sampling.generate`), a recomputed forward, in-flight weight updates, shards."""

import dataclasses

import jax
import numpy as np
import pytest
from sampling_test import CONFIG, _random_params, _teacher_forced_logp

from m2po_jax.models import model as model_lib
from m2po_jax.parallel import sharding
from m2po_jax.rollout import engines as engine_lib
from m2po_jax.rollout import sampling

N = 2  # samples per prompt
PAD = 96
# 12 prompts of 1-8 tokens: 24 sequences through 4 slots.
_rng = np.random.default_rng(0)
PROMPTS = [list(_rng.integers(1, 90, size=int(_rng.integers(1, 9)))) for _ in range(12)]
TOKENS, VALID = sampling.pad_prompts(PROMPTS, PAD)
WIDTH = TOKENS.shape[1]


@pytest.fixture(scope="module")
def params():
    return _random_params(CONFIG, seed=0, std=0.1)


@pytest.fixture(scope="module")
def greedy(params):
    """Greedy settings whose stop ids end the rows after 1 to 16 tokens (some never stop)."""
    base = sampling.SamplingConfig(max_new_tokens=16, greedy=True, pad_id=PAD)
    free = sampling.generate(params, CONFIG, TOKENS, VALID, jax.random.key(0), base, N)
    completions = np.asarray(free.tokens_BxT[:, WIDTH:])
    stops = {int(completions[i, 2 + i % 9]) for i in range(0, 2 * len(PROMPTS), 3)} - {PAD}
    return dataclasses.replace(base, stop_token_ids=tuple(sorted(stops)))


def _assert_same_rollouts(got: sampling.SampleOutput, want: sampling.SampleOutput):
    for field in ("tokens_BxT", "valid_BxT", "completion_mask_BxT", "prompt_len_B"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    for field in ("completion_len_B", "stopped_B", "num_steps"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    np.testing.assert_allclose(got.behav_logp_BxT, want.behav_logp_BxT, atol=1e-5)


def test_greedy_equals_the_static_sampler_and_slots_are_refilled(params, greedy):
    want = sampling.generate(params, CONFIG, TOKENS, VALID, jax.random.key(0), greedy, N)
    lengths = np.asarray(want.completion_len_B)
    assert lengths.min() == 1 and lengths.max() == 16 and len(set(lengths.tolist())) >= 5
    engine = engine_lib.ContinuousEngine(CONFIG, greedy, slots=4, insert_lanes=2)
    got = engine.generate(params, TOKENS, VALID, jax.random.key(0), n_samples=N, version=7)
    _assert_same_rollouts(got.out, want)
    np.testing.assert_array_equal(got.version_BxN, 7)
    # 24 sequences finished through 4 slots; every decode step but the drain ran 4 live.
    assert got.out.tokens_BxT.shape[0] == 24 > engine.slots
    assert got.live_steps == int(np.sum(lengths - 1))
    assert got.slot_steps == 4 * got.decode_steps
    static = engine_lib.StaticEngine(CONFIG, greedy).generate(
        params, TOKENS, VALID, jax.random.key(0), n_samples=N
    )
    assert static.live_steps == got.live_steps
    assert static.slot_steps == 24 * 15 and got.idle_fraction < 0.5 * static.idle_fraction
    # One prompt alone gives its rows of the batch.
    one = sampling.generate(params, CONFIG, TOKENS[5:6], VALID[5:6], jax.random.key(0), greedy, N)
    np.testing.assert_array_equal(got.out.tokens_BxT[10:12], one.tokens_BxT)


@pytest.fixture(scope="module")
def sampled_engine():
    settings = sampling.SamplingConfig(max_new_tokens=12, temperature=0.8, pad_id=PAD)
    return engine_lib.ContinuousEngine(CONFIG, settings, slots=4)


def test_sampled_log_probs_equal_a_recomputed_forward_and_keys_fix_the_tokens(
    params, sampled_engine
):
    run = lambda key, engine=sampled_engine: engine.generate(
        params, TOKENS, VALID, jax.random.key(key), n_samples=N
    )
    first = run(3)
    expected = _teacher_forced_logp(params, first.out, 0.8)
    mask = np.asarray(first.out.completion_mask_BxT)
    assert mask[:, WIDTH:].all()  # no stop token: every row runs to 12
    np.testing.assert_allclose(
        np.asarray(first.out.behav_logp_BxT)[mask], expected[mask], atol=1e-4
    )
    np.testing.assert_array_equal(run(3).out.tokens_BxT, first.out.tokens_BxT)
    assert not np.array_equal(run(4).out.tokens_BxT, first.out.tokens_BxT)
    # A sequence's draws depend on its id, not on the slot it ran in.
    other = engine_lib.ContinuousEngine(CONFIG, sampled_engine.sampling, slots=8, insert_lanes=1)
    np.testing.assert_array_equal(run(3, other).out.tokens_BxT, first.out.tokens_BxT)


def test_no_recompiles_after_the_first_batch(params, sampled_engine):
    sampled_engine.generate(params, TOKENS, VALID, jax.random.key(0), n_samples=N)
    programs = sampled_engine._compiled(N, 4, 1)
    sizes = {name: program._cache_size() for name, program in programs.items()}
    tokens = (TOKENS + 1) % 90 * VALID + PAD * ~VALID
    sampled_engine.generate(params, tokens, VALID, jax.random.key(9), n_samples=N, version=2)
    assert {name: program._cache_size() for name, program in programs.items()} == sizes


def test_weights_taken_in_flight_are_recorded_per_token(params, greedy):
    other = _random_params(CONFIG, seed=1, std=0.1)
    settings = dataclasses.replace(greedy, stop_token_ids=())  # every row runs to 16
    engine = engine_lib.ContinuousEngine(CONFIG, settings, slots=4, insert_lanes=4, chunk_steps=5)
    polls = []
    weights = lambda: polls.append(len(polls)) or (other, 1)
    got = engine.generate(
        params, TOKENS, VALID, jax.random.key(0), n_samples=N, version=0, weights=weights
    )
    assert got.weight_updates == 1 and len(polls) >= 2
    old = sampling.generate(params, CONFIG, TOKENS, VALID, jax.random.key(0), settings, N)
    new = sampling.generate(other, CONFIG, TOKENS, VALID, jax.random.key(0), settings, N)
    versions = got.version_BxN
    # The first 4 sequences ran their first-token prefill and 5 decode steps on the old
    # weights, then went on under the new ones; the queued ones ran on the new weights only.
    np.testing.assert_array_equal(versions[:4, :6], 0)
    np.testing.assert_array_equal(versions[:4, 6:], 1)
    np.testing.assert_array_equal(versions[4:], 1)
    tokens = np.asarray(got.out.tokens_BxT)
    np.testing.assert_array_equal(
        tokens[:4, : WIDTH + 6], np.asarray(old.tokens_BxT)[:4, : WIDTH + 6]
    )
    np.testing.assert_array_equal(tokens[4:], np.asarray(new.tokens_BxT)[4:])
    assert not np.array_equal(tokens[:4], np.asarray(new.tokens_BxT)[:4])


def test_one_engine_per_device_equals_one_engine(params, sampled_engine):
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2}, devices=jax.devices()[:4])
    sharded = engine_lib.ContinuousEngine(CONFIG, sampled_engine.sampling, slots=2, mesh=mesh)
    assert sharded.sizes(24) == (2, 1)
    got = sharded.generate(params, TOKENS, VALID, jax.random.key(3), n_samples=N)
    want = sampled_engine.generate(params, TOKENS, VALID, jax.random.key(3), n_samples=N)
    _assert_same_rollouts(jax.device_get(got.out), jax.device_get(want.out))
    assert got.live_steps == want.live_steps


@pytest.mark.parametrize("shards", [1, 2])
def test_a_stream_yields_each_batch_as_it_ends_with_the_tokens_it_gets_alone(
    params, greedy, shards
):
    """Three batches of 4 prompts x 2 through 4 slots: each is yielded, in order, as soon as
    its sequences end (the later ones report the decode steps after the earlier ones'),
    equal to the batch generated alone; the slots freed by a batch's short completions
    take the next batch's sequences, so the stream needs fewer decode steps."""
    mesh = None
    if shards > 1:
        mesh = sharding.make_mesh({"data": shards}, devices=jax.devices()[:shards])
    engine = engine_lib.ContinuousEngine(
        CONFIG, greedy, slots=4 // shards, chunk_steps=2, mesh=mesh
    )
    units = [(TOKENS[i : i + 4], VALID[i : i + 4], jax.random.key(i)) for i in (0, 4, 8)]
    streamed = list(engine.stream(params, units, n_samples=N, version=3))
    assert len(streamed) == 3
    alone = [engine.generate(params, t, v, k, n_samples=N, version=3) for t, v, k in units]
    for got, want in zip(streamed, alone, strict=True):
        _assert_same_rollouts(got.out, jax.device_get(want.out))
        np.testing.assert_array_equal(got.version_BxN, 3)
        assert got.live_steps == want.live_steps
    assert all(g.decode_steps > 0 for g in streamed)
    assert sum(g.decode_steps for g in streamed) < sum(g.decode_steps for g in alone)


@pytest.mark.parametrize(
    "kwargs, rows, match",
    [
        (dict(slots=-1), 24, "slots: must be >= 0"),
        (dict(chunk_steps=0), 24, "chunk_steps: must be >= 1"),
        (dict(mesh="4"), 6, "6 rows must divide over the mesh.s 4 batch shards"),
    ],
)
def test_bad_settings_are_named(kwargs, rows, match):
    if kwargs.get("mesh") == "4":
        kwargs["mesh"] = sharding.make_mesh({"data": 4}, devices=jax.devices()[:4])
    settings = sampling.SamplingConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match=match):
        engine_lib.ContinuousEngine(CONFIG, settings, **kwargs).sizes(rows)


def test_decode_steps_read_the_written_columns_only_and_agree_with_a_full_forward(
    params, monkeypatch
):
    """With small attention buckets (widths 16 and 29 of a 29-column cache), both engines'
    decode steps read 16 columns while their queries are at most at column 15 and the
    whole cache after: the log-probs equal a full forward's, greedy slots refilled from a
    queue equal the static sampler, and each bucket is taken (a width too small for a
    query would drop its keys and change the log-probs)."""
    monkeypatch.setattr(sampling, "SMALLEST_BUCKET", 4)
    assert sampling.decode_buckets(WIDTH, WIDTH + 21) == (16, 29)
    settings = sampling.SamplingConfig(max_new_tokens=21, temperature=0.9, pad_id=PAD)
    static = sampling.generate(params, CONFIG, TOKENS, VALID, jax.random.key(5), settings, N)
    engine = engine_lib.ContinuousEngine(CONFIG, settings, slots=4, insert_lanes=2)
    continuous = engine.generate(params, TOKENS, VALID, jax.random.key(5), n_samples=N).out
    for out in (static, continuous):
        mask = np.asarray(out.completion_mask_BxT)
        assert mask[:, WIDTH:].all()  # every row runs to 21: both widths are used
        expected = _teacher_forced_logp(params, out, 0.9)
        np.testing.assert_allclose(np.asarray(out.behav_logp_BxT)[mask], expected[mask], atol=1e-4)
    taken = []
    attend = model_lib.attention.grouped_attention
    monkeypatch.setattr(
        model_lib.attention,
        "grouped_attention",
        lambda q, k, *rest: taken.append(k.shape[2]) or attend(q, k, *rest),
    )
    greedy = dataclasses.replace(settings, greedy=True, max_new_tokens=22, stop_token_ids=(7, 11))
    want = sampling.generate(params, CONFIG, TOKENS, VALID, jax.random.key(0), greedy, N)
    got = engine_lib.ContinuousEngine(CONFIG, greedy, slots=4, insert_lanes=2).generate(
        params, TOKENS, VALID, jax.random.key(0), n_samples=N
    )
    _assert_same_rollouts(got.out, want)
    assert {16, 30} <= set(taken)  # traced: both branches of both decode loops


# ------------------------------------------------------------------ multi-turn episodes

STOPS = tuple(range(1, 90, 9))  # ~1 in 9 draws ends a turn


def _episodes(params, engine, key=0, appends=2):
    """Episodes whose turns get `appends` host answers of 3 tokens each, then end; returns
    the generation and, per row, the turns the host saw and what it appended."""
    seen = {}

    def on_turns(turns):
        answers = []
        for turn in turns:
            past = seen.setdefault(turn.row, [])
            delta = [turn.row % 50 + 1, 91, 92 + len(past)]
            go = len(past) < appends and not turn.cut and turn.room >= len(delta)
            past.append((turn.start, list(turn.tokens), delta if go else None))
            answers.append(delta if go else None)
        return answers

    got = engine.episodes(
        params, TOKENS, VALID, jax.random.key(key), on_turns, n_samples=N, version=3, max_append=8
    )
    return got, seen


def _assert_episode_rows(params, got, seen, new: int, atol: float):
    """The rows of `_episodes`: the prompt, the sampled turns the host saw in place and
    the appended ids exactly; the loss mask on sampled tokens only; versions 3 on them and
    -1 on appended ones; the behaviour log-probs a teacher-forced forward's (`atol`)."""
    out = got.out
    tokens, valid = np.asarray(out.tokens_BxT)[:, WIDTH:], np.asarray(out.valid_BxT)[:, WIDTH:]
    sampled = np.asarray(out.completion_mask_BxT)[:, WIDTH:]
    assert sorted(seen) == list(range(2 * len(PROMPTS)))
    appended_any = 0
    for row, turns in seen.items():
        mine = np.zeros(new, bool)
        for start, turn_tokens, delta in turns:
            end = start + len(turn_tokens)
            # The host saw the turn's sampled tokens, in place in the row.
            np.testing.assert_array_equal(tokens[row, start:end], turn_tokens)
            assert sampled[row, start:end].all()
            if delta is not None:
                np.testing.assert_array_equal(tokens[row, end : end + 3], delta)
                mine[end : end + 3] = True
                appended_any += 1
        # Appended tokens: valid, never sampled (no loss), version -1; the rest version 3.
        np.testing.assert_array_equal(valid[row] & ~sampled[row], mine)
        np.testing.assert_array_equal(got.version_BxN[row][mine], -1)
        np.testing.assert_array_equal(got.version_BxN[row][valid[row] & ~mine], 3)
        last_start, last_tokens, last_delta = turns[-1]
        assert last_delta is None and valid[row].sum() == last_start + len(last_tokens)
        assert bool(out.stopped_B[row]) == (last_tokens[-1] in STOPS)
    assert appended_any >= 20
    # The behaviour log-probs are the teacher-forced forward's on the whole trajectory
    # (prompt, sampled turns and appended answers, as one sequence).
    mask = np.asarray(out.completion_mask_BxT)
    expected = _teacher_forced_logp(params, out, 0.8)
    np.testing.assert_allclose(np.asarray(out.behav_logp_BxT)[mask], expected[mask], atol=atol)


def test_turns_append_host_tokens_and_the_trainer_sees_exactly_the_tokens_attended(params):
    settings = sampling.SamplingConfig(
        max_new_tokens=40, temperature=0.8, pad_id=PAD, stop_token_ids=STOPS
    )
    engine = engine_lib.ContinuousEngine(CONFIG, settings, slots=4)
    got, seen = _episodes(params, engine)
    _assert_episode_rows(params, got, seen, 40, atol=1e-4)
    # A sequence's draws depend on its id, not on its slot.
    other = engine_lib.ContinuousEngine(CONFIG, settings, slots=8, insert_lanes=1)
    np.testing.assert_array_equal(_episodes(params, other)[0].out.tokens_BxT, got.out.tokens_BxT)


def test_the_registry_holds_every_engine_and_the_config_reads_it():
    from m2po_jax.common import config_schema, knobs

    assert engine_lib.ENGINES == {
        "static": engine_lib.StaticEngine,
        "continuous": engine_lib.ContinuousEngine,
        "paged": engine_lib.PagedEngine,
    }
    declared = dict(knobs.knobs(config_schema.Config))["rollout.engine"].choices
    assert sorted(declared) == sorted(["auto", *engine_lib.ENGINES])
    with pytest.raises(ValueError, match=r"^rollout.engine='vllm': unknown; known: "):
        engine_lib.engine_class("vllm")
    with pytest.raises(ValueError, match="not a RolloutEngine"):
        engine_lib.register("other")(dict)


def test_the_static_engine_is_the_sampler_streams_per_unit_and_runs_no_episodes(params, greedy):
    static = engine_lib.StaticEngine(CONFIG, greedy)
    want = sampling.generate(params, CONFIG, TOKENS, VALID, jax.random.key(3), greedy, N)
    got = static.generate(params, TOKENS, VALID, jax.random.key(3), n_samples=N, version=5)
    _assert_same_rollouts(got.out, want)
    assert got.version_BxN.shape == (24, 16) and (got.version_BxN == 5).all()
    units = [(TOKENS, VALID, jax.random.key(3)), (TOKENS[:4], VALID[:4], jax.random.key(4))]
    first, second = static.stream(params, units, n_samples=N)
    _assert_same_rollouts(first.out, want)
    assert second.out.tokens_BxT.shape[0] == 8
    with pytest.raises(ValueError, match=r"^rollout.engine='static' runs no multi-turn episodes"):
        static.episodes(params, TOKENS, VALID, jax.random.key(3), lambda turns: [])


@pytest.mark.parametrize("max_append", [0, 8])
def test_programs_compile_from_their_abstract_arguments(params, greedy, max_append):
    """What --compile_only compiles: each program from its abstract arguments and the
    outputs of those before it."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    continuous = engine_lib.ContinuousEngine(CONFIG, greedy, slots=4, insert_lanes=2)
    want = ["engine_prefill", "engine_start", "engine_run"] + ["engine_append"] * bool(max_append)
    cases = [(continuous, want)]
    if not max_append:
        cases.append((engine_lib.StaticEngine(CONFIG, greedy), ["sampler"]))
    else:  # the paged engine's episodes: its resume and append programs too
        paged = ["engine_prefill", "engine_start", "engine_run", "engine_resume", "engine_append"]
        cases.insert(0, (engine_lib.PagedEngine(CONFIG, greedy, slots=4, page_size=4), paged))
    for engine, names in cases:
        outputs = {}
        programs = engine.programs(abstract, 12, N, prompt_len=WIDTH, max_append=max_append)
        assert [p.name for p in programs] == names
        for program in programs:
            args = [
                outputs[a.program] if isinstance(a, engine_lib.OutputOf) else a
                for a in program.args
            ]
            outputs[program.name] = program.jitted.lower(*args).compile().out_info
    if max_append:
        assert programs[1].what == "4 slots per engine, 2 insert lanes"
    with pytest.raises(ValueError, match="runs no multi-turn episodes"):
        engine_lib.StaticEngine(CONFIG, greedy).programs(
            abstract, 12, N, prompt_len=8, max_append=8
        )
