"""Experts split over fsdp (tokens exchanged) against every expert on every device (expert
weights gathered): Qwen3-30B-A3B's train-step pass compiled for a TPU slice (libtpu,
deviceless), its per-chip memory and bytes from the compiler.

    python benchmarks/moe_expert_axis.py                  # v5p:2x2x2, fsdp=8, 4 layers
    python benchmarks/moe_expert_axis.py v5e:4x4 16 2     # topology, fsdp, layers

The pass is the loss's value and gradients over one micro-batch (8 rows of 2,560 tokens,
remat, scanned layers, bfloat16 params), the params and gradients sharded as the trainer
shards them; layers fewer than 48 so it compiles in a minute (memory per layer scales).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from m2po_jax.models import architectures
from m2po_jax.models import model as model_lib
from m2po_jax.parallel import sharding
from m2po_jax.trainer import compile_only

_GIB = 1024**3


def measure(topology: str, fsdp: int, layers: int, expert_axis: str, rows: int = 8) -> dict:
    tgt = compile_only.target(topology)
    config = architectures.model_config(
        "qwen3-30b-a3b", dtype="bfloat16", param_dtype="bfloat16", num_layers=layers,
        remat=True, scan_layers=True, expert_axis=expert_axis,
    )  # fmt: skip
    devices = list(tgt.devices)[:fsdp]
    mesh = sharding.make_mesh({"fsdp": fsdp}, devices)
    shardings = sharding.param_shardings(config, mesh, sharding.TRAIN_RULES)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        sharding.param_shapes(config),
        shardings,
    )
    ids = jax.ShapeDtypeStruct((rows, 2560), jnp.int32, sharding=NamedSharding(mesh, P("fsdp")))

    def loss(p, t):
        logits = model_lib.apply(p, config, t)
        return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))

    step = jax.jit(
        sharding.on_mesh(jax.value_and_grad(loss), mesh),
        out_shardings=(sharding.replicated(mesh), shardings),
    )
    compiled = step.lower(params, ids).compile()
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    return dict(
        expert_axis=expert_axis or "none",
        arguments=memory.argument_size_in_bytes / _GIB,
        temp=memory.temp_size_in_bytes / _GIB,
        peak=(
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes
        )
        / _GIB,  # fmt: skip
        bytes_accessed=cost.get("bytes accessed", 0.0) / 1e9,
        gmm_calls=text.count("jit(gmm)/pallas_call") + text.count("jit(tgmm)/pallas_call"),
        all_gathers=text.count(" all-gather("),
        reduce_scatters=text.count(" reduce-scatter("),
    )


def main(argv: list[str]) -> None:
    topology = argv[0] if argv else "v5p:2x2x2"
    fsdp = int(argv[1]) if len(argv) > 1 else 8
    layers = int(argv[2]) if len(argv) > 2 else 4
    print(f"qwen3-30b-a3b, {layers} layers, {topology} fsdp={fsdp}, 8 x 2,560 tokens")
    print("| experts | arguments GiB | temp GiB | peak GiB | GB accessed | gmm+tgmm | "
          "all-gathers | reduce-scatters |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for axis in ("fsdp", ""):
        r = measure(topology, fsdp, layers, axis)
        print(f"| {r['expert_axis']} | {r['arguments']:.2f} | {r['temp']:.2f} | {r['peak']:.2f} "
              f"| {r['bytes_accessed']:.1f} | {r['gmm_calls']} | {r['all_gathers']} | "
              f"{r['reduce_scatters']} |")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
