"""The paged engine's default pool sized by what the device has left (`setup.kv_budget`):
the engine the trainer builds and the memory plan agree on its pages, on one device and
on a mesh's batch shards; a roomy device gives the whole default, a set `rollout.kv_pages`
is kept, a device too small for the least pool is refused before any work."""

from __future__ import annotations

import jax
import pytest

from configs import arith
from m2po_jax import config as config_lib
from m2po_jax.learner import memory
from m2po_jax.models import model_config as model_config_lib
from m2po_jax.parallel import placement as placement_lib
from m2po_jax.parallel import sharding
from m2po_jax.rollout import engines, sampling
from m2po_jax.trainer import setup as setup_lib

MODEL = model_config_lib.ModelConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, dtype="float32",
)  # fmt: skip


def _cfg(**changes):
    c = arith.get_config("m2po,tiny")
    c.mesh.data = 1
    base = {"rollout.engine": "paged", "gconfig.max_new_tokens": 64, "rollout.batch_size": 8}
    config_lib.apply_dotted(c, {**base, **changes})
    return config_lib.from_configdict(c)


def _placement(cfg, shape=None):
    shape = shape or {"data": 1, "fsdp": 1, "tensor": 1}
    mesh = sharding.make_mesh(shape, jax.devices()[: shape["data"] * shape["tensor"]])
    return placement_lib.Placement(mesh, MODEL)


def _pool(cfg, placement, limit):
    """(pages of the engine the run builds, per shard, for its rollouts; the plan's)."""
    decoding = sampling.from_gconfig(cfg.gconfig, (0,), 0)
    engine = setup_lib.build_engine(cfg, MODEL, decoding, placement, limit)
    size = engine.sizes(cfg.rollout.batch_size, cfg.task.max_prompt_len, cfg.gconfig.n_samples)
    plan, kwargs = setup_lib.memory_plan(cfg, MODEL, placement, limit)
    return engine, size, plan, kwargs


@pytest.mark.parametrize("shape", [None, {"data": 2, "fsdp": 1, "tensor": 2}])
def test_the_default_pool_takes_what_the_plan_leaves_of_the_device(shape):
    cfg = _cfg(**({"mesh.data": 2, "mesh.tensor": 2} if shape else {}))
    placement = _placement(cfg, shape)
    engine, full, roomy_plan, _ = _pool(cfg, placement, None)
    assert engine.name == "paged" and engine.kv_budget == 0
    least = full["pages"] - (full["slots"] - 1) * full["own"]  # the prompts and one completion
    # A device whose 90% holds the plan with about half of the slots' completions.
    _, _, least_plan, _ = _pool(
        _cfg(**{"rollout.kv_pages": least * full["shards"]}), placement, None
    )
    page = engine.page_bytes
    half = least_plan.sampling + (full["pages"] - least) // 2 * page
    limit = int(half / setup_lib.POOL_MEMORY_FRACTION)
    engine, size, plan, kwargs = _pool(cfg, placement, limit)
    assert engine.kv_budget > 0
    assert least < size["pages"] < full["pages"], (least, size["pages"], full["pages"])
    assert abs(size["pages"] - (least + (full["pages"] - least) // 2)) <= 1
    # The plan counts the pool the engine makes: 90% of the device holds it, one more
    # page would not fit (page tables: 8 bytes a page).
    assert kwargs["kv_cache_bytes"] == memory.engine_bytes(
        MODEL, "paged", prompts=cfg.rollout.batch_size, n_samples=cfg.gconfig.n_samples,
        prompt_len=cfg.task.max_prompt_len, max_new=cfg.gconfig.max_new_tokens,
        slots=cfg.rollout.engine_slots, pages=size["pages"] * size["shards"],
        page_size=cfg.rollout.page_size, insert_lanes=cfg.rollout.insert_lanes,
        shards=size["shards"], tensor=shape["tensor"] if shape else 1,
    )  # fmt: skip
    fraction = setup_lib.POOL_MEMORY_FRACTION * limit
    assert plan.sampling <= fraction + 8 * size["pages"] < plan.sampling + page
    # A roomy device: the whole default, as without a limit.
    assert _pool(cfg, placement, 100 * roomy_plan.peak)[1]["pages"] == full["pages"]
    # A pool the config sets is the config's, whatever the device.
    set_cfg = _cfg(**{"rollout.kv_pages": 2 * least * full["shards"]},
                   **({"mesh.data": 2, "mesh.tensor": 2} if shape else {}))  # fmt: skip
    engine, size, _, _ = _pool(set_cfg, placement, limit // 4)
    assert engine.kv_budget == 0 and size["pages"] == 2 * least


def test_a_device_without_room_for_the_least_pool_is_refused():
    cfg = _cfg()
    placement = _placement(cfg)
    _, full, _, _ = _pool(cfg, placement, None)
    least = full["pages"] - (full["slots"] - 1) * full["own"]
    _, _, least_plan, _ = _pool(_cfg(**{"rollout.kv_pages": least}), placement, None)
    limit = int(least_plan.sampling * 0.95)  # a rollout with the least pool does not fit
    engine, size, plan, _ = _pool(cfg, placement, limit)
    assert size["pages"] == least and plan.peak > limit
    small = _cfg(**{"mesh.device_memory_gib": limit / 2**30})
    with pytest.raises(MemoryError, match="exceeds the device memory"):
        setup_lib.check_memory(small, MODEL, placement)


def test_pool_pages_stays_between_the_least_pool_and_the_whole_default():
    assert engines.pool_pages(10, 4, 3) == 22
    assert engines.pool_pages(10, 4, 3, cap=17) == 17
    assert engines.pool_pages(10, 4, 3, cap=5) == 13  # the prompts and one completion
    assert engines.pool_pages(10, 4, 3, cap=100) == 22


def test_the_evaluation_engine_counts_where_it_holds_more():
    """An evaluation of 16 prompts x 8 (128 sequences) against rollouts of 8 x 4: the plan's
    engine line is the evaluation's engine at the pool it takes, and on a device that
    caps the pool the evaluation's engine with its pool stays within 90% of it by the
    plan (the rollouts' figure alone would leave the evaluation's buffers out)."""
    cfg = _cfg(**{"eval.batch_size": 16, "eval.n_samples": 8, "eval.temperature": 0.6})
    placement = _placement(cfg)
    _, _, roomy, _ = _pool(cfg, placement, None)
    limit = int(0.8 * roomy.sampling / setup_lib.POOL_MEMORY_FRACTION)
    engine, size, plan, kwargs = _pool(cfg, placement, limit)
    evaluation = engine.sizes(16, cfg.task.max_prompt_len, 8)
    held = dict(
        prompt_len=cfg.task.max_prompt_len, max_new=cfg.gconfig.max_new_tokens,
        slots=cfg.rollout.engine_slots, page_size=cfg.rollout.page_size,
        insert_lanes=cfg.rollout.insert_lanes,
    )  # fmt: skip
    evaluating = memory.engine_bytes(MODEL, "paged", prompts=16, n_samples=8,
                                     pages=evaluation["pages"], **held)  # fmt: skip
    rolling = memory.engine_bytes(MODEL, "paged", prompts=cfg.rollout.batch_size,
                                  n_samples=cfg.gconfig.n_samples, pages=size["pages"], **held)  # fmt: skip
    assert kwargs["kv_cache_bytes"] == evaluating > rolling
    assert plan.sampling <= setup_lib.POOL_MEMORY_FRACTION * limit


def test_a_narrower_kv_dtype_gets_more_pages_from_the_same_budget():
    """rollout.kv_dtype on a float32 model: a page of the rollouts' pool takes half
    (bfloat16) or a quarter (float8) of the bytes, so within one device limit the default
    pool gets twice or four times the pages (floors of one budget: 20, 41, 83 here); the
    plan counts that pool and the evaluation's float32 one; the static sampler's KV line
    halves and quarters. The run's engine runs the rollout config, the run (and its
    evaluation) the trained one."""
    from m2po_jax.trainer import evaluate

    cfg = _cfg()
    placement = _placement(cfg)
    base, full, _, _ = _pool(cfg, placement, None)
    least = full["pages"] - (full["slots"] - 1) * full["own"]
    _, _, least_plan, _ = _pool(_cfg(**{"rollout.kv_pages": least}), placement, None)
    extra = (full["pages"] - least) // 20 * base.page_bytes
    limit = int((least_plan.sampling + extra) / setup_lib.POOL_MEMORY_FRACTION)
    decoding = sampling.from_gconfig(cfg.gconfig, (0,), 0)
    pages = {}
    for kv_dtype, share in (("", 1), ("bfloat16", 2), ("float8_e4m3fn", 4)):
        cfg = _cfg(**{"rollout.kv_dtype": kv_dtype})
        rollout = setup_lib.rollout_model_config(cfg, MODEL)
        assert rollout == MODEL.replace(kv_dtype=kv_dtype)
        engine = setup_lib.build_engine(cfg, MODEL, decoding, placement, limit)
        assert engine.model_config == rollout and engine.page_bytes * share == base.page_bytes
        size = engine.sizes(cfg.rollout.batch_size, cfg.task.max_prompt_len, 4)
        assert least < size["pages"] == engine.kv_budget // engine.page_bytes < full["pages"]
        pages[kv_dtype] = size["pages"]
    assert 2 * pages[""] <= pages["bfloat16"] <= 2 * pages[""] + 1
    assert 4 * pages[""] <= pages["float8_e4m3fn"] <= 4 * pages[""] + 3
    # The plan: the rollouts' float8 pool as the engine sizes it, the evaluation's float32.
    _, kwargs = setup_lib.memory_plan(cfg, MODEL, placement, limit)
    evaluation = setup_lib.build_engine(cfg, MODEL, decoding, placement, limit)
    held = dict(
        prompt_len=cfg.task.max_prompt_len, max_new=cfg.gconfig.max_new_tokens,
        slots=cfg.rollout.engine_slots, page_size=cfg.rollout.page_size,
        insert_lanes=cfg.rollout.insert_lanes,
    )  # fmt: skip
    rolling = memory.engine_bytes(engine.model_config, "paged", prompts=8, n_samples=4,
                                  pages=pages["float8_e4m3fn"], **held)  # fmt: skip
    eval_pages = evaluation.sizes(cfg.eval.batch_size, cfg.task.max_prompt_len, 1)["pages"]
    evaluating = memory.engine_bytes(MODEL, "paged", prompts=cfg.eval.batch_size,
                                     n_samples=cfg.eval.n_samples, pages=eval_pages, **held)  # fmt: skip
    assert kwargs["kv_cache_bytes"] == max(rolling, evaluating)
    assert kwargs["kv_dtype_bytes"] == 1
    static = {
        kv: setup_lib.memory_plan(
            _cfg(**{"rollout.engine": "static", "rollout.kv_dtype": kv}), MODEL, placement
        )[0].kv_cache
        for kv in ("", "bfloat16", "float8_e4m3fn")
    }
    assert static[""] == 2 * static["bfloat16"] == 4 * static["float8_e4m3fn"] > 0
    run = setup_lib.build(_cfg(**{"rollout.kv_dtype": "float8_e4m3fn"}))
    assert run.model_config.kv_dtype == "" and run.engine.model_config == run.model_config.replace(
        kv_dtype="float8_e4m3fn"
    )
    assert evaluate._engine(run, run.sampling_config).model_config == run.model_config


def _least(cfg, prompts, shards=1):
    """The least pool of `prompts` prompts on `shards` batch shards: each shard's prompts'
    pages and one whole completion (the prompt's copied tail and gconfig.max_new_tokens)."""
    page = cfg.rollout.page_size
    own = -(-(cfg.gconfig.max_new_tokens + page - 1) // page)
    return shards * (prompts // shards * -(-cfg.task.max_prompt_len // page) + own)


@pytest.mark.parametrize("more", [0, 30])
def test_the_evaluation_takes_a_pool_its_batch_fits_beside_a_set_kv_pages(more):
    """rollout.kv_pages sized for the rollouts (8 prompts: 13 pages, the least) and an
    evaluation of 16 prompts (21 pages at least): the evaluation's engine takes the pool its
    batch needs, the rollouts' keeps the config's, and the plan counts both; a kv_pages
    above the evaluation's least is the evaluation's too. (Before, the evaluation ran in
    the rollouts' 13 pages and the run died at its first evaluation.)"""
    import numpy as np

    from m2po_jax.trainer import evaluate

    probe = _cfg(**{"eval.batch_size": 16})
    rollouts, evaluation = _least(probe, 8), _least(probe, 16)
    assert (rollouts, evaluation) == (13, 21)
    cfg = _cfg(**{"eval.batch_size": 16, "rollout.kv_pages": rollouts + more})
    run = setup_lib.build(cfg)
    width, n = cfg.task.max_prompt_len, cfg.gconfig.n_samples
    assert run.engine.sizes(8, width, n)["pages"] == rollouts + more
    engine = evaluate._engine(run, evaluate.decoding(run))
    size = engine.sizes(16, width, cfg.eval.n_samples)
    assert size["pages"] == max(evaluation, rollouts + more)
    engine._check_pool(np.ones((16, width), bool), size)  # what the first evaluation checks
    _, kwargs = setup_lib.memory_plan(cfg, run.model_config, run.placement)
    held = dict(
        prompt_len=width, max_new=cfg.gconfig.max_new_tokens, slots=0, page_size=16,
        insert_lanes=0,
    )  # fmt: skip
    assert kwargs["kv_cache_bytes"] == max(
        memory.engine_bytes(run.model_config, "paged", prompts=8, n_samples=n,
                            pages=rollouts + more, **held),
        memory.engine_bytes(run.model_config, "paged", prompts=16, n_samples=1,
                            pages=size["pages"], **held),
    )  # fmt: skip


PAGED_SIZES_REFUSED = [
    ({"rollout.kv_pages": 12}, r"^rollout\.kv_pages=12: the rollouts' pool must hold .* at least 13$"),
    (
        {"mesh.data": 2, "rollout.engine_slots": 3},
        r"^rollout\.engine_slots=3: must divide over the mesh's 2 batch shards",
    ),
    (
        {"mesh.data": 2, "rollout.kv_pages": 27},
        r"^rollout\.kv_pages=27: must divide over the mesh's 2 batch shards",
    ),
    (
        {"rollout.stream_batches": 2, "rollout.mode": "async", "mesh.rollout_devices": 1,
         "rollout.kv_pages": 20},
        r"^rollout\.kv_pages=20: the rollouts' pool must hold .*rollout\.stream_batches=2.* "
        r"at least 21$",
    ),
]  # fmt: skip


@pytest.mark.parametrize("changes, message", PAGED_SIZES_REFUSED)
def test_the_paged_engines_sizes_are_refused_at_setup(changes, message):
    """Sizes the paged engine cannot run are refused by `setup.build` (the trainer's
    setup: the CLI's one line and exit 2) in one line naming the field, before any
    program runs, not when the engine first generates (inside the warm-up's first
    accuracy check, a traceback)."""
    from m2po_jax.trainer import compile_only

    cfg = _cfg(**changes)
    with pytest.raises(ValueError, match=message) as err:
        setup_lib.build(cfg)
    assert "\n" not in str(err.value)
    # --compile_only refuses it as the run does, before its first compile
    with pytest.raises(ValueError, match=message):
        compile_only._placements(cfg, MODEL, jax.devices()[:2])


@pytest.mark.parametrize("weight_dtype", ["int8", "bfloat16"])
def test_the_pool_budget_counts_the_trainers_weights_under_cheaper_rollout_weights(
    monkeypatch, weight_dtype
):
    """rollout.weight_dtype int8 / bfloat16: the budget of the rollouts' pool is what the
    plan of the trainer's config (float32 params and optimizer state) leaves, in the run
    (`setup.build`) and in `--compile_only` (its engines); the rollouts' config passed as
    the trainer's is refused (it counted the train state at the rollouts' bytes: a pool
    1.3-1.4x too large on an 80 GiB device)."""
    from m2po_jax.trainer import compile_only

    limit_gib = 1 / 64
    cfg = _cfg(**{"rollout.weight_dtype": weight_dtype, "mesh.device_memory_gib": limit_gib})
    run = setup_lib.build(cfg)
    limit = int(limit_gib * 2**30)
    rollout = setup_lib.rollout_model_config(cfg, run.model_config)
    assert rollout != run.model_config
    want = setup_lib.kv_budget(cfg, run.model_config, run.placement, limit)
    plan, _ = setup_lib.memory_plan(cfg, run.model_config, run.placement, limit)
    n_params = sum(x.size for x in jax.tree.leaves(sharding.param_shapes(run.model_config)))
    assert plan.params == 4 * n_params  # the trained float32 params, not the rollouts'
    assert 0 < want and run.engine.kv_budget == want
    assert run.engine.model_config == rollout
    with pytest.raises(ValueError, match="the trainer's model config"):
        setup_lib.kv_budget(cfg, rollout, run.placement, limit)
    built = []
    monkeypatch.setattr(
        compile_only, "_compile_engine", lambda engine, *a, **k: built.append(engine) or []
    )
    monkeypatch.setattr(compile_only, "_compile_decode", lambda *a: None)
    shapes = sharding.param_shapes(run.model_config)
    compile_only._sampling_programs(
        cfg, run.model_config, rollout, (run.placement, run.placement), None, shapes,
        cfg.rollout.batch_size, limit, ((0,), 0), lambda program: program,
    )  # fmt: skip
    assert [e.kv_budget for e in built] == [want, want]
    assert [e.model_config for e in built] == [rollout, run.model_config]
