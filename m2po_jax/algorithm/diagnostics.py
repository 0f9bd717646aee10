"""Diagnostics of a step's off-policy data, as additive parts that combine across blocks.

What explains whether M2PO helps on stale data (trainer metrics, every run):

| key | meaning |
|---|---|
| `m2po/m2_p50`, `m2po/m2_p99`, `m2po/m2_p999` | median, 99th and 99.9th percentile of m2 over valid tokens with finite m2 (from a histogram: see below) |
| `m2po/m2_max` | the largest finite m2 (exact) |
| `offpolicy/ess` | effective sample size of the behaviour importance weights w = exp(prox - behav) over the valid tokens: `(sum w)^2 / (n sum w^2)`, in (0, 1]; 1 when every weight is equal (on-policy). VCPO (arXiv 2602.17616) reads a drop of it as the sign of collapse |
| `offpolicy/ess_kept` | the same over the tokens M2PO kept |
| `m2po/masked_loss_share` | share of the absolute per-token loss carried by the tokens M2PO masked: `sum_masked abs(l) / sum_valid abs(l)`, each token's loss as the step's loss takes it (ratio, clip, behaviour weight) had it been kept |

m2 is the second moment the mask reads (`actor.m2po_second_moment`). The quantiles come
from a histogram of log10(m2) with `BINS_PER_DECADE` bins per decade over
[10^LOG10_LOW, 10^LOG10_HIGH), interpolated log-linearly inside a bin: within a factor
10^(1 / BINS_PER_DECADE) (about 1.16) of the exact quantile, and never above the exact
maximum. m2 below 10^LOG10_LOW (exactly on-policy tokens: m2 = 0) falls in an underflow
bin read as 0; m2 above the top falls in an overflow bin read as the maximum.

A histogram, sums and log-sum-exps add up exactly across minibatches, micro-batches and
shards, so one schema serves every place the train step takes the mask: `parts` of each
block, `combine` of stacked blocks (axis 0), `finalize` of the union.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOG10_LOW, LOG10_HIGH, BINS_PER_DECADE = -12, 4, 16
N_BINS = (LOG10_HIGH - LOG10_LOW) * BINS_PER_DECADE + 2  # + underflow and overflow bins
QUANTILES = (("m2po/m2_p50", 0.5), ("m2po/m2_p99", 0.99), ("m2po/m2_p999", 0.999))
STAT_KEYS = (
    *(name for name, _ in QUANTILES),
    "m2po/m2_max",
    "offpolicy/ess",
    "offpolicy/ess_kept",
    "m2po/masked_loss_share",
)

_HIST, _MAX = "diag_parts/m2_hist", "diag_parts/m2_max"
_LSE = ("diag_parts/lse_w", "diag_parts/lse_w2", "diag_parts/kept_lse_w", "diag_parts/kept_lse_w2")
_SUMS = (
    "diag_parts/weighted_tokens",
    "diag_parts/kept_weighted_tokens",
    "diag_parts/abs_loss",
    "diag_parts/abs_loss_masked",
)
PART_KEYS = (_HIST, _MAX, *_LSE, *_SUMS)


def _bins(m2: jax.Array) -> jax.Array:
    """The histogram bin of each m2 (0: underflow, N_BINS - 1: overflow)."""
    safe = jnp.maximum(m2, 1e-30)
    inner = jnp.floor((jnp.log10(safe) - LOG10_LOW) * BINS_PER_DECADE).astype(jnp.int32) + 1
    return jnp.clip(inner, 0, N_BINS - 1)


def _lse(x: jax.Array, where: jax.Array) -> jax.Array:
    """log sum exp(x) over `where` (-inf when empty)."""
    top = jnp.max(jnp.where(where, x, -jnp.inf), initial=-jnp.inf)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    total = jnp.sum(jnp.where(where, jnp.exp(x - shift), 0.0))
    return jnp.log(total) + shift


def parts(m2, log_w, valid, kept) -> dict[str, jax.Array]:
    """Parts of one block: m2 per token (what the mask reads), the log behaviour weight
    log w = prox - behav, valid tokens and the tokens M2PO kept."""
    m2 = jnp.asarray(m2, jnp.float32)
    log_w = jnp.asarray(log_w, jnp.float32)
    valid = jnp.asarray(valid, bool)
    kept = valid & jnp.asarray(kept, bool)
    finite = valid & jnp.isfinite(m2)
    hist = (
        jnp.zeros((N_BINS,), jnp.int32)
        .at[jnp.where(finite, _bins(m2), 0)]
        .add(finite.astype(jnp.int32))
    )
    weighted, kept_weighted = valid & jnp.isfinite(log_w), kept & jnp.isfinite(log_w)
    values = {
        _HIST: hist,
        _MAX: jnp.max(jnp.where(finite, m2, 0.0), initial=0.0),
        _LSE[0]: _lse(log_w, weighted),
        _LSE[1]: _lse(2.0 * log_w, weighted),
        _LSE[2]: _lse(log_w, kept_weighted),
        _LSE[3]: _lse(2.0 * log_w, kept_weighted),
        _SUMS[0]: jnp.sum(weighted, dtype=jnp.int32),
        _SUMS[1]: jnp.sum(kept_weighted, dtype=jnp.int32),
    }
    return values


def loss_parts(per_token_loss, valid, kept) -> dict[str, jax.Array]:
    """The loss parts of one (micro-)batch: the absolute per-token loss of all valid tokens
    and of the masked ones (valid and not kept)."""
    a = jnp.abs(jnp.where(valid, per_token_loss, 0.0))
    return {_SUMS[2]: jnp.sum(a), _SUMS[3]: jnp.sum(jnp.where(kept, 0.0, a))}


def combine(stacked: dict[str, jax.Array], axis: int = 0) -> dict[str, jax.Array]:
    """Parts of blocks stacked on `axis` -> the parts of their union (exact)."""
    out = {}
    for k, v in stacked.items():
        if k == _MAX:
            out[k] = jnp.max(v, axis=axis)
        elif k in _LSE:
            out[k] = jax.nn.logsumexp(v, axis=axis)
        else:
            out[k] = jnp.sum(v, axis=axis)
    return out


def _quantile(hist: jax.Array, m2_max: jax.Array, q: float) -> jax.Array:
    """The q-quantile of the histogram's values (see the module docstring)."""
    n = jnp.sum(hist)
    cum = jnp.cumsum(hist)
    rank = q * n.astype(jnp.float32)
    b = jnp.clip(jnp.searchsorted(cum, rank, side="left"), 0, N_BINS - 1)
    below = jnp.where(b > 0, cum[jnp.maximum(b - 1, 0)], 0)
    frac = jnp.clip((rank - below) / jnp.maximum(hist[b], 1), 0.0, 1.0)
    low = LOG10_LOW + (b - 1).astype(jnp.float32) / BINS_PER_DECADE
    value = 10.0 ** (low + frac / BINS_PER_DECADE)
    value = jnp.where(b == 0, 0.0, jnp.where(b == N_BINS - 1, m2_max, value))
    return jnp.where(n > 0, jnp.minimum(value, m2_max), 0.0)


def _ess(lse_w, lse_w2, n) -> jax.Array:
    """(sum w)^2 / (n sum w^2) from log sums; 1 where there are no weights."""
    log_ess = 2.0 * lse_w - lse_w2 - jnp.log(jnp.maximum(n, 1).astype(jnp.float32))
    return jnp.where(n > 0, jnp.exp(jnp.minimum(log_ess, 0.0)), 1.0)


def finalize(p: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Parts -> `STAT_KEYS` (the loss share only where the loss parts are present)."""
    hist, m2_max = p[_HIST], p[_MAX]
    out = {name: _quantile(hist, m2_max, q) for name, q in QUANTILES}
    out["m2po/m2_max"] = m2_max
    out["offpolicy/ess"] = _ess(p[_LSE[0]], p[_LSE[1]], p[_SUMS[0]])
    out["offpolicy/ess_kept"] = _ess(p[_LSE[2]], p[_LSE[3]], p[_SUMS[1]])
    if _SUMS[2] in p:
        out["m2po/masked_loss_share"] = p[_SUMS[3]] / jnp.maximum(p[_SUMS[2]], 1e-30)
    return out
