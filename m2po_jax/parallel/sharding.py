"""Device meshes, logical-axis rules and shardings for training and sampling.

One mesh with three axes, `MESH_AXES = ("data", "fsdp", "tensor")`:
- `data`: pure data parallelism (batch split, weights replicated);
- `fsdp`: batch split *and* weights split along "embed" (ZeRO-3 style);
- `tensor`: heads, MLP and vocab split (Megatron style).
A mixture of experts' expert axis ("expert") goes where its model's `expert_axis` says
(`param_specs`): "" (the rules' default) keeps every expert on every device, sharded as a
dense MLP's kernels (hidden dim over fsdp, expert hidden dim over tensor); "fsdp" or
"data" splits the experts over that batch axis (hidden dim whole, expert hidden dim over
tensor), and `moe.moe_experts` exchanges tokens over it instead of gathering weights.

Parameters carry logical axis names (model.py); a rule set maps each logical name
to mesh axes. `TRAIN_RULES` shards weights over fsdp and tensor; `SAMPLE_RULES`
keeps weights tensor-parallel only, so decoding does not gather weights every
token. `reshard` moves a tree between the two layouts.

Typical use::

    mesh = make_mesh({"data": -1, "tensor": 2})
    params = shard_init(model_config, rng, mesh, TRAIN_RULES)
    step = jax.jit(train_step, in_shardings=(param_shardings(...), batch_sharding(mesh)))
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from m2po_jax.common.mesh_axes import BATCH_AXES, MESH_AXES
from m2po_jax.models import model as model_lib
from m2po_jax.models import model_config as model_config_lib

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

# Pairs (logical name, mesh axes), in the format of `flax.linen.logical_axis_rules`.
TRAIN_RULES: Rules = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("expert", None),  # a mixture of experts' expert axis: every device holds every expert
)
SAMPLE_RULES: Rules = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("embed", None),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("expert", None),  # a mixture of experts' expert axis: every device holds every expert
)


# ----------------------------------------------------------------------------- mesh


def on_mesh(fn, mesh: Mesh | None):
    """`fn` traced with `mesh` as the mesh in context (`jax.sharding.use_abstract_mesh`).

    What depends on the devices a program is compiled for reads that context at trace
    time: the attention implementation "auto" picks, Pallas' interpret mode, and the
    `shard_map` around a kernel XLA cannot partition (`attention_kernels`). A program
    built for a TPU mesh on a CPU host (a deviceless topology) thus gets TPU kernels.
    Wrap the Python function before `jax.jit`; `mesh=None` returns `fn` itself.
    """
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def traced_on_mesh(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced_on_mesh


def make_mesh(
    shape: Mapping[str, int] | Sequence[int], devices: Sequence[Any] | None = None
) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh over all (or the given) devices.

    Args:
      shape: `{"data": 2, "tensor": -1}` (missing axes get size 1) or a 3-tuple in
        `MESH_AXES` order. One entry may be -1: it takes the devices left over.
      devices: devices to use (default `jax.devices()`); the mesh must use all of them.

    Returns:
      A `Mesh` whose axes are `AxisType.Auto`, so jit propagates shardings itself.
    """
    if isinstance(shape, Mapping):
        unknown = sorted(set(shape) - set(MESH_AXES))
        if unknown:
            raise ValueError(f"shape: unknown mesh axes {unknown}; expected names from {MESH_AXES}")
        sizes = [shape.get(name, 1) for name in MESH_AXES]
    else:
        sizes = list(shape)
        if len(sizes) != len(MESH_AXES):
            raise ValueError(f"shape: expected {len(MESH_AXES)} sizes for {MESH_AXES}, got {shape}")
    if any(not isinstance(s, (int, np.integer)) or (s < 1 and s != -1) for s in sizes):
        raise ValueError(f"shape: sizes must be positive ints or one -1, got {shape}")
    if sizes.count(-1) > 1:
        raise ValueError(f"shape: at most one -1 allowed, got {shape}")
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n % known:
            raise ValueError(
                f"shape {shape}: the fixed axes use {known} devices, which does not divide "
                f"the device count {n}"
            )
        sizes[sizes.index(-1)] = n // known
    elif known != n:
        raise ValueError(
            f"shape {shape}: mesh size {known} does not equal the device count {n} "
            "(use -1 for one axis, or pass devices=)"
        )
    return jax.make_mesh(
        tuple(int(s) for s in sizes),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
        devices=devices,
    )


# ----------------------------------------------------------------------------- rules


def _canonical_rules(rules: Rules | Mapping) -> Rules:
    """Rules as a hashable tuple of (name, axes) pairs."""
    items = rules.items() if isinstance(rules, Mapping) else rules
    return tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in items)


def _rule_map(rules: Rules | Mapping) -> dict[str, tuple[str, ...]]:
    items = rules.items() if isinstance(rules, Mapping) else rules
    out: dict[str, tuple[str, ...]] = {}
    for name, axes in items:
        if name in out:  # first match wins, as in flax
            continue
        out[name] = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return out


def logical_to_spec(
    logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Rules | Mapping
) -> P:
    """Mesh PartitionSpec for one array from its logical axis names and shape.

    Each dim takes the mesh axes its rule names, skipping axes missing from the mesh
    or already used by an earlier dim; it keeps the longest prefix of those axes whose
    total size divides the dim, so an indivisible dim (kv_heads=2 on tensor=4) is
    replicated instead of raising.
    """
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {tuple(logical)} do not match shape {tuple(shape)}")
    rule = _rule_map(rules)
    used: set[str] = set()
    dims: list[Any] = []
    for name, size in zip(logical, shape, strict=True):
        axes = [a for a in rule.get(name, ()) if a in mesh.shape and a not in used]
        while axes and size % math.prod(mesh.shape[a] for a in axes):
            axes.pop()
        used.update(axes)
        dims.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return P(*dims)


@functools.lru_cache(maxsize=32)
def param_shapes(model_config: model_config_lib.ModelConfig):
    return jax.eval_shape(lambda: model_lib.init_params(model_config, jax.random.key(0)))


def param_specs(model_config: model_config_lib.ModelConfig, mesh: Mesh, rules: Rules | Mapping):
    """Pytree of mesh PartitionSpecs matching `init_params(model_config, ...)`.

    A mixture of experts' "expert" axis goes on `model_config.expert_axis` (ahead of the
    rules' own "expert" rule), whose size must divide `num_experts`.
    """
    axis = model_config.expert_axis
    if model_config.is_moe and axis:
        size = mesh.shape.get(axis, 1)
        if model_config.num_experts % size:
            raise ValueError(
                f"expert_axis: num_experts ({model_config.num_experts}) must divide by the "
                f"size of mesh axis {axis!r} ({size})"
            )
        rules = (("expert", axis), *_canonical_rules(rules))
    logical = model_lib.logical_axes(model_config)
    shapes = param_shapes(model_config)
    return jax.tree.map(
        lambda spec, s: logical_to_spec(tuple(spec), s.shape, mesh, rules),
        logical,
        shapes,
        is_leaf=lambda x: isinstance(x, P),
    )


def param_shardings(model_config: model_config_lib.ModelConfig, mesh: Mesh, rules: Rules | Mapping):
    """Pytree of NamedShardings matching `init_params(model_config, ...)`."""
    specs = param_specs(model_config, mesh, rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Dim 0 split over ("data", "fsdp"), the other dims replicated."""
    if ndim < 1:
        raise ValueError(f"ndim: a batch array needs at least 1 dim, got {ndim}")
    axes = tuple(a for a in BATCH_AXES if a in mesh.shape)
    return NamedSharding(mesh, P(axes or None, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device."""
    return NamedSharding(mesh, P())


def batch_shards(mesh: Mesh) -> int:
    """How many ways the batch dim is split."""
    return math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES)


def cache_shardings(
    model_config: model_config_lib.ModelConfig,
    mesh: Mesh,
    rules: Rules | Mapping,
    batch: int,
    max_len: int,
) -> model_lib.KVCache:
    """Shardings for `init_cache(model_config, batch, max_len)`: batch and kv heads split.

    Keys and values are [B, K, S, D] (see `model.KVCache`), the valid mask [B, S].
    """
    shape = (batch, model_config.num_kv_heads, max_len, model_config.dim_per_head)
    kv = NamedSharding(
        mesh, logical_to_spec(("batch", "kv_heads", None, "head_dim"), shape, mesh, rules)
    )
    valid = NamedSharding(mesh, logical_to_spec(("batch", None), (batch, max_len), mesh, rules))
    layers = (kv,) * model_config.num_layers
    return model_lib.KVCache(k=layers, v=layers, valid_BxS=valid)


def opt_state_shardings(opt_state: Any, params_shardings: Any, mesh: Mesh) -> Any:
    """Shardings for an optimizer state (concrete or from `jax.eval_shape`).

    Every subtree shaped like the params (AdamW's mu and nu) takes the params'
    shardings; everything else (step counts) is replicated.
    """
    treedef = jax.tree.structure(params_shardings)

    def mirrors_params(node) -> bool:
        return not isinstance(node, (jax.Array, jax.ShapeDtypeStruct)) and (
            jax.tree.structure(node) == treedef
        )

    return jax.tree.map(
        lambda node: params_shardings if mirrors_params(node) else replicated(mesh),
        opt_state,
        is_leaf=mirrors_params,
    )


# ----------------------------------------------------------------------------- params


def shard_init(
    model_config: model_config_lib.ModelConfig, rng: jax.Array, mesh: Mesh, rules: Rules | Mapping
):
    """`init_params` computed straight into its shardings (no full copy on one device).

    With jax's partitionable threefry (the default) the values equal the unsharded
    `init_params(model_config, rng)`.
    """
    return _sharded_init(model_config, mesh, _canonical_rules(rules))(rng)


@functools.lru_cache(maxsize=8)
def _sharded_init(model_config: model_config_lib.ModelConfig, mesh: Mesh, rules: Rules):
    # Cached so that a second init (a reference policy, a restart) does not recompile.
    return jax.jit(
        functools.partial(model_lib.init_params, model_config),
        in_shardings=replicated(mesh),
        out_shardings=param_shardings(model_config, mesh, rules),
    )


def load_pretrained_sharded(
    path: str | os.PathLike,
    model_config: model_config_lib.ModelConfig,
    mesh: Mesh,
    rules: Rules | Mapping,
    dtype: Any = None,
):
    """Params of a local Hugging Face checkpoint, each placed straight into its sharding.

    Reads one tensor at a time from `hf.iter_hf_params`; every device receives only
    its own slice, so host memory holds one tensor and no device a full copy.

    Args:
      path: checkpoint directory (config.json + *.safetensors).
      model_config: the architecture, as `hf` derives it from config.json.
      mesh, rules: where the params go.
      dtype: param dtype (default `model_config.param_dtype`).

    Returns:
      A params pytree like `init_params(model_config, ...)`.
    """
    from m2po_jax.models import hf

    dtype = model_config_lib.as_dtype(dtype or model_config.param_dtype)
    shardings = param_shardings(model_config, mesh, rules)
    shapes = param_shapes(model_config)
    expected = {
        tuple(k.key for k in kp): s for kp, s in jax.tree_util.tree_leaves_with_path(shapes)
    }
    shard_of = {
        tuple(k.key for k in kp): s for kp, s in jax.tree_util.tree_leaves_with_path(shardings)
    }
    loaded: dict[tuple[str, ...], jax.Array] = {}
    for key, array in hf.iter_hf_params(path, model_config, dtype):
        key = tuple(key.split("/")) if isinstance(key, str) else tuple(key)
        if key not in expected:
            raise ValueError(f"checkpoint {path}: unexpected parameter {'/'.join(key)}")
        want = expected[key].shape
        if tuple(array.shape) != tuple(want):
            raise ValueError(
                f"checkpoint {path}: {'/'.join(key)} has shape {tuple(array.shape)}, "
                f"expected {tuple(want)}"
            )
        host = np.asarray(array, dtype=dtype)
        loaded[key] = jax.make_array_from_callback(want, shard_of[key], lambda idx, h=host: h[idx])
    missing = sorted("/".join(k) for k in expected.keys() - loaded.keys())
    if missing:
        raise ValueError(f"checkpoint {path}: missing parameters {missing}")
    leaves = [
        loaded[tuple(k.key for k in kp)] for kp, _ in jax.tree_util.tree_leaves_with_path(shapes)
    ]
    return jax.tree.unflatten(jax.tree.structure(shapes), leaves)


def reshard(tree: Any, shardings: Any, *, donate: bool = False) -> Any:
    """Move a tree into new shardings (train layout <-> sample layout); values unchanged.

    `shardings` is a matching tree or a single sharding for every leaf; `donate`
    frees the source buffers so both layouts never coexist in device memory.
    """
    return jax.device_put(tree, shardings, donate=donate)


# ----------------------------------------------------------------------------- M2PO
