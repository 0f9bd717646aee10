"""The per-device memory plan counts what a run holds, and the check refuses what cannot fit."""

import math

import jax
import pytest

from m2po_jax import config as config_lib
from m2po_jax.configs import default
from m2po_jax.learner import memory
from m2po_jax.models import model_config as model_config_lib
from m2po_jax.parallel import placement as placement_lib
from m2po_jax.parallel import sharding
from m2po_jax.trainer import memory_check
from m2po_jax.trainer import setup as setup_lib

CFG = model_config_lib.ModelConfig(
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
    # The head's chunk: 1 row per device x 31 predicting columns x V, f32 logits, softmax, grad.
    assert half.logits == 3 * 1 * 31 * 64 * 4
    assert half.gradients == fsdp8.gradients + fsdp8.params  # + the f32 accumulator
    # Remat keeps one layer's input per layer plus one layer (and its gradients) in flight.
    deep = CFG.replace(num_layers=8)
    full = memory.memory_plan(deep, mesh_of("fsdp8"), **kwargs)
    remat = memory.memory_plan(deep, mesh_of("fsdp8"), **kwargs, remat=True)
    assert remat.activations == 8 * 2 * 32 * 32 * 4 + 2 * full.activations // 8
    bf16 = memory.memory_plan(CFG, mesh_of("fsdp8"), **kwargs, param_dtype_bytes=2)
    assert bf16.params * 2 == fsdp8.params
    # The sampler's weights: split over tensor only. Data-parallel: the train layout.
    assert data8.sampling_weights == 0
    assert fsdp8.sampling_weights == data8.params  # fsdp without tensor: all of them
    assert tp.sampling_weights < data8.params and tp.sampling_weights > data8.params // 2
    no_sampler = memory.memory_plan(CFG, mesh_of("fsdp8"), **{**kwargs, "kv_cache_batch": 0})
    assert no_sampler.sampling_weights == 0 and no_sampler.kv_cache == 0
    fields = "params optimizer gradients stacked_layers activations logits kv_cache".split()
    fields += ["sampling_weights"]
    assert fsdp8.total == sum(getattr(fsdp8, f) for f in fields)
    assert fsdp8.train_step == fsdp8.total - fsdp8.kv_cache - fsdp8.sampling_weights
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
    assert memory_check.check_fits(plan, device_memory_bytes=plan.total + 1) == plan.total + 1
    limit = plan.total // 2
    with pytest.raises(MemoryError) as err:
        memory_check.check_fits(plan, device_memory_bytes=limit)
    assert str(plan.total) in str(err.value) and str(limit) in str(err.value)
    # CPU devices report no memory limit: the check is skipped.
    if memory_check.device_memory_limit() is None:
        assert memory_check.check_fits(plan) is None


def _run_config(rows, seq_len, prompt_len, n_samples, n_mbs):
    c = default.get_config()
    c.rollout.batch_size = rows // n_samples
    c.gconfig.n_samples = n_samples
    c.task.max_prompt_len = prompt_len
    c.gconfig.max_new_tokens = seq_len - prompt_len
    c.actor.mb_spec.n_mbs = n_mbs
    c.actor.mb_spec.max_tokens_per_mb = 0
    return config_lib.from_configdict(c)


BASE = dict(
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=704,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
)


@pytest.mark.parametrize(
    "model,rows,seq_len,n_samples,n_mbs,share,blocks",
    [
        (dict(BASE, vocab_size=512), 8, 512, 8, 1, True, 8),
        (BASE, 8, 512, 8, 1, True, 1),  # blocks do not pay at this vocabulary
        (BASE, 8, 512, 8, 1, False, 1),
        ({**BASE, "remat": True}, 8, 512, 2, 4, True, 1),
        (
            dict(BASE, vocab_size=151936, hidden_size=128, tie_word_embeddings=True),
            8,
            256,
            4,
            2,
            True,
            1,
        ),
    ],
    ids=["shared-blocks", "shared", "plain", "remat-4-micro", "152k-vocab-tied"],
)
def test_memory_plan_is_within_25_percent_of_xla(
    model, rows, seq_len, n_samples, n_mbs, share, blocks
):
    """The plan of the path the step plan picks, against XLA's analysis of the step the
    trainer builds (`setup.build_train_step`, through `compiled_step_memory`)."""
    config = model_config_lib.ModelConfig(**model)
    cfg = _run_config(rows, seq_len, seq_len // 4, n_samples, n_mbs)
    placement = placement_lib.Placement.from_shape({"data": 1, "fsdp": 1, "tensor": 1}, config)
    xla = setup_lib.compiled_step_memory(cfg, config, placement, share_prompts=share)
    shared = setup_lib.step_plan(cfg, placement).loss_prompt if share else None
    assert (shared.length_blocks if share else 1) == blocks
    plan = memory.memory_plan(
        config,
        placement.mesh,
        batch=rows,
        seq_len=seq_len,
        micro_batch=rows // n_mbs,
        shared_prompt=shared,
    )
    assert 0.75 <= plan.train_step / xla.held_bytes <= 1.25, (plan.format(), xla.held_bytes)
    assert xla.compile_s > 0 and xla.lower_s > 0


MOE = dict(
    model_type="qwen3_moe", vocab_size=512, hidden_size=256, intermediate_size=512, num_heads=4,
    num_kv_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
    norm_topk_prob=True, dtype="bfloat16", param_dtype="bfloat16", remat=True, scan_layers=True,
)  # fmt: skip


def _moe_step(layers, expert_axis):
    """(plan, XLA's held bytes) of the trainer's step for a tiny MoE on fsdp=8, 4 micro-batches."""
    config = model_config_lib.ModelConfig(**MOE, num_layers=layers, expert_axis=expert_axis)
    cfg = _run_config(32, 64, 16, 8, 4)
    placement = placement_lib.Placement.from_shape({"data": 1, "fsdp": 8, "tensor": 1}, config)
    xla = setup_lib.compiled_step_memory(cfg, config, placement, share_prompts=False)
    plan, kwargs = setup_lib.memory_plan(cfg, config, placement)
    return plan, xla.held_bytes, kwargs


@pytest.mark.parametrize("expert_axis", ["", "fsdp"])
def test_moe_plan_grows_per_layer_as_xla_does(expert_axis):
    """What each scanned layer adds (train state, gradients and their accumulator, the
    scan's stacked params and gradients) against XLA's figure for 4 layers less 2. XLA:CPU
    grows ~5.3 x a layer's params (246,400 bytes a device here) where the TPU compiler
    grows 7.1 x (Qwen3-30B-A3B, docs/scale.md) and the plan 7: between 0.85 and 1.3 of the
    CPU's. Without the stacked copies the plan grew 3 x: 0.6 of the CPU's."""
    plan2, held2, kwargs = _moe_step(2, expert_axis)
    plan4, held4, _ = _moe_step(4, expert_axis)
    layer = (plan4.params - plan2.params) // 2
    assert layer == 246_400  # bf16 [8, 256, 128] x 3 + attention + norms, / 8 devices
    assert kwargs["proximal_pass"]  # 4 minibatches: a separate proximal pass
    assert plan4.stacked_layers == 4 * 4 * layer  # (2 stacks of params + 2 of gradients) x L
    grown = (plan4.train_step - plan2.train_step) / (held4 - held2)
    assert 0.85 <= grown <= 1.3, (grown, plan4.format())


def test_moe_plan_counts_gathered_experts_without_a_split():
    """No expert split on fsdp: one layer's experts gathered and their gradient, 2 x X x 3 x
    E x F in param dtype, on top of what the split plan holds for its activations' share."""
    mesh = mesh_of("fsdp8")
    base = model_config_lib.ModelConfig(**MOE, num_layers=2)
    kwargs = dict(batch=8, seq_len=64, micro_batch=8)
    whole = memory.memory_plan(base, mesh, **kwargs)
    dense_mesh = memory.memory_plan(base, mesh_of("data8"), **kwargs)
    assert whole.activations - dense_mesh.activations == 2 * 8 * 3 * 256 * 128 * 2
    # Split over fsdp (or data): no gathered weights, the same activations either way.
    split = memory.memory_plan(base.replace(expert_axis="fsdp"), mesh, **kwargs)
    over_data = memory.memory_plan(base.replace(expert_axis="data"), mesh_of("data8"), **kwargs)
    assert split.activations == over_data.activations
    unscanned = memory.memory_plan(base.replace(scan_layers=False), mesh, **kwargs)
    assert unscanned.stacked_layers == 0 and whole.stacked_layers > 0


def test_a_run_that_does_not_fit_is_told_which_setting_fits():
    mesh = mesh_of("data8")
    # Activations dominate: two micro-batches halve them.
    kwargs = dict(batch=64, seq_len=256, micro_batch=64)
    plan = memory.memory_plan(CFG, mesh, **kwargs)
    fixes = memory_check.remedies(CFG, mesh, plan.total * 3 // 4, **kwargs)
    assert fixes == [f"2 micro-batches per minibatch (actor.mb_spec.n_mbs) ({0.01:.2f} GiB)"]
    with pytest.raises(MemoryError, match="it would fit with 2 micro-batches"):
        memory_check.check_fits(plan, plan.total * 3 // 4, fixes)
    # Replicated params dominate: sharding them over the data axis is what fits.
    big_vocab = CFG.replace(vocab_size=32000)
    plan = memory.memory_plan(big_vocab, mesh, **kwargs)
    fixes = memory_check.remedies(big_vocab, mesh, plan.total * 3 // 4, **kwargs)
    assert len(fixes) == 1 and fixes[0].startswith("mesh.data=1 mesh.fsdp=8")
    with pytest.raises(MemoryError, match="no single setting makes it fit"):
        memory_check.check_fits(plan, plan.total // 100, [])
    # The sampler's copy of the weights dominates (fsdp, no tensor: all of them on every
    # device): tensor parallelism splits it.
    fsdp8 = mesh_of("fsdp8")
    sampled = dict(batch=8, seq_len=16, micro_batch=8, kv_cache_batch=8)
    plan = memory.memory_plan(big_vocab, fsdp8, **sampled)
    assert plan.sampling_weights == big_vocab.num_params() * 4
    assert plan.sampling_weights > max(plan.logits, plan.optimizer, plan.activations)
    assert plan.peak == plan.sampling  # a rollout, not the train step, is the peak
    swapped = sharding.make_mesh(
        {"data": 1, "fsdp": 4, "tensor": 2}, fsdp8.devices.flatten().tolist()
    )
    limit = memory.memory_plan(big_vocab, swapped, **sampled).peak
    assert limit < plan.peak
    fixes = memory_check.remedies(big_vocab, fsdp8, limit, **sampled)
    assert fixes and fixes[0].startswith("mesh.fsdp=4 mesh.tensor=2"), fixes


def test_length_blocks_pay_where_activations_outweigh_the_branches_head_buffers():
    """Measured against XLA (benchmarks/scale_bench.py): at Qwen2.5-0.5B's vocabulary and 8
    or 32 rows per micro-batch the blocks' branches held 2.5x / 1.5x the whole-row step;
    at a 512-token vocabulary they hold less."""
    from m2po_jax.models import architectures

    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    qwen = architectures.model_config("qwen2.5-0.5b", remat=True, scan_layers=True)
    small = model_config_lib.ModelConfig(**dict(BASE, vocab_size=512))
    kwargs = dict(seq_len=1280, prompt_len=256, blocks=8)
    assert not memory.length_blocks_pay(qwen, mesh, rows=8, **kwargs)
    assert not memory.length_blocks_pay(qwen, mesh, rows=32, **kwargs)
    assert memory.length_blocks_pay(small, mesh, rows=8, **kwargs)


@pytest.mark.parametrize(
    "engine,pages,shards",
    [("continuous", 0, 1), ("paged", 0, 1), ("paged", 200, 1), ("paged", 0, 4), ("paged", 200, 4)],
    ids=str,
)
def test_engine_plan_is_within_15_percent_of_xla(engine, pages, shards):
    """The plan's figure for a rollout engine against XLA:CPU's analysis of the programs
    the engine runs (`RolloutEngine.programs`, compiled as `--compile_only` does): the
    largest held beside the weights. `shards` 4: the paged engine on a data=2 x fsdp=2 x
    tensor=2 mesh (the params in the sampling layout), a quarter of the prompts, slots and
    pool on each device and half of the pool's heads."""
    from m2po_jax.models import model as model_lib
    from m2po_jax.rollout import engines, sampling
    from m2po_jax.trainer import compile_only

    config = model_config_lib.ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    params = jax.eval_shape(lambda: model_lib.init_params(config, jax.random.key(0)))
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    mesh = None
    if shards > 1:  # the params in the sampling layout (split over tensor only)
        mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
        layout = sharding.param_shardings(config, mesh, sharding.SAMPLE_RULES)
        params = jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), params, layout
        )
        weights = sum(
            math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for x in jax.tree.leaves(params)
        )
    settings = sampling.SamplingConfig(max_new_tokens=256, stop_token_ids=(3,))
    kwargs = dict(slots=16) if engine == "continuous" else dict(slots=16, pages=pages)
    built = engines.engine_class(engine)(config, settings, **kwargs, mesh=mesh)
    programs = compile_only._compile_engine(built, params, 16, 4, 64)
    xla = max(p.held_bytes for p in programs) - weights
    plan = memory.engine_bytes(
        config, engine, prompts=16, n_samples=4, prompt_len=64, max_new=256, **kwargs,
        shards=shards, tensor=2 if shards > 1 else 1,
    )  # fmt: skip
    assert 0.85 <= plan / xla <= 1.15, [(p.name, p.held_bytes - weights) for p in programs]


def test_a_resume_in_chunks_holds_one_chunks_activations(monkeypatch):
    """1,024 new tokens: the paged engine's resume recomputes a preempted sequence in
    chunks of `paged.RESUME_CHUNK` tokens; XLA:CPU holds about a quarter for chunks of 256
    of what one pass over the whole width holds, and the plan's figure falls with it."""
    from m2po_jax.models import model as model_lib
    from m2po_jax.models import paged
    from m2po_jax.rollout import engines, sampling
    from m2po_jax.trainer import compile_only

    config = model_config_lib.ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    params = jax.eval_shape(lambda: model_lib.init_params(config, jax.random.key(0)))
    settings = sampling.SamplingConfig(max_new_tokens=1024, stop_token_ids=(3,))
    held = {}
    for size in (1024, 256):
        monkeypatch.setattr(paged, "RESUME_CHUNK", size)
        built = engines.PagedEngine(config, settings, slots=16, pages=200)
        programs = compile_only._compile_engine(built, params, 16, 4, 64)
        resume = next(p for p in programs if p.name == "engine_resume")
        plan = memory.engine_bytes(config, "paged", prompts=16, n_samples=4, prompt_len=64,
                                   max_new=1024, slots=16, pages=200)  # fmt: skip
        held[size] = (resume.held_bytes, plan)
    assert held[1024][0] > 150e6  # one pass: the whole width's scores
    assert held[256][0] < 0.35 * held[1024][0] and held[256][1] < 0.35 * held[1024][1]


def test_routing_replay_counts_the_recorded_experts_of_the_batch_and_the_sampler():
    """L x K int16 a token: the train batch's rows (activations) and the sampler's (KV)."""
    c = model_config_lib.ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
        num_kv_heads=2, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16,
    )  # fmt: skip
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    sizes = dict(batch=8, seq_len=20, micro_batch=4, kv_cache_batch=8, kv_cache_len=20)
    off = memory.memory_plan(c, mesh, **sizes)
    on = memory.memory_plan(c, mesh, **sizes, router_replay=True)
    assert on.activations - off.activations == 8 * 20 * 3 * 2 * 2
    assert on.kv_cache - off.kv_cache == 8 * 20 * 3 * 2 * 2
    assert (on.params, on.logits) == (off.params, off.logits)
