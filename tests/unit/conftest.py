"""A scripted vLLM stand-in and the real gateway in front of it, and a scripted judge, for the unit tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from journeyman.backend.serving.gateway import GatewayThread
from journeyman.judge import Judge
from tests.scripted_judge import ScriptedJudge, running
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


@pytest.fixture
def script() -> ScriptedJudge:
    """A scripted judge server's behaviour (set ``script.respond``)."""
    return ScriptedJudge()


@pytest.fixture
def judge(script: ScriptedJudge) -> Iterator[Judge]:
    """A judge on ``script``, without retries or a cache (calibration and probe tests; modules that
    need another judge define their own)."""
    with running(script) as url:
        yield Judge("judge", base_url=url, timeout=5.0, max_retries=0, retry_delay=0, cache=False)
