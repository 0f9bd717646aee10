"""Programs compiled by the TPU compiler for real TPU topologies, on this CPU host (and by
jax's CUDA plugin for GPUs, where it is installed).

libtpu's deviceless compile (`jax.experimental.topologies`) builds for a v5e slice that
is not here: the real Mosaic kernels, XLA's TPU partitioner and its memory analysis.
The `tpu` extra installs libtpu, and `.ci/run` installs it; without it these tests skip.
"""

import importlib.util
import math
import re

import jax
import pytest

from m2po_jax import config as config_lib
from m2po_jax.configs import arith
from m2po_jax.models import model as model_lib
from m2po_jax.parallel import placement as placement_lib
from m2po_jax.parallel import sharding
from m2po_jax.trainer import compile_only
from m2po_jax.trainer import setup as setup_lib

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed (the tpu extra: pip install -e '.[tpu]')",
)


def _cfg(**mesh):
    """A tiny arithmetic run with a model the splash kernel takes (head_dim 128, bf16)."""
    c = arith.get_config("tiny")
    c.rollout.batch_size, c.gconfig.n_samples = 4, 4
    c.model.attention, c.model.dtype = "auto", "bfloat16"
    c.model.num_heads, c.model.num_kv_heads, c.model.head_dim = 4, 2, 128
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = (mesh.pop(a, 1) for a in ("data", "fsdp", "tensor"))
    config_lib.apply_dotted(c, mesh)  # the other settings, by dotted name
    return config_lib.from_configdict(c)


def _model(cfg):
    return compile_only.model_for(cfg)[0]


@pytest.fixture(scope="module")
def v5e_2x2():
    return compile_only.target("v5e:2x2")


@needs_libtpu
def test_train_step_with_splash_compiles_on_a_multi_chip_tpu(v5e_2x2):
    """The train step with the attention a TPU picks compiles on 4 chips, the splash kernel
    in it (a Mosaic `tpu_custom_call`); before splash ran inside shard_map the partitioner
    refused it ("Mosaic kernels cannot be automatically partitioned")."""
    cfg = _cfg(data=2, tensor=2)  # fsdp x tensor: the dry run's test; fsdp alone: async's
    model_config = _model(cfg)
    placement = placement_lib.Placement(
        sharding.make_mesh(
            {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor},
            list(v5e_2x2.devices),
        ),
        model_config,
    )
    program, state = compile_only.train_step_program(cfg, model_config, placement)
    assert not program.error
    assert program.kernels >= 2  # the forward and backward kernels at least
    text = program.compiled.as_text()
    assert "tpu_custom_call" in text
    # Params and optimizer state sharded as planned: the arguments hold the state's shards.
    assert program.argument_bytes >= compile_only._bytes_per_device(state)
    plan, _ = setup_lib.memory_plan(cfg, model_config, placement)
    assert plan.params == pytest.approx(
        compile_only._bytes_per_device(state.params), rel=0.05, abs=4096
    )


@needs_libtpu
def test_dry_run_compiles_every_program_of_a_run(v5e_2x2):
    """fsdp x tensor, the warm-up on, the continuous engine: every program compiles for
    the v5e slice, the train and warm-up steps with the kernel, and the report sums what
    is resident at once."""
    cfg = _cfg(fsdp=2, tensor=2, **{"rollout.engine": "continuous", "sft.max_steps": 5})
    model_config = _model(cfg)
    report = compile_only.dry_run(cfg, model_config, v5e_2x2, say=lambda _: None)
    names = [p.name for p in report.programs]
    assert names == [
        "train_step",
        "sft_step",
        "reshard",
        "engine_prefill",
        "engine_start",
        "engine_run",
        # the evaluation as the run evaluates: through its engine, at eval.n_samples
        "evaluate_engine_prefill",
        "evaluate_engine_start",
        "evaluate_engine_run",
        "decode_step",
    ]
    assert f"x {cfg.eval.n_samples}" in report.programs[-2].what
    by_name = {p.name: p for p in report.programs}
    assert by_name["train_step"].kernels > 0 and by_name["sft_step"].kernels > 0
    assert not any(p.error for p in report.programs)
    assert by_name["decode_step"].probe and report.run_programs == report.programs[:-1]
    # Sampling-side programs run beside the train state.
    assert by_name["engine_run"].resident_beside == report.state_bytes
    assert by_name["engine_run"].peak_bytes == by_name["engine_run"].held_bytes + report.state_bytes
    assert report.fits is True
    assert report.mesh_shape == {"data": 1, "fsdp": 2, "tensor": 2}
    r = report.roofline
    # A decode step reads at least its weights and the KV cache it attends over.
    assert r["decode_bytes"] >= r["decode_floor_bytes"] > 0
    assert r["train_bound_s"] > 0 and 0 < r["best_mfu"] <= 1
    text = report.format()
    assert "fits:" in text and "v5e:2x2" in text


@needs_libtpu
def test_the_paged_engines_decode_runs_the_ragged_paged_attention_kernel(v5e_2x2):
    """fsdp x tensor, rollout.engine=paged, the engine the run builds on the chip: the
    decode loop's attention is jax's ragged paged attention kernel (a Mosaic
    `tpu_custom_call`, one engine per batch shard, the heads over tensor); the prompts'
    prefill runs splash, the resume the XLA path. The memory plan's engine figure, which
    sizes the pool, is an upper bound of what the TPU compiler holds for the engine's
    programs (it counts the resume's float32 scores, which the TPU compiler fuses away:
    here 4.4x over; XLA:CPU within 15%, memory_test)."""
    from m2po_jax.rollout import sampling

    changes = {"rollout.engine": "paged", "gconfig.max_new_tokens": 1024, "rollout.batch_size": 8}
    cfg = _cfg(fsdp=2, tensor=2, **changes)
    model_config = _model(cfg)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 2}, list(v5e_2x2.devices))
    placement = placement_lib.Placement(mesh, model_config)
    decoding = sampling.from_gconfig(cfg.gconfig, (0,), 0)
    engine = setup_lib.build_engine(cfg, model_config, decoding, placement, v5e_2x2.hbm_bytes)
    layout = sharding.param_shardings(model_config, mesh, sharding.SAMPLE_RULES)
    shapes = jax.eval_shape(lambda: model_lib.init_params(model_config, jax.random.key(0)))
    params = jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, model_config.dtype, sharding=sh),
        shapes, layout,
    )  # fmt: skip
    n, width = cfg.gconfig.n_samples, cfg.task.max_prompt_len
    by_name = {
        p.name: p
        for p in compile_only._compile_engine(engine, params, cfg.rollout.batch_size, n, width)
    }
    assert not any(p.error for p in by_name.values())
    assert by_name["engine_run"].kernels >= 1
    assert "tpu_custom_call" in by_name["engine_run"].compiled.as_text()
    # The decode loop updates the pool in place: no copy of a layer's pages (a `lax.cond`
    # around a page copy, or whole-page indexing the compiler changes the layout for,
    # copied every layer's pool every step).
    size = engine.sizes(cfg.rollout.batch_size, cfg.task.max_prompt_len, cfg.gconfig.n_samples)
    layer = rf"bf16\[{size['pages']},{size['page_size']},2,128\]\S* copy\("
    assert not re.search(layer, by_name["engine_run"].compiled.as_text())
    # The prompts' prefill attends with splash (inside the engine's shard_map over the
    # batch shards, the heads over tensor); the resume reads the prompt pages: XLA.
    assert by_name["engine_prefill"].kernels >= 1
    assert by_name["engine_resume"].kernels == 0
    _, kwargs = setup_lib.memory_plan(cfg, model_config, placement, v5e_2x2.hbm_bytes)
    weights = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in jax.tree.leaves(params)
    )
    held = max(p.held_bytes for p in by_name.values()) - weights
    assert held <= kwargs["kv_cache_bytes"] <= 6 * held, (kwargs["kv_cache_bytes"], held)
    # The decode roofline's probe: the model's pass of one step, the kernel in it; what it
    # reads (XLA's count + the kernel's pages) is at least the floor it is measured against.
    probe = engine.decode_probe(params, cfg.rollout.batch_size, n, prompt_len=width)
    start = compile_only._outputs(by_name["engine_start"].compiled)
    program = compile_only.compile_program(probe.name, probe.what, probe.jitted, params, start)
    assert program.kernels >= 1 and not program.error
    size = engine.sizes(cfg.rollout.batch_size, width, n)
    r = compile_only._paged_roofline(
        v5e_2x2, model_config, program, engine, size, width, n, weights
    )
    assert r["paged_kernel"] and r["paged_bytes"] >= r["paged_floor_bytes"] > weights
    # What it moves to and from HBM is below XLA's cost analysis, which also counts the
    # copies XLA stages in VMEM (here the whole small pool, read once from HBM).
    assert r["paged_bytes"] < r["paged_cost_bytes"]
    assert r["paged_tokens_s"] == pytest.approx(
        size["slots"] / 2 / (r["paged_bytes"] / v5e_2x2.hbm_bandwidth)
    )


@needs_libtpu
def test_async_split_compiles_on_one_topology(v5e_2x2):
    """rollout.mode=async: two chips sample (their own mesh), two train; the learner's
    params are gathered on the train mesh before the copy, as `WeightPublisher` does."""
    cfg = _cfg(fsdp=2, **{"rollout.mode": "async", "mesh.rollout_devices": 2})
    report = compile_only.dry_run(cfg, _model(cfg), v5e_2x2, say=lambda _: None)
    by_name = {p.name: p for p in report.programs}
    assert report.mesh_shape == {"data": 1, "fsdp": 2, "tensor": 1}
    train_devices = by_name["train_step"].compiled.input_shardings[0][0].params
    train_ids = {d.id for s in jax.tree.leaves(train_devices) for d in s.device_set}
    sampler = by_name["sampler"].compiled.input_shardings[0][0]
    sampler_ids = {d.id for s in jax.tree.leaves(sampler) for d in s.device_set}
    assert len(train_ids) == 2 and len(sampler_ids) == 2 and not train_ids & sampler_ids
    assert "gathered" in by_name["reshard"].what
    assert by_name["sampler"].resident_beside == 0  # the train state is on other chips


@needs_libtpu
def test_a_program_over_the_chip_is_refused_with_what_the_compiler_said(monkeypatch):
    """A model whose params and AdamW moments alone exceed one v5e chip: the TPU compiler
    refuses the train step (recorded, not raised), and the dry run stops in one line."""
    cfg = _cfg(**{"model.vocab_size": 262144, "model.hidden_size": 4096, "sft.max_steps": 0})
    tgt = compile_only.target("v5e:1x1")
    model_config = _model(cfg)
    placement = placement_lib.Placement(sharding.make_mesh({}, list(tgt.devices)), model_config)
    refused, _ = compile_only.train_step_program(cfg, model_config, placement)
    assert "RESOURCE_EXHAUSTED" in refused.error and "HBM" in refused.error
    assert refused.temp_bytes > 16 * 2**30  # the compiler's figure, from its message
    report = compile_only.Report(tgt, {"data": 1, "fsdp": 1, "tensor": 1}, [refused], 0, 0, {}, [])
    assert report.fits is False
    monkeypatch.setattr(compile_only, "dry_run", lambda *a, **k: report)
    with pytest.raises(MemoryError, match=r"^v5e:1x1: train_step: RESOURCE_EXHAUSTED.*HBM"):
        compile_only.run(cfg, "v5e:1x1", say=lambda _: None)


@needs_libtpu
def test_topology_names():
    assert len(compile_only.target("v5e:1x1").devices) == 1  # smaller than a host
    v4 = compile_only.target("v4:2x2x1")
    assert v4.devices_per_chip == 2 and v4.hbm_bytes == 16 * 2**30  # a device per core
    with pytest.raises(ValueError, match="unknown chip 'v9'"):
        compile_only.target("v9:2x2")
    with pytest.raises(ValueError, match="expected a chip and its shape"):
        compile_only.target("v5e-16")


@pytest.mark.skipif(
    not __import__("m2po_jax.parallel.gpu_targets").parallel.gpu_targets.cuda_plugin_installed(),
    reason="jax's CUDA plugin is not installed (pip install 'jax[cuda12-local]' nvidia-cudnn-cu12)",
)
def test_dry_run_for_gpus_without_them():
    """h100:2 through jax's CUDA plugin (JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 set before jax
    starts): the train step holds cuDNN attention calls; no cost analysis, so the roofline
    is the model's."""
    cfg = _cfg(data=2, **{"actor.m2po_method": "bisect"})
    report = compile_only.dry_run(cfg, _model(cfg), compile_only.target("h100:2"), say=print)
    train = report.programs[0]
    assert train.name == "train_step" and train.kernels > 0
    assert "__cudnn$fmha" in train.compiled.as_text()
    assert report.fits is True and report.roofline["cost_analysis"] is False


@pytest.mark.parametrize("lora_rank", [4, 0], ids=["lora", "full"])
def test_the_dry_runs_train_step_call_is_the_trainers_with_a_kl_penalty(
    monkeypatch, tmp_path, lora_rank
):
    """With `actor.kl_ctl` > 0 the dry run passes the train step the KL reference the
    trainer passes it: None under LoRA (the step takes the adapters off), the starting
    params otherwise. (No TPU needed: the call, not its compile, is compared.)"""
    from m2po_jax import trainer as trainer_lib

    c = arith.get_config("tiny")
    changes = {"actor.kl_ctl": 0.1, "model.lora.rank": lora_rank, "sft.max_steps": 0}
    changes["mesh.data"] = 1
    config_lib.apply_dotted(c, {**changes, "logging.tensorboard": False})
    cfg = config_lib.from_configdict(c)
    model_config = _model(cfg)
    placement = placement_lib.Placement(
        sharding.make_mesh({"data": 1}, jax.devices()[:1]), model_config
    )
    calls = []
    monkeypatch.setattr(compile_only, "compile_program", lambda *args: calls.append(args))
    compile_only.train_step_program(cfg, model_config, placement)
    dry_ref = calls[0][-1]
    trainer = trainer_lib.Trainer(cfg, tmp_path)
    monkeypatch.setattr(trainer, "_rollout", lambda *a, **k: (None,))  # no queue to fill
    monkeypatch.setattr(trainer.queue, "push", lambda batch: None)
    trainer._begin()  # sets the reference the trainer's steps are passed
    shape = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)  # noqa: E731
    assert shape(dry_ref) == shape(trainer.ref_params)
    assert (dry_ref is None) == bool(lora_rank)


@pytest.mark.skipif(
    not __import__("m2po_jax.parallel.gpu_targets").parallel.gpu_targets.cuda_plugin_installed(),
    reason="jax's CUDA plugin is not installed (pip install 'jax[cuda12-local]' nvidia-cudnn-cu12)",
)
def test_the_paged_engines_decode_runs_the_triton_kernel_on_gpus():
    """h100:2 (fsdp x tensor), rollout.engine=paged: the pool takes the split layout and
    the decode loop's attention is jax's Triton paged attention kernel (a Triton custom
    call), the heads split over tensor. (XLA attention elsewhere: no cuDNN needed.)"""
    changes = {"rollout.engine": "paged", "gconfig.max_new_tokens": 256, "model.attention": "xla"}
    cfg = _cfg(tensor=2, **changes)
    said = []
    report = compile_only.dry_run(cfg, _model(cfg), compile_only.target("h100:2"), say=said.append)
    by_name = {p.name: p for p in report.programs}
    run, resume = by_name["engine_run"], by_name["engine_resume"]
    assert not run.error and run.kernels >= 1
    assert "__gpu$xla.gpu.triton" in run.compiled.as_text()
    assert "paged_attention" in run.compiled.as_text()
    assert resume.kernels == 0  # multi-token calls: the XLA path


def _tiny_moe_for_tpu(mesh, **changes):
    """A 2-layer bfloat16 Qwen3-MoE (8 experts, top 2) with `changes`, its params as
    abstract arrays sharded by the training rules on `mesh`, a batch of 4 x 32 token ids
    split over fsdp, and a loss whose value and gradient the tests compile."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from m2po_jax.models import model_config as model_config_lib

    config = model_config_lib.ModelConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
        num_kv_heads=2, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
        dtype="bfloat16", **changes,
    )  # fmt: skip
    shardings = sharding.param_shardings(config, mesh, sharding.TRAIN_RULES)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        jax.eval_shape(lambda: model_lib.init_params(config, jax.random.key(0))),
        shardings,
    )
    tokens = jax.ShapeDtypeStruct((4, 32), jnp.int32, sharding=NamedSharding(mesh, P("fsdp")))

    def loss(p, t):
        logits = model_lib.apply(p, config, t)
        return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])

    return config, params, tokens, loss


@needs_libtpu
def test_a_mixture_of_experts_forward_and_backward_compile_on_a_multi_chip_tpu(v5e_2x2):
    """Qwen3-MoE's grouped matmuls (`moe.moe_experts`, `jax.lax.ragged_dot`) compile for 4
    chips sharded fsdp x tensor, forward and backward, as the TPU's grouped-matmul call
    (`ragged-dot-none` custom calls: 3 per layer forward, and the backward's gradients
    too), not a dense masked product."""
    import numpy as np
    from jax.sharding import Mesh

    mesh = Mesh(np.array(v5e_2x2.devices).reshape(2, 2), ("fsdp", "tensor"))
    config, params, tokens, loss = _tiny_moe_for_tpu(mesh, moe_intermediate_size=64)
    text = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile().as_text()
    calls = re.findall(r"%ragged-dot-none(?:\.\d+)? = \S+ custom-call\(", text)
    assert len(calls) >= 2 * 3 * config.num_layers, len(calls)  # forward and backward


@needs_libtpu
def test_expert_parallel_megablox_compiles_on_a_multi_chip_tpu(v5e_2x2):
    """With the experts split over fsdp=2 (x tensor=2), traced for the TPU mesh, every
    layer's grouped matmuls run Pallas' megablox kernels (Mosaic `tpu_custom_call`s): `gmm`
    3 per layer forward, and the backward's `gmm` (input gradients) and `tgmm` (expert
    kernels' gradients) 3 each; tokens meet the experts by an all-gather and a
    reduce-scatter, and no ragged-dot call is left."""
    from jax.sharding import PartitionSpec as P

    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2}, list(v5e_2x2.devices))
    config, params, tokens, loss = _tiny_moe_for_tpu(
        mesh, moe_intermediate_size=256, expert_axis="fsdp"
    )
    spec = params["layers_0"]["mlp"]["gate_experts"].sharding.spec
    assert spec == P("fsdp", None, "tensor")
    step = jax.jit(sharding.on_mesh(jax.value_and_grad(loss), mesh))
    text = step.lower(params, tokens).compile().as_text()
    calls = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    kernels = [re.search(r"jit\((t?gmm)\)/pallas_call", line) for line in calls]
    kernels = [k.group(1) for k in kernels if k]
    assert kernels.count("gmm") == 2 * 3 * config.num_layers, kernels
    assert kernels.count("tgmm") == 3 * config.num_layers, kernels
    assert "all-gather" in text and "reduce-scatter" in text
    assert "ragged-dot" not in text
