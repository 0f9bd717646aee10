"""The memory check of a run: refuse a run that cannot fit, and XLA's own account of the step.

check_fits(memory.memory_plan(...))   # raises with the numbers, and the knob that makes it fit

`memory_plan` (m2po_jax.learner.memory) is the analytic plan of what the train step holds;
`setup.compiled_step_memory` compiles the run's step from abstract shapes and reads XLA's
`memory_analysis()` (a `CompiledStep`), which tests/learner/memory_test.py checks the plan
against.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from m2po_jax.learner import memory as memory_lib
from m2po_jax.models import model_config as model_config_lib
from m2po_jax.parallel import sharding


def device_memory_limit() -> int | None:
    """Memory limit of device 0 from `memory_stats()`, None where unreported (CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else stats.get("bytes_limit")


def remedies(
    model_config: model_config_lib.ModelConfig, mesh: Mesh, limit: int, **plan_kwargs
) -> list[str]:
    """The settings that would make a plan fit in `limit` bytes, each with its total.

    Tried one knob at a time: more micro-batches (down to one row per device), remat of
    every layer, fsdp traded for tensor (the sampler's weights are split over tensor only),
    and the data axis folded into fsdp (params and optimizer state sharded over every
    batch shard).
    """
    base = memory_lib.memory_plan(model_config, mesh, **plan_kwargs)
    batch, micro = plan_kwargs["batch"], base.micro_batch
    shards = sharding.batch_shards(mesh)
    found = []

    def note(setting: str, plan: memory_lib.MemoryPlan) -> bool:
        if plan.peak <= limit:
            found.append(f"{setting} ({plan.peak / 2**30:.2f} GiB)")
            return True
        return False

    n = batch // micro
    for more in range(n + 1, batch // shards + 1):
        if batch % more == 0 and (batch // more) % shards == 0:
            changed = {**plan_kwargs, "micro_batch": batch // more}
            if note(
                f"{more} micro-batches per minibatch (actor.mb_spec.n_mbs)",
                memory_lib.memory_plan(model_config, mesh, **changed),
            ):
                break
    if not model_config.remat:
        note(
            "model.remat=True",
            memory_lib.memory_plan(model_config.replace(remat=True), mesh, **plan_kwargs),
        )
    # The sampler's weights are split over tensor only: trade fsdp for tensor.
    fsdp, tensor = mesh.shape.get("fsdp", 1), mesh.shape.get("tensor", 1)
    if base.sampling_weights:
        t = tensor * 2
        while fsdp * tensor % t == 0:
            shape = {"data": mesh.shape.get("data", 1), "fsdp": fsdp * tensor // t, "tensor": t}
            swapped = sharding.make_mesh(shape, mesh.devices.flatten().tolist())
            plan = memory_lib.memory_plan(model_config, swapped, **plan_kwargs)
            if note(f"mesh.fsdp={shape['fsdp']} mesh.tensor={t}", plan):
                break
            t *= 2
    data = mesh.shape.get("data", 1)
    if data > 1:
        shape = {
            "data": 1,
            "fsdp": data * mesh.shape.get("fsdp", 1),
            "tensor": mesh.shape.get("tensor", 1),
        }
        folded = sharding.make_mesh(shape, mesh.devices.flatten().tolist())
        note(
            f"mesh.data=1 mesh.fsdp={shape['fsdp']}",
            memory_lib.memory_plan(model_config, folded, **plan_kwargs),
        )
    return found


def check_fits(
    plan: memory_lib.MemoryPlan,
    device_memory_bytes: int | None = None,
    remedies: list[str] | None = None,
) -> int | None:
    """Raise MemoryError when `plan.peak` (the larger of the train step's and a rollout's
    memory: they are not held at once) exceeds the device memory.

    Args:
      plan: from `memory_plan`.
      device_memory_bytes: the limit; default the device's own `bytes_limit`.
        When neither is known (CPU) nothing is checked.
      remedies: settings that would fit (`remedies(...)`), named in the error.

    Returns:
      The limit checked against, or None when skipped.
    """
    limit = device_memory_bytes if device_memory_bytes is not None else device_memory_limit()
    if limit is None:
        return None
    if plan.peak > limit:
        advice = (
            "it would fit with " + "; or ".join(remedies)
            if remedies
            else "no single setting makes it fit: use more devices (mesh.fsdp), a shorter "
            "sequence, or fewer rows per step"
        )
        raise MemoryError(
            f"estimated {plan.peak / 2**30:.3f} GiB ({plan.peak} bytes) per device exceeds "
            f"the device memory {limit / 2**30:.3f} GiB ({limit} bytes); {advice}:\n"
            f"{plan.format()}"
        )
    return limit


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """XLA's memory analysis of a compiled train step and the time it took to build."""

    analysis: Any  # `compiled.memory_analysis()`: bytes per device
    lower_s: float  # tracing and lowering
    compile_s: float  # XLA's compilation

    @property
    def held_bytes(self) -> int:
        """Arguments + temporaries + outputs, less the donated buffers the outputs reuse."""
        x = self.analysis
        return (
            x.argument_size_in_bytes
            + x.temp_size_in_bytes
            + x.output_size_in_bytes
            - x.alias_size_in_bytes
        )
