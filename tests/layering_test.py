"""The package's layering: each role package imports only the packages below it.

Parses every module's imports (function-level ones included) and checks them against
`ALLOWED`, the table in docs/design.md. Also: no import cycle between modules, and no
module-level re-export outside a package face (`__init__.py`).
"""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "m2po_jax"

BELOW_ROLLOUT_AND_LEARNER = {"common", "algorithm", "models", "tasks", "parallel"}
ALLOWED = {
    "common": set(),
    "algorithm": {"common"},
    "models": {"common"},
    "tasks": {"common", "models"},
    "parallel": {"common", "models"},
    "learner": {"common", "algorithm", "models", "parallel"},
    "rollout": {"common", "models", "parallel", "tasks"},
    "config": BELOW_ROLLOUT_AND_LEARNER | {"learner", "rollout"},
    "run": {"common", "models", "parallel", "config", "configs"},
    "trainer": BELOW_ROLLOUT_AND_LEARNER | {"learner", "rollout", "config", "configs", "run"},
    "cli": BELOW_ROLLOUT_AND_LEARNER
    | {"learner", "rollout", "config", "configs", "run", "trainer"},
}


def modules():
    return sorted(p for p in PKG.rglob("*.py"))


def dotted(path: pathlib.Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path):
    """(line, imported m2po_jax module) for every import in the file, nested ones too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "m2po_jax":
                found += [(node.lineno, f"m2po_jax.{a.name}") for a in node.names]
            elif node.module.startswith("m2po_jax."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("m2po_jax.")]
    return found


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_imports(path: pathlib.Path) -> list[str]:
    own = package_of(dotted(path))
    if own is None or own not in ALLOWED:
        return []  # the top-level face and the presets
    bad = []
    for line, module in imports(path):
        target = package_of(module)
        if target != own and target not in ALLOWED[own]:
            bad.append(f"{path.relative_to(PKG.parent)}:{line}: {own} imports {module}")
    return bad


def test_every_module_is_in_a_role_package():
    loose = [p.name for p in PKG.glob("*.py") if p.name != "__init__.py"]
    assert loose == []
    assert {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()} == set(ALLOWED)


def test_every_package_ships():
    """A plain (non-editable) install copies only the packages pyproject.toml lists."""
    import tomllib

    listed = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {dotted(p.parent / "__init__.py") for p in PKG.rglob("__init__.py")}
    assert set(listed["packages"]) == found | {"m2po_jax.configs"}


def test_imports_only_point_down():
    bad = [line for path in modules() for line in upward_imports(path)]
    assert bad == [], "\n".join(bad)


def test_an_upward_import_is_caught(tmp_path):
    """The check itself: a learner module importing the trainer is reported."""
    fake = PKG / "learner" / "upward_example.py"
    text = "def f():\n    from m2po_jax.trainer import metrics\n"
    try:
        fake.write_text(text)
        assert upward_imports(fake) == [
            "m2po_jax/learner/upward_example.py:2: learner imports m2po_jax.trainer"
        ]
    finally:
        fake.unlink()


BENCHMARKS = PKG.parent / "benchmarks"


def _module_files() -> dict[str, pathlib.Path]:
    """Dotted name -> file, of the package's modules and the benchmarks (which import each
    other by bare name: `import fixtures`)."""
    found = {dotted(p): p for p in modules()}
    found |= {p.stem: p for p in sorted(BENCHMARKS.glob("*.py"))}
    return found


def _graph(files: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """module -> modules it imports anywhere in the file: at module level and inside
    functions (a function-level import hides a cycle from Python, not from a reader)."""
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                base = node.module
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    deps.add(sub if sub in files else base)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def import_cycles(files: dict[str, pathlib.Path]) -> list[str]:
    """Every import cycle among `files` ("a -> b -> a"); a package face importing its own
    package's modules is not one."""
    graph = _graph(files)
    faces = {m for m, path in files.items() if path.name == "__init__.py"}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if dep in faces:
                continue  # a face imports its own package's modules: not a cycle of homes
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state and node not in faces:
            visit(node, [node])
    return cycles


def test_no_import_cycle():
    cycles = import_cycles(_module_files())
    assert cycles == [], "\n".join(cycles)


def test_a_cycle_through_a_function_level_import_is_caught(tmp_path):
    """The check itself: b imports a only inside a function; still a cycle."""
    (tmp_path / "a.py").write_text("from m2po_jax.x import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from m2po_jax.x import a\n")
    (tmp_path / "c.py").write_text("def f():\n    import m2po_jax.x.a\n")
    files = {f"m2po_jax.x.{n}": tmp_path / f"{n}.py" for n in "abc"}
    assert import_cycles(files) == ["m2po_jax.x.a -> m2po_jax.x.b -> m2po_jax.x.a"]
    del files["m2po_jax.x.b"]
    assert import_cycles(files) == []


def _defined(path: pathlib.Path) -> set[str]:
    """Names a module defines at module level (functions, classes, assignments)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _file_of(module: str) -> pathlib.Path | None:
    base = PKG.parent.joinpath(*module.split("."))
    if (base / "__init__.py").exists():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").exists() else None


def borrowed_names(path: pathlib.Path) -> list[str]:
    """`from m2po_jax.<module> import name` where the module only imports that name: a use
    of a re-export. Package faces (`__init__.py`) may be imported from."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
            continue
        source = _file_of(node.module) if node.module.startswith("m2po_jax.") else None
        if source is None or source.name == "__init__.py":
            continue
        defined = _defined(source)
        for alias in node.names:
            if alias.name not in defined and _file_of(f"{node.module}.{alias.name}") is None:
                bad.append(f"{path.name}:{node.lineno}: {node.module} does not define {alias.name}")
    return bad


REPO = PKG.parent
CODE = sorted(
    p for d in ("m2po_jax", "tests", "benchmarks", "configs") for p in (REPO / d).rglob("*.py")
)


def test_every_name_is_imported_from_its_home():
    bad = [line for path in CODE for line in borrowed_names(path)]
    assert bad == [], "\n".join(bad)


def test_a_borrowed_name_is_caught(tmp_path):
    # train_step imports make_optimizer from optim: its one home.
    fake = tmp_path / "user.py"
    fake.write_text("from m2po_jax.learner.train_step import make_optimizer\n")
    assert borrowed_names(fake) == [
        "user.py:1: m2po_jax.learner.train_step does not define make_optimizer"
    ]


@pytest.mark.parametrize("path", [p for p in modules() if p.name != "__init__.py"], ids=dotted)
def test_no_module_level_re_export(path):
    """Every name a module imports is used there: no `# noqa: F401` homes."""
    text = path.read_text()
    assert "noqa: F401" not in text


def test_every_old_module_path_is_the_new_module_with_a_warning():
    import importlib
    import sys
    import warnings

    import m2po_jax

    assert len(m2po_jax.MOVED) == 62
    for old, new in sorted(m2po_jax.MOVED.items()):
        sys.modules.pop(f"m2po_jax.{old}", None)
        with pytest.warns(DeprecationWarning, match=f"m2po_jax.{old} moved to m2po_jax.{new}"):
            module = importlib.import_module(f"m2po_jax.{old}")
        assert module is importlib.import_module(f"m2po_jax.{new}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the public paths: no warning
        from m2po_jax import config, hf, rollout, trainer  # noqa: F401
        from m2po_jax.models import hf as models_hf

        assert hf is models_hf
        assert trainer.Trainer.__module__ == "m2po_jax.trainer.loop"
        assert config.from_configdict.__module__ == "m2po_jax.config.validate"
        assert rollout.StaleQueue.__module__ == "m2po_jax.rollout.batches"


def test_the_masking_function_loads_no_flax_orbax_or_transformers():
    import subprocess
    import sys

    code = (
        "import sys, m2po_jax; from m2po_jax import m2po_mask; "
        "import m2po_jax.algorithm.masking; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'flax', 'orbax', 'transformers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
