"""The manual builds in strict mode, every page is reachable from the front page, the API
pages carry the docstrings, and the Configuration page lists every declared config field.

One `mkdocs build --strict` in a subprocess (about 5 s on 2 cores) for the whole module:
any warning (a broken link or anchor, a page outside the nav, a reference mkdocstrings
cannot resolve) fails it.
"""

import ast
import html
import html.parser
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        "mkdocs build --strict failed (the docs extra: pip install -e '.[docs]'):\n"
        + proc.stdout
        + proc.stderr
    )
    assert "WARNING" not in proc.stderr, proc.stderr
    return out


class _Text(html.parser.HTMLParser):
    """The visible text of a page's article, whitespace collapsed."""

    def __init__(self):
        super().__init__()
        self.parts, self.skip = [], 0

    def handle_starttag(self, tag, attrs):
        self.skip += tag in ("script", "style")

    def handle_endtag(self, tag):
        self.skip -= tag in ("script", "style")

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def page_text(page: Path) -> str:
    parser = _Text()
    parser.feed(page.read_text())
    return " ".join("".join(parser.parts).split())


def built(site: Path, source: str) -> Path:
    """The HTML file mkdocs writes for docs/<source> (directory URLs)."""
    stem = source.removesuffix(".md")
    return site / ("index.html" if stem == "index" else f"{stem.removesuffix('/index')}/index.html")


def nav_pages() -> list[str]:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def walk(item):
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for value in item.values():
                yield from walk(value)
        else:
            for value in item:
                yield from walk(value)

    return list(walk(nav))


def links(text: str) -> set[str]:
    """Targets of Markdown links and images, without anchors."""
    return {m.split("#")[0] for m in re.findall(r"\]\(([^)\s]+)\)", text)} - {""}


def test_every_docs_page_is_in_the_nav():
    pages = set(nav_pages())
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert on_disk == pages, (on_disk - pages, pages - on_disk)


def test_every_nav_page_is_linked_from_the_front_page():
    from_readme = {
        t.removeprefix("docs/") for t in links(README.read_text()) if t.startswith("docs/")
    }
    from_index = links((DOCS / "index.md").read_text())
    missing = [p for p in nav_pages() if p not in from_readme | from_index]
    assert not missing, f"pages reachable from neither README.md nor docs/index.md: {missing}"
    assert "index.md" in from_readme


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) < 300, len(lines)


def test_the_site_has_every_page(site):
    for page in nav_pages():
        assert built(site, page).is_file(), page


def _summary(module: str, name: str) -> str:
    """The first line of `name`'s docstring in `module`, read from the source."""
    path = ROOT / (module.replace(".", "/") + ".py")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
            return ast.get_docstring(node).splitlines()[0].replace("`", "")
    raise AssertionError(f"{name} is not defined in {module}")


@pytest.mark.parametrize(
    "page, module, name",
    [
        ("api/algorithm.md", "m2po_jax.algorithm.masking", "m2po_mask"),
        ("api/algorithm.md", "m2po_jax.algorithm.masking", "m2po_mask_with_stats"),
        ("api/algorithm.md", "m2po_jax.algorithm.losses", "policy_loss"),
        ("api/algorithm.md", "m2po_jax.algorithm.advantages", "grpo_token_advantages"),
        ("api/algorithm.md", "m2po_jax.algorithm.advantages", "normalize_rewards"),
        ("api/models.md", "m2po_jax.models.hf", "load_pretrained"),
        ("api/models.md", "m2po_jax.models.hf", "save_pretrained"),
        ("api/tasks.md", "m2po_jax.tasks.environments", "Environment"),
        ("api/tasks.md", "m2po_jax.tasks.environments", "ToolEnv"),
        ("api/tasks.md", "m2po_jax.tasks.environments", "StepResult"),
        ("api/tasks.md", "m2po_jax.tasks.tools", "tool"),
    ],
)
def test_api_pages_carry_the_docstrings(site, page, module, name):
    source = built(site, page)
    assert f'id="{module}.{name}"' in source.read_text(), f"no entry for {module}.{name}"
    summary = " ".join(_summary(module, name).split())
    assert summary in html.unescape(page_text(source)), (name, summary)


def _default_fields() -> set[str]:
    """Every declared field of the config schema (not the sections)."""
    from m2po_jax.common import config_schema, knobs

    return {path for path, _ in knobs.knobs(config_schema.Config)}


def test_the_configuration_page_lists_every_field(site):
    page = built(site, "configuration.md").read_text()
    fields = _default_fields()
    assert {"rollout.batch_size", "agent.max_turns", "model.lora.rank"} <= fields
    assert len(fields) > 100
    missing = sorted(f for f in fields if f"<code>{f}</code>" not in page)
    assert not missing, f"declared fields missing from the page: {missing}"
    # with its default and comment, on the field's own row
    row = re.search(r"<td><code>rollout\.batch_size</code></td>.*?</tr>", page, flags=re.S)[0]
    assert "<code>64</code>" in row and "prompts per step" in row and "[1, inf)" in row
    row = re.search(r"<td><code>actor\.m2po_method</code></td>.*?</tr>", page, flags=re.S)[0]
    assert "<code>sort</code> | <code>bisect</code>" in row, row
    # and the presets of every preset file
    for preset in ("arith:paper_final", "gsm8k:qwen3-8b", "math:qwen3-4b-base"):
        assert f"<code>{preset}</code>" in page, preset
