"""The compile-only dry run: every program a run compiles, built for a named topology.

    m2po-train --config=gsm8k:qwen3-8b --architecture=qwen3-8b --compile_only --topology=v5e:4x4

builds, for the devices of `--topology` (libtpu's deviceless compile: a CPU host compiles
for a TPU slice it does not have, as MaxText's `train_compile.py` does) or for this host's
devices when no topology is named, and for the run's own mesh: the train step (the widest
completion bucket, the proximal and reference passes inside it), the supervised warm-up
step, the weight reshard from the train layout to the sampling layout, the rollout
engine's programs (`RolloutEngine.programs`), the greedy evaluation, one decode
step, and in an async run the rollout and train devices split as the trainer splits them.
Nothing is allocated: every argument is a `jax.ShapeDtypeStruct` with its sharding.

Per program it reports compile seconds, XLA's memory analysis per chip, the kernels in the
compiled code (Mosaic `tpu_custom_call`s, cuDNN attention, Triton calls), and the peak it holds with what stays resident
beside it (the train state while the sampler runs). The run fits when the largest peak is
within the chip's HBM (`chips.py`); when it is not, `check` raises `MemoryError` naming a
setting that would fit. A roofline follows from XLA's cost analysis and the chip's peak
bfloat16 FLOP/s and HBM bandwidth: the train step's lower-bound time and the MFU it can
reach at best, and the bytes one decode step reads against the weights plus KV cache.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

from m2po_jax import config as config_lib
from m2po_jax.common.config_schema import Config
from m2po_jax.common.mesh_axes import BATCH_AXES
from m2po_jax.common.types import TrainBatch
from m2po_jax.learner import batching, optim
from m2po_jax.learner import train_step as step_lib
from m2po_jax.models import model as model_lib
from m2po_jax.models import model_config as model_config_lib
from m2po_jax.models import quant
from m2po_jax.parallel import chips as chips_lib
from m2po_jax.parallel import gpu_targets, sharding
from m2po_jax.parallel import placement as placement_lib
from m2po_jax.rollout import engines, sampling
from m2po_jax.trainer import evaluate as evaluate_lib
from m2po_jax.trainer import hlo_traffic, sft
from m2po_jax.trainer import setup as setup_lib

_GIB = 2**30
# The kernels a compiled program calls: Mosaic (Pallas TPU), cuDNN attention, Triton (Pallas GPU).
KERNEL_CALL = re.compile(
    r"custom_call_target=\"(tpu_custom_call|__cudnn\$fmha\w*|__gpu\$xla\.gpu\.triton)"
)


# ----------------------------------------------------------------------------- devices


@dataclasses.dataclass(frozen=True)
class Target:
    """The devices the dry run compiles for, and the chip each is (part of)."""

    name: str  # the topology name, or "local"
    devices: tuple
    chip: chips_lib.Chip | None
    devices_per_chip: int = 1  # 2 where each TensorCore is a device (v4 without megacore)

    @property
    def hbm_bytes(self) -> int | None:
        return None if self.chip is None else self.chip.hbm_bytes // self.devices_per_chip

    @property
    def peak_flops(self) -> float | None:
        return None if self.chip is None else self.chip.peak_flops / self.devices_per_chip

    @property
    def hbm_bandwidth(self) -> float | None:
        return None if self.chip is None else self.chip.hbm_bandwidth / self.devices_per_chip


def target(topology: str | None) -> Target:
    """The devices of a TPU topology ("v5e:4x4", "v5p:2x2x2", ...; needs libtpu: the `tpu`
    extra), or of this host (`jax.devices()`) when `topology` is None or empty."""
    if not topology:
        devices = tuple(jax.devices())
        return Target("local", devices, chips_lib.for_device_kind(devices[0].device_kind))
    if not re.fullmatch(r"[a-z0-9]+:\d+(x\d+)*", topology):
        raise ValueError(
            f"--topology={topology!r}: expected a chip and its shape as jax takes them, "
            "e.g. v5e:4x4, v5p:2x2x2, v4:2x2x1, v6e:2x4"
        )
    chip = chips_lib.for_topology(topology)
    dims = [int(n) for n in topology.split(":", 1)[1].split("x")]
    if chip.device_kind.startswith("NVIDIA"):
        return _gpu_target(topology, chip, dims)
    import importlib.util

    from jax.experimental import topologies

    if importlib.util.find_spec("libtpu") is None:
        raise ValueError(
            f"--topology={topology}: the TPU compiler (libtpu) is not installed; it comes "
            "with the tpu extra: pip install -e '.[tpu]'"
        )
    # Deviceless: no chip to guard, so libtpu's one-process-per-host lock is not needed
    # (two dry runs, or two test workers, compile side by side).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:
        if "chips_per_host_bounds" not in str(e):
            raise ValueError(f"--topology={topology}: {_first_line(e)}") from e
        # A slice smaller than one host (v5e:1x1, v5e:2x1): the host is the slice.
        bounds = tuple(dims + [1] * (3 - len(dims)))
        try:
            desc = topologies.get_topology_desc(
                platform="tpu", topology_name=topology, chips_per_host_bounds=bounds
            )
        except Exception as e2:
            raise ValueError(f"--topology={topology}: {_first_line(e2)}") from e2
    devices = tuple(desc.devices)
    chip_count = math.prod(dims)
    return Target(topology, devices, chip, max(1, len(devices) // chip_count))


def _gpu_target(topology: str, chip: chips_lib.Chip, dims: list[int]) -> Target:
    """Compile-only GPUs: "h100:8" is one host of 8, "h100:2x8" two hosts of 8."""

    if len(dims) > 2:
        raise ValueError(
            f"--topology={topology}: expected {chip.name}:GPUS or {chip.name}:HOSTSxGPUS"
        )
    hosts, per_host = (1, dims[0]) if len(dims) == 1 else dims
    if not gpu_targets.cuda_plugin_installed():
        raise ValueError(
            f"--topology={topology}: the GPU compiler (jax's CUDA plugin) is not installed: "
            'pip install "jax[cuda12-local]==<your jax>" nvidia-cudnn-cu12'
        )
    try:
        devices = gpu_targets.devices(chip.name, per_host, hosts)
    except NotImplementedError as e:
        raise ValueError(
            f"--topology={topology}: jax's CUDA plugin did not register ({_first_line(e)}); "
            "on a host without a GPU set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before jax starts"
        ) from e
    return Target(topology, tuple(devices), chip)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


# ----------------------------------------------------------------------------- programs


@dataclasses.dataclass
class Program:
    """One compiled program and what XLA says of it (bytes and FLOPs per device)."""

    name: str
    what: str
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    flops: float
    bytes_accessed: float
    kernels: int  # Mosaic (Pallas TPU), cuDNN attention or Triton custom calls in the code
    resident_beside: int = 0  # bytes resident on the chip while it runs, not its arguments
    compiled: Any = dataclasses.field(default=None, repr=False)
    error: str = ""  # the compiler's refusal (out of HBM): the program does not fit
    probe: bool = False  # compiled for the roofline only (the samplers run it in their loop)

    @property
    def held_bytes(self) -> int:
        """Arguments + temporaries + outputs, less the donated buffers outputs reuse."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    @property
    def peak_bytes(self) -> int:
        return self.held_bytes + self.resident_beside


def compile_program(name: str, what: str, jitted, *args, **kwargs) -> Program:
    """Lowers and compiles `jitted` on abstract `args`; XLA's figures per device."""
    start = time.perf_counter()
    lowered = jitted.lower(*args, **kwargs)
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "cudaErrorInvalidDevice" in str(e):
            # Seen compiling the train step for H100 without one: XLA sizes cub's radix
            # sort (large sorts: the M2PO "sort" method) by asking the device.
            raise ValueError(
                f"{name}: jax's CUDA compiler asked for a GPU that is not there "
                f"({_first_line(e)}); large sorts need one to be sized: "
                "--config.actor.m2po_method=bisect (the same mask, sort-free) compiles"
            ) from e
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        # The TPU compiler refuses a program over the chip's HBM and says by how much.
        message = str(e).strip().splitlines()[0]
        sizes = [float(x) for x in re.findall(r"\((\d+(?:\.\d+)?)G\)", message)]
        return Program(
            name=name, what=what, compile_s=time.perf_counter() - start, argument_bytes=0,
            output_bytes=0, alias_bytes=0, temp_bytes=int(sizes[0] * 2**30) if sizes else 0,
            flops=0.0, bytes_accessed=0.0, kernels=0, error=message,
        )  # fmt: skip
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
    text = compiled.as_text() or ""
    return Program(
        name=name,
        what=what,
        compile_s=seconds,
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        kernels=len(KERNEL_CALL.findall(text)),
        compiled=compiled,
    )


def _abstract(tree, shardings):
    """ShapeDtypeStructs of `tree`'s leaves with `shardings` (a matching tree or one)."""
    if not isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
        )
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)


def _rows(placement, dtype, *dims):
    """A batch array [rows, ...] split over the batch axes."""
    spec = sharding.batch_sharding(placement.mesh, len(dims))
    return jax.ShapeDtypeStruct(dims, dtype, sharding=spec)


def _bytes_per_device(tree) -> int:
    """Bytes of one device's shards of an abstract tree (the largest shard of each leaf)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


@dataclasses.dataclass
class Report:
    """What the dry run compiled, for which devices, and whether the run fits."""

    target: Target
    mesh_shape: dict
    programs: list[Program]
    state_bytes: int  # params + optimizer state per device, train layout
    plan_total: int  # the analytic memory plan's peak of its phases (`MemoryPlan.peak`)
    roofline: dict
    widths: list[int]

    @property
    def run_programs(self) -> list[Program]:
        """The programs the run compiles (not the roofline's probe)."""
        return [p for p in self.programs if not p.probe]

    @property
    def peak(self) -> Program:
        return max(self.run_programs, key=lambda p: p.peak_bytes)

    @property
    def fits(self) -> bool | None:
        if any(p.error for p in self.run_programs):
            return False
        limit = self.target.hbm_bytes
        return None if limit is None else self.peak.peak_bytes <= limit

    def format(self) -> str:
        t = self.target
        chip = (
            f"{t.chip.name} ({t.hbm_bytes / _GIB:.1f} GiB HBM, "
            f"{t.peak_flops / 1e12:.0f} TFLOP/s bf16, {t.hbm_bandwidth / 1e9:.0f} GB/s per device)"
            if t.chip
            else "unknown chip"
        )
        lines = [
            f"compile-only: {t.name}, {len(t.devices)} devices of {chip}; mesh {self.mesh_shape}",
            f"{'program':<22} {'compile s':>9} {'args GiB':>9} {'temp GiB':>9} "
            f"{'out GiB':>8} {'peak GiB':>9} {'kernels':>7}  what",
        ]
        for p in self.programs:
            lines.append(
                f"{p.name:<22} {p.compile_s:9.1f} {p.argument_bytes / _GIB:9.3f} "
                f"{p.temp_bytes / _GIB:9.3f} {p.output_bytes / _GIB:8.3f} "
                f"{p.peak_bytes / _GIB:9.3f} {p.kernels:7d}  {p.what}"
                + (" (roofline probe)" if p.probe else "")
            )
        for p in self.programs:
            if p.error:
                lines.append(f"{p.name}: the compiler refused it: {p.error}")
        peak = self.peak
        lines.append(
            f"peak per device: {peak.peak_bytes / _GIB:.2f} GiB in {peak.name} (train state "
            f"{self.state_bytes / _GIB:.2f} GiB resident throughout); the analytic plan said "
            f"{self.plan_total / _GIB:.2f} GiB"
        )
        if t.hbm_bytes is not None:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            lines.append(
                f"{verdict}: {peak.peak_bytes / _GIB:.2f} of {t.hbm_bytes / _GIB:.1f} GiB "
                f"({100 * peak.peak_bytes / t.hbm_bytes:.0f}%)"
            )
        lines.append(f"train step widths the run can compile: {self.widths}")
        r = self.roofline
        if r and not r["cost_analysis"]:
            lines.append(
                "roofline (this compiler gives no cost analysis: jax's CUDA plugin; the "
                f"model's FLOPs and weights + KV cache bytes): the train step needs "
                f"{r['model_flops'] / 1e12:.2f} TFLOP per device, "
                f"{r['bound_flops'] / 1e12:.2f} with recompute -> at least "
                f"{r['train_bound_s'] * 1e3:.0f} ms"
            )
        elif r:
            lines.append(
                f"roofline, train step (widest bucket, per device): XLA counts "
                f"{r['train_flops'] / 1e12:.2f} TFLOP + {r['kernel_flops'] / 1e12:.2f} in "
                f"attention kernels and {r['train_bytes'] / 1e9:.1f} GB accessed (a loop body "
                f"once); the model needs {r['model_flops'] / 1e12:.2f} TFLOP, "
                f"{r['bound_flops'] / 1e12:.2f} with recompute -> at least "
                f"{r['train_bound_s'] * 1e3:.0f} ms ({r['train_bound']}-bound), MFU at best "
                f"{100 * r['best_mfu']:.0f}%"
            )
        if r:
            lines.append(
                f"roofline, one decode step ({r['decode_rows']} rows): reads "
                f"{r['decode_bytes'] / 1e9:.2f} GB per device against weights + KV cache "
                f"{r['decode_floor_bytes'] / 1e9:.2f} GB ({r['decode_ratio']:.2f}x) -> at least "
                f"{r['decode_bound_s'] * 1e3:.2f} ms, {r['decode_tokens_s']:.0f} tokens/s per "
                f"device at most"
            )
        if r.get("paged_bytes"):
            reads = "the ragged paged attention kernel's page reads added" if r[
                "paged_kernel"] else "the XLA path"  # fmt: skip
            lines.append(
                f"roofline, one paged decode step ({r['paged_slots']} slots per batch shard, "
                f"each {r['paged_live']} tokens live; {reads}): moves "
                f"{r['paged_bytes'] / 1e9:.2f} GB per device to and from HBM (XLA's cost "
                f"analysis, which also counts on-chip copies: {r['paged_cost_bytes'] / 1e9:.2f}"
                f" GB) against weights + unique live KV "
                f"{r['paged_floor_bytes'] / 1e9:.2f} GB ({r['paged_ratio']:.2f}x) -> at least "
                f"{r['paged_bound_s'] * 1e3:.2f} ms, {r['paged_tokens_s']:.0f} tokens/s per "
                f"device at most"
            )
        return "\n".join(lines)


def train_step_program(cfg: Config, model_config, placement) -> tuple[Program, Any]:
    """The run's train step (`setup.build_train_step`) compiled for the run's largest batch
    on `placement`'s devices, and its abstract train state."""

    rows = cfg.rollout.batch_size * cfg.gconfig.n_samples
    seq_len = cfg.task.max_prompt_len + cfg.gconfig.max_new_tokens
    tx, schedule = optim.make_optimizer(cfg.actor.optimizer, max(cfg.total_steps, 1))
    params_shape = jax.eval_shape(lambda: model_lib.init_params(model_config, jax.random.key(0)))
    state_shape = jax.eval_shape(lambda p: step_lib.init_train_state(p, tx), params_shape)
    state = _abstract(state_shape, placement.state_shardings(state_shape))
    batch = TrainBatch(
        tokens_BxT=_rows(placement, jnp.int32, rows, seq_len),
        valid_BxT=_rows(placement, jnp.bool_, rows, seq_len),
        behav_logp_BxT=_rows(placement, jnp.float32, rows, seq_len),
        loss_mask_BxT=_rows(placement, jnp.bool_, rows, seq_len),
        rewards_B=_rows(placement, jnp.float32, rows),
        version_B=_rows(placement, jnp.int32, rows),
        version_BxT=_rows(placement, jnp.int32, rows, seq_len),
        routed_experts_BxTxLxK=setup_lib.replayed_experts(
            cfg, model_config, functools.partial(_rows, placement), rows, seq_len
        ),
    )
    ref = setup_lib.reference_params(cfg, model_config, state.params)  # as the trainer's
    step = setup_lib.build_train_step(cfg, model_config, tx, schedule, placement, state_shape)
    program = compile_program(
        "train_step",
        f"{rows} rows x {seq_len} tokens, the proximal pass"
        f"{', the reference pass' if cfg.actor.kl_ctl > 0 else ''} inside",
        step,
        state,
        batch,
        _key(placement),
        ref,
    )
    return program, state


def _key(placement):
    """A replicated PRNG key, abstract."""
    dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype
    return jax.ShapeDtypeStruct((), dtype, sharding=placement.replicated)


def dry_run(cfg: Config, model_config: model_config_lib.ModelConfig, tgt: Target, *,
            stop_ids=(0,), pad_id: int = 0, say=print) -> Report:  # fmt: skip
    """Compiles every program of `cfg`'s run for `tgt`'s devices; see the module doc."""
    placement, rollout_placement = _placements(cfg, model_config, list(tgt.devices))
    sampler_placement = rollout_placement or placement
    # The rollouts' weights (`rollout.weight_dtype`), as the trainer's engine runs them.
    rollout_config = setup_lib.rollout_model_config(cfg, model_config)
    programs: list[Program] = []

    def add(program: Program) -> Program:
        programs.append(program)
        say(
            f"  {program.name}: {program.compile_s:.1f} s, "
            + (
                f"REFUSED: {program.error}"
                if program.error
                else f"holds {program.held_bytes / _GIB:.3f} GiB per device, "
                f"{program.kernels} kernels"
            )
        )
        return program

    rows = cfg.rollout.batch_size * cfg.gconfig.n_samples
    seq_len = cfg.task.max_prompt_len + cfg.gconfig.max_new_tokens
    train, state = train_step_program(cfg, model_config, placement)
    add(train)
    params_shape = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.params)
    state_bytes = _bytes_per_device(state)
    if cfg.sft.max_steps:
        add(_sft_program(cfg, model_config, placement, state.params, params_shape, seq_len))
    publish, sample_params = _reshard_program(
        cfg, rollout_config, placement, rollout_placement, state.params, params_shape
    )
    add(publish)
    # The train state stays resident beside the sampling-side programs when they share
    # devices; the sampling copy replaces nothing.
    beside = 0 if rollout_placement is not None else state_bytes
    publish.resident_beside = beside - _bytes_per_device(state.params)

    limit = cfg.mesh.device_memory_gib and int(cfg.mesh.device_memory_gib * 2**30)
    limit = limit or tgt.hbm_bytes
    prompts = _sampled_prompts(cfg, rollout_placement is not None, tgt.devices)
    engine, step_params, decode = _sampling_programs(
        cfg, model_config, rollout_config, (placement, sampler_placement), sample_params,
        params_shape, prompts, limit, (stop_ids, pad_id), add,
    )  # fmt: skip
    for p in programs[programs.index(publish) + 1 :]:
        p.resident_beside = state_bytes if p.name.startswith("evaluate") else beside

    plan, _ = setup_lib.memory_plan(cfg, model_config, placement, limit)
    new = cfg.gconfig.max_new_tokens
    widths = sorted({batching.completion_width(n, new) for n in range(new + 1)})
    roofline = _roofline(
        tgt, rollout_config, train, decode, sample_params, rows, seq_len, sampler_placement
    )
    run = next((p for p in programs if p.name == "paged_decode_step"), None)
    if roofline and run is not None:  # the probe was compiled: `step_params` is its weights
        prompt_len = cfg.task.max_prompt_len
        size = engine.sizes(prompts, prompt_len, cfg.gconfig.n_samples)
        weights = _bytes_per_device(step_params)
        roofline |= _paged_roofline(
            tgt, rollout_config, run, engine, size, prompt_len, cfg.gconfig.n_samples, weights
        )
    return Report(
        target=tgt,
        mesh_shape=dict(placement.mesh.shape),
        programs=programs,
        state_bytes=state_bytes,
        plan_total=plan.peak,
        roofline=roofline,
        widths=widths,
    )


def _placements(cfg: Config, model_config, devices: list):
    """(train placement, rollout placement or None) as the run makes them on `devices`:
    async splits each host's devices, sync takes the first devices of the mesh's size."""
    mesh_shape = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
    rollout_placement = None
    if cfg.rollout.mode == "async":
        rollout_config = setup_lib.rollout_model_config(cfg, model_config)
        rollout_devices, train_devices = _split(devices, cfg.mesh.rollout_devices)
        placement = placement_lib.Placement(
            sharding.make_mesh(mesh_shape, train_devices), model_config
        )
        tensor = cfg.mesh.tensor if len(rollout_devices) % cfg.mesh.tensor == 0 else 1
        rollout_placement = placement_lib.Placement(
            sharding.make_mesh({"data": -1, "tensor": tensor}, rollout_devices), rollout_config
        )
    else:
        size = math.prod(mesh_shape.values())
        if -1 not in mesh_shape.values() and size < len(devices):
            devices = devices[:size]  # as `Placement.from_shape`: a mesh on the first devices
        placement = placement_lib.Placement(sharding.make_mesh(mesh_shape, devices), model_config)
    setup_lib.check_rows(cfg, placement, rollout_placement)
    prompts = _sampled_prompts(cfg, rollout_placement is not None, devices)
    setup_lib.check_engine_sizes(cfg, model_config, placement, rollout_placement, prompts)
    return placement, rollout_placement


def _sft_program(cfg: Config, model_config, placement, train_params, params_shape, seq_len):
    """The supervised warm-up's step, on what it trains: every param, or under LoRA the
    base, or under a quantised base the adapters (`sft.warmup_split`)."""
    sft_tx = optax.adamw(cfg.sft.lr, weight_decay=0.0)
    warm_shape = sft.warmup_split(params_shape, model_config)[0]
    opt_shape = jax.eval_shape(sft_tx.init, warm_shape)
    warm_shardings = sft.warmup_split(placement.train_params, model_config)[0]
    opt = _abstract(
        opt_shape, sharding.opt_state_shardings(opt_shape, warm_shardings, placement.mesh)
    )
    b = cfg.sft.batch_size
    return compile_program(
        "sft_step",
        f"warm-up, {b} rows x {seq_len} tokens",
        sft.make_sft_step(model_config, sft_tx, placement.mesh),
        train_params,
        opt,
        _rows(placement, jnp.int32, b, seq_len),
        _rows(placement, jnp.bool_, b, seq_len),
        _rows(placement, jnp.bool_, b, seq_len),
    )


def _reshard_program(cfg, rollout_config, placement, rollout_placement, train_params,
                     params_shape) -> tuple[Program, Any]:  # fmt: skip
    """The weights' move to the sampling layout, converted to `rollout.weight_dtype` on
    the way (`quant.convert_weights`) as the trainer's `SamplingCopy` (sync) or
    `WeightPublisher` (async) does; and the sampling-side params it makes (abstract)."""
    weight_dtype = config_lib.rollout_weight_dtype(cfg)
    convert = functools.partial(quant.convert_weights, weight_dtype=weight_dtype)
    rollout_shape = jax.eval_shape(convert, params_shape)
    sampler_placement = rollout_placement or placement
    sample_shardings = sharding.param_shardings(
        rollout_config, sampler_placement.mesh, sharding.SAMPLE_RULES
    )
    converted = f", as {weight_dtype}" if weight_dtype else ""
    if rollout_placement is None:
        reshard = jax.jit(convert, out_shardings=sample_shardings)
        what = f"train layout -> sampling layout (tensor-parallel only){converted}"
    else:
        gathered = jax.tree.map(lambda _: placement.replicated, rollout_shape)
        reshard = jax.jit(convert, out_shardings=gathered)
        what = (
            "async: params gathered on the train mesh before the copy to rollout devices"
            + converted
        )
    program = compile_program("reshard", what, reshard, train_params)
    return program, _abstract(rollout_shape, sample_shardings)


def _sampled_prompts(cfg: Config, async_rollouts: bool, devices) -> int:
    """Prompts per rollout batch on one process's engine: async rollouts split the batch
    over the topology's processes."""
    prompts = cfg.rollout.batch_size
    if async_rollouts:
        prompts //= max(1, len({d.process_index for d in devices}))
    return prompts


def _sampling_programs(cfg, model_config, rollout_config, placements, sample_params,
                       params_shape, prompts, limit, stop_pad, add):  # fmt: skip
    """The rollout engine's programs (its KV sized as the run sizes it on this chip,
    `setup.kv_budget`), the evaluation's (the run's engine on the training devices, the
    evaluation's decoding, eval.n_samples per prompt), the static decode step, and under
    the paged engine one decode step as its loop runs it. Returns (engine, the step's
    params, the decode program)."""
    placement, sampler_placement = placements
    decoding = sampling.from_gconfig(cfg.gconfig, *stop_pad)
    decoding = dataclasses.replace(decoding, record_experts=cfg.actor.router_replay != "off")
    prompt_len = cfg.task.max_prompt_len
    rows = cfg.rollout.batch_size * cfg.gconfig.n_samples
    seq_len = prompt_len + cfg.gconfig.max_new_tokens
    engine = setup_lib.build_engine(cfg, model_config, decoding, sampler_placement, limit)
    max_append = cfg.agent.max_append_tokens if cfg.agent.env else 0
    started = [
        add(p)
        for p in _compile_engine(
            engine,
            sample_params,
            prompts,
            cfg.gconfig.n_samples,
            prompt_len,
            max_append=max_append,
        )  # fmt: skip
    ]
    settings = evaluate_lib.eval_decoding(cfg, decoding)
    evaluator = setup_lib.build_engine(
        cfg, model_config, settings, placement, limit, trained_weights=True
    )
    evaluation = _compile_engine(
        evaluator, _abstract(params_shape, placement.sample_params), cfg.eval.batch_size,
        cfg.eval.n_samples, prompt_len, max_append=max_append,
    )  # fmt: skip
    for p in evaluation:
        p.name = "evaluate" if len(evaluation) == 1 else f"evaluate_{p.name}"
        p.what = f"evaluation ({p.what}), {cfg.eval.batch_size} prompts x {cfg.eval.n_samples}"
        add(p)
    decode = add(_compile_decode(sampler_placement, sample_params, rollout_config, rows, seq_len))
    start = next((p for p in started if p.name == "engine_start" and not p.error), None)
    step_params = None
    if isinstance(engine, engines.PagedEngine) and start is not None:
        # The weights as the decode loop's body reads them: XLA hoists their cast to the
        # compute dtype out of `engine_run`'s while loop (its HLO converts them in the
        # entry computation), so one step reads them in the compute dtype (quantised
        # codes and their scales as stored).
        dtype = model_config_lib.as_dtype(model_config.dtype)

        def as_read(path, x):
            keys = tuple(getattr(k, "key", k) for k in path)
            cast = jnp.issubdtype(x.dtype, jnp.floating)
            cast = cast and not quant.is_quantized_leaf(keys, x.dtype)
            return jax.ShapeDtypeStruct(x.shape, dtype if cast else x.dtype, sharding=x.sharding)

        step_params = jax.tree_util.tree_map_with_path(as_read, sample_params)
        probe = engine.decode_probe(step_params, prompts, cfg.gconfig.n_samples,
                                    prompt_len=prompt_len)  # fmt: skip
        args = [_outputs(start.compiled) if isinstance(a, engines.OutputOf) else a
                for a in probe.args]  # fmt: skip
        add(compile_program(probe.name, probe.what, probe.jitted, *args)).probe = True
    return engine, step_params, decode


def _split(devices: list, rollout_per_process: int) -> tuple[list, list]:
    """`placement.split_devices` over a topology's devices: (process 0's rollout devices,
    every process's train devices)."""
    by_process: dict[int, list] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    local = by_process[min(by_process)]
    n = rollout_per_process or len(local) // 2
    if not 0 < n < len(local):
        raise ValueError(
            f"mesh.rollout_devices={rollout_per_process}: each host of the topology has "
            f"{len(local)} devices; rollouts need at least one and training at least one"
        )
    train = [d for p in sorted(by_process) for d in by_process[p][: len(local) - n]]
    return local[len(local) - n :], train


def _compile_engine(engine, params, prompts: int, n_samples: int, prompt_len: int, *,
                    max_append: int = 0) -> list[Program]:  # fmt: skip
    """`engine.programs`, each compiled from the abstract outputs of those it takes them
    from, in order; stops at a program the compiler refuses."""
    compiled: dict[str, Any] = {}
    done = []
    for program in engine.programs(
        params, prompts, n_samples, prompt_len=prompt_len, max_append=max_append
    ):
        args = [compiled[a.program] if isinstance(a, engines.OutputOf) else a for a in program.args]
        done.append(compile_program(program.name, program.what, program.jitted, *args))
        if done[-1].error:
            break
        compiled[program.name] = _outputs(done[-1].compiled)
    return done


def _outputs(compiled):
    """A compiled program's outputs as ShapeDtypeStructs with their shardings."""
    shapes = compiled.out_info
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes,
        compiled.output_shardings,
    )


def _compile_decode(placement, params, model_config, rows, seq_len) -> Program:
    """One decode step of `rows` rows against a cache of `seq_len` columns (the roofline's
    decode figure; the samplers run it inside their loops)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = placement.mesh
    cache_shape = jax.eval_shape(lambda: model_lib.init_cache(model_config, rows, seq_len))
    # Rows over the batch axes, kv heads over tensor where they divide (as the sampling
    # layout splits the k / v projections).
    heads = "tensor" if model_config.num_kv_heads % mesh.shape.get("tensor", 1) == 0 else None
    kv = NamedSharding(mesh, P(BATCH_AXES, heads, None, None))
    cache = model_lib.KVCache(
        k=_abstract(cache_shape.k, kv),
        v=_abstract(cache_shape.v, kv),
        valid_BxS=_abstract(cache_shape.valid_BxS, NamedSharding(mesh, P(BATCH_AXES, None))),
    )

    def step(params, tokens_Bx1, positions_Bx1, cache):
        return model_lib.apply(
            params, model_config, tokens_Bx1, positions_Bx1, None, cache, seq_len - 1,
            last_only=True,
        )  # fmt: skip

    jitted = jax.jit(sharding.on_mesh(step, placement.mesh), donate_argnums=(3,))
    program = compile_program(
        "decode_step",
        f"one token for {rows} rows, cache of {seq_len} columns",
        jitted,
        params,
        _rows(placement, jnp.int32, rows, 1),
        _rows(placement, jnp.int32, rows, 1),
        cache,
    )
    program.probe = True
    return program


def _roofline(tgt, model_config, train, decode, sample_params, rows, seq_len, placement) -> dict:
    """Lower bounds of the train step's and one decode step's time on `tgt`'s chip
    (`model_config`: the rollouts', whose `cache_dtype` the decode floor's KV takes)."""
    if tgt.chip is None or train.error or decode.error:
        return {}
    c = model_config
    shards = placement.mesh.size
    batch_shards = sharding.batch_shards(placement.mesh)
    # Mosaic kernels are custom calls: XLA's cost analysis counts none of their FLOPs.
    # Causal attention: 4 * T^2 / 2 * H * D per row and layer forward; backward 2x; the
    # remat policy recomputes the forward once more.
    attention = 2 * seq_len**2 * c.num_heads * c.dim_per_head * c.num_layers * rows
    passes = 3 + (1 if c.remat else 0)
    kernel_flops = attention * passes / shards if train.kernels else 0.0
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(
        jax.eval_shape(lambda: model_lib.init_params(c, jax.random.key(0)))))  # fmt: skip
    n_params -= c.num_params() - c.num_params(active=True)  # experts a token does not run
    tokens = rows * seq_len
    model_flops = (6 * n_params * tokens + 3 * attention) / shards
    # XLA's cost analysis counts a loop body once (micro-batches and scanned layers are
    # loops): its FLOPs are a lower bound. The step runs at least the model's FLOPs, and
    # the remat policy's recomputed forward on top.
    executed = model_flops * (passes / 3)
    flops = max(train.flops + kernel_flops, executed)
    compute_s = flops / tgt.peak_flops
    memory_s = train.bytes_accessed / tgt.hbm_bandwidth
    bound_s = max(compute_s, memory_s)
    weights = _bytes_per_device(sample_params)
    kv_per_device = (
        2 * c.num_layers * (rows // batch_shards) * seq_len * c.num_kv_heads * c.dim_per_head
        * c.cache_dtype.itemsize
        // (placement.mesh.shape.get("tensor", 1) if c.num_kv_heads % placement.mesh.shape.get(
            "tensor", 1) == 0 else 1)
    )  # fmt: skip
    floor = weights + kv_per_device
    # A compiler without a cost analysis (jax's CUDA plugin): the analytic floor.
    decode_bytes = decode.bytes_accessed or floor
    decode_s = decode_bytes / tgt.hbm_bandwidth
    return dict(
        train_flops=train.flops,
        bound_flops=flops,
        kernel_flops=kernel_flops,
        train_bytes=train.bytes_accessed,
        train_bound_s=bound_s,
        train_bound="compute" if compute_s >= memory_s else "memory",
        model_flops=model_flops,
        best_mfu=model_flops / (bound_s * tgt.peak_flops) if bound_s else 0.0,
        decode_rows=rows,
        decode_bytes=decode_bytes,
        decode_floor_bytes=floor,
        decode_ratio=decode_bytes / floor if floor else 0.0,
        cost_analysis=bool(train.bytes_accessed),
        decode_bound_s=decode_s,
        decode_tokens_s=(rows / batch_shards) / decode_s if decode_s else 0.0,
    )


def _paged_roofline(
    tgt, model_config, run: Program, engine, size, prompt_len, n_samples, weights
) -> dict:
    """Lower bound of one decode step of the paged engine on `tgt`'s chip, every slot live
    with its whole prompt and half the completion budget: what the step (the probe `run`)
    moves to and from HBM per device (`hlo_traffic.hbm_bytes` of its compiled HLO: the
    weights, the cache write and the bookkeeping; plus, where the decode attention is the
    Mosaic kernel, which that count leaves out, each sequence's pages, its prompt's
    shared pages read again per sequence) against the floor: the weights and the unique
    live KV (each group's prompt pages once). `paged_cost_bytes`: the same with XLA's cost
    analysis instead, which also counts the on-chip copies of the weights."""
    if tgt.chip is None or run.error or not run.bytes_accessed:
        return {}
    c = model_config
    mesh = engine.mesh
    tensor = 1 if mesh is None else mesh.shape.get("tensor", 1)
    split = tensor if c.num_kv_heads % tensor == 0 else 1
    itemsize = c.cache_dtype.itemsize
    token = 2 * c.num_layers * c.num_kv_heads * c.dim_per_head * itemsize // split
    slots, new = size["slots"], engine.sampling.max_new_tokens
    completion = new // 2
    kernel = slots * (prompt_len + completion) * token if run.kernels else 0
    groups = -(-slots // n_samples)  # the prompts of the live sequences
    floor = weights + (groups * prompt_len + slots * completion) * token
    hbm = hlo_traffic.hbm_bytes(run.compiled.as_text()) if run.compiled is not None else 0.0
    step = (hbm or run.bytes_accessed) + kernel
    seconds = step / tgt.hbm_bandwidth
    return dict(
        paged_slots=slots,
        paged_live=prompt_len + completion,
        paged_kernel=bool(run.kernels),
        paged_bytes=step,
        paged_cost_bytes=run.bytes_accessed + kernel,
        paged_floor_bytes=floor,
        paged_ratio=step / floor,
        paged_bound_s=seconds,
        paged_tokens_s=slots / tensor / seconds,
    )


# ----------------------------------------------------------------------------- command line


def model_for(
    cfg: Config, architecture: str = ""
) -> tuple[model_config_lib.ModelConfig, tuple, int]:
    """(model config, stop ids, pad id) of a run without its weights or data: the
    `config.json` of `model.path`, a named architecture (`architectures.ARCHITECTURES`),
    or the built-in task's new model."""
    from m2po_jax.models import architectures

    m = cfg.model
    layout = dict(remat=m.remat, remat_policy=m.remat_policy, attention=m.attention,
                  scan_layers=m.scan_layers, expert_axis=cfg.mesh.expert_axis,
                  **setup_lib.lora_fields(m))  # fmt: skip
    if architecture:
        model_config = architectures.model_config(
            architecture, dtype=m.dtype, param_dtype=m.param_dtype, **layout
        )
        eos = architectures.hf_config(architecture).get("eos_token_id", 0)
    elif m.path:
        from m2po_jax.models import hf, hf_format

        hf_config = hf.read_hf_config(m.path)
        model_config = hf_format.config_from_hf(
            hf_config, dtype=m.dtype, param_dtype=m.param_dtype
        ).replace(**layout)
        eos = hf_config.get("eos_token_id", 0)
    elif cfg.task.name == "arith":
        task = setup_lib.build_task(cfg)
        model_config, _ = setup_lib.build_model(cfg, task.tokenizer.vocab_size)
        return model_config, (task.tokenizer.eos_id,), task.tokenizer.pad_id
    else:
        raise ValueError(
            f"model.path: empty; a compile-only run of task.name={cfg.task.name!r} needs the "
            "model's config.json (model.path=DIR, no weights read) or --architecture=NAME "
            f"(one of {', '.join(architectures.ARCHITECTURES)})"
        )
    stop = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos or 0),)
    return model_config, stop, 0


def run(cfg: Config, topology: str = "", architecture: str = "", say=print) -> Report:
    """The dry run of `m2po-train --compile_only`: prints the report; raises MemoryError
    naming a setting that would fit when the run does not fit the chip."""
    from m2po_jax.trainer import memory_check

    tgt = target(topology)
    model_config, stop, pad = model_for(cfg, architecture)
    say(f"compile-only: compiling every program of the run for {tgt.name} ...")
    report = dry_run(cfg, model_config, tgt, stop_ids=stop, pad_id=pad, say=say)
    say(report.format())
    if report.fits is False:
        peak = report.peak
        refused = next((p for p in report.run_programs if p.error), None)
        placement = placement_lib.Placement(
            sharding.make_mesh(report.mesh_shape, list(tgt.devices)[: math.prod(
                report.mesh_shape.values())]), model_config)  # fmt: skip
        plan, kwargs = setup_lib.memory_plan(cfg, model_config, placement, tgt.hbm_bytes)
        # The plan's knobs, against the chip's memory scaled by how far the plan is from
        # the compiler's figure for this run.
        limit = int(tgt.hbm_bytes * plan.peak / max(peak.peak_bytes, 1))
        fixes = memory_check.remedies(model_config, placement.mesh, limit, **kwargs)
        advice = (
            "it would fit with " + "; or ".join(f.split(" (")[0] for f in fixes)
            if fixes
            else "no single setting makes it fit: more chips (mesh.fsdp), shorter sequences "
            "or fewer rows per step"
        )
        sampling_side = {"reshard", "sampler", "decode_step"}
        name = (refused or peak).name
        if name in sampling_side or name.startswith(("engine", "evaluate")):
            advice += (
                "; the sampling layout keeps whole weights on every device but for "
                "mesh.tensor: a larger mesh.tensor (with mesh.fsdp smaller by as much) "
                "divides them"
            )
        if refused is not None:
            raise MemoryError(f"{tgt.name}: {refused.name}: {refused.error}; {advice}")
        raise MemoryError(
            f"{tgt.name}: {peak.name} needs {peak.peak_bytes / _GIB:.2f} GiB per device, over "
            f"the {tgt.hbm_bytes / _GIB:.1f} GiB of a {tgt.chip.name} chip; {advice}"
        )
    return report
