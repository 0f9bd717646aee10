"""MkDocs hook: the Configuration page's tables, generated from the declarations.

`<!-- m2po:config-fields -->` becomes one table per config section (field, type, default,
allowed, doc), read from the dataclasses of `m2po_jax/common/config_schema.py`, where each
field is declared once (`knob(default, doc, low=..., high=..., choices=...)`).
`<!-- m2po:presets -->` becomes the presets of `configs/arith.py`, `configs/gsm8k.py` and
`configs/math.py`: each file's docstring, the fields its base config changes, and per
preset its docstring and the fields it sets. The preset files are read as text: this hook
parses them with `ast` (the `c.section.field = value` assignments of each preset function)
and `tokenize` (the comment lines right above each assignment and the comments on its own
lines); an assignment of a shape it does not know stops the build, so the page can never
silently miss a field.
"""

from __future__ import annotations

import ast
import dataclasses
import html
import inspect
import io
import json
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's schema, whatever is installed

from m2po_jax.common import config_schema, knobs  # noqa: E402

CONFIGS = ROOT / "configs"
FIELDS_MARKER = "<!-- m2po:config-fields -->"
PRESETS_MARKER = "<!-- m2po:presets -->"
PRESET_FILES = ("arith.py", "gsm8k.py", "math.py")


@dataclasses.dataclass
class Field:
    """One `c.<path> = value` of a config function."""

    path: str  # dotted, without the leading `c.`
    value: str  # the value's source text; "None" for an unset placeholder
    comment: str
    is_section: bool = False


# --------------------------------------------------------------------------- parsing


def _comments(source: str) -> tuple[dict[int, str], set[int]]:
    """Comment text by line, and the lines that hold nothing but a comment."""
    by_line: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    return by_line, set(by_line) - code_lines


def _comment_of(node: ast.stmt, comments: dict[int, str], alone: set[int]) -> str:
    """The comment block right above `node` (no blank line between) and its inline ones."""
    above = []
    line = node.lineno - 1
    while line in alone:
        above.append(comments[line])
        line -= 1
    inline = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
    return " ".join(list(reversed(above)) + inline)


def _path(node: ast.expr, root: str) -> str | None:
    """`c.a.b` -> "a.b" (None for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == root and parts:
        return ".".join(reversed(parts))
    return None


def _call_name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        return ast.unparse(node.func)
    return ""


def _assignments(fn: ast.FunctionDef, source: str, root: str = "c") -> list[Field]:
    """Every `root.<path> = value` in `fn`'s body (in order), with its comment.

    Tuple targets (`c.a, c.b = 1, 2`) give one field each; a call on its own line
    (`variants.configure(c.actor, "paper")`) is kept as a field whose path is "" and whose
    value is the call. Anything else that assigns to `root` stops the build.
    """
    comments, alone = _comments(source)
    fields = []
    statements = [n for n in ast.walk(fn) if isinstance(n, ast.stmt) and n is not fn]
    for node in sorted(statements, key=lambda n: n.lineno):
        comment = _comment_of(node, comments, alone)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            if any(_path(a, root) is not None for a in node.value.args):
                fields.append(Field("", ast.get_source_segment(source, node.value), comment))
            continue
        if not isinstance(node, ast.Assign):
            continue
        target, value = node.targets[0], node.value
        if len(node.targets) != 1:
            raise ValueError(f"line {node.lineno}: chained assignment")
        pairs = [(target, value)]
        if isinstance(target, ast.Tuple):
            if not isinstance(value, ast.Tuple) or len(value.elts) != len(target.elts):
                raise ValueError(f"line {node.lineno}: unpacking needs a tuple of values")
            pairs = list(zip(target.elts, value.elts, strict=True))
        for tgt, val in pairs:
            path = _path(tgt, root)
            if path is None:
                if isinstance(tgt, ast.Attribute):
                    raise ValueError(f"line {node.lineno}: cannot read {ast.unparse(tgt)}")
                continue
            call = _call_name(val)
            if call.endswith("ConfigDict"):
                fields.append(Field(path, "", comment, is_section=True))
            elif call == "placeholder":
                fields.append(Field(path, "None", comment))
            else:
                fields.append(Field(path, ast.get_source_segment(source, val), comment))
    return fields


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise ValueError(f"no function {name}")


def _docstring_as_written(tree: ast.Module, source: str) -> str:
    """The module docstring as the file spells it: a backslash that ends a line (a shell
    continuation inside a command) is kept, and a doubled backslash is shown as one."""
    node = tree.body[0]
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
        return ""
    text = ast.get_source_segment(source, node.value)
    text = re.sub(r'^[rRuU]?("""|\'\'\')', "", text)[:-3]
    return inspect.cleandoc(text.replace("\\\\", "\\"))


def presets(path: Path) -> tuple[str, list[Field], list[tuple[str, str, list[Field]]]]:
    """A preset file's docstring, its `_base` fields (none for arith.py) and its presets:
    (name, docstring, fields) for every entry of its `PRESETS` dict, in order."""
    source = path.read_text()
    tree = ast.parse(source)
    names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    base = _assignments(_function(tree, "_base"), source) if "_base" in names else []
    table = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "PRESETS":
            table = node.value
    if not isinstance(table, ast.Dict):
        raise ValueError(f"{path}: no PRESETS dict")
    out = []
    for key, value in zip(table.keys, table.values, strict=True):
        fn = _function(tree, value.id)
        out.append((key.value, ast.get_docstring(fn) or "", _assignments(fn, source)))
    return _docstring_as_written(tree, source), base, out


# --------------------------------------------------------------------------- rendering


def cell(text: str) -> str:
    """Text for one Markdown table cell: code spans kept, HTML and pipes escaped."""
    out = []
    for i, part in enumerate(re.split(r"(`[^`]*`)", text)):
        if i % 2:  # a code span
            out.append(part.replace("|", "&#124;"))
            continue
        part = html.escape(part, quote=False).replace("|", "\\|")
        out.append(re.sub(r"([*_\[\]])", r"\\\1", part))
    return "".join(out)


def _code(value: str) -> str:
    value = " ".join(value.split())
    return f"`{value}`" if value else ""


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def _literal(value) -> str:
    """A default as Python spells it, strings in double quotes: `"arith"`, `0.2`, `None`."""
    return f"`{json.dumps(value)}`" if isinstance(value, str) else f"`{value!r}`"


def render_fields(schema: type = config_schema.Config) -> str:
    """One table per section of `schema`: `##` for top-level sections, `###` for nested
    ones; a row per field: its path, type, default, what it allows and its doc."""
    sections: dict[str, tuple[str, list[tuple[str, ...]]]] = {"": ("", [])}
    for path, f in knobs.fields(schema):
        if "section" in f.metadata:
            sections[path] = (f.metadata["section"], [])
            continue
        spec = f.metadata["knob"]
        # each choice its own code span: a pipe inside one would be read as a cell border
        allowed = " | ".join(f"`{part}`" for part in spec.allowed().split(" | ") if part)
        row = (f"`{path}`", f"`{f.type}`", _literal(f.default), cell(allowed), cell(spec.doc))
        sections[path.rpartition(".")[0]][1].append(row)
    count = sum(len(rows) for _, rows in sections.values())
    lines = [f"{count} fields in {len(sections)} sections.", ""]
    for name, (doc, rows) in sections.items():
        depth = "##" if "." not in name else "###"
        anchor = name.replace(".", "-") or "top-level"
        lines += [f"{depth} {name or 'Top level'} {{#{anchor}}}", ""]
        if doc:
            lines += [cell(doc), ""]
        if rows:
            lines += _table(rows, ("field", "type", "default", "allowed", "doc"))
    return "\n".join(lines)


def render_presets(paths: list[Path]) -> str:
    lines = []
    for path in paths:
        doc, base, entries = presets(path)
        name = path.stem
        lines += [f"### `configs/{path.name}` {{#presets-{name}}}", ""]
        lines += ["```text", doc, "```", ""]
        if base:
            lines += [f"The base of every `{name}` preset, over `configs/default.py`:", ""]
            rows = [(f"`{f.path}`", _code(f.value), cell(f.comment)) for f in base]
            lines += _table(rows, ("field", "value", "comment"))
        rows = []
        for preset, pdoc, fields in entries:
            sets = "<br>".join(
                cell(f"`{f.path} = {' '.join(f.value.split())}`" if f.path else f"`{f.value}`")
                + (f" ({cell(f.comment)})" if f.comment else "")
                for f in fields
            )
            rows.append((f"`{name}:{preset}`", cell(" ".join(pdoc.split())), sets))
        lines += _table(rows, ("preset", "what it is", "what it sets"))
    return "\n".join(lines)


# --------------------------------------------------------------------------- MkDocs


def on_page_markdown(markdown: str, page, config, files) -> str:
    if FIELDS_MARKER in markdown:
        markdown = markdown.replace(FIELDS_MARKER, render_fields())
    if PRESETS_MARKER in markdown:
        paths = [CONFIGS / name for name in PRESET_FILES]
        markdown = markdown.replace(PRESETS_MARKER, render_presets(paths))
    return markdown
