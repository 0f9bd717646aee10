"""The train step's metrics: per-part statistics combined, and the step's flat dict."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from m2po_jax.algorithm import diagnostics, masking_stats, mismatch


def combine_stats(stats: dict, weights: jax.Array) -> dict:
    """Per-part statistics stacked on axis 0 -> one value each: M2PO statistics parts
    combine exactly (`masking.combine_stat_parts`), and so do the diagnostics' and the
    mismatch parts (`diagnostics.combine`, `mismatch.combine`); token counts add up, minima
    and maxima stay extreme, the rest are means weighted by `weights`."""
    share = weights / jnp.maximum(jnp.sum(weights), 1)
    parts = _only(stats, masking_stats.M2PO_PART_KEYS)
    diag = _only(stats, diagnostics.PART_KEYS)
    gaps = _only(stats, mismatch.PART_KEYS)
    out = {
        **masking_stats.combine_stat_parts(parts),
        **diagnostics.combine(diag),
        **mismatch.combine(gaps),
    }
    for name, values in stats.items():
        if name in parts or name in diag or name in gaps:
            continue
        if name.endswith("_tokens"):
            out[name] = jnp.sum(values)
        elif name.endswith("_min"):
            out[name] = jnp.min(values)
        elif name.endswith("_max"):
            out[name] = jnp.max(values)
        else:
            out[name] = jnp.sum(values * share)
    return out


def _only(parts: dict, keys) -> dict:
    """The entries of `parts` named in `keys` (one schema's parts)."""
    return {k: v for k, v in parts.items() if k in keys}


def step_metrics(state, params, prep, mb_stats: dict, mb_valid, all_finite, schedule, plan) -> dict:
    """The step's flat metrics dict (minibatch statistics combined, M2PO, entropy, norms).

    `plan` is the step's `step_plan.StepPlan`: "train/prox_pass" says whether a separate
    forward pass computed the proximal log-probs (1) or the loss pass did (0), and
    "train/prox_loglinear" whether they are AReaL's approximation (1). Entropy and the
    behaviour-proximal gap come from that pass, whichever it was. "train/shared_prompt"
    is 1 when the loss pass runs each prompt once for its group, "train/length_blocks"
    the blocks of rows by completion length it runs in (1: whole rows). "mismatch/..."
    splits the behaviour-proximal gap by token freshness (`algorithm.mismatch`), from the
    same level as the M2PO statistics, where the proximal log-probs are a recompute.
    """
    loss_mask, n_valid = prep.loss_mask_BxT, jnp.maximum(jnp.sum(prep.loss_mask_BxT), 1)
    grad_norm_BxM = mb_stats.pop("grad_norm")
    metrics = combine_stats(mb_stats, mb_valid)
    metrics["grad_norm"] = jnp.mean(grad_norm_BxM)
    metrics["actor/loss"] = metrics["loss"]
    # The M2PO parts of whichever level took the mask (batch, minibatches or micro-batches).
    m2_parts = {k: metrics.pop(k) for k in masking_stats.M2PO_PART_KEYS if k in metrics}
    m2_parts = m2_parts or _only(prep.m2_parts, masking_stats.M2PO_PART_KEYS)
    metrics.update(masking_stats.finalize_stats(m2_parts))
    # m2 and weights from that level too; the loss parts always from the loss pass.
    diag = {k: metrics.pop(k) for k in diagnostics.PART_KEYS if k in metrics}
    diag = {**_only(prep.m2_parts, diagnostics.PART_KEYS), **diag}
    if diagnostics.PART_KEYS[0] in diag:  # the train step always has them
        metrics.update(diagnostics.finalize(diag))
    # The mismatch parts from the same level, where prox is a recompute
    # (`StepPlan.prox_recomputed`): fresh against stale tokens.
    gaps = {k: metrics.pop(k) for k in mismatch.PART_KEYS if k in metrics}
    gaps = gaps or _only(prep.m2_parts, mismatch.PART_KEYS)
    if gaps:
        metrics.update(mismatch.finalize(gaps))
    metrics.update(
        {
            "train/nonfinite": 1 - all_finite.astype(jnp.int32),
            "train/lr": schedule(state.step * plan.n_minibatches),
            "train/tokens": jnp.sum(loss_mask),
            "train/adv_abs_mean": jnp.sum(jnp.abs(prep.advantages_BxT) * loss_mask) / n_valid,
            "train/grad_norm_max": jnp.max(grad_norm_BxM),
            "train/param_norm": optax.tree.norm(params),
            "train/prox_pass": jnp.int32(plan.prox_pass),
            "train/prox_loglinear": jnp.int32(plan.prox_source == "loglinear"),
            "train/shared_prompt": jnp.int32(plan.loss_prompt is not None),
            "train/length_blocks": jnp.int32(plan.length_blocks),
        }
    )
    if prep.entropy_BxT is not None:
        metrics["train/entropy"] = jnp.sum(prep.entropy_BxT * loss_mask) / n_valid
    if prep.prox_BxT is not None:
        gap = jnp.abs(prep.behav_BxT - prep.prox_BxT) * loss_mask
        metrics["train/behav_prox_abs_diff"] = jnp.sum(gap) / n_valid
    if isinstance(prep.eps_clip, jax.Array):
        metrics["m2po/clip_bound_low"] = 1.0 - prep.eps_clip
        metrics["m2po/clip_bound_high"] = 1.0 + prep.eps_clip_higher
    return metrics
