"""What keeps README.md and the docs site honest without running them: every Python block parses
and runs unless it says why not, every example is listed, the README stays short, and no user page
names an internal issue. (The blocks run in tests/integration/test_docs_snippets.py; `make check`
builds the site with `mkdocs build --strict` and lints the markdown.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.docs_snippets import ROOT, pages, snippets

README_MAX_LINES = 200
INTERNAL_ISSUE = re.compile(r"\b(issues?|stop|session) \d+\b", re.IGNORECASE)
USER_PAGES = pages()


def test_the_pages_have_python_blocks_to_run() -> None:
    blocks = [s for page in USER_PAGES for s in snippets(page)]
    assert any(s.skip is None and s.page.name == "README.md" for s in blocks), "README's quick start must run"
    assert sum(s.skip is None for s in blocks) >= len(blocks) // 2, "most blocks run; a skip is the exception"


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_parses_and_a_skipped_one_says_why(page: Path) -> None:
    for snippet in snippets(page):
        try:
            ast.parse(snippet.code, filename=snippet.where)
        except SyntaxError as error:
            pytest.fail(f"{snippet.where}: {error.msg} (line {error.lineno} of the block)")
        if snippet.skip is not None:
            assert len(snippet.skip) >= 10, (
                f"{snippet.where}: <!-- skip: ... --> needs a reason a reader understands"
            )


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_user_page_names_an_internal_issue(page: Path) -> None:
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        assert not INTERNAL_ISSUE.search(line), f"{page.relative_to(ROOT)}:{number}: {line.strip()}"


FROM_PYPI = re.compile(r"pip install\s+(?:-\S+\s+)*['\"]?journeyman(?:\[|['\"\s]|$)", re.MULTILINE)
"""``pip install journeyman...``: journeyman is not on PyPI, so an install line names a clone."""


@pytest.mark.parametrize(
    "page",
    [*USER_PAGES, *sorted((ROOT / "examples").glob("*/README.md"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_page_installs_journeyman_from_pypi(page: Path) -> None:
    found = FROM_PYPI.findall(page.read_text(encoding="utf-8"))
    assert not found, (
        f'{page.relative_to(ROOT)} installs journeyman from PyPI: write pip install "./journeyman[...]"'
    )


def test_the_readme_stays_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines: move detail into docs/ (at most {README_MAX_LINES})"
    )


@pytest.mark.parametrize("listing", ["README.md", "docs/examples.md", "examples/README.md"])
def test_every_example_is_listed(listing: str) -> None:
    text = (ROOT / listing).read_text(encoding="utf-8")
    folders = sorted(
        p.name for p in (ROOT / "examples").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
    )
    missing = [name for name in folders if f"{name}/" not in text and f"{name}`" not in text]
    assert not missing, f"{listing} does not list examples/{', examples/'.join(missing)}"


def test_a_skip_marker_is_found_only_right_above_its_fence(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- skip: needs a CUDA GPU -->\n```python\nimport torch\n```\n\ntext\n\n"
        "```python\nx = 1\n```\n\n```bash\nmake demo\n```\n",
        encoding="utf-8",
    )
    first, second = snippets(page)
    assert (first.skip, first.line, first.code) == ("needs a CUDA GPU", 2, "import torch\n")
    assert (second.skip, second.line, second.code) == (None, 8, "x = 1\n")


@pytest.mark.parametrize("page", ["README.md", "CHANGELOG.md", "CONTRIBUTING.md", "examples/README.md"])
def test_the_links_of_pages_outside_the_site_lead_somewhere(page: str) -> None:
    """mkdocs checks the site's links; these pages live beside it (a link into docs/ included)."""
    text = (ROOT / page).read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://", "mailto:")):
            assert ((ROOT / page).parent / target).exists(), f"{page} links to {target}, which is not there"
