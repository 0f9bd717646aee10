"""PNG plots of runs: the panels of one run's metrics.jsonl, and several runs overlaid."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from m2po_jax.common.checks import is_number
from m2po_jax.run import paths
from m2po_jax.run.metrics import read_metrics

DEFAULT_COMPARISON_KEYS = (
    "reward/mean",
    "eval/accuracy",
    "m2po/masked_fraction",
    "m2po/m2_before",
)
# (file stem, title, keys, log y) of each panel of `plot_metrics`.
PANELS = (
    ("reward", "reward", ("reward/mean",), False),
    ("eval_accuracy", "eval accuracy", ("eval/accuracy",), False),
    ("masked_fraction", "M2PO masked fraction", ("m2po/masked_fraction",), False),
    ("m2", "second moment", ("m2po/m2_before", "m2po/m2_after"), True),
    ("loss", "loss", ("loss",), False),
    ("grad_norm", "gradient norm", ("grad_norm",), True),
    ("clip_fraction", "PPO clip fraction", ("actor/clip_fraction",), False),
    ("entropy", "policy entropy", ("train/entropy",), False),
    ("staleness", "staleness (versions)", ("staleness/mean", "staleness/max"), False),
    ("mismatch", "mismatch vs staleness", ("mismatch/fresh/m2", "mismatch/stale/m2"), True),
)
# A log axis spans at most this many decades below its largest value (a step-0 m2 of
# 1e-13, an exact on-policy step, would otherwise flatten everything else).
LOG_DECADES = 4
# Panels with more: (keys on a linear right axis, decades of the log axis). The fresh
# tokens' m2 (engine/trainer numerics alone) sits many decades below the stale tokens'
# (float32 rounding: 1e-14 against 1e-2): that gap is what the panel shows.
PANEL_EXTRAS = {
    "mismatch": (("mismatch/fresh/m2po_drop_alone", "mismatch/fresh/m2po_dropped"), 16),
}


def _series(records: Iterable[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records that have `key`; null becomes NaN."""
    steps, values = [], []
    for record in records:
        if key in record and (record[key] is None or is_number(record[key])):
            steps.append(record["step"])
            values.append(np.nan if record[key] is None else float(record[key]))
    return np.asarray(steps, np.int64), np.asarray(values, np.float64)


def _draw_panel(
    ax: Any,
    records: Sequence[Mapping[str, Any]],
    title: str,
    keys,
    log_y,
    tau=None,
    right=(),
    decades: int = LOG_DECADES,
) -> bool:
    """Plots `keys` on `ax`; False (nothing drawn) if no record has any of them. `tau`
    (M2PO's threshold) is drawn on the second-moment panel and named on the masked one.
    `right`: keys drawn dashed on a linear right axis from 0 (fractions); `decades`: how far
    a log axis reaches below its largest value."""
    drawn, top = False, 0.0
    for key in keys:
        steps, values = _series(records, key)
        if steps.size == 0:
            continue
        if log_y:
            values = np.where(values > 0, values, np.nan)  # log scale: drop zeros
            if np.isfinite(values).any():
                top = max(top, float(np.nanmax(values)))
        marker = "o" if steps.size < 30 else None
        ax.plot(steps, values, label=key, marker=marker, markersize=3)
        drawn = True
    if drawn:
        m2_panel = any(k.startswith("m2po/m2") for k in keys)
        if tau is not None and m2_panel:
            ax.axhline(tau, color="k", ls="--", lw=1, label=f"tau = {tau:g}")
            top = max(top, tau)
        if tau is not None and "m2po/masked_fraction" in keys:
            title = f"{title} (tau = {tau:g})"
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if log_y:
            ax.set_yscale("log")
            if top > 0:
                low = [line.get_ydata() for line in ax.get_lines()]
                floor = min((np.nanmin(v) for v in low if np.isfinite(v).any()), default=top)
                ax.set_ylim(bottom=max(floor, top * 10.0**-decades) / 1.5)
        handles = ax.get_lines()
        if right:
            handles = [*handles, *_draw_right(ax.twinx(), records, right, len(handles))]
        if len(handles) > 1:
            ax.legend(handles=handles, fontsize="small")
    return drawn


def _draw_right(ax: Any, records: Sequence[Mapping[str, Any]], keys, colour: int) -> list:
    """The lines of `keys` on a right axis (fractions, from 0), in the colours after the
    left axis's first `colour` ones."""
    lines = []
    for key in keys:
        steps, values = _series(records, key)
        if steps.size:
            style = dict(ls="--", marker="x", ms=3, color=f"C{colour + len(lines)}")
            lines += ax.plot(steps, values, label=key, **style)
    if lines:
        ax.set_ylim(bottom=0.0)
        ax.set_ylabel("fraction of fresh tokens", fontsize="small")
    return lines


def _panels(records: Sequence[Mapping[str, Any]]):
    """`PANELS`, the evaluation panel with every held-out set's avg@k and pass@k
    (`eval.sets`, `eval.n_samples`) that the run logged beside `eval/accuracy`."""
    found = sorted({k for r in records for k in r if k.startswith("eval/") and "@" in k})
    out = []
    for stem, title, keys, log_y in PANELS:
        if stem == "eval_accuracy" and found:
            keys, title = (*keys, *found), "held-out accuracy (per set: avg@k, pass@k)"
        out.append((stem, title, keys, log_y))
    return out


def plot_metrics(
    metrics_path: str | os.PathLike, out_dir: str | os.PathLike, *, tau: float | None = None
) -> list[str]:
    """PNG plots of a run: one file per panel of `PANELS` with data, plus summary.png.

    Panels whose keys never appear are skipped; `tau` (the run's `actor.m2_threshold`) is
    drawn on the second-moment panel. Returns the written paths (empty if no panel has data).
    """
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    records = read_metrics(metrics_path)
    out_dir = paths.as_path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written, available = [], []
    for stem, title, keys, log_y in _panels(records):
        right, decades = PANEL_EXTRAS.get(stem, ((), LOG_DECADES))
        panel = (title, keys, log_y, tau, right, decades)
        fig = Figure(figsize=(6, 4), layout="constrained")
        if _draw_panel(fig.add_subplot(), records, *panel):
            path = os.fspath(out_dir / f"{stem}.png")
            _save(fig, path)
            written.append(path)
            available.append(panel)
    if available:
        cols = min(3, len(available))
        rows = math.ceil(len(available) / cols)
        fig = Figure(figsize=(5 * cols, 3.5 * rows), layout="constrained")
        for i, panel in enumerate(available):
            _draw_panel(fig.add_subplot(rows, cols, i + 1), records, *panel)
        path = os.fspath(out_dir / "summary.png")
        _save(fig, path)
        written.append(path)
    return written


def plot_comparison(
    runs: Mapping[str, str | os.PathLike],
    out_path: str | os.PathLike,
    keys: Sequence[str] = DEFAULT_COMPARISON_KEYS,
) -> str:
    """One PNG overlaying several runs, one panel per key (e.g. on-policy vs stale-k).

    Args:
      runs: label -> metrics.jsonl path.
      out_path: the PNG to write.
      keys: metric names, one panel each; keys no run has are skipped; "m2po/m2*"
        keys use a log y axis.

    Returns:
      `out_path`.
    """
    from matplotlib.figure import Figure

    if not runs:
        raise ValueError("runs: expected at least one label -> metrics path")
    records = {label: read_metrics(path) for label, path in runs.items()}
    present = [k for k in keys if any(_series(r, k)[0].size for r in records.values())]
    if not present:
        raise ValueError(f"keys: none of {list(keys)} appears in any of the runs {list(runs)}")
    fig = Figure(figsize=(5 * len(present), 3.8), layout="constrained")
    for i, key in enumerate(present):
        ax = fig.add_subplot(1, len(present), i + 1)
        log_y = key.startswith("m2po/m2")
        for label, run_records in records.items():
            steps, values = _series(run_records, key)
            if log_y:
                values = np.where(values > 0, values, np.nan)
            ax.plot(steps, values, label=label, marker="o" if steps.size < 30 else None, ms=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if log_y:
            ax.set_yscale("log")
        ax.legend(fontsize="small")
    out_path = os.fspath(out_path)
    paths.as_path(out_path).parent.mkdir(parents=True, exist_ok=True)
    _save(fig, out_path)
    return out_path


def _save(fig, path: str) -> None:
    """A PNG written whole (`paths.write_atomic`): local or object store."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    paths.write_atomic(path, buffer.getvalue())


# Colours of the timeline's span kinds (lane "learner/train" is kind "train").
TIMELINE_COLOURS = {
    "generate": "tab:blue",
    "score": "tab:purple",
    "train": "tab:orange",
    "publish": "tab:green",
    "wait": "lightgrey",
}
TIMELINE_ROWS = {
    "learner": "learner devices",
    "rollout": "rollout devices",
    "host": "host: rewards",
}


def plot_timeline(
    spans: Sequence[tuple[str, float, float]],
    out_path: str,
    window: tuple[float, float] | None = None,
) -> str:
    """Who was busy when in an async run: one row per device group, a bar per interval.

    `spans` are (lane, start s, end s) as `rollout.worker.Timeline` records them: lanes
    "rollout/generate" (the worker sampling), "host/score" (its rewards) and
    "learner/<kind>" (wait, train, publish). `window`: (start, end) seconds to show
    (e.g. after the compiles). Returns the PNG's path.
    """
    if window is not None:
        a, b = window
        spans = [(lane, max(s, a), min(e, b)) for lane, s, e in spans if e > a and s < b]
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.1))
    ax = fig.add_subplot(1, 1, 1)
    rows = {group: i for i, group in enumerate(TIMELINE_ROWS)}
    seen = set()
    for lane, start, end in spans:
        group, _, kind = lane.partition("/")
        kind = kind or group
        label = None if kind in seen else kind
        seen.add(kind)
        ax.broken_barh(
            [(start, max(end - start, 1e-4))],
            (rows.get(group, len(rows)) - 0.4, 0.8),
            color=TIMELINE_COLOURS.get(kind, "tab:red"),
            label=label,
        )
    ax.set_yticks(list(rows.values()), list(TIMELINE_ROWS.values()))
    ax.set_xlabel("seconds since the rollout worker started")
    if window is not None:
        ax.set_xlim(*window)
    ax.set_title("async run: who was busy when")
    if seen:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), fontsize="small", ncol=len(seen))
    fig.tight_layout()
    _save(fig, str(out_path))
    return str(out_path)
