"""The Colab notebooks run end to end: every code cell, in order, in a fresh process.

`M2PO_COLAB_QUICK=1` makes the training cells use the `tiny` preset (the study: a 3-cell grid); everything else runs as a
Colab user would run it (the install cell is a no-op because the package is importable).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "colab").glob("*.ipynb"))


def code_of(notebook: Path) -> str:
    nb = json.loads(notebook.read_text())
    assert nb["nbformat"] == 4
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert cells, f"{notebook.name}: no code cells"
    for cell in cells:
        assert not cell["outputs"], f"{notebook.name}: commit notebooks without outputs"
    return "\n\n".join("".join(cell["source"]) for cell in cells)


def test_there_is_a_notebook():
    assert [p.name for p in NOTEBOOKS] == ["m2po_quickstart.ipynb", "stale_study.ipynb"]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_end_to_end(notebook, tmp_path):
    env = dict(
        os.environ,
        M2PO_COLAB_QUICK="1",
        M2PO_COLAB_WORKDIR=str(tmp_path),
        MPLBACKEND="Agg",
        XLA_FLAGS=os.environ["M2PO_TEST_XLA_FLAGS"],  # one CPU device, as on Colab's CPU
    )
    script = tmp_path / "notebook.py"
    script.write_text(code_of(notebook))
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    EXPECT[notebook.stem](proc.stdout, tmp_path)


def _quickstart(out, tmp_path):
    assert "max |logit difference| vs transformers:" in out
    assert "max |recorded - recomputed| log-prob:" in out
    assert "held-out accuracy by step:" in out
    assert "max |logit difference| export vs trained params:" in out
    assert (tmp_path / "real_m2po" / "hf" / "step_2" / "config.json").exists()
    assert (tmp_path / "arith_m2po" / "metrics.jsonl").exists()


def _stale_study(out, tmp_path):
    assert "m2po-study table:" in out and "| 2 | m2po | 0.001 | 1 |" in out
    assert "lr 0.001, k = 2: staleness" in out
    assert (tmp_path / "stale_study" / "study_k2.png").exists()
    assert len(list((tmp_path / "stale_study" / "cells").glob("*/done.json"))) == 3


EXPECT = {"m2po_quickstart": _quickstart, "stale_study": _stale_study}
