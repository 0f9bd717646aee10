"""benchmarks/mutants.py's machinery: the list is honest (every snippet occurs exactly once in
its module), applying a mutant replaces exactly its snippet, broken mutants are refused by
name, and missing test files are an error. Cheap: no JAX, no mutant is run."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("mutants", ROOT / "benchmarks" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutants"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


mutants = _load()
MUTANTS = mutants.MUTANTS
IDS = [m.id for m in MUTANTS]


def test_list_prints_every_mutant_and_runs_nothing():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "mutants.py"), "--list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BROKEN" not in out.stdout
    for m in MUTANTS:
        assert f"{m.id}  [{m.module}]" in out.stdout
    assert out.stdout.strip().endswith(f"{len(MUTANTS)} mutants")


@pytest.mark.parametrize("mutant", MUTANTS, ids=IDS)
def test_every_snippet_occurs_exactly_once_in_its_module(mutant):
    """Fails when the code changes under a mutant: update its snippet in the list."""
    text = (ROOT / mutant.module).read_text(encoding="utf-8")
    assert text.count(mutant.original) == 1, (
        f"{mutant.id}: snippet occurs {text.count(mutant.original)} times in {mutant.module}"
    )
    assert mutant.original != mutant.mutated and mutant.description and mutant.tests
    assert all(t.file.startswith("tests/") and t.file.endswith("_test.py") for t in mutant.tests)


def test_ids_are_unique_and_the_list_covers_the_modules():
    assert len(set(IDS)) == len(IDS)
    modules = {m.module for m in MUTANTS}
    for module in (
        "m2po_jax/learner/train_step.py",
        "m2po_jax/learner/optim.py",
        "m2po_jax/algorithm/masking.py",
    ):
        assert module in modules
    assert len(MUTANTS) >= 20


@pytest.mark.parametrize("mutant", MUTANTS, ids=IDS)
def test_apply_replaces_exactly_the_snippet_in_the_copy(mutant, tmp_path):
    source = (ROOT / mutant.module).read_text(encoding="utf-8")
    target = tmp_path / mutant.module
    target.parent.mkdir(parents=True)
    target.write_text(source, encoding="utf-8")
    mutants.apply(mutant, tmp_path)
    at = source.index(mutant.original)
    expected = source[:at] + mutant.mutated + source[at + len(mutant.original) :]
    assert target.read_text(encoding="utf-8") == expected
    assert (ROOT / mutant.module).read_text(encoding="utf-8") == source  # the repo is untouched
    compile(expected, str(target), "exec")  # the mutant is still valid Python


@pytest.mark.parametrize(
    "original, problem", [("z = 3", "does not occur"), ("y = 1", "occurs 2 times")]
)
def test_a_snippet_not_occurring_exactly_once_is_refused_by_name(tmp_path, original, problem):
    text = "y = 1\nx = 0\ny = 1\n"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(text)
    mutant = mutants.Mutant(
        "fake-mutant", "pkg/mod.py", original, "y = 2", (mutants.T("tests/x_test.py"),), "fake"
    )
    with pytest.raises(mutants.MutantError, match=rf"mutant fake-mutant: .*{problem} in pkg/mod"):
        mutants.apply(mutant, tmp_path)
    assert (tmp_path / "pkg" / "mod.py").read_text() == text  # nothing written


def test_a_run_with_a_broken_mutant_refuses_before_running_anything(monkeypatch, capsys):
    broken = mutants.Mutant(
        "broken-one",
        "m2po_jax/learner/optim.py",
        "this snippet is nowhere in optim.py",
        "x",
        (mutants.T("tests/learner/optim_test.py"),),
        "broken",
    )
    monkeypatch.setattr(mutants, "MUTANTS", (*MUTANTS, broken))
    ran = []
    monkeypatch.setattr(mutants, "clean_check", lambda *a: ran.append(a) or {})
    assert mutants.main(["--ids", "broken-one"]) == 2
    assert "refusing to run: mutant broken-one: its original snippet does not occur" in (
        capsys.readouterr().err
    )
    assert not ran
    assert mutants.main(["--list", "--ids", "broken-one"]) == 2
    assert "BROKEN: mutant broken-one" in capsys.readouterr().out


def test_unknown_modules_and_ids_are_named():
    with pytest.raises(mutants.MutantError, match=r"no mutants for \['m2po_jax/nothing.py'\]"):
        mutants.select(MUTANTS, ["m2po_jax/nothing.py"], None)
    with pytest.raises(mutants.MutantError, match=r"unknown mutants \['nope'\]"):
        mutants.select(MUTANTS, None, ["nope"])
    chosen = mutants.select(MUTANTS, ["m2po_jax/learner/optim.py"], None)
    assert chosen and all(m.module == "m2po_jax/learner/optim.py" for m in chosen)


def test_missing_test_files_are_an_error_not_a_crash(tmp_path):
    mutant = mutants.Mutant(
        "no-tests",
        MUTANTS[0].module,
        MUTANTS[0].original,
        MUTANTS[0].mutated,
        (mutants.T("tests/no_such_file_test.py", "x"), mutants.T("tests/nor_this_test.py")),
        "tests not written yet",
    )
    outcome = mutants.run_mutant(mutant, timeout=5, workdir=tmp_path)
    assert outcome.status == "error"
    assert outcome.detail == (
        "no such test file: tests/no_such_file_test.py, tests/nor_this_test.py"
    )
    assert not list(tmp_path.iterdir())  # nothing copied, nothing run


def test_copy_leaves_out_git_venv_runs_and_caches(tmp_path):
    src = tmp_path / "src"
    for name in (".git/HEAD", ".venv/bin/python", "runs/x/metrics.jsonl", "a/__pycache__/m.pyc"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text("x")
    (src / "workdir_old").mkdir()
    (src / "workdir_old" / "config.json").write_text("{}")
    (src / "m2po_jax" / "run").mkdir(parents=True)
    (src / "m2po_jax" / "mod.py").write_text("x = 1\n")
    (src / "m2po_jax" / "run" / "workdir.py").write_text("x = 2\n")  # code, not a run
    dst = mutants.copy_repo(src, tmp_path / "dst")
    files = sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file())
    assert files == ["m2po_jax/mod.py", "m2po_jax/run/workdir.py"]


def test_device_flag_follows_the_conftest(tmp_path):
    assert not mutants.needs_device_flag(ROOT)  # tests/conftest.py sets the device count
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text("import os\n")
    env = mutants.child_env(tmp_path)
    assert env["PYTHONPATH"] == str(tmp_path)
    assert mutants.DEVICE_FLAG in env["XLA_FLAGS"]


@pytest.mark.parametrize(
    "results, code",
    [(["caught", "caught"], 0), (["caught", "survived"], 1), (["caught", "error"], 0)],
)
def test_exit_status_and_score(monkeypatch, capsys, results, code):
    chosen = MUTANTS[:2]
    outcome = dict(zip([m.id for m in chosen], results, strict=True))
    monkeypatch.setattr(mutants, "clean_check", lambda *a: {})
    monkeypatch.setattr(
        mutants,
        "run_mutant",
        lambda m, timeout, workdir: mutants.Outcome(outcome[m.id], 1.5, "tests/a_test.py::t"),
    )
    assert mutants.main(["--ids", ",".join(m.id for m in chosen)]) == code
    out = capsys.readouterr().out
    assert f"score: {results.count('caught')} / 2 caught" in out
    ids = {m.id for m in chosen}
    rows = [line.split() for line in out.splitlines()]
    table = {r[0]: r[2:4] for r in rows if r and r[0] in ids}  # the table's rows
    assert table == {m.id: [r, "1.5"] for m, r in zip(chosen, results, strict=True)}
