"""The Python blocks of README.md and docs/: every one runs in CI unless the line above its fence is
``<!-- skip: why -->``. A page's blocks run in order in one namespace, so a later block uses what an
earlier one defined (tests/integration/test_docs_snippets.py runs them; tests/unit/test_docs.py
checks they parse and every skip says why)."""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent> *)(?P<ticks>`{3,}|~{3,})(?P<info>[^\n`]*)$")
SKIP = re.compile(r"^\s*<!--\s*skip:\s*(?P<why>.*?)\s*-->\s*$")
RUN_LANGUAGES = {"python", "py"}


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int
    """1-based line of the opening fence."""
    code: str
    skip: str | None
    """Why it does not run (the ``<!-- skip: ... -->`` above it), or None: it runs."""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """The pages a user reads: README.md and every page of the docs site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def snippets(page: Path) -> list[Snippet]:
    """The page's Python blocks in order (``python`` or ``py`` fences; other languages are text)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Snippet] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, ticks = len(opening["indent"]), opening["ticks"]
        language = opening["info"].strip().split(" ")[0].lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(ticks):
            end += 1
        if language in RUN_LANGUAGES:
            body = "\n".join(line[indent:] for line in lines[i + 1 : end])
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            skip = SKIP.match(before)
            found.append(Snippet(page, i + 1, body + "\n", skip["why"] if skip else None))
        i = end + 1
    return found


def runnable_pages() -> list[Path]:
    return [page for page in pages() if any(s.skip is None for s in snippets(page))]


@functools.cache
def docs_hooks() -> types.ModuleType:
    """scripts/docs_hooks.py, loaded as mkdocs loads it (a module of its own, outside the package)."""
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
