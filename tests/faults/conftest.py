"""The faults tier: each fault the project promises to survive, injected for real.

Tests that need no model use a scripted upstream; the ones that kill vLLM or the trainer start
their own real processes (one vLLM server per module) and run under the heavy-work lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from journeyman.backend.serving.router import Router
from tests.scripted_upstream import ScriptedServer, ScriptedUpstream, serve


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[tuple[ScriptedUpstream, Router]]:
    """A scripted OpenAI-compatible upstream on a real port, and a router in front of it."""
    upstream = ScriptedUpstream()
    thread = serve(upstream.app())
    yield upstream, Router(ScriptedServer(thread.base_url, log_dir=tmp_path))
    thread.stop()
