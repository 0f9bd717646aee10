"""Tests for m2po_jax.run.metrics and m2po_jax.run.plots: writers, resume, non-finite values, plots."""

import json
import os
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax.common.errors import WriterError
from m2po_jax.run import metrics as M
from m2po_jax.run import paths, plots, tensorboard


def _lines(path):
    with open(path) as f:
        return [json.loads(line, parse_constant=_reject) for line in f]


def _reject(name):
    raise AssertionError(f"invalid JSON constant {name} in metrics.jsonl")


def test_jsonl_content_and_types(tmp_path):
    with M.MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(0, {"reward/mean": np.float32(0.25), "count": np.int32(7), "x": 1})
        writer.write(
            np.int64(1),
            {"reward/mean": jnp.float32(0.5), "staleness/hist_k": np.array([3, 1]), "ok": True},
        )
    records = _lines(tmp_path / "metrics.jsonl")
    assert records == [
        {"step": 0, "reward/mean": 0.25, "count": 7, "x": 1},
        {"step": 1, "reward/mean": 0.5, "staleness/hist_k": [3, 1], "ok": True},
    ]
    assert [list(r)[0] for r in records] == ["step", "step"]
    assert type(records[0]["count"]) is int and type(records[1]["reward/mean"]) is float
    assert M.read_metrics(tmp_path / "metrics.jsonl") == records


def test_nonfinite_values_become_null_and_are_named(tmp_path):
    with M.MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(
            3,
            {"loss": float("nan"), "grad_norm": np.float32(np.inf), "ok": 1.5, "h": [1.0, -np.inf]},
        )
    (record,) = _lines(tmp_path / "metrics.jsonl")  # parse_constant rejects NaN/Infinity
    assert record == {
        "step": 3,
        "loss": None,
        "grad_norm": None,
        "ok": 1.5,
        "h": [1.0, None],
        "nonfinite": ["loss", "grad_norm", "h"],
    }


def test_resume_drops_steps_at_or_after_resume_step(tmp_path):
    with M.MetricsWriter(tmp_path, tensorboard=False) as writer:
        for step in range(5):
            writer.write(step, {"reward/mean": step / 10})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rew')  # torn line from a crash
    with M.MetricsWriter(tmp_path, tensorboard=False, resume_step=3) as writer:
        assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [0, 1, 2]
        for step in range(3, 6):
            writer.write(step, {"reward/mean": 1.0})
    records = _lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert records[2]["reward/mean"] == 0.2 and records[3]["reward/mean"] == 1.0
    # Without resume_step the file is appended to as is.
    with M.MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(6, {})
    assert len(_lines(tmp_path / "metrics.jsonl")) == 7


def test_non_primary_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    writer = M.MetricsWriter(workdir, is_primary=False, wandb={"project": "x"})
    writer.write(0, {"reward/mean": 1.0})
    writer.close()
    assert not workdir.exists()


def test_a_failing_close_keeps_the_first_error_and_is_reported_alone(tmp_path, monkeypatch):
    class ClosesOnAFullDisk:
        def __init__(self, f):
            self._f = f

        def __getattr__(self, name):
            return getattr(self._f, name)

        def close(self):
            self._f.close()
            raise OSError(28, "No space left on device")

    real_open = open
    monkeypatch.setattr(  # the writer's file opens in the path layer
        paths, "open", lambda *a, **k: ClosesOnAFullDisk(real_open(*a, **k)), raising=False
    )
    with pytest.raises(RuntimeError, match="the step failed"):
        with M.MetricsWriter(tmp_path / "a", tensorboard=False):
            raise RuntimeError("the step failed")
    with pytest.raises(WriterError, match=r"metrics.jsonl: No space left on device \(ENOSPC\)"):
        with M.MetricsWriter(tmp_path / "b", tensorboard=False) as writer:
            writer.write(0, {"reward/mean": 1.0})


def test_tensorboard_scalars_read_back(tmp_path):
    with M.MetricsWriter(tmp_path) as writer:
        for step in range(3):
            writer.write(
                step,
                {
                    "reward/mean": 0.1 * step,
                    "count": np.int32(step),
                    "note": "text",
                    "hist": [1, 2],
                },
            )
    tb_dir = tmp_path / M.TENSORBOARD_DIR
    events = [f for f in os.listdir(tb_dir) if f.startswith("events.out.tfevents")]
    assert len(events) == 1
    scalars = tensorboard.read_scalars(tb_dir)
    # Numbers only (text and lists stay in metrics.jsonl), at their steps, as float32.
    assert sorted(scalars) == ["count", "reward/mean"]
    assert scalars["count"] == {0: 0.0, 1: 1.0, 2: 2.0}
    assert list(scalars["reward/mean"]) == [0, 1, 2]
    np.testing.assert_allclose(list(scalars["reward/mean"].values()), [0.0, 0.1, 0.2], rtol=1e-6)
    # A resumed run's file drops the older file's steps at and after the resume step.
    with M.MetricsWriter(tmp_path, resume_step=1) as writer:
        writer.write(1, {"reward/mean": 0.75})
    scalars = tensorboard.read_scalars(tb_dir)
    assert scalars["reward/mean"] == {0: 0.0, 1: 0.75}
    assert scalars["count"] == {0: 0.0}


def test_wandb_logs_scalars_and_missing_package_is_clear(tmp_path, monkeypatch):
    calls = {"init": [], "log": [], "finish": 0}

    class Run:
        def log(self, data, step):
            calls["log"].append((step, data))

        def finish(self):
            calls["finish"] += 1

    def init(**kwargs):
        calls["init"].append(kwargs)
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with M.MetricsWriter(tmp_path, tensorboard=False, wandb={"project": "p"}) as writer:
        writer.write(2, {"reward/mean": np.float32(0.5), "hist": [1, 2], "name": "a"})
    assert calls == {"init": [{"project": "p"}], "log": [(2, {"reward/mean": 0.5})], "finish": 1}
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        M.MetricsWriter(tmp_path / "w", wandb={})


def test_writer_bad_input(tmp_path):
    with M.MetricsWriter(tmp_path, tensorboard=False) as writer:
        with pytest.raises(ValueError, match="step"):
            writer.write(-1, {})
        with pytest.raises(ValueError, match="reserved"):
            writer.write(0, {"step": 1})
    with pytest.raises(ValueError, match="resume_step"):
        M.MetricsWriter(tmp_path, resume_step=-2)


def test_read_metrics_errors(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="m.jsonl:2"):
        M.read_metrics(path)
    path.write_text('{"step": 0}\n{"step": 1, "x"')  # write in progress
    assert M.read_metrics(path) == [{"step": 0}]
    with pytest.raises(FileNotFoundError):
        M.read_metrics(tmp_path / "nope.jsonl")


def test_progress_bar_shows_metrics(capsys):
    bar = M.ProgressBar(10, initial=2)
    bar.update(3, {"reward/mean": 0.5, "eval/accuracy": 0.75, "m2po/masked_fraction": 0.01})
    bar.update(4, {"reward/mean": jnp.float32(0.625)})
    bar.close()
    err = capsys.readouterr().err
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert "4/10" in last
    assert "reward=0.625" in last and "eval_acc=0.750" in last  # eval kept from step 3
    quiet = M.ProgressBar(10, enabled=False)
    quiet.update(1, {"reward/mean": 1.0})
    quiet.close()
    assert capsys.readouterr().err == ""


def _mask_rows(m2_before, masked, tokens=100, stale=4.0):
    return [
        {
            "step": i,
            "m2po/m2_before": b,
            "m2po/m2_after": b if m == 0 else b / 2,
            "m2po/masked_tokens": m,
            "train/tokens": tokens,
            "staleness/mean": stale,
        }
        for i, (b, m) in enumerate(zip(m2_before, masked, strict=True))
    ]


def test_the_mask_summary_says_what_the_mask_did_by_phase():
    # 6 steps in 3 phases of 2; steps 4 and 5 masked 10 and 30 of their 100 tokens
    rows = _mask_rows([0.01, 0.03, 0.02, 0.04, 0.2, 0.6], [0, 0, 0, 0, 10, 30])
    rows.insert(2, {"step": 99, "eval/accuracy": 0.5})  # a row without the mask: skipped
    (line,) = M.mask_summary(rows, tau=0.04)
    assert "tau=0.04" in line and "masked 6.67% of the trained tokens (40 of 600)" in line
    assert "acted on 2 of 6 steps" in line
    # phase means of m2 before -> after (after = before / 2 on the masked steps)
    want = "steps 0-1 0.0200 -> 0.0200, steps 2-3 0.0300 -> 0.0300, steps 4-5 0.4000 -> 0.2000"
    assert want in line
    assert M.mask_summary(rows, tau=None) == [] and M.mask_summary([{"step": 0}], 0.04) == []


def test_the_mask_summary_says_why_a_mask_that_dropped_nothing_did_so():
    idle = M.mask_summary(_mask_rows([0.01] * 9 + [0.05], [0] * 10, stale=4.0), tau=0.04)
    assert len(idle) == 2 and "masked 0.00%" in idle[0]
    assert "below tau before the mask on 9 of 10 steps" in idle[1]
    assert "4.0 updates stale" in idle[1] and M.STALE_STUDY_COMMAND in idle[1]
    # above tau on most steps but nothing masked (another rule): no staleness excuse
    busy = M.mask_summary(_mask_rows([0.05] * 10, [0] * 10), tau=0.04)
    assert len(busy) == 1


def _synthetic_run(path, steps=40, collapse=False):
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for step in range(steps):
            record = {
                "step": step,
                "reward/mean": min(1.0, step / steps + 0.1 * rng.random()),
                "m2po/masked_fraction": 0.01 * rng.random(),
                "m2po/m2_before": 0.1 * (1 + step if collapse else 1.0),
                "m2po/m2_after": 0.03,
                "staleness/mean": 3.5,
                "staleness/max": 4,
                "loss": -0.1 * rng.random(),
                "grad_norm": 1.0 + rng.random(),
                "actor/clip_fraction": 0.02,
                "train/entropy": 1.5 - step / steps,
            }
            if step == 0:
                record["m2po/m2_before"] = 1e-13  # on-policy at step 0: round-off only
            if step % 10 == 0:
                record["eval/accuracy"] = step / steps
            f.write(json.dumps(record) + "\n")
    return path


def _assert_png(path, size=None):
    """A PNG of `size` (width, height) pixels with something drawn on it."""
    from matplotlib import image

    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(path)
    if size is not None:
        assert pixels.shape[:2] == (size[1], size[0]), path
    drawn = (pixels[..., :3] < 0.9).any(axis=-1).mean()
    assert 0.01 < drawn < 0.5, path  # lines, labels and ticks on white: not a blank canvas


def test_plot_metrics_writes_every_panel_and_summary(tmp_path):
    metrics_path = _synthetic_run(tmp_path / "metrics.jsonl")
    paths = plots.plot_metrics(metrics_path, tmp_path / "plots")
    names = [os.path.basename(p) for p in paths]
    assert names == [
        "reward.png",
        "eval_accuracy.png",
        "masked_fraction.png",
        "m2.png",
        "loss.png",
        "grad_norm.png",
        "clip_fraction.png",
        "entropy.png",
        "staleness.png",
        "summary.png",
    ]
    for p in paths[:-1]:
        _assert_png(p, size=(600, 400))  # 6 x 4 inches at 100 dpi
    _assert_png(paths[-1], size=(1500, 1050))  # 9 panels: 3 x 3 of 5 x 3.5 inches


def test_a_panel_draws_the_records_values(tmp_path):
    from matplotlib.figure import Figure

    records = M.read_metrics(_synthetic_run(tmp_path / "metrics.jsonl", steps=12))
    ax = Figure().add_subplot()
    assert plots._draw_panel(ax, records, "reward", ("reward/mean", "eval/accuracy"), False)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert sorted(lines) == ["eval/accuracy", "reward/mean"]
    np.testing.assert_array_equal(lines["reward/mean"].get_xdata(), np.arange(12))
    np.testing.assert_array_equal(
        lines["reward/mean"].get_ydata(), [r["reward/mean"] for r in records]
    )
    # eval/accuracy only at the steps that have it (0 and 10).
    np.testing.assert_array_equal(lines["eval/accuracy"].get_xdata(), [0, 10])
    np.testing.assert_array_equal(lines["eval/accuracy"].get_ydata(), [0.0, 10 / 12])
    assert not plots._draw_panel(Figure().add_subplot(), records, "x", ("missing/key",), False)


def test_the_second_moment_panel_draws_tau_and_ignores_a_step0_round_off(tmp_path):
    from matplotlib.figure import Figure

    records = M.read_metrics(_synthetic_run(tmp_path / "metrics.jsonl"))
    ax = Figure().add_subplot()
    assert plots._draw_panel(ax, records, "m2", ("m2po/m2_before", "m2po/m2_after"), True, 0.04)
    taus = [line for line in ax.get_lines() if line.get_label() == "tau = 0.04"]
    assert len(taus) == 1 and set(taus[0].get_ydata()) == {0.04}
    assert ax.get_ylim()[0] > 1e-6  # the 1e-13 at step 0 does not set the axis
    ax = Figure().add_subplot()
    plots._draw_panel(ax, records, "M2PO masked", ("m2po/masked_fraction",), False, 0.04)
    assert ax.get_title() == "M2PO masked (tau = 0.04)"


def test_the_mismatch_panel_shows_fresh_and_stale_m2_and_the_fresh_drops(tmp_path):
    """Fresh m2 of float32 rounding (1e-14) stays on the log axis beside the stale m2; the
    fresh tokens' drop fractions go on a linear right axis; the run writes mismatch.png."""
    from matplotlib.figure import Figure

    rows = [
        {"step": s, "mismatch/fresh/m2": 1e-14 * (s + 1), "mismatch/stale/m2": 0.1 * (s + 1),
         "mismatch/fresh/m2po_drop_alone": 0.01 * s, "mismatch/fresh/m2po_dropped": 0.02 * s}
        for s in range(4)
    ]  # fmt: skip
    rows[0]["mismatch/stale/m2"] = 0.0  # no stale token at step 0: left off the log axis
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = M.read_metrics(path)
    ax = Figure().add_subplot()
    stem, title, keys, log_y = plots._panels(records)[-1]
    right, decades = plots.PANEL_EXTRAS[stem]
    assert (stem, title) == ("mismatch", "mismatch vs staleness")
    assert plots._draw_panel(ax, records, title, keys, log_y, None, right, decades)
    lines = {line.get_label(): line.get_ydata() for line in ax.get_lines()}
    np.testing.assert_array_equal(lines["mismatch/fresh/m2"], [1e-14, 2e-14, 3e-14, 4e-14])
    assert np.isnan(lines["mismatch/stale/m2"][0])
    assert ax.get_yscale() == "log" and ax.get_ylim()[0] < 1e-14
    (twin,) = [a for a in ax.figure.axes if a is not ax]
    drops = {line.get_label(): line.get_ydata() for line in twin.get_lines()}
    np.testing.assert_allclose(drops["mismatch/fresh/m2po_dropped"], [0, 0.02, 0.04, 0.06])
    assert twin.get_yscale() == "linear" and twin.get_ylim()[0] == 0.0
    assert len(ax.get_legend().get_texts()) == 4
    written = [os.path.basename(p) for p in plots.plot_metrics(path, tmp_path / "plots")]
    assert written == ["mismatch.png", "summary.png"]


def test_plot_metrics_skips_missing_keys(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward/mean": s / 5}) + "\n" for s in range(5)))
    names = [os.path.basename(p) for p in plots.plot_metrics(path, tmp_path / "plots")]
    assert names == ["reward.png", "summary.png"]
    path.write_text('{"step": 0, "other": 1}\n')
    assert plots.plot_metrics(path, tmp_path / "empty") == []


def test_the_eval_panel_shows_every_held_out_set():
    rows = [
        {"step": 0, "eval/accuracy": 0.5, "eval/math500/avg@4": 0.6, "eval/aime24/avg@4": 0.4,
         "eval/math500/pass@4": 0.8, "eval/pass@4": 0.7},
        {"step": 1, "reward/mean": 0.2},
    ]  # fmt: skip
    panel = {stem: (title, keys) for stem, title, keys, _ in plots._panels(rows)}
    title, keys = panel["eval_accuracy"]
    assert keys == ("eval/accuracy", "eval/aime24/avg@4", "eval/math500/avg@4",
                    "eval/math500/pass@4", "eval/pass@4")  # fmt: skip
    assert title.startswith("held-out accuracy") and panel["reward"][1] == ("reward/mean",)
    assert {s: k for s, _, k, _ in plots._panels(rows[1:])}["eval_accuracy"] == ("eval/accuracy",)


def test_plot_comparison(tmp_path):
    runs = {
        "GRPO on-policy": _synthetic_run(tmp_path / "a.jsonl"),
        "GRPO stale-4": _synthetic_run(tmp_path / "b.jsonl", collapse=True),
        "M2PO stale-4": _synthetic_run(tmp_path / "c.jsonl"),
    }
    out = plots.plot_comparison(runs, tmp_path / "cmp" / "stale.png")
    _assert_png(out)
    with pytest.raises(ValueError, match="none of"):
        plots.plot_comparison(runs, tmp_path / "x.png", keys=("missing/key",))
    with pytest.raises(ValueError, match="runs"):
        plots.plot_comparison({}, tmp_path / "x.png")


def test_staleness_stats_hand_example():
    stats = M.staleness_stats(np.array([5, 5, 4, 2], np.int32), 5)
    assert stats == {
        "staleness/mean": 1.0,
        "staleness/max": 3,
        "staleness/min": 0,
        "staleness/hist_k": [2, 1, 0, 1],
    }
    assert M.staleness_stats(jnp.array([7, 7]), 9)["staleness/hist_k"] == [0, 0, 2]
    assert M.staleness_stats([5, 5, 4, 2], 5, max_k=1)["staleness/hist_k"] == [2, 2]
    assert M.staleness_stats([5, 5, 4, 2], 5, max_k=5)["staleness/hist_k"] == [2, 1, 0, 1, 0, 0]
    with pytest.raises(ValueError, match="newer than current_version"):
        M.staleness_stats([3, 6], 5)
    with pytest.raises(ValueError, match="shape"):
        M.staleness_stats(np.zeros((2, 2), np.int32), 5)
    with pytest.raises(TypeError, match="integer"):
        M.staleness_stats([1.5], 5)


def test_host_metrics_converts_to_python():
    out = M.host_metrics(
        {"loss": jnp.float32(1.5), "count": jnp.int32(3), "m2po": {"hist": jnp.array([1, 2])}}
    )
    assert out == {"loss": 1.5, "count": 3, "m2po/hist": [1, 2]}
    assert type(out["loss"]) is float and type(out["count"]) is int
