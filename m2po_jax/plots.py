"""PNG plots of runs: the panels of one run's metrics.jsonl, and several runs overlaid."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from m2po_jax.checks import is_number
from m2po_jax.metrics import read_metrics

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
    ("staleness", "staleness (versions)", ("staleness/mean", "staleness/max"), False),
)


def _series(records: Iterable[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records that have `key`; null becomes NaN."""
    steps, values = [], []
    for record in records:
        if key in record and (record[key] is None or is_number(record[key])):
            steps.append(record["step"])
            values.append(np.nan if record[key] is None else float(record[key]))
    return np.asarray(steps, np.int64), np.asarray(values, np.float64)


def _draw_panel(ax: Any, records: Sequence[Mapping[str, Any]], title: str, keys, log_y) -> bool:
    """Plots `keys` on `ax`; False (nothing drawn) if no record has any of them."""
    drawn = False
    for key in keys:
        steps, values = _series(records, key)
        if steps.size == 0:
            continue
        if log_y:
            values = np.where(values > 0, values, np.nan)  # log scale: drop zeros
        marker = "o" if steps.size < 30 else None
        ax.plot(steps, values, label=key, marker=marker, markersize=3)
        drawn = True
    if drawn:
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if log_y:
            ax.set_yscale("log")
        if len(keys) > 1:
            ax.legend(fontsize="small")
    return drawn


def plot_metrics(metrics_path: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
    """PNG plots of a run: one file per panel of `PANELS` with data, plus summary.png.

    Panels whose keys never appear are skipped. Returns the written paths (empty if
    no panel has data).
    """
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    records = read_metrics(metrics_path)
    os.makedirs(out_dir, exist_ok=True)
    paths, available = [], []
    for stem, title, keys, log_y in PANELS:
        fig = Figure(figsize=(6, 4), layout="constrained")
        if _draw_panel(fig.add_subplot(), records, title, keys, log_y):
            path = os.path.join(os.fspath(out_dir), f"{stem}.png")
            fig.savefig(path, dpi=100)
            paths.append(path)
            available.append((title, keys, log_y))
    if available:
        cols = min(3, len(available))
        rows = math.ceil(len(available) / cols)
        fig = Figure(figsize=(5 * cols, 3.5 * rows), layout="constrained")
        for i, (title, keys, log_y) in enumerate(available):
            _draw_panel(fig.add_subplot(rows, cols, i + 1), records, title, keys, log_y)
        path = os.path.join(os.fspath(out_dir), "summary.png")
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


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
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    fig.savefig(out_path, dpi=100)
    return out_path
