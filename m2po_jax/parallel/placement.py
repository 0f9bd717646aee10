"""Where one run's arrays live: the mesh, the train/sample shardings, host <-> device batches.

Single- and multi-process runs share one code path: every process holds the same host
rollouts (numpy), feeds only its own rows into global arrays with
`jax.make_array_from_process_local_data`, and gathers generated tokens back with
`process_allgather` so that rewards and the stale queue are identical everywhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from m2po_jax.common import mesh_axes
from m2po_jax.common.types import TrainBatch
from m2po_jax.models import lora, quant
from m2po_jax.models import model_config as model_config_lib
from m2po_jax.parallel import distributed, sharding


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a jitted step keeps the rows it regroups (`train_step(..., layout=)`).

    The step splits the batch into minibatches and micro-batches; without a constraint the
    partitioner may replicate a regrouped batch on every device (the Qwen2.5-7B step of
    `benchmarks/scale_bench.py` then needed 179 GiB of temporaries per device instead of 73).
    `rows` pins an array's rows to the batch axes. `mesh` is also where the "shard" M2PO
    scope (`scopes.m2po_mask_scoped`) splits the batch.
    """

    mesh: jax.sharding.Mesh

    def rows(self, x: jax.Array, row_axis: int = 0) -> jax.Array:
        axes = tuple(a for a in mesh_axes.BATCH_AXES if a in self.mesh.shape) or None
        spec = [None] * x.ndim
        spec[row_axis] = axes
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*spec)))


class Placement:
    """Mesh and shardings for one model; moves batches between host and devices."""

    def __init__(self, mesh: jax.sharding.Mesh, model_config: model_config_lib.ModelConfig):
        self.mesh = mesh
        self.model_config = model_config
        self.train_params = sharding.param_shardings(model_config, mesh, sharding.TRAIN_RULES)
        self.sample_params = sharding.param_shardings(model_config, mesh, sharding.SAMPLE_RULES)
        self.replicated = sharding.replicated(mesh)
        self.batch_shards = sharding.batch_shards(mesh)
        self.layout = Layout(mesh)

    @classmethod
    def from_shape(cls, shape: dict, model_config, devices=None) -> Placement:
        """A mesh of `shape` over `devices` (default: all); a fixed shape smaller than the
        devices uses the first ones.

        (Single process only: a multi-process mesh must span every device.)
        """
        devices = jax.devices() if devices is None else list(devices)
        size = int(np.prod([v for v in shape.values()]))
        if -1 not in shape.values() and size < len(devices) and jax.process_count() == 1:
            devices = devices[:size]
        return cls(sharding.make_mesh(shape, devices), model_config)

    def check_rows(self, name: str, rows: int) -> None:
        if rows % self.batch_shards:
            raise ValueError(
                f"{name}={rows} must be divisible by the {self.batch_shards} batch shards of "
                f"the mesh {dict(self.mesh.shape)} (data x fsdp)"
            )

    # ---- params and state ---------------------------------------------------------------

    def init_params(self, rng: jax.Array):
        return sharding.shard_init(self.model_config, rng, self.mesh, sharding.TRAIN_RULES)

    def put_params(self, params):
        """Host (numpy) or single-device params into the train layout."""
        return jax.tree.map(
            lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda i: np.asarray(x)[i]),
            params,
            self.train_params,
        )

    def for_sampling(self, params):
        """Params in the sampling layout (weights tensor-parallel only)."""
        return sharding.reshard(params, self.sample_params)

    def state_shardings(self, state_shape):
        """Shardings for a `TrainState` (from `jax.eval_shape` or a concrete state)."""
        return state_shape.replace(
            step=self.replicated,
            params=self.train_params,
            opt_state=sharding.opt_state_shardings(
                state_shape.opt_state, lora.trainable(self.train_params), self.mesh
            ),
            nonfinite_steps=self.replicated,
        )

    def batch_shardings(self, batch):
        """Batch-dim shardings for every array of `batch` (arrays or shape structs)."""
        return jax.tree.map(lambda x: sharding.batch_sharding(self.mesh, np.ndim(x)), batch)

    def train_batch_shardings(self, replay: bool = False) -> TrainBatch:
        """`TrainBatch` of shardings: [B, T] fields and [B] fields split over the batch axes
        (`replay`: and the recorded experts [B, T, L, K])."""
        rows_by_tokens = sharding.batch_sharding(self.mesh, 2)
        rows = sharding.batch_sharding(self.mesh, 1)
        return TrainBatch(
            tokens_BxT=rows_by_tokens,
            valid_BxT=rows_by_tokens,
            behav_logp_BxT=rows_by_tokens,
            loss_mask_BxT=rows_by_tokens,
            rewards_B=rows,
            version_B=rows,
            version_BxT=rows_by_tokens,
            routed_experts_BxTxLxK=sharding.batch_sharding(self.mesh, 4) if replay else None,
        )

    def train_step_shardings(self, state_shape, with_ref: bool, replay: bool = False) -> dict:
        """`jax.jit` keyword arguments that lay out `train_step(state, batch, rng, ref_params)`
        (`replay`: the batch carries recorded experts)."""
        state = self.state_shardings(state_shape)
        ref = self.train_params if with_ref else None
        return dict(
            in_shardings=(state, self.train_batch_shardings(replay), self.replicated, ref),
            out_shardings=(state, self.replicated),
        )

    # ---- host <-> device ----------------------------------------------------------------

    def local_rows(self, rows: int) -> slice:
        """This process's share of a global batch of `rows` rows."""
        return distributed.process_batch_slice(rows, self.mesh)

    def from_local(self, local_tree, rows: int):
        """Global batch-sharded arrays of `rows` rows from this process's share."""
        return distributed.global_batch_from_local(local_tree, self.mesh, rows)

    def to_global(self, host_tree):
        """Global batch-sharded arrays from full host arrays (each process feeds its rows)."""
        rows = np.shape(jax.tree.leaves(host_tree)[0])[0]
        local = self.local_rows(rows)
        return self.from_local(jax.tree.map(lambda x: np.asarray(x)[local], host_tree), rows)

    def to_host(self, tree):
        """Full numpy copies of (possibly multi-process) global arrays, on every process."""
        return to_host(tree)


def to_host(tree):
    """Full numpy copies of (possibly multi-process) global arrays, on every process (an
    all-gather every process takes part in when there are several; none for arrays on
    this process's devices only, such as an async run's rollouts)."""
    local = all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree))
    if jax.process_count() == 1 or local:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def split_devices(rollout_per_process: int) -> tuple[list, list]:
    """(this process's rollout devices, every process's train devices) of an async run.

    Each process gives its last `rollout_per_process` local devices (0: half of them) to
    rollouts and the rest to training, so the train mesh spans every process and each
    process's rollout devices sit next to the train shards it holds: publishing weights
    is a copy inside each process, and the rollout programs involve no other process.
    """
    local = jax.local_devices()
    n = rollout_per_process or len(local) // 2
    if not 0 < n < len(local):
        cpu = local[0].platform == "cpu"
        raise ValueError(
            f"mesh.rollout_devices={rollout_per_process}: each process has {len(local)} "
            f"devices; rollouts need at least one and training at least one"
            + (
                " (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=2 before the "
                "run makes two)"
                if cpu and len(local) < 2
                else ""
            )
        )
    by_process: dict[int, list] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    counts = {p: len(ds) for p, ds in by_process.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(f"async rollouts need as many devices on every process, got {counts}")
    train = [d for p in sorted(by_process) for d in by_process[p][: len(local) - n]]
    return local[len(local) - n :], train


class WeightPublisher:
    """Copies the learner's params to the rollout devices (`rollout.mode = "async"`).

    Params that a process holds whole on one of its train devices (data-parallel training:
    every train device holds a full copy) go straight from that device to the rollout
    devices of the same process. Params split over several processes (fsdp or tensor
    axes) are first gathered on the train mesh, one all-gather every process takes part
    in, in the learner's program order. `dtype` (`rollout.weight_dtype`,
    `quant.convert_weights`) converts the weights first, on the train devices: "bfloat16"
    casts the float weights (half the bytes copied; a quantised base's integer codes and
    float32 scales go as they are, so the sampler dequantises exactly the learner's
    kernels), int8 / float8_e4m3fn quantise every projection kernel (about a quarter).
    `rollout_shardings` are the converted tree's (`setup.rollout_model_config`'s).
    """

    def __init__(self, rollout_shardings, dtype: str = ""):
        self.rollout_shardings = rollout_shardings
        self.dtype = dtype
        self._convert = jax.jit(functools.partial(quant.convert_weights, weight_dtype=dtype))
        self._gather = {}

    def __call__(self, params):
        if self.dtype:
            params = self._convert(params)
        whole = [_local_whole_copy(x) for x in jax.tree.leaves(params)]
        if any(w is None for w in whole):
            params = self._gathered(params)
            whole = [_local_whole_copy(x) for x in jax.tree.leaves(params)]
        targets = jax.tree.leaves(self.rollout_shardings)
        copies = [jax.device_put(w, s) for w, s in zip(whole, targets, strict=True)]
        return jax.tree.unflatten(jax.tree.structure(params), copies)

    def _gathered(self, params):
        key = jax.tree.structure(params)
        if key not in self._gather:
            mesh = jax.tree.leaves(params)[0].sharding.mesh
            replicated = jax.tree.map(lambda _: sharding.replicated(mesh), params)
            self._gather[key] = jax.jit(lambda t: t, out_shardings=replicated)
        return self._gather[key](params)


class SamplingCopy:
    """The weights sync rollouts generate with: the learner's params converted to `dtype`
    (`rollout.weight_dtype`, `quant.convert_weights`; one jitted call in the train layout,
    so a quantised copy moves at its own bytes) and laid out in `shardings` (the sampling
    layout of `setup.rollout_model_config`). Made once per policy version: the k batches
    that fill the queue share one; `release` drops it before anything else needs the
    memory (the train step, the evaluation), as the memory plan assumes."""

    def __init__(self, shardings, dtype: str = ""):
        self.shardings = shardings
        self.dtype = dtype
        self._convert = jax.jit(functools.partial(quant.convert_weights, weight_dtype=dtype))
        self._version: int | None = None
        self._copy = None
        self.made = 0  # copies made (one per version generated with)

    def __call__(self, params, version: int):
        """The copy of `params`, policy `version`; the one made already for that version."""
        if self._copy is None or version != self._version:
            self._copy = None  # the older version's buffers go before the new ones come
            converted = self._convert(params) if self.dtype else params
            self._copy = sharding.reshard(converted, self.shardings)
            self._version = version
            self.made += 1
        return self._copy

    @property
    def held(self) -> bool:
        return self._copy is not None

    def release(self) -> None:
        self._copy, self._version = None, None


def _local_whole_copy(x: jax.Array):
    """A single-device array of the whole of `x` on one of this process's devices, or None."""
    for shard in x.addressable_shards:
        if shard.data.shape == x.shape:
            return shard.data
    return None
