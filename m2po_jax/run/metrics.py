"""Metrics on the host: JSONL / TensorBoard / wandb writers, a progress bar (plots: `plots.py`).

Metric dicts are flat with "/" namespaces ("reward/mean", "m2po/masked_fraction").
`metrics.jsonl` holds one JSON object per step, "step" first. JSON has no NaN, so
non-finite values are written as null and their names listed under "nonfinite".
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from m2po_jax.common.checks import is_number
from m2po_jax.common.errors import WriterError, describe_os_error
from m2po_jax.run import paths

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"

_log = logging.getLogger(__name__)


def _to_python(value: Any) -> Any:
    """numpy / jax scalars and arrays -> Python numbers and lists; others unchanged."""
    if hasattr(value, "__array__") and not isinstance(value, (str, bytes)):
        array = np.asarray(value)
        return array.item() if array.ndim == 0 else array.tolist()
    if isinstance(value, (list, tuple)):
        return [_to_python(v) for v in value]
    return value


def _finite_or_none(value: Any) -> tuple[Any, bool]:
    """(JSON-safe value, whether something non-finite was replaced by None)."""
    if isinstance(value, list):
        items = [_finite_or_none(v) for v in value]
        return [v for v, _ in items], any(bad for _, bad in items)
    if is_number(value) and not math.isfinite(value):
        return None, True
    return value, False


def _read_lines(path: str) -> list[tuple[int, str, dict | None]]:
    """(line number, line, parsed object or None if it is not JSON) for non-empty lines."""
    out = []
    with io.StringIO(paths.as_path(path).read_text(encoding="utf-8")) as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    record = None
                out.append((number, line, record if isinstance(record, dict) else None))
    return out


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All records of a metrics.jsonl file, in file order.

    A final line without a newline that does not parse (a write in progress) is
    skipped; any other bad line raises ValueError naming the line.
    """
    path = os.fspath(path)
    if not paths.as_path(path).is_file():
        raise FileNotFoundError(f"metrics file not found: {path!r}")
    lines = _read_lines(path)
    records = []
    for i, (number, line, record) in enumerate(lines):
        if record is None:
            if i == len(lines) - 1 and not line.endswith("\n"):
                break
            raise ValueError(f"{path}:{number}: not a JSON object: {line.strip()[:80]!r}")
        records.append(record)
    return records


@contextlib.contextmanager
def _io_errors(path: str) -> Iterator[None]:
    """An OSError (disk full, I/O) becomes a WriterError naming `path`."""
    try:
        yield
    except WriterError:
        raise
    except OSError as e:
        raise WriterError(describe_os_error(e, path)) from e


class MetricsWriter:
    """Writes metric dicts to `workdir/metrics.jsonl`, TensorBoard and (optionally) wandb.

    Args:
      workdir: output directory (created if needed).
      tensorboard: also write scalars to `workdir/tensorboard` (`m2po_jax.run.tensorboard`:
        on this thread, so a full disk raises here instead of hanging a writer thread).
      wandb: keyword arguments for `wandb.init`, or None for no wandb.
      is_primary: False on every process but 0 of a multi-host run; then nothing is
        written and no file is opened.
      resume_step: when resuming, records with step >= resume_step are dropped from an
        existing metrics.jsonl (and TensorBoard events purged) so steps never repeat.

    A failed write (disk full, I/O error) raises `WriterError` naming the file.
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        wandb: Mapping[str, Any] | None = None,
        is_primary: bool = True,
        resume_step: int | None = None,
    ):
        if resume_step is not None and (not isinstance(resume_step, int) or resume_step < 0):
            raise ValueError(
                f"resume_step: expected a non-negative int or None, got {resume_step!r}"
            )
        if wandb is not None and not isinstance(wandb, Mapping):
            raise TypeError(
                f"wandb: expected a dict of wandb.init kwargs or None, got {type(wandb).__name__}"
            )
        self.is_primary = is_primary
        directory = paths.as_path(workdir)
        self.path = os.fspath(directory / METRICS_FILE)
        self._file = None
        self._tb = None
        self._wandb_run = None
        if not is_primary:
            return
        wandb_module = None
        if wandb is not None:
            try:
                import wandb as wandb_module
            except ImportError as e:
                raise ImportError(
                    "wandb logging was requested but the wandb package is not installed: "
                    "pip install wandb (or m2po-jax[wandb]), or set wandb=None"
                ) from e
        tb_dir = directory / TENSORBOARD_DIR
        with _io_errors(self.path):
            directory.mkdir(parents=True, exist_ok=True)
            if resume_step is not None and paths.as_path(self.path).exists():
                self._truncate(resume_step)
            self._file = paths.AppendLog(self.path)
        if tensorboard:
            from m2po_jax.run.tensorboard import EventFile

            with _io_errors(tb_dir):
                self._tb = EventFile(tb_dir, purge_step=resume_step)
        if wandb_module is not None:
            self._wandb_run = wandb_module.init(**dict(wandb))

    def _truncate(self, resume_step: int) -> None:
        """Rewrites metrics.jsonl without records at step >= resume_step (or unreadable)."""
        kept = []
        for number, line, record in _read_lines(self.path):
            if record is None or not is_number(record.get("step")):
                _log.warning("%s:%d: dropping an unreadable metrics line", self.path, number)
            elif record["step"] < resume_step:
                kept.append(line if line.endswith("\n") else line + "\n")
        paths.write_atomic(self.path, "".join(kept))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Appends one record for `step`; array values become lists (JSONL only)."""
        if not self.is_primary:
            return
        if self._file is None:
            raise ValueError("MetricsWriter.write: the writer is closed")
        step = _to_python(step)
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step: expected a non-negative int, got {step!r}")
        values = {key: _to_python(value) for key, value in metrics.items()}
        record: dict[str, Any] = {"step": step}
        nonfinite = []
        for key, value in values.items():
            if key in ("step", "nonfinite"):
                raise ValueError(f"metrics: key {key!r} is reserved by the writer")
            record[key], bad = _finite_or_none(value)
            if bad:
                nonfinite.append(key)
        if nonfinite:
            record["nonfinite"] = nonfinite
        try:
            line = json.dumps(record, allow_nan=False)
        except TypeError as e:
            raise TypeError(
                f"metrics at step {step}: a value is not JSON-serialisable ({e})"
            ) from e
        with _io_errors(self.path):
            self._file.write(line + "\n")
        scalars = {k: float(v) for k, v in values.items() if is_number(v)}
        if self._tb is not None:
            with _io_errors(self._tb.path):
                self._tb.add_scalars(step, scalars)
        if self._wandb_run is not None:
            self._wandb_run.log(scalars, step=step)

    def flush(self) -> None:
        """Writes everything to disk (fsync): the trainer calls it before each checkpoint."""
        if self._file is not None:
            with _io_errors(self.path):
                self._file.sync()
        if self._tb is not None:
            with _io_errors(self._tb.path):
                self._tb.sync()

    def close(self) -> None:
        """Flushes and closes everything; safe to call twice, closes all even if one fails."""
        file, tb, self._file, self._tb = self._file, self._tb, None, None
        try:
            if file is not None:
                with _io_errors(self.path):
                    file.close()
        finally:
            if tb is not None:
                with _io_errors(tb.path):
                    tb.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, exc_type: Any, *exc_info: Any) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(OSError):
            self.close()  # after an error: close what is open, keep the first error


def say(message: str) -> None:
    """Routine progress for the person watching (a memory plan, warm-up, a resume): plain
    lines on stderr, above the progress bar, not log warnings. Call it on process 0."""
    from tqdm.auto import tqdm

    tqdm.write(message, file=sys.stderr)
    _log.info(message)


# The study whose figure shows a mask holding a stale run near on-policy (README, "The
# default run"): the final paper's rule at 256 updates stale, against stale GRPO.
STALE_STUDY_COMMAND = (
    "m2po-study --staleness=256 --methods=grpo,stale_grpo,m2po,paper_final --lrs=3e-4 "
    "--seeds=0,1,2 --steps=150 --config.rollout.batch_size=32"
)


def mask_summary(rows: list[dict], tau: float | None, phases: int = 3) -> list[str]:
    """What the M2PO mask did over a run, for its closing lines: the share of the trained
    tokens it masked, and the mean m2 before and after it against tau in each of `phases`
    equal spans of the steps; and, when it dropped almost nothing because m2 stayed below
    tau, that the rollouts were not stale enough and which run shows it at work. [] when
    no step recorded the mask (M2PO off, no RL step).

    Args:
      rows: `read_metrics` rows (one per step; those without "m2po/m2_before" skipped).
      tau: `actor.m2_threshold` of the run.
      phases: how many spans of steps to report.
    """
    steps = [r for r in rows if is_number(r.get("m2po/m2_before")) and is_number(r.get("step"))]
    if tau is None or not steps:
        return []
    steps.sort(key=lambda r: r["step"])
    masked = sum(float(r.get("m2po/masked_tokens") or 0) for r in steps)
    tokens = sum(float(r.get("train/tokens") or 0) for r in steps)
    share = masked / tokens if tokens else 0.0
    by_phase = []
    for span in np.array_split(np.arange(len(steps)), min(phases, len(steps))):
        part = [steps[i] for i in span]
        before = np.mean([r["m2po/m2_before"] for r in part])
        after = np.mean([r.get("m2po/m2_after", r["m2po/m2_before"]) for r in part])
        by_phase.append(f"steps {part[0]['step']}-{part[-1]['step']} {before:.4f} -> {after:.4f}")
    acted = sum(1 for r in steps if float(r.get("m2po/masked_tokens") or 0) > 0)
    lines = [
        f"the M2PO mask (tau={tau:g}) masked {100 * share:.2f}% of the trained tokens "
        f"({int(masked):,} of {int(tokens):,}) and acted on {acted} of {len(steps)} steps; "
        "mean m2 before -> after it: " + ", ".join(by_phase)
    ]
    below = sum(1 for r in steps if r["m2po/m2_before"] < tau)
    if share < 1e-3 and below >= 0.9 * len(steps):
        stale = np.mean([float(r.get("staleness/mean") or 0.0) for r in steps])
        lines.append(
            f"m2 was below tau before the mask on {below} of {len(steps)} steps: rollouts "
            f"{stale:.1f} updates stale on average are not stale enough here for it to act; "
            f"`{STALE_STUDY_COMMAND}` shows masking at work on 256-update-stale rollouts "
            "(docs/stale_study.md)"
        )
    return lines


class ProgressBar:
    """A tqdm bar showing the step, reward/mean, the latest eval/accuracy and the mask rate.

    Args:
      total_steps: steps of the whole run.
      initial: steps already done (on resume).
      enabled: False (e.g. on non-primary processes) shows nothing.
    """

    def __init__(self, total_steps: int, *, initial: int = 0, enabled: bool = True):
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total_steps, initial=initial, disable=not enabled, dynamic_ncols=True, unit="step"
        )
        self._eval_accuracy: float | None = None

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Moves the bar to `step` completed steps and refreshes the shown metrics."""
        values = {k: _to_python(v) for k, v in metrics.items()}
        if is_number(values.get("eval/accuracy")):
            self._eval_accuracy = float(values["eval/accuracy"])
        postfix = {}
        for label, key in (("reward", "reward/mean"), ("masked", "m2po/masked_fraction")):
            if is_number(values.get(key)):
                postfix[label] = f"{values[key]:.3f}"
        if self._eval_accuracy is not None:
            postfix["eval_acc"] = f"{self._eval_accuracy:.3f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(int(step) - self._bar.n)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def staleness_stats(
    version_B: Any, current_version: int, *, max_k: int | None = None
) -> dict[str, Any]:
    """Staleness k = current_version - version of each sample, summarised on the host.

    Args:
      version_B: policy version that generated each sample, shape [B].
      current_version: version of the policy being updated.
      max_k: histogram length is max_k + 1, with staleness > max_k counted in the last
        bin; None sizes it to the largest observed staleness.

    Returns:
      "staleness/mean" (float), "staleness/max", "staleness/min" (int) and
      "staleness/hist_k" (list of counts for k = 0..K).
    """
    version_B = np.asarray(version_B)
    if version_B.ndim != 1 or version_B.size == 0:
        raise ValueError(f"version_B: expected a non-empty 1-D array, got shape {version_B.shape}")
    if not np.issubdtype(version_B.dtype, np.integer):
        raise TypeError(f"version_B: expected integer versions, got dtype {version_B.dtype}")
    staleness_B = int(current_version) - version_B.astype(np.int64)
    if staleness_B.min() < 0:
        raise ValueError(
            f"version_B: max version {version_B.max()} is newer than current_version "
            f"{current_version}"
        )
    if max_k is not None and max_k < 0:
        raise ValueError(f"max_k: expected a non-negative int or None, got {max_k!r}")
    top = int(staleness_B.max()) if max_k is None else max_k
    hist = np.bincount(np.minimum(staleness_B, top), minlength=top + 1)
    return {
        "staleness/mean": float(staleness_B.mean()),
        "staleness/max": int(staleness_B.max()),
        "staleness/min": int(staleness_B.min()),
        "staleness/hist_k": hist.tolist(),
    }


def token_staleness(version_BxT: Any, mask_BxT: Any, current_version: int) -> dict[str, float]:
    """Staleness of the trained tokens, each by the version that generated it (a row's
    tokens differ where the rollout engine took new weights in flight):
    "staleness/token_mean" over the `mask_BxT` tokens."""
    version_BxT, mask_BxT = np.asarray(version_BxT), np.asarray(mask_BxT, bool)
    if version_BxT.shape != mask_BxT.shape:
        raise ValueError(
            f"version_BxT: shape {version_BxT.shape} must equal the mask's {mask_BxT.shape}"
        )
    stale = int(current_version) - version_BxT[mask_BxT].astype(np.int64)
    return {"staleness/token_mean": float(stale.mean()) if stale.size else 0.0}


def engine_stats(generation: Any) -> dict[str, float]:
    """A rollout engine's decode counters (`rollout.engines.Generation`; {} for none):
    "rollout/decode_steps" and "rollout/decode_idle_fraction", the share of decode work
    (rows or slots x steps) spent on finished or empty rows; the paged engine's
    "rollout/kv_pages_peak_fraction" (the most pages in use at once, of the pool) and
    "rollout/preemptions" (sequences preempted and recomputed)."""
    if generation is None:
        return {}
    record = {
        "rollout/decode_steps": generation.decode_steps,
        "rollout/decode_idle_fraction": generation.idle_fraction,
    }
    if generation.weight_updates:
        record["rollout/inflight_updates"] = generation.weight_updates
    if hasattr(generation, "peak_pages"):  # the paged engine's pool
        record["rollout/kv_pages_peak_fraction"] = generation.peak_pages / generation.pages
        record["rollout/preemptions"] = generation.preemptions
    return record


def rollout_stats(sampled: Any) -> dict[str, float]:
    """A sampled rollout's decode counters (`engine_stats`) and, for multi-turn episodes,
    their outcomes (`rollout.episodes.EpisodeStats.metrics`: episode/...)."""
    record = engine_stats(sampled.generation)
    if sampled.episodes is not None:
        record.update(sampled.episodes.metrics())
    return record


def host_metrics(tree: Mapping[str, Any]) -> dict[str, Any]:
    """Device metrics -> Python numbers with one `jax.device_get` for the whole dict.

    Nested dicts are flattened with "/"; integer scalars become int, other scalars
    float, arrays lists.
    """
    import jax

    host = jax.device_get(tree)
    out: dict[str, Any] = {}

    def visit(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping):
            for key, child in node.items():
                visit(f"{prefix}/{key}" if prefix else str(key), child)
            return
        array = np.asarray(node)
        if array.ndim:
            out[prefix] = array.tolist()
        elif np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
            out[prefix] = int(array)
        else:
            out[prefix] = float(array)

    visit("", host)
    return out
