"""`m2po-study`: the grid, its table, a failing cell, a resumed grid that skips the finished
cells, and a SIGTERM that checkpoints the running cells."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from m2po_jax.cli import study
from m2po_jax.common.errors import ConfigError
from m2po_jax.configs import arith
from m2po_jax.trainer import loop

REPO = Path(__file__).resolve().parents[2]


def test_the_grid_runs_grpo_on_policy_and_the_rest_stale():
    cells = study.grid([0, 16], ["grpo", "m2po", "paper_final"], [1e-4, 3e-4], [0, 1])
    assert len(cells) == 2 * 2 * (1 + 2)
    assert {(c.staleness, c.method) for c in cells} == {
        (0, "grpo"), (16, "m2po"), (16, "paper_final")}  # fmt: skip
    with pytest.raises(ValueError, match="unknown method 'ppo'"):
        study.grid([0], ["ppo"], [1e-4], [0])
    with pytest.raises(ValueError, match="no cell"):
        study.grid([0], ["m2po"], [1e-4], [0])


def test_cell_devices_gives_each_parallel_cell_its_own_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert study.cell_devices(1, 0) == [] and study.cell_devices(3, 0) == [None] * 3
    assert study.cell_devices(4, 2) == ["0,1", "2,3", "4,5", "6,7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    assert study.cell_devices(2, 2) == ["3,5", "6,7"] and study.cell_devices(1, 1) == ["3"]
    with pytest.raises(ValueError, match="needs 6 devices, CUDA_VISIBLE_DEVICES='3,5,6,7' lists 4"):
        study.cell_devices(3, 2)


def test_the_paper_and_authors_methods_are_the_shipped_presets_rules():
    base = arith.get_config("m2po").to_dict()
    keys = (
        "m2_threshold", "m2po_second_moment", "m2po_stop_rule", "m2po_candidates", "eps_clip",
        "eps_clip_higher", "loss_denominator", "use_decoupled_loss", "ppo_n_minibatches",
    )  # fmt: skip
    for method in ("paper", "authors", "paper_final"):
        cell = study.Cell(256, method, 1e-4, 0)
        got = study.cell_config(base, cell, tau=0.04, steps=10).actor
        want = arith.get_config(method).actor
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, method
    # By hand, from the rules' definitions; a base config's own settings do not carry over.
    other_base = arith.get_config("authors").to_dict()
    want = {
        "paper": dict(m2po_second_moment="current_behav", m2po_stop_rule="le",
                      m2po_candidates="all", eps_clip=None, loss_denominator="valid"),
        "authors": dict(m2po_second_moment="behav_prox", m2po_stop_rule="capped_clip",
                        m2po_candidates="harmful", eps_clip=0.2),
        "m2po": dict(m2po_second_moment="behav_prox", m2po_stop_rule="lt",
                     m2po_candidates="all", eps_clip=0.2),
    }  # fmt: skip
    for method, values in want.items():
        cell = study.Cell(256, method, 1e-4, 0)
        got = study.cell_config(other_base, cell, tau=0.5, steps=10).actor
        assert got.m2_threshold == 0.5 and {k: got[k] for k in values} == values, method
    # Every method but routing replay's (a mixture of experts only: its own test below).
    dense = [m for m in study.METHODS if not m.endswith("_r3")]
    cells = study.grid([0, 256], dense, [1e-4], [0])
    assert [c.method for c in cells] == dense
    study.check_cells(base, cells, tau=0.04, steps=10)  # every method's config is valid


def _runs(*finals):
    return [{"final": f, "seed": i} for i, f in enumerate(finals)]


def test_the_verdicts_follow_the_protocol():
    # Grid A's second run (docs/stale_study_results.md), final accuracies by seed.
    found = {
        (0, "grpo", 1e-4): _runs(0.582, 0.586, 0.590),
        (16, "stale_grpo", 1e-4): _runs(0.582, 0.586, 0.590),
        (16, "m2po", 1e-4): _runs(0.562, 0.570, 0.578),
        (256, "stale_grpo", 1e-4): _runs(0.527, 0.543, 0.578),
        (256, "m2po", 1e-4): _runs(0.504, 0.550, 0.578),
        (256, "paper_final", 1e-4): _runs(0.574, 0.594, 0.598),
        (0, "grpo", 3e-4): _runs(0.605, 0.617, 0.664),
        (256, "stale_grpo", 3e-4): _runs(0.422, 0.457, 0.512),
        (256, "m2po", 3e-4): _runs(0.004, 0.320, 0.367),
        (256, "paper_final", 3e-4): _runs(0.551, 0.562, 0.582),
    }
    assert study.verdicts(found) == [
        "lr 0.0001, k = 16: staleness does not hurt; m2po hurts (on-policy final >= 0.582)",
        "lr 0.0001, k = 256: staleness hurts; m2po does not rescue; paper_final rescues "
        "(on-policy final >= 0.582)",
        "lr 0.0001: the claim is partly reproduced at k = 256 (paper_final rescues, m2po does not)",
        "lr 0.0003, k = 256: staleness hurts; m2po does not rescue; paper_final does not "
        "rescue (on-policy final >= 0.605)",
        "lr 0.0003: the claim is not reproduced at k = 256 (no M2PO rule rescues)",
    ]
    found[(256, "m2po", 3e-4)] = found[(256, "paper_final", 3e-4)] = _runs(0.60, 0.61, 0.62)
    assert study.verdicts(found)[-1] == (
        "lr 0.0003: the claim is reproduced at k = 256 (m2po and paper_final rescue)"
    )
    found[(256, "stale_grpo", 3e-4)] = _runs(0.60, 0.61, 0.62)  # mean 0.61 >= 0.605
    assert study.verdicts(found)[-1] == (
        "lr 0.0003: the claim is not tested at k = 256 (staleness does not hurt there)"
    )


def test_one_seed_gives_a_reading_not_a_verdict():
    found = {
        (0, "grpo", 1e-4): _runs(0.60),
        (256, "stale_grpo", 1e-4): _runs(0.50),
        (256, "m2po", 1e-4): _runs(0.61),
    }
    assert study.verdicts(found)[-1] == (
        "lr 0.0001: one seed cannot support a verdict on the claim (run --seeds=0,1,2); on this "
        "seed it reads: the claim is reproduced at k = 256 (m2po rescues)"
    )
    found[(0, "grpo", 1e-4)] = _runs(0.60, 0.61)  # one group with one seed is enough to say so
    assert study.verdicts(found)[-1].startswith("lr 0.0001: one seed cannot support a verdict")


def _study_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "m2po_jax.cli.study", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_study_help_and_a_bad_list_name_the_flag():
    shown = _study_cli("--help")
    assert shown.returncode == 0, shown.stderr
    for needle in ("usage: m2po-study", "--lrs: Learning rates. (default: 1e-4,3e-4)", "--tau:",
                   "--devices_per_cell:", "examples:", "Exit status:", "128 + N"):  # fmt: skip
        assert needle in shown.stdout, needle
    assert "--stderrthreshold" not in shown.stdout and "helpfull" not in shown.stdout
    for flag, value, message in (
        ("lrs", "1e-4,abc", "m2po-study: --lrs=1e-4,abc: 'abc' is not a number (e.g. --lrs="),
        ("seeds", "0,1.5", "m2po-study: --seeds=0,1.5: '1.5' is not an integer (e.g. --seeds="),
        ("staleness", "", "m2po-study: --staleness: no values; give a list such as"),
    ):
        bad = _study_cli(f"--{flag}={value}", "--out=/nonexistent/never")
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        assert bad.stderr.strip().splitlines()[-1].startswith(message), bad.stderr


def _tiny():
    base = arith.get_config("m2po,tiny").to_dict()
    base["mesh"]["data"] = 1  # one of the suite's 8 CPU devices
    return base


def test_a_cell_config_that_is_refused_stops_the_study_before_any_work(tmp_path):
    cells = study.grid([0, 2], ["grpo", "m2po"], [1e-3], [0])
    with pytest.raises(ConfigError, match="cell k2_m2po_lr0.001_seed0: actor.m2_threshold"):
        study.run_study(_tiny(), cells, tmp_path / "out", tau=-1.0, steps=3)
    assert not (tmp_path / "out").exists()


def test_a_study_writes_its_table_and_a_resumed_grid_skips_finished_cells(
    tmp_path, monkeypatch, capsys
):
    base = _tiny()
    cells = study.grid([0, 2], ["grpo", "m2po"], [1e-3], [0])
    run = loop.Trainer.run

    def diverges(self, *args, **kwargs):  # the m2po cell's run ends as a diverged one does
        if "m2po" in self.workdir.name:
            raise loop.NonFiniteError("max_nonfinite_steps: 3 consecutive steps had NaN loss")
        return run(self, *args, **kwargs)

    monkeypatch.setattr(loop.Trainer, "run", diverges)
    with pytest.raises(study.StudyError, match="1 cell") as failed:
        study.run_study(base, cells, tmp_path, steps=3)
    monkeypatch.undo()
    assert list(failed.value.failed) == ["k2_m2po_lr0.001_seed0"] and failed.value.signum is None
    assert (tmp_path / "cells" / "k0_grpo_lr0.001_seed0" / study.DONE).exists()  # went on
    table = (tmp_path / "study.md").read_text()
    assert "| 0 | grpo | 0.001 | 1 |" in table and "| 2 | m2po |" not in table
    assert "- failed: k2_m2po_lr0.001_seed0: training stopped: max_nonfinite_steps: 3" in table
    capsys.readouterr()
    assert study._exit_status(failed.value, tmp_path) == 2  # the user's: no traceback
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "m2po-study: k2_m2po_lr0.001_seed0: training stopped: max_nonfinite_steps: 3 "
        "consecutive steps had NaN loss"
    )
    assert err[1].startswith("m2po-study: 1 cell(s) failed; the finished cells are in")
    assert len(err) == 2

    ran = study.run_study(base, cells, tmp_path, steps=3)  # the failed cell again, alone
    assert [c.name for c in ran] == ["k2_m2po_lr0.001_seed0"]
    assert (tmp_path / "warmup" / study.WARMUP_PARAMS).exists()  # one warm-up, shared
    made = json.loads((tmp_path / "warmup" / "warmup.json").read_text())
    assert made["environment"]["devices"] == 8 and made["environment"]["backend"] == "cpu"
    m2po_dir = tmp_path / "cells" / "k2_m2po_lr0.001_seed0"
    recorded = json.loads((m2po_dir / "config.json").read_text())
    assert recorded["config"]["sft.max_steps"] == 0  # the cells start from it
    rows = [json.loads(line) for line in (m2po_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness/max"] for r in rows] == [0, 1, 2]
    done = json.loads((m2po_dir / study.DONE).read_text())
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert done["final"] == evals[-1] and done["best"] == max(evals)
    masked = [r["m2po/masked_fraction"] for r in rows]
    assert done["m2po/masked_fraction"] == pytest.approx(sum(masked) / len(masked))
    assert done["m2po/masked_grad_share"] is not None  # the study turns the gradient on
    table = (tmp_path / "study.md").read_text()
    assert "| 2 | m2po | 0.001 | 1 |" in table and "| 0 | grpo | 0.001 | 1 |" in table
    assert (tmp_path / "study_k2.png").exists()
    stamp = (m2po_dir / study.DONE).stat().st_mtime_ns

    more = study.grid([0, 2], ["grpo", "m2po", "stale_grpo"], [1e-3], [0])
    ran = study.run_study(base, more, tmp_path, steps=3)
    assert [c.name for c in ran] == ["k2_stale_grpo_lr0.001_seed0"]
    assert (m2po_dir / study.DONE).stat().st_mtime_ns == stamp
    table = (tmp_path / "study.md").read_text()
    assert "| 2 | stale_grpo | 0.001 | 1 |" in table
    verdict = [line for line in table.splitlines() if line.startswith("- lr 0.001, k = 2:")]
    assert len(verdict) == 1 and "; m2po " in verdict[0]
    last = table.strip().splitlines()[-1]
    assert last.startswith(
        "- lr 0.001: one seed cannot support a verdict on the claim (run --seeds=0,1,2); on this "
        "seed it reads: the claim is "
    )
    assert table.startswith("# m2po-study\n\nGrid (3 cells): staleness k = 0, 2; methods grpo, "
                            "m2po, stale_grpo (grpo at k = 0 only); learning rates 0.001; seeds 0.")  # fmt: skip
    assert "3 RL steps per cell from one shared warm-up; tau 0.04 for the M2PO methods" in table
    assert "\n\nColumns: k: the staleness bound" in table
    assert "environments differ" not in table

    made = tmp_path / "warmup" / "warmup.json"  # as if the warm-up had run on one device
    record = json.loads(made.read_text())
    record["environment"]["devices"] = 1
    made.write_text(json.dumps(record))
    note = study.report(tmp_path, more).strip().splitlines()[-1]
    assert note.startswith("- environments differ (not comparable bit for bit): warm-up: {")
    assert '"devices": 1' in note and "k0_grpo_lr0.001_seed0, k2_m2po_lr0.001_seed0" in note


def _stepped(workdir: Path) -> int:
    metrics = workdir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def test_sigterm_checkpoints_the_running_cells_and_the_study_resumes_them(tmp_path):
    names = ["k2_m2po_lr0.001_seed0", "k2_stale_grpo_lr0.001_seed0"]
    cmd = [
        Path(sys.executable).with_name("m2po-study"), "--config=arith:m2po,tiny",
        "--config.mesh.data=1", f"--out={tmp_path}", "--staleness=2",
        "--methods=m2po,stale_grpo", "--lrs=1e-3", "--seeds=0", "--steps=2000", "--parallel=2",
        "--devices_per_cell=1",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    child = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    t0 = time.monotonic()
    while min(_stepped(tmp_path / "cells" / n) for n in names) < 2 and child.poll() is None:
        assert time.monotonic() - t0 < 240, "the cells never stepped"
        time.sleep(0.2)
    child.send_signal(signal.SIGTERM)  # the study only: its cells are in their own groups
    out, err = child.communicate(timeout=120)
    assert child.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    last = err.decode().strip().splitlines()[-1]
    assert last.startswith("m2po-study: stopped by signal 15 (") and "Traceback" not in last
    stopped = {}
    for n in names:
        workdir = tmp_path / "cells" / n
        assert not (workdir / study.DONE).exists()
        step = _stepped(workdir)  # rows 0 .. step - 1, then the checkpoint of that step
        assert f"{n} at step {step}" in last
        assert (workdir / "checkpoints" / str(step)).is_dir()
        stopped[n] = step
    assert step < 2000
    # Each cell's process had its own device (a GPU host's CUDA_VISIBLE_DEVICES; the CPU
    # backend ignores it), the warm-up the first cell's; this process held none.
    pinned = [json.loads((tmp_path / "cells" / n / study.ENVIRONMENT).read_text()) for n in names]
    assert sorted(e["cuda_visible_devices"] for e in pinned) == ["0", "1"]
    made = json.loads((tmp_path / "warmup" / "warmup.json").read_text())["environment"]
    assert made["cuda_visible_devices"] == "0"

    base = arith.get_config("m2po,tiny").to_dict()
    base["mesh"]["data"] = 1
    cells = study.grid([2], ["m2po", "stale_grpo"], [1e-3], [0])
    end = max(stopped.values()) + 2
    assert [c.name for c in study.run_study(base, cells, tmp_path, steps=end)] == names
    for n in names:  # each resumed from its checkpoint: every step once
        rows = [json.loads(x) for x in (tmp_path / "cells" / n / "metrics.jsonl").open()]
        assert [r["step"] for r in rows] == list(range(end))


def test_the_verdict_rules_at_equality():
    """The protocol's boundaries: staleness hurts only when the stale mean is below the
    on-policy minimum; a rule rescues when its mean reaches that minimum (ties count)."""
    on = _runs(0.50, 0.60)  # on-policy minimum 0.50
    tie = {(0, "grpo", 1e-4): on, (8, "stale_grpo", 1e-4): _runs(0.40, 0.60)}  # mean 0.50
    assert study.verdicts(tie)[0].startswith("lr 0.0001, k = 8: staleness does not hurt")
    below = {**tie, (8, "stale_grpo", 1e-4): _runs(0.40, 0.59), (8, "m2po", 1e-4): _runs(0.5, 0.5)}
    lines = study.verdicts(below)
    assert lines[0] == (
        "lr 0.0001, k = 8: staleness hurts; m2po rescues (on-policy final >= 0.500)"
    )
    below[(8, "m2po", 1e-4)] = _runs(0.49, 0.50)
    assert "m2po does not rescue" in study.verdicts(below)[0]


def test_the_precision_grid_runs_m2po_at_staleness_zero_only_against_a_cheaper_rollout():
    cells = study.grid([0, 4], ["grpo", "stale_grpo", "m2po", "m2po_tis"], [3e-4], [0],
                       ["float32", "int8"])  # fmt: skip
    by_precision = {p: {(c.staleness, c.method) for c in cells if c.precision == p}
                    for p in ("float32", "int8")}  # fmt: skip
    both = {(0, "grpo"), (4, "stale_grpo"), (4, "m2po"), (4, "m2po_tis")}
    assert by_precision["float32"] == by_precision["int8"] == both | {(0, "m2po"), (0, "m2po_tis")}
    plain = study.grid([0, 4], ["grpo", "m2po"], [3e-4], [0])  # no cheaper rollout: as before
    assert {(c.staleness, c.method) for c in plain} == {(0, "grpo"), (4, "m2po")}
    names = {c.name for c in cells}
    assert "k0_m2po_lr0.0003_seed0_int8" in names and "k0_m2po_lr0.0003_seed0" in names
    with pytest.raises(ValueError, match="unknown precision 'fp4'; choose from float32, "):
        study.grid([0], ["grpo"], [1e-4], [0], ["fp4"])


def test_a_cells_precision_and_tis_reach_its_config():
    base = arith.get_config("m2po").to_dict()
    want = {"float32": ("", ""), "bfloat16": ("bfloat16", "bfloat16"),
            "int8": ("int8", "bfloat16"), "float8": ("float8_e4m3fn", "float8_e4m3fn")}  # fmt: skip
    for precision, dtypes in want.items():
        c = study.cell_config(
            base, study.Cell(4, "m2po_tis", 1e-4, 0, precision), tau=0.04, steps=5
        )
        assert (c.rollout.weight_dtype, c.rollout.kv_dtype) == dtypes
        assert c.actor.rollout_correction.is_threshold == 2.0 and c.actor.m2_threshold == 0.04
    c = study.cell_config(base, study.Cell(4, "m2po", 1e-4, 0), tau=0.04, steps=5)
    assert c.actor.rollout_correction.is_threshold is None  # plain M2PO: no truncation
    cells = study.grid([0, 4], ["grpo", "stale_grpo", "m2po", "m2po_tis"], [1e-4], [0],
                       list(study.PRECISIONS))  # fmt: skip
    study.check_cells(base, cells, tau=0.04, steps=5)  # every cell's config is valid


def test_the_mismatch_table_and_collapses(tmp_path):
    def summary(final, first, fresh_m2, seed):
        curve = [[0, first], [10, final]]
        return {"final": final, "best": max(final, first), "curve": curve, "seed": seed,
                "collapsed": final < study.COLLAPSE * first, "mismatch/fresh/m2": fresh_m2,
                "mismatch/fresh/abs_mean": fresh_m2 ** 0.5}  # fmt: skip

    cells = [study.Cell(0, "m2po", 1e-4, s, p) for p in ("float32", "int8") for s in (0, 1)]
    cells.append(study.Cell(0, "m2po", 1e-4, 2, "int8"))
    made = {
        ("float32", 0): summary(0.50, 0.40, 1e-12, 0),
        ("float32", 1): summary(0.52, 0.40, 3e-12, 1),
        ("int8", 0): summary(0.10, 0.40, 2e-3, 0),  # below half its first: collapsed
        ("int8", 1): summary(0.30, 0.40, 4e-3, 1),
    }
    for (p, seed), s in made.items():
        cell = study.Cell(0, "m2po", 1e-4, seed, p)
        (tmp_path / "cells" / cell.name).mkdir(parents=True)
        (tmp_path / "cells" / cell.name / study.DONE).write_text(json.dumps(s))
    failed = {cells[-1].name: loop.NonFiniteError("max_nonfinite_steps: 3")}
    counted = study.collapses(tmp_path, cells, failed)
    assert counted == {(0, "m2po", 1e-4, "float32"): 0, (0, "m2po", 1e-4, "int8"): 2}
    text = study.report(tmp_path, cells, failed, tau=0.04)
    rows = [
        line
        for line in text.splitlines()
        if line.startswith(("| 0 | m2po | float32 |", "| 0 | m2po | int8 |"))
    ]
    assert rows == [
        "| 0 | m2po | float32 | 0.0001 | 2 | 0.510 | 0 | 1.4e-06 | 2.0e-12 | - | - | - |",
        "| 0 | m2po | int8 | 0.0001 | 2 | 0.200 | 2 | 0.054 | 0.003 | - | - | - |",
    ]
    assert "| 0 | m2po (int8) | 0.0001 | 2 | 0.200 (0.100-0.300) |" in text  # the main table
    assert (tmp_path / "study_precision.png").exists()


def test_a_cells_mismatch_means_take_only_the_steps_with_such_tokens(tmp_path):
    """A run 2 steps stale has fresh tokens in its first step only: the fresh metrics'
    run mean is that step's, not diluted by the steps without any; the rest average all."""
    rows = [
        {"step": 0, "eval/accuracy": 0.4, "mismatch/fresh/tokens": 64, "mismatch/fresh/m2": 3e-4,
         "mismatch/stale/tokens": 0, "mismatch/stale/m2": 0.0, "m2po/masked_fraction": 0.0},
        {"step": 1, "mismatch/fresh/tokens": 0, "mismatch/fresh/m2": 0.0,
         "mismatch/stale/tokens": 64, "mismatch/stale/m2": 0.02, "m2po/masked_fraction": 0.1},
        {"step": 2, "eval/accuracy": 0.1, "mismatch/fresh/tokens": 0, "mismatch/fresh/m2": 0.0,
         "mismatch/stale/tokens": 64, "mismatch/stale/m2": 0.04, "m2po/masked_fraction": 0.2},
    ]  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in rows))
    got = study.summarize(metrics)
    assert got["mismatch/fresh/m2"] == 3e-4
    assert got["mismatch/stale/m2"] == pytest.approx(0.03)
    assert got["m2po/masked_fraction"] == pytest.approx(0.1)
    assert got["collapsed"] and (got["final"], got["best"]) == (0.1, 0.4)  # 0.1 < 0.5 x 0.4


def test_the_replay_methods_run_where_their_plain_methods_run_with_replay_on():
    """grpo_r3 at staleness 0 only, stale_grpo_r3 above it only, m2po_r3 as m2po; each is
    its plain method's config plus actor.router_replay=rollout, and the router table
    reads their agreement and load."""
    methods = ["grpo", "grpo_r3", "stale_grpo", "stale_grpo_r3", "m2po", "m2po_r3"]
    cells = study.grid([0, 4], methods, [3e-4], [0], ["bfloat16"])
    assert {(c.staleness, c.method) for c in cells} == {
        (0, "grpo"), (0, "grpo_r3"), (0, "m2po"), (0, "m2po_r3"),
        (4, "stale_grpo"), (4, "stale_grpo_r3"), (4, "m2po"), (4, "m2po_r3"),
    }  # fmt: skip
    base = arith.get_config("m2po,moe").to_dict()
    for plain in ("grpo", "stale_grpo", "m2po"):
        k = 0 if plain == "grpo" else 4
        a = study.cell_config(base, study.Cell(k, plain, 3e-4, 0), tau=0.04, steps=5)
        b = study.cell_config(base, study.Cell(k, f"{plain}_r3", 3e-4, 0), tau=0.04, steps=5)
        assert a.actor.router_replay == "off" and b.actor.router_replay == "rollout"
        b.actor.router_replay = "off"
        assert a.to_dict() == b.to_dict()
    study.check_cells(base, cells, tau=0.04, steps=5)
    runs = [{"final": 0.5, "moe/router_agreement": 0.97, "moe/expert_load_max": 1.8}]
    table = study.router_table({(0, "grpo_r3", 3e-4, "bfloat16"): runs})
    assert table.splitlines()[-1] == (
        "| 0 | grpo_r3 | bfloat16 | 0.0003 | 1 | 0.500 (0.500-0.500) | - | - | - | - "
        "| 0.9700 | 1.800 |"
    )
