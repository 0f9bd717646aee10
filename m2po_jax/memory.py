"""Per-device memory plan of a run, and the check that refuses a run that cannot fit.

plan = memory_plan(model_config, mesh, batch=rows, seq_len=T, kv_cache_batch=rows)
print(plan.format())             # params, optimizer, gradients, activations, ...
check_fits(plan)                 # raises with the numbers when it exceeds the device
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
from jax.sharding import Mesh

from m2po_jax import model as model_lib
from m2po_jax import sharding

_OPT_MOMENTS = {"adamw": 2, "adam": 2, "lion": 1, "sgd": 0}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Estimated bytes per device; see `memory_plan` for what each entry counts."""

    params: int
    optimizer: int
    gradients: int
    activations: int
    logits: int
    kv_cache: int
    mesh_shape: tuple[tuple[str, int], ...] = ()

    @property
    def total(self) -> int:
        return (
            self.params
            + self.optimizer
            + self.gradients
            + self.activations
            + self.logits
            + self.kv_cache
        )

    def format(self) -> str:
        """A small table in MiB."""
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape)
        rows = [f"memory per device (mesh {mesh or '?'})"]
        for name in ("params", "optimizer", "gradients", "activations", "logits", "kv_cache"):
            rows.append(f"  {name:<12}{getattr(self, name) / 2**20:>12.2f} MiB")
        rows.append(f"  {'total':<12}{self.total / 2**20:>12.2f} MiB")
        return "\n".join(rows)


def _per_device(n_items: int, splits: int) -> int:
    return -(-n_items // splits)


def memory_plan(
    model_config: model_lib.ModelConfig,
    mesh: Mesh,
    *,
    rules: sharding.Rules | Mapping = sharding.TRAIN_RULES,
    batch: int,
    seq_len: int,
    micro_batch: int | None = None,
    kv_cache_batch: int = 0,
    kv_cache_len: int | None = None,
    optimizer: str = "adamw",
    remat: bool | None = None,
    param_dtype_bytes: int | None = None,
    compute_dtype_bytes: int | None = None,
) -> MemoryPlan:
    """Estimate peak bytes per device for one train step (plus a sampling KV cache).

    - params / gradients: each param's shard under `rules` (exact);
    - optimizer: moments (2 for AdamW) sharded like the params, in param dtype;
    - activations, per micro-batch (rows split over data x fsdp, heads and MLP over
      tensor when divisible), kept for the backward pass per layer:
      4 residual-width tensors [b,T,E], q/k/v/out [b,T,(2H+2K)D], scores and probs
      [b,H,T,T], MLP gate/up/hidden [b,T,F]x3; with remat only each layer's input plus
      one layer recomputed at a time;
    - logits: float32 logits and their gradient [b,T,V] (V split over tensor);
    - kv_cache: k and v [b,S,K,D] per layer in compute dtype, b split over data x
      fsdp and K over tensor (0 when `kv_cache_batch` is 0).
    The total assumes all of these live at once, so it is an upper bound for a
    trainer that samples and trains on the same devices.
    """
    c = model_config
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch ({batch}) and seq_len ({seq_len}) must be positive")
    micro_batch = batch if micro_batch is None else micro_batch
    if micro_batch < 1 or batch % micro_batch:
        raise ValueError(f"micro_batch: {micro_batch} must be positive and divide batch {batch}")
    if optimizer not in _OPT_MOMENTS:
        raise ValueError(
            f"optimizer: {optimizer!r} unknown; expected one of {sorted(_OPT_MOMENTS)}"
        )
    remat = c.remat if remat is None else remat
    pbytes = param_dtype_bytes or model_lib.as_dtype(c.param_dtype).itemsize
    cbytes = compute_dtype_bytes or model_lib.as_dtype(c.dtype).itemsize
    kv_cache_len = seq_len if kv_cache_len is None else kv_cache_len

    shardings = sharding.param_shardings(c, mesh, rules)
    shapes = sharding.param_shapes(c)
    param_items = sum(
        math.prod(sh.shard_shape(s.shape))
        for sh, s in zip(jax.tree.leaves(shardings), jax.tree.leaves(shapes), strict=True)
    )
    params = param_items * pbytes

    tensor = mesh.shape.get("tensor", 1)

    def split(n: int) -> int:  # per-device share of a tensor-parallel dim
        return n // tensor if n % tensor == 0 else n

    b, t, e = _per_device(micro_batch, sharding.batch_shards(mesh)), seq_len, c.hidden_size
    h, k, d, f = (
        split(c.num_heads),
        split(c.num_kv_heads),
        c.dim_per_head,
        split(c.intermediate_size),
    )
    layer = b * t * (4 * e + (2 * h + 2 * k) * d + 3 * f) + 2 * b * h * t * t
    if remat:
        activations = (c.num_layers * b * t * e + layer) * cbytes
    else:
        activations = c.num_layers * layer * cbytes
    logits = 2 * b * t * split(c.vocab_size) * 4

    kv_b = _per_device(kv_cache_batch, sharding.batch_shards(mesh))
    kv_cache = 2 * c.num_layers * kv_b * kv_cache_len * split(c.num_kv_heads) * d * cbytes
    return MemoryPlan(
        params=params,
        optimizer=_OPT_MOMENTS[optimizer] * params,
        gradients=params,
        activations=activations,
        logits=logits,
        kv_cache=kv_cache,
        mesh_shape=tuple(mesh.shape.items()),
    )


def device_memory_limit() -> int | None:
    """Memory limit of device 0 from `memory_stats()`, None where unreported (CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else stats.get("bytes_limit")


def check_fits(plan: MemoryPlan, device_memory_bytes: int | None = None) -> int | None:
    """Raise MemoryError when `plan.total` exceeds the device memory.

    Args:
      plan: from `memory_plan`.
      device_memory_bytes: the limit; default the device's own `bytes_limit`.
        When neither is known (CPU) nothing is checked.

    Returns:
      The limit checked against, or None when skipped.
    """
    limit = device_memory_bytes if device_memory_bytes is not None else device_memory_limit()
    if limit is None:
        return None
    if plan.total > limit:
        raise MemoryError(
            f"estimated {plan.total / 2**30:.3f} GiB ({plan.total} bytes) per device exceeds "
            f"the device memory {limit / 2**30:.3f} GiB ({limit} bytes):\n{plan.format()}"
        )
    return limit
