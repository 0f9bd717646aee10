"""The per-device memory plan counts what a run holds, and the check refuses what cannot fit."""

import pytest

from m2po_jax import memory, sharding
from m2po_jax import model as model_lib

CFG = model_lib.ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2
)
MESHES = {
    "data8": {"data": 8},
    "fsdp8": {"fsdp": 8},
    "d2f2t2": {"data": 2, "fsdp": 2, "tensor": 2},
}


def mesh_of(name):
    return sharding.make_mesh(MESHES[name])


def test_memory_plan_scales_with_fsdp():
    kwargs = dict(batch=16, seq_len=32, micro_batch=16, kv_cache_batch=8, kv_cache_len=48)
    data8 = memory.memory_plan(CFG, mesh_of("data8"), **kwargs)
    fsdp8 = memory.memory_plan(CFG, mesh_of("fsdp8"), **kwargs)
    assert data8.params == CFG.num_params() * 4  # replicated, float32
    assert fsdp8.params == data8.params // 8  # every param has an "embed" dim
    assert fsdp8.optimizer == 2 * fsdp8.params and fsdp8.gradients == fsdp8.params
    # Batch is split 8 ways in both layouts, so activations agree.
    assert fsdp8.activations == data8.activations
    # KV cache: 2 (k, v) x layers x 1 row x 48 cols x 2 kv heads x 8 head dim x 4 bytes.
    assert data8.kv_cache == 2 * 2 * 1 * 48 * 2 * 8 * 4
    tp = memory.memory_plan(CFG, mesh_of("d2f2t2"), **kwargs)
    assert tp.kv_cache == 2 * 2 * 2 * 48 * 1 * 8 * 4  # 2 rows per device, kv heads split
    half = memory.memory_plan(CFG, mesh_of("fsdp8"), **{**kwargs, "micro_batch": 8})
    assert half.activations * 2 == fsdp8.activations
    assert half.logits == 2 * 1 * 32 * 64 * 4  # f32 logits and grad, 1 row per device
    remat = memory.memory_plan(CFG, mesh_of("fsdp8"), **kwargs, remat=True)
    assert remat.activations < fsdp8.activations
    bf16 = memory.memory_plan(CFG, mesh_of("fsdp8"), **kwargs, param_dtype_bytes=2)
    assert bf16.params * 2 == fsdp8.params
    assert fsdp8.total == sum(
        getattr(fsdp8, f)
        for f in ("params", "optimizer", "gradients", "activations", "logits", "kv_cache")
    )
    table = fsdp8.format()
    assert "params" in table and "total" in table and "fsdp=8" in table


def test_memory_plan_errors():
    mesh = mesh_of("data8")
    with pytest.raises(ValueError, match="micro_batch"):
        memory.memory_plan(CFG, mesh, batch=16, seq_len=8, micro_batch=5)
    with pytest.raises(ValueError, match="optimizer"):
        memory.memory_plan(CFG, mesh, batch=16, seq_len=8, optimizer="adagrad")


def test_check_fits():
    plan = memory.memory_plan(CFG, mesh_of("fsdp8"), batch=16, seq_len=32)
    assert memory.check_fits(plan, device_memory_bytes=plan.total + 1) == plan.total + 1
    limit = plan.total // 2
    with pytest.raises(MemoryError) as err:
        memory.check_fits(plan, device_memory_bytes=limit)
    assert str(plan.total) in str(err.value) and str(limit) in str(err.value)
    # CPU devices report no memory limit: the check is skipped.
    if memory.device_memory_limit() is None:
        assert memory.check_fits(plan) is None
