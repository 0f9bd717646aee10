"""Short functions: none in `m2po_jax/` over `LIMIT` lines (its docstring not counted)
unless a `# Long on purpose:` comment right above it says why, and docs/design.md lists
exactly those (between its `long-functions` markers)."""

import ast
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
LIMIT = 80
REASON = "# Long on purpose:"


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the `def` to the end, less the docstring's."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            lines -= first.end_lineno - first.lineno + 1
    return lines


def _has_reason(lines: list[str], node) -> bool:
    """A comment block right above the def (or its decorators) that starts with REASON."""
    top = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 2
    block = []
    while top >= 0 and lines[top].strip().startswith("#"):
        block.append(lines[top].strip())
        top -= 1
    return any(line.startswith(REASON) for line in block)


def _long_in(path: pathlib.Path, root: pathlib.Path) -> dict[str, bool]:
    text = path.read_text()
    lines, found = text.splitlines(), {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                if body_lines(child) > LIMIT:
                    found[f"{path.relative_to(root.parent)}:{name}"] = _has_reason(lines, child)
                visit(child, f"{name}.")

    visit(ast.parse(text), "")
    return found


def long_functions(root: pathlib.Path) -> dict[str, bool]:
    """`path:qualified name` of every function over LIMIT lines -> whether it says why."""
    return {k: v for path in sorted(root.rglob("*.py")) for k, v in _long_in(path, root).items()}


def listed_in_design() -> set[str]:
    page = (REPO / "docs" / "design.md").read_text()
    section = re.search(r"<!-- long-functions -->(.*?)<!-- /long-functions -->", page, re.S)
    assert section, "docs/design.md: no <!-- long-functions --> ... <!-- /long-functions -->"
    return set(re.findall(r"`(m2po_jax/[^`]+)`", section.group(1)))


def test_every_long_function_says_why_and_is_listed():
    found = long_functions(REPO / "m2po_jax")
    unexplained = sorted(k for k, ok in found.items() if not ok)
    assert unexplained == [], f"over {LIMIT} lines with no '{REASON}' comment: {unexplained}"
    assert listed_in_design() == set(found)


def test_a_long_function_without_its_reason_is_caught(tmp_path):
    """The check itself, on a package of two long functions, one with its reason."""

    def body(n, indent="    "):
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    pkg = tmp_path / "m2po_jax"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        f'def short():\n    """Doc."""\n{body(LIMIT - 1)}\n\n'
        f'class C:\n    def long(self):\n        """Doc\n        two."""\n'
        f"{body(LIMIT, '        ')}\n\n"
        f"{REASON} one table.\n@staticmethod\ndef explained():\n{body(LIMIT)}"
    )
    assert long_functions(pkg) == {"m2po_jax/a.py:C.long": False, "m2po_jax/a.py:explained": True}
