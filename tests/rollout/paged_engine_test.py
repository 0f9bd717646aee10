"""The paged engine against the static sampler (greedy), the continuous engine (sampled: the
same keys give the same tokens), a teacher-forced forward, a pool so small that sequences
are preempted and recomputed, a group's prompt stored once, weights taken in flight, and
multi-turn episodes whose pending turns do not stop the other sequences."""

import dataclasses
import queue
import threading
import time

import jax
import numpy as np
import pytest
from engine_test import (
    PAD,
    STOPS,
    TOKENS,
    VALID,
    WIDTH,
    _assert_episode_rows,
    _assert_same_rollouts,
    _episodes,
)
from sampling_test import CONFIG, _random_params, _teacher_forced_logp

from m2po_jax.rollout import engines as engine_lib
from m2po_jax.rollout import sampling
from m2po_jax.rollout.engines import PagedEngine

N = 2
PG = 4  # tokens per page: prompts of 1-8 tokens take 1-2 pages, completions up to 4


@pytest.fixture(scope="module")
def params():
    return _random_params(CONFIG, seed=0, std=0.1)


@pytest.fixture(scope="module")
def sampled():
    return sampling.SamplingConfig(max_new_tokens=12, temperature=0.8, pad_id=PAD)


@pytest.fixture(scope="module")
def continuous(params, sampled):
    return engine_lib.ContinuousEngine(CONFIG, sampled, slots=4).generate(
        params, TOKENS, VALID, jax.random.key(3), n_samples=N
    )


def test_greedy_equals_the_static_sampler(params):
    settings = sampling.SamplingConfig(
        max_new_tokens=16, greedy=True, pad_id=PAD, stop_token_ids=(5, 17, 33)
    )
    want = sampling.generate(params, CONFIG, TOKENS, VALID, jax.random.key(0), settings, N)
    got = PagedEngine(CONFIG, settings, slots=4, page_size=PG).generate(
        params, TOKENS, VALID, jax.random.key(0), n_samples=N, version=7
    )
    _assert_same_rollouts(jax.device_get(got.out), jax.device_get(want))
    np.testing.assert_array_equal(got.version_BxN, 7)
    assert got.preemptions == 0 and got.live_steps == int(np.sum(want.completion_len_B - 1))


@pytest.mark.parametrize("pages, chunk", [(0, 256), (21, 256), (21, 4)])
def test_sampled_rows_are_the_continuous_engines_and_a_forward_s_preempted_or_not(
    params, sampled, continuous, pages, chunk, monkeypatch
):
    """The same keys give the continuous engine's tokens; the behaviour log-probs equal a
    teacher-forced forward over the whole row. With 21 pages (the 12 prompts take 17, a
    completion up to 4 with its prompt's partly filled last page copied) sequences are
    preempted, recomputed, and give the same rows; also when the recompute runs in chunks
    of 4 tokens (up to 3 of them: each attends to the pages the ones before it wrote)."""
    from m2po_jax.models import paged

    monkeypatch.setattr(paged, "RESUME_CHUNK", chunk)
    engine = PagedEngine(CONFIG, sampled, slots=4, page_size=PG, pages=pages)
    got = engine.generate(params, TOKENS, VALID, jax.random.key(3), n_samples=N)
    out = jax.device_get(got.out)
    _assert_same_rollouts(out, jax.device_get(continuous.out))
    expected = _teacher_forced_logp(params, out, 0.8)
    mask = np.asarray(out.completion_mask_BxT)
    np.testing.assert_allclose(np.asarray(out.behav_logp_BxT)[mask], expected[mask], atol=1e-5)
    if pages:
        assert got.preemptions > 0 and got.peak_pages == pages
    else:
        assert got.preemptions == 0 and got.peak_pages <= got.pages


def test_a_groups_prompt_pages_are_stored_once(params):
    """16 prompts x 8 samples against 128 prompts x 1 of the same lengths (completions
    run to the budget): the pages in use at once differ by exactly 112 prompts' pages."""
    settings = sampling.SamplingConfig(max_new_tokens=6, temperature=1.0, pad_id=PAD)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(1, 90, size=n)) for n in rng.integers(5, 13, size=16)]
    tokens, valid = sampling.pad_prompts(prompts, PAD)
    engine = PagedEngine(CONFIG, settings, slots=128, page_size=PG)
    grouped = engine.generate(params, tokens, valid, jax.random.key(0), n_samples=8)
    alone = engine.generate(
        params, np.repeat(tokens, 8, 0), np.repeat(valid, 8, 0), jax.random.key(0), n_samples=1
    )
    prompt_pages = sum(-(-len(p) // PG) for p in prompts)
    assert alone.peak_pages - grouped.peak_pages == 7 * prompt_pages
    assert grouped.peak_pages == prompt_pages + 128 * 2  # 5 cached tokens: 2 pages each


def test_weights_taken_in_flight_are_recorded_per_token(params):
    settings = sampling.SamplingConfig(max_new_tokens=16, greedy=True, pad_id=PAD)
    other = _random_params(CONFIG, seed=1, std=0.1)
    engine = PagedEngine(CONFIG, settings, slots=4, insert_lanes=4, chunk_steps=5, page_size=PG)
    got = engine.generate(
        params, TOKENS, VALID, jax.random.key(0), n_samples=N, weights=lambda: (other, 1)
    )
    old = sampling.generate(params, CONFIG, TOKENS, VALID, jax.random.key(0), settings, N)
    assert got.weight_updates == 1
    # The first 4 sequences ran their prefill token and 5 decode steps on the old weights.
    np.testing.assert_array_equal(got.version_BxN[:4, :6], 0)
    np.testing.assert_array_equal(got.version_BxN[:4, 6:], 1)
    tokens = np.asarray(got.out.tokens_BxT)
    np.testing.assert_array_equal(
        tokens[:4, : WIDTH + 6], np.asarray(old.tokens_BxT)[:4, : WIDTH + 6]
    )
    # Later sequences draw their first token from the prompts' prefill (version 0), then 1.
    np.testing.assert_array_equal(got.version_BxN[4:, 0], 0)
    np.testing.assert_array_equal(got.version_BxN[4:, 1:], 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pages=16), r"rollout.kv_pages=16: the pool must hold every prompt \(17 pages "),
        (dict(page_size=0), r"rollout.page_size: must be an int >= 1, got 0"),
        (dict(slots=-1), r"rollout.engine_slots: must be an int >= 0, got -1"),
    ],
)
def test_bad_settings_are_named(params, sampled, kwargs, match):
    with pytest.raises(ValueError, match=match):
        PagedEngine(CONFIG, sampled, **{"page_size": PG, **kwargs}).generate(
            params, TOKENS, VALID, jax.random.key(0), n_samples=N
        )


def test_samples_differ_by_key(params, sampled):
    engine = PagedEngine(CONFIG, dataclasses.replace(sampled), slots=8, page_size=PG)
    a = engine.generate(params, TOKENS, VALID, jax.random.key(3), n_samples=N)
    b = engine.generate(params, TOKENS, VALID, jax.random.key(4), n_samples=N)
    assert not np.array_equal(np.asarray(a.out.tokens_BxT), np.asarray(b.out.tokens_BxT))


def test_a_stream_yields_each_batch_with_the_tokens_it_gets_alone(params, sampled):
    """Three batches through 4 slots and one pool (small enough to preempt): each is
    yielded in order with the rows `generate` gives it alone under its key."""
    engine = PagedEngine(CONFIG, sampled, slots=4, page_size=PG, pages=30, chunk_steps=3)
    half = len(TOKENS) // 2
    units = [
        (TOKENS[:half], VALID[:half], jax.random.key(1)),
        (TOKENS[half:], VALID[half:], jax.random.key(2)),
        (TOKENS[:half][::-1], VALID[:half][::-1], jax.random.key(3)),
    ]
    alone = PagedEngine(CONFIG, sampled, slots=4, page_size=PG)
    got = list(engine.stream(params, units, n_samples=N))
    assert len(got) == 3 and sum(g.preemptions for g in got) > 0
    for g, (tokens, valid, key) in zip(got, units, strict=True):
        want = alone.generate(params, tokens, valid, key, n_samples=N)
        _assert_same_rollouts(g.out, jax.device_get(want.out))
        assert g.live_steps == want.live_steps


def _mesh_placement():
    from m2po_jax.parallel import placement as placement_lib
    from m2po_jax.parallel import sharding

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    return mesh, placement_lib.Placement(mesh, CONFIG)


def test_on_a_mesh_the_engine_gives_the_rows_of_one_device(params, sampled, continuous):
    """The trainer's rollout placement: params sharded over fsdp x tensor, prompts over the
    batch axes (4 batch shards of 3 prompts); one engine per shard, each with 2 slots and
    its quarter of the pool (9 of 36 pages, short enough to preempt), gives the single
    device's rows."""
    mesh, placement = _mesh_placement()
    sharded_params = placement.for_sampling(placement.put_params(params))
    tokens, valid = placement.to_global((TOKENS, VALID))
    engine = PagedEngine(CONFIG, sampled, slots=8, page_size=PG, pages=36, mesh=mesh)
    got = engine.generate(sharded_params, tokens, valid, jax.random.key(3), n_samples=N)
    _assert_same_rollouts(placement.to_host(got.out), jax.device_get(continuous.out))
    assert got.preemptions > 0 and got.pages == 9 and 0 < got.peak_pages <= 9
    size = engine.sizes(len(TOKENS), WIDTH, N)
    assert (size["shards"], size["slots"], size["pages"], size["jobs"]) == (4, 2, 9, 6)
    # Each device holds its shard's pages only: the pool is split 4 ways by pages,
    programs, _ = engine._compiled(len(TOKENS), WIDTH, N)
    state = programs["prefill"](sharded_params, tokens, valid, np.int32(0))
    pool_k = state.pool.kv[0]  # [2, K, NP, PG, D]: the split layout off a TPU
    assert state.pool.layout == "split" and pool_k.shape[2] == 36
    # and its KV heads split over "tensor" (1 of the 2 per device).
    k, d = CONFIG.num_kv_heads, pool_k.shape[4]
    assert {s.data.shape for s in pool_k.addressable_shards} == {(2, k // 2, 9, PG, d)}
    assert len(pool_k.addressable_shards) == mesh.size


def test_a_stream_on_a_mesh_gives_the_rows_of_one_device(params, sampled):
    """Two units streamed through 4 batch shards (each its share of both units, 2 slots
    and 10 pages, short enough to preempt): each unit gets the rows one device's stream
    gives it."""
    mesh, placement = _mesh_placement()
    sharded_params = placement.for_sampling(placement.put_params(params))
    units = [
        (TOKENS[:8], VALID[:8], jax.random.key(1)),
        (TOKENS[4:], VALID[4:], jax.random.key(2)),
    ]
    engine = PagedEngine(CONFIG, sampled, slots=8, page_size=PG, pages=40, chunk_steps=3,
                         mesh=mesh)  # fmt: skip
    alone = PagedEngine(CONFIG, sampled, slots=8, page_size=PG, pages=40, chunk_steps=3)
    got = list(engine.stream(sharded_params, units, n_samples=N))
    want = list(alone.stream(params, units, n_samples=N))
    assert len(got) == 2 and sum(g.preemptions for g in got) > 0
    for g, w in zip(got, want, strict=True):
        _assert_same_rollouts(g.out, w.out)
        assert g.live_steps == w.live_steps and g.pages == 10


def test_on_a_mesh_the_programs_compile_from_their_sharded_abstract_arguments(params, sampled):
    """What --compile_only compiles on a mesh: each program from its abstract arguments
    (prompts and resume lanes split over the batch shards, the params as the sampler holds
    them) and the outputs of those before it; the state's pool comes out split 4 ways by
    pages and 2 by KV heads."""
    from m2po_jax.rollout.engines.base import OutputOf

    mesh, placement = _mesh_placement()
    sharded_params = placement.for_sampling(placement.put_params(params))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), sharded_params
    )
    engine = PagedEngine(CONFIG, sampled, slots=8, page_size=PG, pages=36, mesh=mesh)
    programs = engine.programs(abstract, 12, N, prompt_len=WIDTH)
    names = ["engine_prefill", "engine_start", "engine_run", "engine_resume"]
    assert [p.name for p in programs] == names
    what = "12 prompts into a pool of 9 pages of 4 tokens on each of 4 batch shards"
    assert programs[0].what == what
    assert programs[1].args[2].sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
    outputs = {}
    for program in programs:
        args = [outputs[a.program] if isinstance(a, OutputOf) else a for a in program.args]
        outputs[program.name] = program.jitted.lower(*args).compile().out_info
    pool_k = outputs["engine_prefill"].pool.kv[0]
    assert pool_k.shape[2] == 36 and pool_k.sharding.shard_shape(pool_k.shape)[:4] == (2, 1, 9, PG)


def test_a_short_pool_preempts_the_youngest_sequences_as_few_as_cover_the_need():
    """vLLM's rule, on a hand-made state: 3 live slots admitted in order (ages 0, 1, 2)
    holding 2, 1 and 1 pages, none free; slots 0 and 2 each need a page. Preempting the
    youngest (slot 2) frees 1 page and drops its need: slot 0's need is covered, so slot 2
    alone waits, its pages returned and its sequence (job 5) queued to resume."""
    import jax.numpy as jnp

    from m2po_jax.rollout.engines import paged as paged_engine

    none = 10
    state = paged_engine._State(
        pool=None,
        free_N=jnp.asarray([7, 8, 9, 0, 0, 0, 0, 0, 0, 0], jnp.int32),
        free_1=jnp.zeros(1, jnp.int32),
        prompt_table_IxM=None,
        prompt_len_I=None,
        logits_IxV=None,
        prefill_version=None,
        job_S=jnp.asarray([3, 4, 5], jnp.int32),
        step_S=None,
        last_token_S=None,
        live_S=jnp.ones(3, bool),
        held_S=jnp.zeros(3, bool),
        own_table_SxM=jnp.asarray([[1, 2], [3, none], [4, none]], jnp.int32),
        age_S=jnp.asarray([0, 1, 2], jnp.int32),
        admitted_1=None,
        next_job_1=None,
        waiting_J=jnp.zeros(8, bool),
        unit_J=None,
        seq_id_J=None,
        tokens_JxN=None,
        logp_JxN=None,
        valid_JxN=None,
        sampled_JxN=None,
        version_JxN=None,
        stopped_J=None,
        done_J=jnp.zeros(8, bool),
        decode_steps_1=None,
        live_steps_1=None,
        preemptions_1=jnp.zeros(1, jnp.int32),
        peak_1=None,
    )
    state, live_S = paged_engine._preempt(state, jnp.asarray([True, False, True]))
    np.testing.assert_array_equal(live_S, [True, True, False])
    np.testing.assert_array_equal(state.job_S, [3, 4, 8])
    np.testing.assert_array_equal(state.own_table_SxM[2], [none, none])
    np.testing.assert_array_equal(np.flatnonzero(state.waiting_J), [5])
    assert int(state.free_1[0]) == 1 and int(state.free_N[0]) == 4
    assert int(state.preemptions_1[0]) == 1
    # Enough pages free: nobody is preempted.
    state, live_S = paged_engine._preempt(state, jnp.asarray([True, False, False]))
    np.testing.assert_array_equal(live_S, [True, True, False])
    assert int(state.preemptions_1[0]) == 1


# ---------------------------------------------------------------- multi-turn episodes

TURNS = sampling.SamplingConfig(
    max_new_tokens=40, temperature=0.8, pad_id=PAD, stop_token_ids=STOPS
)


@pytest.fixture(scope="module")
def continuous_episodes(params):
    return _episodes(params, engine_lib.ContinuousEngine(CONFIG, TURNS, slots=4))[0]


@pytest.mark.parametrize("pages", [0, 30])
def test_episodes_are_the_continuous_engines_parked_and_preempted_or_not(
    params, continuous_episodes, pages
):
    """The continuous engine's episode test on the paged engine: rows = prompt ++ sampled
    turns ++ appended ids, the loss mask on sampled tokens, versions -1 on appended ones,
    log-probs a teacher-forced forward's (1e-5), and the continuous engine's tokens under
    the same key. With 30 pages (the prompts take 17, a sequence up to 10) sequences are
    preempted while others are parked, and appends the pool cannot hold park theirs out
    to be recomputed: the same rows."""
    engine = PagedEngine(CONFIG, TURNS, slots=4, page_size=PG, pages=pages)
    got, seen = _episodes(params, engine)
    _assert_episode_rows(params, got, seen, 40, atol=1e-5)
    want = continuous_episodes
    for field in ("tokens_BxT", "valid_BxT", "completion_mask_BxT", "stopped_B"):
        np.testing.assert_array_equal(
            np.asarray(getattr(got.out, field)), np.asarray(getattr(want.out, field)), field
        )
    np.testing.assert_array_equal(got.version_BxN, want.version_BxN)
    assert (got.preemptions > 0) == bool(pages)
    assert got.peak_pages <= (pages or got.pages)


def test_on_a_mesh_episodes_run_as_one_program_and_give_one_devices_rows(
    params, continuous_episodes
):
    """`episodes` on a mesh keeps one program over every slot and page (partitioned by
    XLA, not split by batch shard): the rows of one device, preempted and parked."""
    mesh, placement = _mesh_placement()
    sharded_params = placement.for_sampling(placement.put_params(params))
    engine = PagedEngine(CONFIG, TURNS, slots=4, page_size=PG, pages=30, mesh=mesh)
    assert engine.sizes(len(TOKENS), WIDTH, N, turns=True)["shards"] == 1
    got, seen = _episodes(sharded_params, engine)
    want = continuous_episodes
    for field in ("tokens_BxT", "valid_BxT", "completion_mask_BxT", "stopped_B"):
        np.testing.assert_array_equal(
            np.asarray(getattr(got.out, field)), np.asarray(getattr(want.out, field)), field
        )
    assert got.preemptions > 0 and got.pages == 30


class _Answers:
    """`_episodes`' answers as a `TurnQueue` answered on threads, each after `fast_s`
    seconds (a tool's latency) but row 0's first, after `slow_s`. `blocking`: a plain
    `on_turns` answering its turns at once on threads and waiting for all of them, as
    the episode driver does for an engine that waits."""

    def __init__(self, slow_s: float, fast_s: float = 0.02):
        self.slow_s, self.fast_s = slow_s, fast_s
        self.seen, self.done = {}, queue.SimpleQueue()

    def answer(self, turn):
        past = self.seen.setdefault(turn.row, [])
        delta = [turn.row % 50 + 1, 91, 92 + len(past)]
        go = len(past) < 2 and not turn.cut and turn.room >= len(delta)
        past.append((turn.start, list(turn.tokens), delta if go else None))
        time.sleep(self.slow_s if turn.row == 0 and len(past) == 1 else self.fast_s)
        return delta if go else None

    def submit(self, turns):
        for turn in turns:
            threading.Thread(target=lambda t=turn: self.done.put((t, self.answer(t)))).start()

    def poll(self, timeout_s):
        ready = []
        try:
            ready.append(self.done.get(timeout_s != 0, timeout_s))
            while True:
                ready.append(self.done.get_nowait())
        except queue.Empty:
            return ready

    def blocking(self, turns):
        self.submit(turns)
        answers = {}
        while len(answers) < len(turns):
            answers.update((t.row, a) for t, a in self.poll(None))
        return [answers[t.row] for t in turns]


def test_a_slow_answer_holds_back_its_own_episode_only(params, continuous_episodes):
    """Answers take 20 ms, row 0's first 1 s: through a `TurnQueue` the other sequences
    decode and get their answers meanwhile (decode steps while waiting) and the run ends
    well before the same engine waiting for every held turn's answer at once (the
    continuous engine's way); the rows are the same either way."""
    engine = PagedEngine(CONFIG, TURNS, slots=4, page_size=PG)

    def run(on_turns):
        start = time.perf_counter()
        got = engine.episodes(
            params, TOKENS, VALID, jax.random.key(0), on_turns, n_samples=N, version=3,
            max_append=8,
        )  # fmt: skip
        return got, time.perf_counter() - start

    run(_Answers(0.0, 0.0).blocking)  # compiles
    blocking, blocked_s = run(_Answers(1.0).blocking)
    free, free_s = run(_Answers(1.0))
    _assert_same_rollouts(jax.device_get(free.out), jax.device_get(continuous_episodes.out))
    _assert_same_rollouts(jax.device_get(blocking.out), jax.device_get(continuous_episodes.out))
    assert blocking.decode_steps_while_waiting == 0 < free.decode_steps_while_waiting
    print(f"blocking {blocked_s:.2f}s, non-blocking {free_s:.2f}s, "
          f"{free.decode_steps_while_waiting} of {free.decode_steps} decode steps while waiting")  # fmt: skip
    assert free_s < blocked_s - 0.5, (free_s, blocked_s)


def test_on_a_gpu_the_triton_kernels_decode_gives_the_same_rollouts(
    params, sampled, continuous, monkeypatch
):
    """Traced for a GPU, the decode steps run jax's Triton paged attention kernel (in
    Pallas' interpreter here) over the split pool: greedy rows are the static sampler's,
    and a pool short enough to preempt gives the continuous engine's sampled rows."""
    from jax.experimental.pallas.ops.gpu import paged_attention

    from m2po_jax.models import attention_kernels, paged_kernels

    calls = []

    def interpreted(*args, **kwargs):
        calls.append(args[0].shape)
        return paged_attention.paged_attention(*args, **{**kwargs, "interpret": True})

    monkeypatch.setattr(paged_kernels, "_gpu_kernel", interpreted)
    monkeypatch.setattr(attention_kernels, "target_platform", lambda: "gpu")
    settings = sampling.SamplingConfig(max_new_tokens=10, greedy=True, pad_id=PAD,
                                       stop_token_ids=(5, 17, 33))  # fmt: skip
    want = sampling.generate(params, CONFIG, TOKENS, VALID, jax.random.key(0), settings, N)
    got = PagedEngine(CONFIG, settings, slots=4, page_size=PG).generate(
        params, TOKENS, VALID, jax.random.key(0), n_samples=N
    )
    assert calls and all(shape == (4, CONFIG.num_heads, CONFIG.dim_per_head) for shape in calls)
    _assert_same_rollouts(jax.device_get(got.out), jax.device_get(want))
    got = PagedEngine(CONFIG, sampled, slots=4, page_size=PG, pages=21).generate(
        params, TOKENS, VALID, jax.random.key(3), n_samples=N
    )
    _assert_same_rollouts(jax.device_get(got.out), jax.device_get(continuous.out))
    assert got.preemptions > 0
