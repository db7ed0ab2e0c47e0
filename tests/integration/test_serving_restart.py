"""A vLLM server that dies is noticed, and a restart serves the same adapters again."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from journeyman.backend.serving.gateway import GatewayThread
from journeyman.backend.serving.router import Router
from journeyman.backend.serving.vllm import VLLMServer
from tests.integration.conftest import SERVED_BASE, _gateway, _server, make_adapter
from tests.integration.test_serving import _greedy


@pytest.fixture
def own_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VLLMServer, Router, GatewayThread]]:
    """A server of this test's own: the test kills it, and a restart that failed must not fail
    every later test that shares the session's server."""
    for server in _server(model_dir, SERVED_BASE, tmp_path_factory, kv_cache_gib=1):
        router = Router(server, keep_versions=2)
        for gateway in _gateway(router, SERVED_BASE, tmp_path_factory):
            yield server, router, gateway


async def test_crashed_server_is_detected_and_restarted_with_its_adapters(
    own_server: tuple[VLLMServer, Router, GatewayThread], model_dir: Path, tmp_path: Path
) -> None:
    vllm_server, router, gateway = own_server
    name = "restart-check"
    await router.deploy(name, make_adapter(model_dir, tmp_path / "a", seed=5), 1)
    before, _ = await _greedy(gateway, name)

    assert vllm_server.pid is not None
    os.killpg(vllm_server.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while vllm_server.exit_code() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert vllm_server.exit_code() == -signal.SIGKILL

    async with httpx.AsyncClient(base_url=gateway.base_url) as http:
        assert (await http.get("/health")).status_code == 503
        down = await http.post(
            "/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert down.status_code == 503 and "not running" in down.json()["error"]["message"]

    await router.restart_server()
    after, record = await _greedy(gateway, name)
    assert after == before
    assert record.served_model == f"{name}@1"
