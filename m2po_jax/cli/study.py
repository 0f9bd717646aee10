"""`m2po-study`: staleness x method x learning rate x seed (x rollout precision), from one
shared warm-up.

  m2po-study --config=arith:m2po --out=runs/stale_study \\
      --staleness=0,16,64,256 --lrs=1e-4,3e-4 --seeds=0,1,2 --steps=150 --parallel=2

Every cell is an ordinary `m2po-train` run of the config with its method, staleness
(`rollout.max_head_offpolicyness`), learning rate and seed set, in `<out>/cells/<name>/`,
started from the same params: the config's supervised warm-up (`sft.*`), run once into
`<out>/warmup/` (a config without one starts every cell from `model.path` or the seed-0
init). A cell that finished wrote `done.json` and is skipped when the study runs again; a
cell that was stopped resumes from its checkpoints. `--parallel=N` runs N cells at once, each
in its own process (the warm-up too); `--devices_per_cell=M` pins each to M GPUs of its own.
Every cell's config is checked before any work. A cell that fails (a
diverged run, a bad file) is reported in one line and does not stop the others; SIGTERM or
Ctrl-C stops the running cells after their step, with a checkpoint (a second one: at once).
Exit status: 0, every cell finished; 2, a cell refused its config or failed with an error of
the user's; 1, an error of the project's own (its traceback printed); 128 + the signal if
one stopped the study. At the end, finished or not: `<out>/study.md` (one row per
staleness, method and learning rate: mean and range over seeds of the final and best
held-out accuracy, and the run means of the diagnostics), `<out>/study.json` (every cell),
and `<out>/study_k<K>.png` (held-out accuracy by step, mean over seeds with their range, per
learning rate).

Methods (`METHODS`): `grpo` (on-policy, staleness 0 only), `stale_grpo` (decoupled PPO with
the eps-clip, no M2PO), and the four M2PO rules, each at tau `--tau`: `m2po` (AReaL's),
`paper` (the paper's Algorithm 1), `authors` (the authors' code: a capped-mean clip range on
the harmful tokens), `paper_final` (the final paper's, `m2po_jax/algorithm/variants.py`), and `m2po_tis`
(AReaL's M2PO with verl's token-level truncated importance weight, threshold `TIS_THRESHOLD`).
On a mixture of experts (`arith:m2po,moe`) `grpo_r3`, `stale_grpo_r3` and `m2po_r3` are
`grpo`, `stale_grpo` and `m2po` with routing replay (`actor.router_replay=rollout`); the
study then adds a table of the router's agreement and load beside m2 before the mask.
The default is the protocol's four (no `paper`, `authors`). The verdicts under the table
follow `docs/stale_study_protocol.md`.

Rollout precisions (`--precisions`, `PRECISIONS`): `float32` (the rollout engine holds the
params as trained), `bfloat16` (weights and KV cache in bfloat16), `int8` (weights int8 per
output channel, KV cache bfloat16), `float8` (weights and KV cache float8 e4m3). The cheaper
the rollout, the larger the engine/trainer mismatch that the staleness-0 tokens' metrics
(`mismatch/fresh/*`) measure; where the grid has a precision other than float32, the M2PO
methods also run at staleness 0 (their mask then reads mismatch alone). A cell's collapse:
its final held-out accuracy below half its first (the warm-up's), or a run stopped on
non-finite steps.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import multiprocessing
import os
import signal
import sys
import traceback
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

# Imported lazily where JAX is needed: a `--parallel` worker is a fresh process.
DONE = "done.json"
ENVIRONMENT = "environment.json"  # a cell's, written when it starts
WARMUP_PARAMS = "params.msgpack"
SUMMARY_MEANS = (
    "m2po/masked_fraction",
    "m2po/m2_p50",
    "m2po/m2_p99",
    "m2po/m2_p999",
    "m2po/m2_max",
    "actor/clip_fraction",
    "grad_norm",
    "offpolicy/ess",
    "m2po/masked_loss_share",
    "m2po/masked_grad_share",
    "mismatch/fresh/abs_mean",
    "mismatch/fresh/m2",
    "mismatch/stale/m2",
    "mismatch/fresh/m2po_drop_alone",
    "mismatch/m2_fresh_share",
    "moe/router_agreement",
    "moe/expert_load_max",
)
TIS_THRESHOLD = 2.0  # m2po_tis: verl's default rollout_is_threshold
COLLAPSE = 0.5  # a cell collapsed: its final accuracy below this share of its first


def _grpo(c, tau):
    c.actor.m2_threshold = None


def _stale_grpo(c, tau):
    c.actor.m2_threshold = None


def _m2po(c, tau):
    c.actor.m2_threshold = tau
    c.actor.m2po_second_moment, c.actor.m2po_stop_rule = "behav_prox", "lt"
    c.actor.m2po_candidates, c.actor.m2po_scope = "all", "global"


def _variant(name):
    """A published rule (`m2po_jax/algorithm/variants.py`) over AReaL's mask settings, so
    that none of the base config's own M2PO settings carry over."""

    def method(c, tau):
        from m2po_jax.algorithm import variants

        _m2po(c, tau)
        variants.configure(c.actor, name)

    return method


def _m2po_tis(c, tau):
    _m2po(c, tau)
    c.actor.rollout_correction.is_level = "token"
    c.actor.rollout_correction.is_threshold = TIS_THRESHOLD


def _replayed(method):
    """`method` with routing replay (a mixture of experts: `actor.router_replay`)."""

    def replayed(c, tau):
        method(c, tau)
        c.actor.router_replay = "rollout"

    return replayed


METHODS = {
    "grpo": _grpo,
    "stale_grpo": _stale_grpo,
    "m2po": _m2po,
    "paper": _variant("paper"),
    "authors": _variant("authors"),
    "paper_final": _variant("paper_final"),
    "m2po_tis": _m2po_tis,
    "grpo_r3": _replayed(_grpo),
    "stale_grpo_r3": _replayed(_stale_grpo),
    "m2po_r3": _replayed(_m2po),
}
ON_POLICY = "grpo"
STALE = "stale_grpo"  # GRPO's decoupled loss on stale rollouts: staleness > 0 only
ON_POLICY_METHODS = (ON_POLICY, "grpo_r3")  # staleness 0 only
STALE_METHODS = (STALE, "stale_grpo_r3")  # staleness > 0 only
RULES = ("m2po", "paper", "authors", "paper_final", "m2po_tis", "m2po_r3")  # the M2PO methods
PROTOCOL_METHODS = ("grpo", "stale_grpo", "m2po", "paper_final")  # docs/stale_study_protocol.md
TRAINED = "float32"  # the precision that leaves the rollout weights as trained
PRECISIONS = {  # name: (rollout.weight_dtype, rollout.kv_dtype)
    TRAINED: ("", ""),
    "bfloat16": ("bfloat16", "bfloat16"),
    "int8": ("int8", "bfloat16"),
    "float8": ("float8_e4m3fn", "float8_e4m3fn"),
}


@dataclasses.dataclass(frozen=True)
class Cell:
    staleness: int
    method: str
    lr: float
    seed: int
    precision: str = TRAINED

    @property
    def name(self) -> str:
        tail = "" if self.precision == TRAINED else f"_{self.precision}"
        return f"k{self.staleness}_{self.method}_lr{self.lr:g}_seed{self.seed}{tail}"


def grid(staleness, methods, lrs, seeds, precisions=(TRAINED,)) -> list[Cell]:
    """The cells: `grpo` at staleness 0, `stale_grpo` at each staleness > 0, the M2PO
    methods at each staleness > 0, and at 0 too where `precisions` names a cheaper rollout
    than the trained weights (M2PO's mask then reads the engine/trainer mismatch alone)."""
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"--methods: unknown method {m!r}; choose from {sorted(METHODS)}")
    for p in precisions:
        if p not in PRECISIONS:
            raise ValueError(
                f"--precisions: unknown precision {p!r}; choose from {', '.join(PRECISIONS)}"
            )
    if any(k < 0 for k in staleness):
        raise ValueError(f"--staleness: values must be >= 0, got {list(staleness)}")
    mismatch = any(p != TRAINED for p in precisions)

    def runs(m, k):
        if m in ON_POLICY_METHODS:
            return k == 0
        return k > 0 or (mismatch and m not in STALE_METHODS)

    cells = [
        Cell(k, m, lr, seed, p)
        for lr in lrs
        for seed in seeds
        for p in precisions
        for k in staleness
        for m in methods
        if runs(m, k)
    ]
    if not cells:
        raise ValueError(
            f"--staleness={list(staleness)} --methods={list(methods)}: no cell (grpo runs at "
            "staleness 0, the other methods at staleness > 0)"
        )
    return cells


def cell_config(base: dict, cell: Cell, *, tau: float, steps: int):
    """The cell's config: `base` (a config as a dict) with its method and settings."""
    import ml_collections

    c = ml_collections.ConfigDict(base)
    METHODS[cell.method](c, tau)
    c.rollout.weight_dtype, c.rollout.kv_dtype = PRECISIONS[cell.precision]
    c.rollout.max_head_offpolicyness = cell.staleness
    c.actor.optimizer.lr = cell.lr
    c.seed = cell.seed
    c.total_steps = steps
    c.sft.max_steps = 0  # every cell starts from the shared warm-up
    c.logging.masked_grad_norm = True
    c.logging.progress = c.logging.plots = c.logging.tensorboard = False
    c.checkpoint.every = max(steps // 3, 1)
    return c


def _write_json(path: Path, record) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, path)


def environment() -> dict:
    """What a cell's numbers depend on besides its config: a warm-up made on 8 devices is not
    the one made on 1 (the reductions differ), nor one made under other XLA flags."""
    import jax

    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def _use_devices(devices: str | None) -> None:
    """Pins this (fresh) process to `devices` before JAX starts its backend."""
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices


def warmup(base: dict, out: Path, devices: str | None = None) -> Path | None:
    """The shared warm-up's params file (run once; None: the config has no warm-up)."""
    if not base["sft"]["max_steps"]:
        return None
    path = out / "warmup" / WARMUP_PARAMS
    if path.exists():
        return path
    _use_devices(devices)
    import jax
    import ml_collections
    import numpy as np
    from flax import serialization

    from m2po_jax import config as config_lib
    from m2po_jax.trainer import loop

    c = ml_collections.ConfigDict(base)
    c.logging.progress = c.logging.plots = c.logging.tensorboard = False
    trainer = loop.Trainer(config_lib.from_configdict(c), out / "warmup")
    trainer.supervised_warmup()
    params = jax.tree.map(np.asarray, jax.device_get(trainer.state.params))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(serialization.msgpack_serialize(params))
    os.replace(tmp, path)
    accuracy = trainer.evaluate()
    record = {"sft_steps": trainer.sft_steps, "accuracy": accuracy, "environment": environment()}
    _write_json(path.parent / "warmup.json", record)
    return path


class CellStopped(Exception):
    """A cell stopped by a signal (its checkpoints resume it); `step` None: not begun."""

    def __init__(self, name: str, step: int | None, signum: int):
        super().__init__(name, step, signum)
        self.name, self.step, self.signum = name, step, signum


class _Stop:
    """A study's SIGTERM / SIGINT: the running cells checkpoint after their step and stop, no
    cell starts; a second signal stops everything at once.

    `signum` is shared with the cells' processes (`--parallel`), which the study's process
    signals itself: they run in their own process groups, so that a terminal's Ctrl-C reaches
    only the study. `trainer` is the cell this process is training, if any.
    """

    def __init__(self, signum=None):
        self.signum = signum if signum is not None else multiprocessing.Value("i", 0, lock=False)
        self.trainer = None

    def stopped(self) -> int:
        return self.signum.value

    def on_signal(self, signum, frame) -> None:
        if self.signum.value:  # the second one
            signal.signal(signum, signal.SIG_DFL)
            _signal_children(signum)
            os.kill(os.getpid(), signum)
            return
        self.signum.value = signum
        if self.trainer is not None:
            self.trainer.request_stop(signum)
        _signal_children(signum)
        print(
            f"m2po-study: signal {signum}: the running cells stop after their step, with a "
            "checkpoint (send it again to stop now)",
            file=sys.stderr,
            flush=True,
        )

    def install(self) -> dict:
        """Handles SIGTERM and SIGINT (main thread only); returns the handlers it replaced."""
        try:
            return {
                sig: signal.signal(sig, self.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
            }
        except ValueError:  # not the main thread: the caller's signals are its own
            return {}


def _signal_children(signum: int) -> None:
    for child in multiprocessing.active_children():
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass


_STOP: _Stop | None = None  # this process's, once a study runs in it


def _cell_process(signum) -> None:
    """A `--parallel` cell process: its own process group, signals from the study."""
    global _STOP
    os.setpgrp()
    _STOP = _Stop(signum)
    _STOP.install()


def run_cell(
    base: dict,
    cell: Cell,
    tau: float,
    steps: int,
    out: str,
    warm: str | None,
    devices: str | None = None,
):
    """Trains one cell (resuming its checkpoints) on `devices` (`CUDA_VISIBLE_DEVICES`; None:
    this process's), writes its `done.json`; returns its summary.

    Raises `CellStopped` if the study was signalled (before the cell began, or during it)."""
    from absl import logging as absl_logging
    from flax import serialization

    from m2po_jax import config as config_lib
    from m2po_jax.trainer import compile_cache, loop

    stop = _STOP
    if stop is not None and stop.stopped():
        raise CellStopped(cell.name, None, stop.stopped())
    _use_devices(devices)
    absl_logging.set_verbosity(absl_logging.ERROR)
    compile_cache.enable()  # the cells share their programs
    workdir = Path(out) / "cells" / cell.name
    workdir.mkdir(parents=True, exist_ok=True)
    _write_json(workdir / ENVIRONMENT, environment())
    cfg = config_lib.from_configdict(cell_config(base, cell, tau=tau, steps=steps))
    params = None if warm is None else serialization.msgpack_restore(Path(warm).read_bytes())
    trainer = loop.Trainer(cfg, workdir, initial_params=params)
    if stop is not None:
        stop.trainer = trainer
        if stop.stopped():  # signalled while the trainer was being built
            trainer.request_stop(stop.stopped())
    try:
        result = trainer.run()
    finally:
        if stop is not None:
            stop.trainer = None
    if result.interrupted:
        raise CellStopped(cell.name, result.final_step, result.signal or signal.SIGTERM)
    summary = {**dataclasses.asdict(cell), **summarize(workdir / "metrics.jsonl")}
    summary["environment"] = json.loads((workdir / ENVIRONMENT).read_text())
    _write_json(workdir / DONE, summary)
    return summary


def summarize(metrics_file: Path) -> dict:
    """One cell's numbers: accuracy curve, final and best, run means of the diagnostics."""
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    curve = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
    out = {"curve": curve, "final": curve[-1][1], "best": max(a for _, a in curve)}
    out["collapsed"] = curve[-1][1] < COLLAPSE * curve[0][1]
    for key in SUMMARY_MEANS:
        values = [r[key] for r in rows if r.get(key) is not None and _has_tokens(r, key)]
        out[key] = sum(values) / len(values) if values else None
    ess = [r["offpolicy/ess"] for r in rows if r.get("offpolicy/ess") is not None]
    out["offpolicy/ess_min"] = min(ess) if ess else None
    return out


def _has_tokens(row: dict, key: str) -> bool:
    """Whether a step's `key` is over some tokens: a fresh (stale) mismatch metric only on
    steps with fresh (stale) tokens (a run k steps stale has fresh ones in its first step
    only), the rest always."""
    for subset in ("fresh", "stale"):
        if key.startswith(f"mismatch/{subset}/"):
            return bool(row.get(f"mismatch/{subset}/tokens"))
    return True


class StudyError(Exception):
    """Cells failed or were stopped; the report covers the finished ones, and running the
    study again retries (resumes) the rest.

    `failed`: {cell name: its exception}; `stopped`: the `CellStopped` of the cells a signal
    stopped, `signum` that signal (None: none)."""

    def __init__(self, failed: dict, stopped: list, signum: int | None):
        self.failed, self.stopped, self.signum = failed, stopped, signum
        parts = [f"{len(failed)} cell(s) failed"] if failed else []
        if signum:
            parts.append(f"stopped by signal {signum}")
        super().__init__("; ".join(parts))


def check_cells(base: dict, cells: list[Cell], *, tau: float, steps: int) -> None:
    """Every cell's config is valid (raises `ConfigError` naming the cell), before any work."""
    from m2po_jax import config as config_lib

    for c in cells:
        try:
            config_lib.from_configdict(cell_config(base, c, tau=tau, steps=steps))
        except config_lib.ConfigError as e:
            raise config_lib.ConfigError(f"cell {c.name}: {e}") from e


def run_study(
    base: dict,
    cells: list[Cell],
    out,
    *,
    tau=0.04,
    steps=150,
    parallel=1,
    devices_per_cell=0,
    config=None,
) -> list:
    """Runs the cells not done yet (`parallel` at a time) and writes the report; returns the
    cells it finished.

    `devices_per_cell` > 0 gives each of the `parallel` cells its own GPUs of this host
    (`CUDA_VISIBLE_DEVICES`, `cell_devices`), and runs the warm-up in a process of its own
    too, so that this process never holds an accelerator. A cell that fails does not stop
    the others; a SIGTERM / SIGINT stops every running cell after its step, with a
    checkpoint. Either way the report of the finished cells is written and `StudyError`
    says which cells did not finish. `config`: the base config's name, for the report."""
    out = Path(out)
    check_cells(base, cells, tau=tau, steps=steps)
    slots = cell_devices(parallel, devices_per_cell)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    _write_json(out / "study_config.json", {"base": base, "tau": tau, "steps": steps})
    global _STOP
    _STOP = stop = _Stop()
    previous = stop.install()
    try:
        finished, failed, stopped = _run_cells(base, cells, out, stop, tau, steps, slots)
    finally:
        _STOP = None
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    report(out, cells, failed, tau=tau, config=config, steps=steps)
    if failed or stop.stopped():
        raise StudyError(failed, stopped, stop.stopped() or None)
    return finished


def cell_devices(parallel: int, devices_per_cell: int) -> list:
    """Each cell slot's `CUDA_VISIBLE_DEVICES` (None: the process's own devices, all of
    them); `parallel` <= 1 and no pinning: no slots, the cells run in this process."""
    if devices_per_cell < 0:
        raise ValueError(f"--devices_per_cell: must be >= 0, got {devices_per_cell}")
    if not devices_per_cell:
        return [None] * parallel if parallel > 1 else []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x for x in visible.split(",") if x.strip()] if visible else None
    need = parallel * devices_per_cell
    if ids is not None and len(ids) < need:
        raise ValueError(
            f"--parallel={parallel} --devices_per_cell={devices_per_cell}: needs {need} "
            f"devices, CUDA_VISIBLE_DEVICES={visible!r} lists {len(ids)}"
        )
    ids = ids or [str(i) for i in range(need)]
    n = devices_per_cell
    return [",".join(ids[i * n : (i + 1) * n]) for i in range(parallel)]


def _run_cells(base, cells, out: Path, stop: _Stop, tau, steps, slots: list):
    """(finished cells, {name: exception} of the failed, `CellStopped` of the stopped).
    `slots`: the device sets of the cells' processes (`cell_devices`); none: this process."""
    finished, failed, stopped = [], {}, []

    def outcome(cell, error):
        if error is None:
            finished.append(cell)
            print(f"m2po-study: {cell.name}: finished", flush=True)
        elif isinstance(error, CellStopped):
            stop.signum.value = stop.signum.value or error.signum  # the trainer's own handler
            if error.step is not None:
                stopped.append(error)
                print(f"m2po-study: {cell.name}: stopped at step {error.step}", flush=True)
        else:
            failed[cell.name] = error
            print(f"m2po-study: {cell.name}: failed: {_one_line(error)}", flush=True)

    todo = [c for c in cells if not (out / "cells" / c.name / DONE).exists()]
    for c in cells:
        if c not in todo:
            print(f"m2po-study: {c.name}: done, skipped", flush=True)
    if not todo:
        return finished, failed, stopped
    if not slots:
        warm = warmup(base, out)
        args = (tau, steps, str(out), None if warm is None else str(warm))
        for c in todo:
            if stop.stopped():  # during the warm-up or the cell before
                break
            try:
                run_cell(base, c, *args)
                outcome(c, None)
            except Exception as e:  # noqa: BLE001 (reported per cell; the others run)
                outcome(c, e)
        return finished, failed, stopped
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        len(slots),
        mp_context=spawn,
        max_tasks_per_child=1,
        initializer=_cell_process,
        initargs=(stop.signum,),
    ) as pool:
        warm = pool.submit(warmup, base, out, slots[0]).result()
        args = (tau, steps, str(out), None if warm is None else str(warm))
        free, pending, running = list(slots), list(todo), {}
        while pending or running:
            while pending and free and not stop.stopped():
                devices, cell = free.pop(0), pending.pop(0)
                job = pool.submit(run_cell, base, cell, *args, devices=devices)
                running[job] = (cell, devices)
            if not running:
                break
            done, _ = concurrent.futures.wait(running, return_when="FIRST_COMPLETED")
            for job in done:
                cell, devices = running.pop(job)
                free.append(devices)
                outcome(cell, job.exception())
    return finished, failed, stopped


def _one_line(error: BaseException) -> str:
    """`<what>: <message>` in one line, as `m2po-train` reports errors."""
    from m2po_jax.cli import train as train_main
    from m2po_jax.common.errors import M2poError

    what = error.what if isinstance(error, M2poError) else type(error).__name__
    return f"{what}: {train_main._clean(error)}"


def _spread(values):
    return sum(values) / len(values), min(values), max(values)


def groups(out: Path, cells: list[Cell]) -> dict:
    """{(staleness, method, lr, precision): [summaries over seeds]} of the finished cells."""
    found: dict = {}
    for c in cells:
        done = out / "cells" / c.name / DONE
        if done.exists():
            key = (c.staleness, c.method, c.lr, c.precision)
            found.setdefault(key, []).append(json.loads(done.read_text()))
    return found


def trained(found: dict) -> dict:
    """{(staleness, method, lr): runs} of the cells whose rollouts ran the trained weights
    (the protocol's verdicts read only these)."""
    return {(k, m, lr): runs for (k, m, lr, p), runs in found.items() if p == TRAINED}


def collapses(out: Path, cells: list[Cell], failed: dict | None) -> dict:
    """{(staleness, method, lr, precision): collapsed runs}: finished cells whose final
    accuracy fell below `COLLAPSE` of their first, and cells stopped on non-finite steps."""
    from m2po_jax.trainer import loop

    count: dict = {}
    for c in cells:
        key = (c.staleness, c.method, c.lr, c.precision)
        done = out / "cells" / c.name / DONE
        error = (failed or {}).get(c.name)
        hit = isinstance(error, loop.NonFiniteError) or (
            done.exists() and json.loads(done.read_text()).get("collapsed", False)
        )
        count[key] = count.get(key, 0) + int(hit)
    return count


def verdicts(found: dict) -> list[str]:
    """The protocol's reading (docs/stale_study_protocol.md) of each learning rate and
    staleness."""
    lines = []
    for lr in sorted({lr for _, _, lr in found}):
        on = found.get((0, ON_POLICY, lr))
        if not on:
            lines.append(f"lr {lr:g}: no on-policy cells, no verdict")
            continue
        lo = min(s["final"] for s in on)
        claim = None  # (k, staleness hurts, {rule: rescues}) at the largest k
        for k in sorted({k for k, _, x in found if x == lr and k > 0}):
            stale = found.get((k, "stale_grpo", lr))
            if not stale:
                continue
            hurts = _spread([s["final"] for s in stale])[0] < lo
            parts = [f"lr {lr:g}, k = {k}: staleness {'hurts' if hurts else 'does not hurt'}"]
            rescued = {}
            for rule in RULES:
                if (k, rule, lr) in found:
                    ok = _spread([s["final"] for s in found[(k, rule, lr)]])[0] >= lo
                    word = ("rescues" if ok else "does not rescue") if hurts else (
                        "harmless" if ok else "hurts")  # fmt: skip
                    parts.append(f"{rule} {word}")
                    rescued[rule] = ok
            lines.append("; ".join(parts) + f" (on-policy final >= {lo:.3f})")
            claim = (k, hurts, rescued)
        if claim is not None and claim[2]:
            seeds = min(len(runs) for (_, _, x), runs in found.items() if x == lr)
            verdict = _claim(lr, *claim)
            if seeds < 2:  # one run per cell: a reading, not a verdict
                verdict = (
                    f"lr {lr:g}: one seed cannot support a verdict on the claim (run "
                    f"--seeds=0,1,2); on this seed it reads:{verdict.split(':', 1)[1]}"
                )
            lines.append(verdict)
    return lines


def _claim(lr: float, k: int, hurts: bool, rescued: dict) -> str:
    """The protocol's verdict on the claim at a learning rate, from its largest staleness."""
    head = f"lr {lr:g}: the claim is"
    if not hurts:
        return f"{head} not tested at k = {k} (staleness does not hurt there)"
    if all(rescued.values()):
        verb = "rescues" if len(rescued) == 1 else "rescue"
        return f"{head} reproduced at k = {k} ({' and '.join(rescued)} {verb})"
    if not any(rescued.values()):
        return f"{head} not reproduced at k = {k} (no M2PO rule rescues)"
    yes = [r for r, ok in rescued.items() if ok]
    no = [r for r, ok in rescued.items() if not ok]
    rescue = "rescues" if len(yes) == 1 else "rescue"
    fail = "does not" if len(no) == 1 else "do not"
    return (
        f"{head} partly reproduced at k = {k} ({', '.join(yes)} {rescue}, {', '.join(no)} {fail})"
    )


def _fmt(x, digits=3):
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if abs(x) >= 1e-3 or x == 0 else f"{x:.1e}"


LEGEND = (
    "k: the staleness bound (`rollout.max_head_offpolicyness`: RL steps the rollouts may lag); "
    "lr: the learning rate; seeds: the finished cells in the row; final: held-out accuracy at "
    "the last evaluation, mean over seeds (min-max); best: each run's best held-out accuracy, "
    "mean over seeds. The rest are means over each run's steps, then over seeds: masked: the "
    "fraction of tokens M2PO masked; m2 p50 / p99 / p99.9: quantiles of the tokens' second "
    "moment (the squared log-ratio of behaviour and proximal policies), to read against tau; "
    "clip: the fraction of tokens at the PPO clip; grad norm: the update's gradient norm; ESS "
    "(min): the effective sample size (sum w)^2 / (n sum w^2) of the behaviour weights (its "
    "smallest step); masked loss: the masked tokens' share of the absolute per-token loss; "
    "masked grad: the norm of their gradient over that of the unmasked loss."
)


def header(cells: list[Cell], *, config=None, steps=None, tau=None) -> str:
    """`study.md`'s title, the grid and config it ran, and the legend of its columns."""

    def values(xs):
        return ", ".join(f"{x:g}" if isinstance(x, float) else str(x) for x in xs)

    def unique(attr):
        return list(dict.fromkeys(getattr(c, attr) for c in cells))

    title = "# m2po-study" + (f": {config}" if config else "")
    grid_line = (
        f"Grid ({len(cells)} cells): staleness k = {values(sorted(unique('staleness')))}; "
        f"methods {values(unique('method'))} (grpo at k = 0 only); learning rates "
        f"{values(sorted(unique('lr')))}; seeds {values(sorted(unique('seed')))}."
    )
    if unique("precision") != [TRAINED]:
        grid_line = grid_line[:-1] + (
            f"; rollout precisions {values(unique('precision'))} (`m2po_jax/cli/study.py` "
            "PRECISIONS)."
        )
    ran = []
    if steps is not None:
        ran.append(f"{steps} RL steps per cell from one shared warm-up")
    if tau is not None and any(c.method in RULES for c in cells):
        ran.append(f"tau {tau:g} for the M2PO methods")
    setup = (
        (f"Config: `{config}`" if config else "Config: see study_config.json")
        + (f", {'; '.join(ran)}" if ran else "")
        + " (every setting: study_config.json; each cell's: cells/<name>/config.json)."
    )
    return "\n\n".join([title, grid_line, setup, "Columns: " + LEGEND]) + "\n\n"


def report(
    out: Path, cells: list[Cell], failed: dict | None = None, tau=None, *, config=None, steps=None
) -> str:
    """Writes `study.md` (a title, the grid, the config, a legend, the table of the finished
    cells and the protocol's verdicts), `study.json` and the plots; returns the text.
    `failed` ({cell name: exception}) are listed under it; `tau` (the M2PO methods') titles
    the plots; `config` (its name on the command line) and `steps` go in the header."""
    found = groups(out, cells)
    head = (
        "| k | method | lr | seeds | final (min-max) | best | masked | m2 p50 | m2 p99 | "
        "m2 p99.9 | clip | grad norm | ESS (min) | masked loss | masked grad |"
    )
    lines = [head, "|" + "---|" * 15]
    for (k, method, lr, precision), runs in sorted(found.items(), key=_in_order):
        mean, lo, hi = _spread([s["final"] for s in runs])
        best = _spread([s["best"] for s in runs])[0]
        avg = functools.partial(_avg, runs)
        label = method if precision == TRAINED else f"{method} ({precision})"
        lines.append(
            f"| {k} | {label} | {lr:g} | {len(runs)} | {mean:.3f} ({lo:.3f}-{hi:.3f}) | "
            f"{best:.3f} | {_fmt(avg('m2po/masked_fraction'), 4)} | {_fmt(avg('m2po/m2_p50'))} | "
            f"{_fmt(avg('m2po/m2_p99'))} | {_fmt(avg('m2po/m2_p999'))} | "
            f"{_fmt(avg('actor/clip_fraction'))} | {_fmt(avg('grad_norm'))} | "
            f"{_fmt(avg('offpolicy/ess'))} ({_fmt(avg('offpolicy/ess_min'))}) | "
            f"{_fmt(avg('m2po/masked_loss_share'))} | {_fmt(avg('m2po/masked_grad_share'))} |"
        )
    table = "\n".join(lines)
    if any(c.precision != TRAINED for c in cells):
        table += "\n\n" + mismatch_table(found, collapses(out, cells, failed))
    if any(s.get("moe/expert_load_max") is not None for runs in found.values() for s in runs):
        table += "\n\n" + router_table(found)
    notes = verdicts(trained(found))
    notes += [f"failed: {n}: {_one_line(e)}" for n, e in (failed or {}).items()]
    notes += _mixed_environments(out, found)
    text = header(cells, config=config, steps=steps, tau=tau) + table + "\n\n"
    text += "\n".join(f"- {v}" for v in notes) + "\n"
    (out / "study.md").write_text(text)
    _write_json(out / "study.json", [s for runs in found.values() for s in runs])
    _plot(out, found, tau)
    return text


def _in_order(item) -> tuple:
    """A `groups` item's place in a table: staleness, method, lr, then `PRECISIONS`' order."""
    (k, method, lr, precision), _ = item
    return k, method, lr, list(PRECISIONS).index(precision)


def _avg(runs, key):
    values = [s[key] for s in runs if s.get(key) is not None]
    return sum(values) / len(values) if values else None


MISMATCH_LEGEND = (
    "Mismatch: the rollout engine's and the trainer's log-probs of the same tokens, apart "
    "from staleness (run means over steps, then over seeds). fresh |d|: the mean "
    "|behav - prox| over staleness-0 tokens (made by the weights the step trains); fresh m2 / "
    "stale m2: the mean (behav - prox)^2 over staleness-0 / older tokens; fresh share: the "
    "staleness-0 tokens' share of the batch's summed m2; drop alone: the fraction of "
    "staleness-0 tokens M2PO's mask drops run over them alone; collapsed: runs whose final "
    "held-out accuracy fell below half their first, or that stopped on non-finite steps."
)


def _by_precision(legend: str, columns: list[str], found: dict, cells) -> str:
    """A table of `found`'s groups in `_in_order` under `legend`: k, method, precision, lr
    and seeds, then `columns`, whose values `cells(key, runs, avg)` gives (`avg(metric)`:
    the mean over the group's runs)."""
    lines = [
        legend,
        "",
        "| k | method | precision | lr | seeds | " + " | ".join(columns) + " |",
        "|" + "---|" * (5 + len(columns)),
    ]
    for key, runs in sorted(found.items(), key=_in_order):
        k, method, lr, precision = key
        values = cells(key, runs, functools.partial(_avg, runs))
        lines.append(
            f"| {k} | {method} | {precision} | {lr:g} | {len(runs)} | " + " | ".join(values) + " |"
        )
    return "\n".join(lines)


def mismatch_table(found: dict, collapsed: dict) -> str:
    """The precision study's table: per staleness, method, lr and rollout precision, the
    final accuracy, the collapses and the mismatch metrics."""
    columns = ["final", "collapsed", "fresh \\|d\\|", "fresh m2", "stale m2", "fresh share"]
    return _by_precision(
        MISMATCH_LEGEND,
        columns + ["drop alone"],
        found,
        lambda key, runs, avg: [
            f"{_spread([s['final'] for s in runs])[0]:.3f}",
            f"{collapsed.get(key, 0)}",
            _fmt(avg("mismatch/fresh/abs_mean")),
            _fmt(avg("mismatch/fresh/m2")),
            _fmt(avg("mismatch/stale/m2")),
            _fmt(avg("mismatch/m2_fresh_share")),
            _fmt(avg("mismatch/fresh/m2po_drop_alone"), 4),
        ],
    )


ROUTER_LEGEND = (
    "Mixture of experts (methods `*_r3`: routing replay, `actor.router_replay=rollout`; run "
    "means over steps, then over seeds). fresh m2 / stale m2: the mean (behav - prox)^2 "
    "before any mask over staleness-0 / older tokens; m2 p99: the batch's 99th percentile "
    "token m2; masked: M2PO's masked fraction; agreement: the share of replayed token-layer "
    "pairs whose own top-k experts under the trainer's weights are the recorded ones (replay "
    "only); load max: the busiest expert's token share over the even share K / X."
)


def router_table(found: dict) -> str:
    """The routing-replay study's table: per staleness, method, lr and precision, the final
    accuracy, m2 before the mask, and the router's agreement and load."""

    def cells(key, runs, avg):
        mean, low, high = _spread([s["final"] for s in runs])
        return [
            f"{mean:.3f} ({low:.3f}-{high:.3f})",
            _fmt(avg("mismatch/fresh/m2")),
            _fmt(avg("mismatch/stale/m2")),
            _fmt(avg("m2po/m2_p99")),
            _fmt(avg("m2po/masked_fraction"), 4),
            _fmt(avg("moe/router_agreement"), 4),
            _fmt(avg("moe/expert_load_max")),
        ]

    columns = ["final (range)", "fresh m2", "stale m2", "m2 p99", "masked", "agreement"]
    return _by_precision(ROUTER_LEGEND, columns + ["load max"], found, cells)


def _mixed_environments(out: Path, found: dict) -> list[str]:
    """A note if the warm-up and the cells ran with different devices, flags or JAX (their
    numbers are then not comparable bit for bit); which GPUs a cell had does not count."""

    def key(env):
        env = dict(env or {})
        env.pop("cuda_visible_devices", None)
        return json.dumps(env, sort_keys=True)

    seen: dict = {}  # (what was not recorded does not count)
    made = out / "warmup" / "warmup.json"
    if made.exists() and "environment" in (record := json.loads(made.read_text())):
        seen.setdefault(key(record["environment"]), []).append("warm-up")
    for (k, method, lr, precision), runs in sorted(found.items()):
        for r in runs:
            if "environment" in r:
                seen.setdefault(key(r["environment"]), []).append(
                    Cell(k, method, lr, r["seed"], precision).name
                )
    if len(seen) <= 1:
        return []
    return [
        "environments differ (not comparable bit for bit): "
        + "; ".join(f"{', '.join(names)}: {env}" for env, names in seen.items())
    ]


def _plot(out: Path, found: dict, tau=None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lrs = sorted({lr for _, _, lr, _ in found})
    for k in sorted({k for k, _, _, _ in found if k > 0}):
        fig, axes = plt.subplots(1, len(lrs), figsize=(5 * len(lrs), 3.6), squeeze=False)
        for ax, lr in zip(axes[0], lrs, strict=True):
            for (kk, method, x, precision), runs in sorted(found.items()):
                if x != lr or kk not in (0, k):
                    continue
                steps = [s for s, _ in runs[0]["curve"]]
                acc = np.array(
                    [[a for _, a in r["curve"]] for r in runs if len(r["curve"]) == len(steps)]
                )
                label = f"{method} (k = {kk})"
                if precision != TRAINED:
                    label = f"{method}, {precision} (k = {kk})"
                ax.plot(steps, acc.mean(0), marker="o", ms=3, label=label)
                ax.fill_between(steps, acc.min(0), acc.max(0), alpha=0.2)
            title = f"staleness {k}, lr {lr:g}"
            if tau is not None and any(m in RULES for _, m, _, _ in found):
                title += f", tau {tau:g}"
            ax.set(title=title, xlabel="RL step", ylabel="held-out accuracy")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"study_k{k}.png", dpi=110)
        plt.close(fig)
    if len({p for *_, p in found}) > 1:
        _plot_precisions(out, found, plt)


def _plot_precisions(out: Path, found: dict, plt) -> None:
    """`study_precision.png`: by rollout precision, each method and staleness's final
    held-out accuracy (mean, range over seeds) and the staleness-0 tokens' mean m2."""
    order = [p for p in PRECISIONS if any(key[3] == p for key in found)]
    fig, (acc_ax, m2_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    series = sorted({(k, m, lr) for k, m, lr, _ in found})
    for k, method, lr in series:
        xs, mean, lo, hi, m2 = [], [], [], [], []
        for i, p in enumerate(order):
            runs = found.get((k, method, lr, p))
            if not runs:
                continue
            a, b, c = _spread([r["final"] for r in runs])
            xs.append(i), mean.append(a), lo.append(a - b), hi.append(c - a)
            m2.append(_avg(runs, "mismatch/fresh/m2"))
        label = f"{method} (k = {k})" + (f", lr {lr:g}" if len({x[2] for x in series}) > 1 else "")
        acc_ax.errorbar(xs, mean, yerr=[lo, hi], marker="o", ms=3, capsize=2, label=label)
        shown = [(x, v) for x, v in zip(xs, m2, strict=True) if v]
        if shown:
            m2_ax.plot(*zip(*shown, strict=True), marker="o", ms=3, label=label)
    for ax in (acc_ax, m2_ax):
        ax.set_xticks(range(len(order)), order)
        ax.set_xlabel("rollout precision")
    acc_ax.set(ylabel="final held-out accuracy", title="accuracy by rollout precision")
    m2_ax.set(ylabel="mean m2 of staleness-0 tokens", yscale="log",
              title="engine/trainer mismatch")  # fmt: skip
    acc_ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "study_precision.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- the command

FLAGS = flags.FLAGS


def define_flags(default_config: str) -> None:
    config_flags.DEFINE_config_file(
        "config", default_config, "The base config FILE.py[:PRESET,...] or a shipped one (arith:m2po).",
        lock_config=False,
    )  # fmt: skip
    flags.DEFINE_string("out", "runs/stale_study", "Study directory (resumes a half-done grid).")
    flags.DEFINE_list("staleness", ["0", "16", "64", "256"], "Staleness values k.")
    flags.DEFINE_list(
        "methods",
        list(PROTOCOL_METHODS),
        f"Methods, of {sorted(METHODS)}; the default is the protocol's four.",
    )
    flags.DEFINE_list("lrs", ["1e-4", "3e-4"], "Learning rates.")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
    flags.DEFINE_list(
        "precisions",
        [TRAINED],
        f"Rollout precisions, of {', '.join(PRECISIONS)} (weights and KV cache of the "
        "rollout engine).",
    )
    flags.DEFINE_integer("steps", 150, "RL steps per cell.", lower_bound=1)
    flags.DEFINE_float("tau", 0.04, "M2PO threshold of the M2PO methods.")
    flags.DEFINE_integer("parallel", 1, "Cells run at once (one process each).", lower_bound=1)
    flags.DEFINE_integer(
        "devices_per_cell",
        0,
        "GPUs of this host per cell (CUDA_VISIBLE_DEVICES of each cell's process: the first "
        "N for one cell, the next N for the next, ...); 0: every cell sees all devices.",
        lower_bound=0,
    )


def _main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.ERROR)
    try:
        cells = grid(
            _numbers("staleness", int, "0,16,64"),
            FLAGS.methods,
            _numbers("lrs", float, "1e-4,3e-4"),
            _numbers("seeds", int, "0,1,2"),
            FLAGS.precisions,
        )
    except ValueError as e:
        print(f"m2po-study: {e}", file=sys.stderr)
        sys.exit(2)
    from m2po_jax.common.errors import M2poError

    base = FLAGS.config.to_dict()
    try:
        run_study(
            base,
            cells,
            FLAGS.out,
            tau=FLAGS.tau,
            steps=FLAGS.steps,
            parallel=FLAGS.parallel,
            devices_per_cell=FLAGS.devices_per_cell,
            config=config_flags.get_config_filename(FLAGS["config"]),
        )
    except M2poError as e:  # a config a cell refuses, before any work
        print(f"m2po-study: {e.what}: {e}", file=sys.stderr)
        sys.exit(2)
    except ValueError as e:  # --devices_per_cell against CUDA_VISIBLE_DEVICES
        print(f"m2po-study: {e}", file=sys.stderr)
        sys.exit(2)
    except StudyError as e:
        sys.exit(_exit_status(e, Path(FLAGS.out)))
    print((Path(FLAGS.out) / "study.md").read_text())


def _numbers(name: str, kind, example: str) -> list:
    """The comma-separated values of `--name` as `kind`, or a ValueError naming the flag."""
    values = getattr(FLAGS, name)
    if not values:
        raise ValueError(f"--{name}: no values; give a list such as --{name}={example}")
    try:
        return [kind(x) for x in values]
    except ValueError:
        bad = next(x for x in values if not _parses(kind, x))
        what = "an integer" if kind is int else "a number"
        raise ValueError(
            f"--{name}={','.join(values)}: {bad!r} is not {what} (e.g. --{name}={example})"
        ) from None


def _parses(kind, text: str) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


_OWN_FLAGS = (
    "config", "out", "staleness", "methods", "lrs", "seeds", "precisions", "steps", "tau",
    "parallel", "devices_per_cell",
)  # fmt: skip


def usage() -> str:
    """`m2po-study --help`: its flags, examples and exit status (absl's `--helpfull` lists its
    own flags too)."""
    lines = [
        "usage: m2po-study [--config=FILE[:PRESET,...]] [--out=DIR] [--staleness=K,...] "
        "[--methods=M,...]",
        "                  [--lrs=LR,...] [--seeds=S,...] [--precisions=P,...] [--steps=N] "
        "[--tau=T]",
        "                  [--parallel=N] [--config.SECTION.FIELD=VALUE ...]",
        "",
        "Runs a grid of m2po-train cells (staleness x method x learning rate x seed x rollout",
        "precision) from one shared supervised warm-up, and writes <out>/study.md (the table",
        "and the protocol's verdicts, docs/stale_study_protocol.md), <out>/study.json,",
        "<out>/study_k<K>.png and, with several precisions, <out>/study_precision.png.",
        "The same command resumes a stopped or half-done study; finished cells are skipped.",
        "",
        "flags:",
    ]
    for name in _OWN_FLAGS:
        flag = FLAGS[name]
        default = flag.default
        if isinstance(default, list):
            default = ",".join(default)
        shown = "" if default in (None, "") else f" (default: {default})"
        if name == "config":
            shown = " (default: the built-in default config)"
        lines.append(f"  --{name}: {flag.help}{shown}")
    lines += [
        "",
        f"Methods: {', '.join(METHODS)} (grpo runs at staleness 0, the others at k > 0).",
        "Any config field of the base: --config.SECTION.FIELD=VALUE, as m2po-train.",
        "",
        "examples:",
        "  m2po-study --config=arith:m2po --out=runs/stale_study --staleness=0,16,64,256 \\",
        "      --lrs=1e-4,3e-4 --seeds=0,1,2 --steps=150 --parallel=2",
        "  m2po-study --config=arith:m2po,tiny --out=/tmp/study --staleness=0,2 \\",
        "      --methods=grpo,m2po --lrs=1e-3 --seeds=0 --steps=3    # a minute on a CPU",
        "  m2po-study --config=arith:m2po --out=runs/mismatch_study --staleness=0,4 \\",
        "      --methods=grpo,stale_grpo,m2po,m2po_tis --precisions=float32,bfloat16,int8,float8 \\",
        "      --lrs=3e-4 --seeds=0,1,2 --parallel=2    # the rollout-precision study",
        "  m2po-study --config=gsm8k:qwen2.5-0.5b --out=/tmp/gsm8k_study --parallel=4 \\",
        "      --devices_per_cell=2 --config.model.path=/models/Qwen2.5-0.5B-Instruct \\",
        "      --config.task.train_path=/data/gsm8k/train.jsonl    # 4 cells at once on 8 GPUs",
        "",
        "Exit status: 0 every cell finished; 2 a flag or a cell's config refused, or a cell",
        "failed with an error of the user's (one line each); 1 an error of the project's own",
        "(its traceback); 128 + N stopped by signal N, the running cells checkpointed",
        "(143 SIGTERM, 130 Ctrl-C).",
    ]
    return "\n".join(lines)


def _exit_status(e: StudyError, out: Path) -> int:
    """Reports a study that did not finish in one line per cell; its exit status: 128 +
    signal if stopped, else 2 if every failure is the user's (`M2poError`), else 1 (an
    error of the project's own, with its traceback)."""
    from m2po_jax.common.errors import M2poError

    for name, error in e.failed.items():
        if not isinstance(error, M2poError):
            traceback.print_exception(error)
        print(f"m2po-study: {name}: {_one_line(error)}", file=sys.stderr)
    where = ", ".join(f"{s.name} at step {s.step}" for s in e.stopped)
    print(
        f"m2po-study: {e}{f' ({where} checkpointed)' if where else ''}; the finished cells are in "
        f"{out / 'study.md'}; the same command resumes the rest",
        file=sys.stderr,
    )
    if e.signum:
        return 128 + e.signum
    return 2 if all(isinstance(x, M2poError) for x in e.failed.values()) else 1


def run() -> None:
    """The `m2po-study` entry point (shipped configs by name, as `m2po-train`)."""
    from m2po_jax.cli import train as train_main

    sys.argv = sys.argv[:1] + [train_main.spelled_our_way(arg) for arg in sys.argv[1:]]
    define_flags(train_main.DEFAULT_CONFIG)
    if any(arg in ("--help", "-h", "-?", "--helpshort") for arg in sys.argv[1:]):
        print(usage())
        sys.exit(0)
    app.run(_main)


if __name__ == "__main__":
    # The cells' processes unpickle this module's functions and errors by its own name.
    from m2po_jax.cli import study

    study.run()
