"""Where one run's arrays live: the mesh, the train/sample shardings, host <-> device batches.

Single- and multi-process runs share one code path: every process holds the same host
rollouts (numpy), feeds only its own rows into global arrays with
`jax.make_array_from_process_local_data`, and gathers generated tokens back with
`process_allgather` so that rewards and the stale queue are identical everywhere.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from m2po_jax.common import mesh_axes
from m2po_jax.common.types import TrainBatch
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
    def from_shape(cls, shape: dict, model_config) -> Placement:
        """A mesh of `shape`; a fixed shape smaller than the host's devices uses the first ones.

        (Single process only: a multi-process mesh must span every device.)
        """
        devices = jax.devices()
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
                state_shape.opt_state, self.train_params, self.mesh
            ),
            nonfinite_steps=self.replicated,
        )

    def batch_shardings(self, batch):
        """Batch-dim shardings for every array of `batch` (arrays or shape structs)."""
        return jax.tree.map(lambda x: sharding.batch_sharding(self.mesh, np.ndim(x)), batch)

    def train_batch_shardings(self) -> TrainBatch:
        """`TrainBatch` of shardings: [B, T] fields and [B] fields split over the batch axes."""
        rows_by_tokens = sharding.batch_sharding(self.mesh, 2)
        rows = sharding.batch_sharding(self.mesh, 1)
        return TrainBatch(
            tokens_BxT=rows_by_tokens,
            valid_BxT=rows_by_tokens,
            behav_logp_BxT=rows_by_tokens,
            loss_mask_BxT=rows_by_tokens,
            rewards_B=rows,
            version_B=rows,
        )

    def train_step_shardings(self, state_shape, with_ref: bool) -> dict:
        """`jax.jit` keyword arguments that lay out `train_step(state, batch, rng, ref_params)`."""
        state = self.state_shardings(state_shape)
        ref = self.train_params if with_ref else None
        return dict(
            in_shardings=(state, self.train_batch_shardings(), self.replicated, ref),
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
    all-gather every process takes part in when there are several)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)
