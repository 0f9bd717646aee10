"""`m2po-study`: the grid, its table, and a resumed grid that skips the finished cells."""

import json

import pytest

from m2po_jax.configs import arith
from m2po_jax.trainer import study


def test_the_grid_runs_grpo_on_policy_and_the_rest_stale():
    cells = study.grid([0, 16], ["grpo", "m2po", "paper_final"], [1e-4, 3e-4], [0, 1])
    assert len(cells) == 2 * 2 * (1 + 2)
    assert {(c.staleness, c.method) for c in cells} == {
        (0, "grpo"), (16, "m2po"), (16, "paper_final")}  # fmt: skip
    with pytest.raises(ValueError, match="unknown method 'ppo'"):
        study.grid([0], ["ppo"], [1e-4], [0])
    with pytest.raises(ValueError, match="no cell"):
        study.grid([0], ["m2po"], [1e-4], [0])


def test_a_study_writes_its_table_and_a_resumed_grid_skips_finished_cells(tmp_path):
    base = arith.get_config("m2po,tiny").to_dict()
    base["mesh"]["data"] = 1  # one of the suite's 8 CPU devices
    cells = study.grid([0, 2], ["grpo", "m2po"], [1e-3], [0])
    ran = study.run_study(base, cells, tmp_path, steps=3)
    assert [c.name for c in ran] == ["k0_grpo_lr0.001_seed0", "k2_m2po_lr0.001_seed0"]
    assert (tmp_path / "warmup" / study.WARMUP_PARAMS).exists()  # one warm-up, shared
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
    assert "lr 0.001, k = 2: staleness" in table and "m2po" in table.splitlines()[-1]
