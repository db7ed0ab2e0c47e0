"""A scripted vLLM stand-in and the real gateway in front of it, for the unit tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from journeyman.backend.serving.gateway import GatewayThread
from tests.scripted_upstream import ScriptedServer, ScriptedUpstream, gateway_to, serve


@pytest.fixture
def upstream() -> Iterator[tuple[ScriptedUpstream, str]]:
    """A scripted OpenAI-compatible server (what vLLM would answer) and its URL."""
    script = ScriptedUpstream()
    thread = serve(script.app())
    yield script, thread.base_url
    thread.stop()


@pytest.fixture
def gateway(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> Iterator[GatewayThread]:
    """The real gateway in front of ``upstream``."""
    thread = gateway_to(ScriptedServer(upstream[1], log_dir=tmp_path), tmp_path)
    yield thread
    thread.stop()
