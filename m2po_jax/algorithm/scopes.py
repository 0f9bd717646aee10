"""Where the M2PO mask is taken: the scope names and the one dispatch every scope goes through.

`M2PO_SCOPES` (the values of `actor.m2po_scope`):

| scope | one set of tokens per |
|---|---|
| `global` | array given: the whole batch, or the minibatch the update sees when the second moment needs the current policy (`m2po_second_moment` other than `behav_prox`) |
| `shard` | data-parallel shard of that array (AReaL's per-rank rule): the blocks of dim 0 over the mesh batch axes (`mesh_axes.BATCH_AXES`, data x fsdp); with no mesh or one batch shard it equals `global` |
| `minibatch` | PPO minibatch (the caller passes each one) |
| `row` | row (sequence) |
| `microbatch` | micro-batch, inside its loss (the caller passes each one) |

`m2po_mask_scoped` runs `masking.m2po_mask_with_parts` with every option on each set
(the shard scope inside `jax.shard_map` on each local block) and returns the statistics
as additive parts, combined exactly across shards (psum of sums and counts, pmax of the
boundary); see `masking_stats.py` for the schema.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from m2po_jax.algorithm import masking
from m2po_jax.algorithm import masking_stats as masking_stats_lib
from m2po_jax.common.checks import check_choice
from m2po_jax.common.mesh_axes import BATCH_AXES

M2PO_SCOPES = ("global", "shard", "minibatch", "row", "microbatch")
# masking's rules, plus the authors' capped mean, which masks nothing and sets a clip range
# (`masking.m2po_clip_bound`) instead.
M2PO_STOP_RULES = (*masking.STOP_RULES, "capped_clip")


@dataclasses.dataclass(frozen=True)
class MaskSettings:
    """The options of `m2po_mask_scoped` besides its arrays, as one frozen, hashable record
    (`actor.m2_threshold` and `actor.m2po_*`); checked when built. `threshold=None` masks
    nothing and still reports the second moment's statistics."""

    threshold: float | None
    scope: str = "global"
    method: str = "sort"
    second_moment: str = "behav_prox"
    stop_rule: str = "lt"
    candidates: str = "all"

    def __post_init__(self):
        check_choice("scope", self.scope, M2PO_SCOPES)
        check_choice("method", self.method, masking.METHODS)
        check_choice("second_moment", self.second_moment, masking.SECOND_MOMENTS)
        check_choice("stop_rule", self.stop_rule, M2PO_STOP_RULES)
        check_choice("candidates", self.candidates, masking.CANDIDATES)


def mask_block(
    settings: MaskSettings,
    behav_logp: ArrayLike,
    prox_logp: ArrayLike,
    loss_mask: ArrayLike,
    advantages: ArrayLike | None = None,
    logp: ArrayLike | None = None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`m2po_mask_scoped` of one block with the options of `settings`."""
    s = settings
    on = s.threshold is not None
    return m2po_mask_scoped(
        behav_logp,
        prox_logp,
        loss_mask,
        jnp.float32(s.threshold) if on else None,
        scope=s.scope,
        method=s.method,
        second_moment=s.second_moment,
        stop_rule=s.stop_rule,
        candidates=s.candidates,
        logp=logp if on else None,
        advantages=advantages,
        mesh=mesh,
    )


def m2po_mask_scoped(
    behav_logp: ArrayLike,
    prox_logp: ArrayLike,
    loss_mask: ArrayLike,
    m2_threshold: ArrayLike | None,
    *,
    scope: str = "global",
    method: str = "sort",
    second_moment: str = "behav_prox",
    stop_rule: str = "lt",
    candidates: str = "all",
    logp: ArrayLike | None = None,
    advantages: ArrayLike | None = None,
    mesh: Mesh | None = None,
    axes: Sequence[str] = BATCH_AXES,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The M2PO mask of one block under `scope`, with its statistics as additive parts.

    Args:
      behav_logp, prox_logp, loss_mask, m2_threshold, method, second_moment, candidates,
        logp, advantages: as in `masking.m2po_mask_with_stats`.
      scope: one of `M2PO_SCOPES`; "global", "minibatch" and "microbatch" make the
        given array one set (the caller passes the minibatch or micro-batch).
      stop_rule: one of `M2PO_STOP_RULES`; "capped_clip" masks nothing (the statistics
        are still reported) because it clips the ratio instead.
      mesh: the device mesh, for scope "shard" (None: one shard).
      axes: mesh axes that split dim 0 into shards.

    Returns:
      ``(mask, parts)``: bool mask shaped like ``loss_mask`` and the statistics parts
      (`masking.M2PO_PART_KEYS`) of the whole array; `masking.finalize_stats(parts)`
      gives the reported values.
    """
    masking._check_choice("scope", scope, M2PO_SCOPES)
    masking._check_choice("stop_rule", stop_rule, M2PO_STOP_RULES)
    if stop_rule == "capped_clip":
        m2_threshold, stop_rule = None, "lt"  # no mask: only the statistics
    options = dict(
        method=method,
        second_moment=second_moment,
        stop_rule=stop_rule,
        candidates=candidates,
        logp=logp,
        advantages=advantages,
    )
    shards = _shard_count(mesh, axes) if scope == "shard" else 1
    if shards == 1 or m2_threshold is None:  # without a mask the scope changes nothing
        block_scope = "row" if scope == "row" else "global"
        return masking.m2po_mask_with_parts(
            behav_logp, prox_logp, loss_mask, m2_threshold, scope=block_scope, **options
        )
    behav_logp, prox_logp, loss_mask, logp, advantages = masking.check_mask_inputs(
        behav_logp, prox_logp, loss_mask, m2_threshold, **options
    )
    if loss_mask.ndim < 1:
        raise ValueError(
            f"scope='shard' needs inputs with a batch dim, got shape {loss_mask.shape}"
        )
    if loss_mask.shape[0] % shards:
        raise ValueError(
            f"loss_mask: batch dim {loss_mask.shape[0]} is not divisible by the {shards} "
            f"shards of mesh axes {tuple(axes)} (scope='shard')"
        )
    static = tuple((k, v) for k, v in options.items() if k not in ("logp", "advantages"))
    fn = _per_shard_fn(mesh, tuple(axes), loss_mask.ndim, static)
    tau = jnp.asarray(m2_threshold, jnp.float32)
    return fn(behav_logp, prox_logp, loss_mask, tau, logp, advantages)


def _shard_count(mesh: Mesh | None, axes: Sequence[str]) -> int:
    if mesh is None:
        return 1
    unknown = [a for a in axes if a not in mesh.shape]
    if unknown:
        raise ValueError(f"axes: {unknown} not in the mesh axes {tuple(mesh.shape)}")
    return math.prod(mesh.shape[a] for a in axes)


@functools.lru_cache(maxsize=64)
def _per_shard_fn(mesh: Mesh, axes: tuple[str, ...], ndim: int, static: tuple):
    """Jitted shard_map: the general mask on each local block, parts summed over `axes`."""
    rows = P(axes, *([None] * (ndim - 1)))

    def block(behav, prox, loss_mask, tau, logp, advantages):
        mask, parts = masking.m2po_mask_with_parts(
            behav, prox, loss_mask, tau, logp=logp, advantages=advantages, **dict(static)
        )
        return mask, masking_stats_lib.psum_stat_parts(parts, axes)

    # Jitted: an eager shard_map runs op by op. check_vma=False: the bisect method's loop
    # carries start replicated and become shard-varying, which the check rejects; the
    # parts are psum'd, and the mask is identical across the unmapped (tensor) axis
    # because its inputs are.
    return jax.jit(
        jax.shard_map(
            block,
            mesh=mesh,
            in_specs=(rows, rows, rows, P(), rows, rows),
            out_specs=(rows, P()),
            check_vma=False,
        )
    )


def m2po_mask_per_shard(
    behav_logp: jax.typing.ArrayLike,
    prox_logp: jax.typing.ArrayLike,
    loss_mask: jax.typing.ArrayLike,
    m2_threshold: float | jax.typing.ArrayLike | None,
    mesh: Mesh,
    *,
    method: str = "sort",
    axes: Sequence[str] = BATCH_AXES,
    **options,
) -> jax.Array:
    """M2PO mask computed independently on each shard of the batch (AReaL's per-rank scope).

    The mask of `m2po_mask_scoped(..., scope="shard")`: dim 0 split over `axes`,
    each block masked on its own with every option of `masking.m2po_mask_with_stats`
    (`options`: second_moment, stop_rule, candidates, logp, advantages).

    Args:
      behav_logp, prox_logp: float [B, ...] log-probs; B divisible by the shard count.
      loss_mask: bool [B, ...] tokens taking part.
      m2_threshold: tau; None returns `loss_mask` unchanged.
      mesh: the device mesh.
      method: "sort" or "bisect".
      axes: mesh axes that split dim 0.

    Returns:
      bool [B, ...] sharded like the batch: each block is the mask of that block.
    """
    from m2po_jax.algorithm import scopes

    return scopes.m2po_mask_scoped(
        behav_logp,
        prox_logp,
        loss_mask,
        m2_threshold,
        scope="shard",
        method=method,
        mesh=mesh,
        axes=axes,
        **options,
    )[0]
