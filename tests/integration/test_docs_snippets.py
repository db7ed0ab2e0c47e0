"""Every runnable Python block of README.md and docs/ runs here, page by page (tests/docs_snippets.py
finds them): the blocks of a page in order, in one namespace, in a folder of their own, with
``JOURNEYMAN_MAX_STEPS=1`` (a training loop trains one step, whatever its budget says). A
``LocalBackend`` a block opens serves from the session's vLLM server with the embedded model
(``engine=shared_engine``), so a page costs its training step, not a server start; a judge it
starts is a real server of its own."""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

import pytest

import journeyman
import journeyman.backend
import journeyman.backend.local
from journeyman.backend import LocalBackend
from journeyman.backend.serving.engine import Engine
from tests.docs_snippets import ROOT, runnable_pages, snippets


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", runnable_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_pages_python_runs(
    page: Path, shared_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class SessionBackend(LocalBackend):
        def __init__(self, *args: Any, **options: Any) -> None:
            options.setdefault("engine", shared_engine)
            super().__init__(*args, **options)

    for module in (journeyman, journeyman.backend, journeyman.backend.local):
        monkeypatch.setattr(module, "LocalBackend", SessionBackend)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JOURNEYMAN_MAX_STEPS", "1")
    monkeypatch.setenv("JOURNEYMAN_ROOT", str(tmp_path / ".journeyman"))
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for snippet in snippets(page):
        if snippet.skip is not None:
            continue
        try:
            exec(compile(snippet.code, snippet.where, "exec"), namespace)
        except Exception:
            pytest.fail(f"the block at {snippet.where} failed:\n{traceback.format_exc()}")
