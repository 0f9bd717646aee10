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
    rollout = setup_lib.rollout_model_config(cfg, MODEL)
    engine = setup_lib.build_engine(cfg, rollout, decoding, placement, limit)
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
